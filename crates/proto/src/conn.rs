//! A connection as the daemons use it: a handshake, then a writer task fed
//! by a channel (so many producers can send without locking the socket) and
//! a reader the owner drives with [`Incoming::recv`].

use crate::{read_frame, write_frame, Msg, ProtoError, Role};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, BufWriter};
use tokio::sync::mpsc;

/// Sending side of a connection. Cheap to clone.
pub type Outgoing = mpsc::Sender<Msg>;

/// Receiving side of a connection.
pub struct Incoming<R> {
    reader: BufReader<R>,
}

impl<R: AsyncRead + Unpin> Incoming<R> {
    /// Next message; `Err(Closed)` at a clean end of stream.
    pub async fn recv(&mut self) -> Result<Msg, ProtoError> {
        read_frame(&mut self.reader).await
    }
}

/// Who is on the other side, from its `Hello`.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub role: Role,
    pub name: String,
    /// The peer wants compressed frames.
    pub compress: bool,
}

/// Outgoing queue depth per connection: bounded, so a slow peer pushes back
/// on whoever produces its traffic (e.g. 100 MB of stdin) instead of
/// buffering without limit.
pub const QUEUE: usize = 256;

/// Exchange `Hello`s and start the writer task. A peer that does not open
/// with `Hello` (or speaks another protocol version) is refused here, and
/// told why before the connection closes.
pub async fn establish<R, W>(
    read: R,
    write: W,
    role: Role,
    name: &str,
) -> Result<(PeerInfo, Incoming<R>, Outgoing), ProtoError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut writer = BufWriter::new(write);
    write_frame(&mut writer, &Msg::Hello { role, name: name.to_string(), compress: false }).await?;
    let mut incoming = Incoming { reader: BufReader::new(read) };
    let peer = match incoming.recv().await {
        Ok(Msg::Hello { role, name, compress }) => PeerInfo { role, name, compress },
        Ok(Msg::Error { message, .. }) => return Err(ProtoError::Refused(message)),
        Ok(other) => {
            let e = format!("expected Hello, got {:?}", std::mem::discriminant(&other));
            let _ = write_frame(&mut writer, &Msg::Error { task: None, message: e.clone() }).await;
            return Err(ProtoError::NoHello);
        }
        Err(e) => {
            if !matches!(e, ProtoError::Closed | ProtoError::Io(_)) {
                let _ = write_frame(&mut writer, &Msg::Error { task: None, message: e.to_string() }).await;
            }
            return Err(e);
        }
    };
    let tx = spawn_writer(writer, peer.compress);
    Ok((peer, incoming, tx))
}

/// The client's side of [`establish`], pipelined for slow links: our
/// `Hello` goes out and the caller may send at once, in the same flight; the
/// head's `Hello` is checked when it arrives (the first message [`Incoming`]
/// yields is that `Hello`). `compress`: compress our frames and ask the peer
/// to compress its frames to us.
pub async fn open_pipelined<R, W>(read: R, write: W, role: Role, name: &str, compress: bool) -> Result<(Incoming<R>, Outgoing), ProtoError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let writer = BufWriter::new(write);
    let tx = spawn_writer(writer, compress);
    tx.send(Msg::Hello { role, name: name.to_string(), compress }).await.map_err(|_| ProtoError::Closed)?;
    Ok((Incoming { reader: BufReader::new(read) }, tx))
}

fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(mut writer: BufWriter<W>, compress: bool) -> Outgoing {
    let (tx, mut rx) = mpsc::channel::<Msg>(QUEUE);
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Some(m) = rx.recv().await {
            let buf = match crate::frame::encode_with(&m, compress) {
                Ok(b) => b,
                Err(_) => continue,
            };
            if writer.write_all(&buf).await.is_err() {
                break;
            }
            // Flush only when nothing else is queued: batches small frames.
            if rx.is_empty() && writer.flush().await.is_err() {
                break;
            }
        }
        let _ = writer.shutdown().await;
    });
    tx
}
