//! `starling exec --x11` (as `ssh -X`): the task's host serves it a display, and each X
//! connection a program opens there arrives here as a stream of its own (`TaskEvent::X11`);
//! we connect it to our real X server (`$DISPLAY`) and pump both ways.
//!
//! The task never sees the real server's cookie: it is given a stand-in made here for this
//! task ([`prepare`]), and each connection's setup request is checked for the stand-in and
//! rewritten with the real authorization (from `$XAUTHORITY` or `~/.Xauthority`) before it
//! reaches the server. A connection that presents anything else is closed unanswered.
//!
//! A roaming task's connections are also counted as they pass (`crate::xsense`): input events
//! to the program and frames drawn by it feed its migration manager's X sensors.

use starling_proto::conn::Outgoing;
use starling_proto::{Msg, SecretKey, TaskId, X11Forward};
use starling_session::X11Event;
use crate::roam::InteractionLog;
use crate::xsense::XStream;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use x11rb_protocol::parse_display::{ConnectAddress, ParsedDisplay};
use x11rb_protocol::xauth::Family;

/// The authorization protocol of the stand-in (what Xlib uses by default).
const COOKIE_NAME: &str = "MIT-MAGIC-COOKIE-1";
/// A cookie's length (as `xauth generate` makes them).
const COOKIE_LEN: usize = 16;
/// Bytes read from the X server per message.
const READ_BYTES: usize = 64 << 10;
/// Largest setup request accepted from the task (its authorization is a few bytes).
const MAX_SETUP: usize = 64 << 10;

/// Why X11 forwarding is off for this task.
#[derive(Debug, thiserror::Error)]
pub enum X11Error {
    #[error("DISPLAY is not set")]
    NoDisplay,
    #[error("cannot parse DISPLAY: {0}")]
    BadDisplay(#[source] x11rb_protocol::errors::DisplayParsingError),
}

/// Our own X server, as the task's connections reach it.
pub struct Display {
    parsed: ParsedDisplay,
    /// The real authorization (name, data), if the Xauthority has one for the display.
    real: Option<(Vec<u8>, Vec<u8>)>,
    /// The stand-in the task presents.
    stand_in: X11Forward,
}

/// Our host name, as Xauthority entries of local displays name it.
fn hostname() -> Vec<u8> {
    std::fs::read("/proc/sys/kernel/hostname").map(|mut h| {
        h.retain(|b| *b != b'\n');
        h
    })
    .unwrap_or_default()
}

/// Forwarding for a task: our display and its real authorization, and the stand-in to put in
/// the task's spec.
pub fn prepare() -> Result<(Display, X11Forward), X11Error> {
    let name = std::env::var("DISPLAY").ok().filter(|d| !d.is_empty()).ok_or(X11Error::NoDisplay)?;
    let parsed = x11rb_protocol::parse_display::parse_display(Some(&name)).map_err(X11Error::BadDisplay)?;
    // A local server's entry names our host (family local); a remote one's, its address.
    let real = match parsed.connect_instruction().next() {
        Some(ConnectAddress::Hostname(host, _)) if host != "localhost" => {
            let ip = host.parse::<std::net::Ipv4Addr>().ok();
            ip.and_then(|ip| x11rb_protocol::xauth::get_auth(Family::INTERNET, &ip.octets(), parsed.display).ok().flatten())
        }
        _ => x11rb_protocol::xauth::get_auth(Family::LOCAL, &hostname(), parsed.display).ok().flatten(),
    };
    let stand_in = X11Forward { auth_name: COOKIE_NAME.to_string(), auth_data: SecretKey::random().0[..COOKIE_LEN].to_vec() };
    Ok((Display { parsed, real, stand_in: stand_in.clone() }, stand_in))
}

/// A connection to our X server.
trait ServerStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> ServerStream for T {}

impl Display {
    /// Connect to our X server as Xlib would: a local display's abstract socket, then its
    /// socket file, then TCP.
    async fn connect(&self) -> std::io::Result<Box<dyn ServerStream>> {
        let mut last = std::io::Error::from(std::io::ErrorKind::NotFound);
        for addr in self.parsed.connect_instruction() {
            match addr {
                ConnectAddress::Socket(path) => {
                    use std::os::linux::net::SocketAddrExt;
                    let abstract_addr = std::os::unix::net::SocketAddr::from_abstract_name(path.as_bytes())?;
                    let std_stream = std::os::unix::net::UnixStream::connect_addr(&abstract_addr)
                        .or_else(|_| std::os::unix::net::UnixStream::connect(&path));
                    match std_stream.and_then(|s| {
                        s.set_nonblocking(true)?;
                        tokio::net::UnixStream::from_std(s)
                    }) {
                        Ok(s) => return Ok(Box::new(s)),
                        Err(e) => last = e,
                    }
                }
                ConnectAddress::Hostname(host, port) => match tokio::net::TcpStream::connect((host, port)).await {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok(Box::new(s));
                    }
                    Err(e) => last = e,
                },
                _ => {}
            }
        }
        Err(last)
    }

    /// The task's setup request with the stand-in replaced by the real authorization; `None`
    /// if it is not a setup request presenting our stand-in.
    fn rewrite_setup(&self, req: &[u8]) -> Option<Vec<u8>> {
        let (name, data) = parse_setup(req)?;
        if name != self.stand_in.auth_name.as_bytes() || data != self.stand_in.auth_data {
            return None;
        }
        let (real_name, real_data) = self.real.clone().unwrap_or_default();
        Some(setup_request(req[0], &req[2..6], &real_name, &real_data))
    }
}

fn pad4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// The length of a complete setup request at the start of `buf`, once its header is there.
fn setup_len(buf: &[u8]) -> Option<usize> {
    let header = buf.get(..12)?;
    let u16_at = |i: usize| {
        let b = [header[i], header[i + 1]];
        usize::from(if header[0] == b'B' { u16::from_be_bytes(b) } else { u16::from_le_bytes(b) })
    };
    Some(12 + pad4(u16_at(6)) + pad4(u16_at(8)))
}

/// The authorization (name, data) of a complete setup request.
fn parse_setup(req: &[u8]) -> Option<(&[u8], &[u8])> {
    if !matches!(req.first(), Some(b'B' | b'l')) || setup_len(req)? != req.len() {
        return None;
    }
    let u16_at = |i: usize| {
        let b = [req[i], req[i + 1]];
        usize::from(if req[0] == b'B' { u16::from_be_bytes(b) } else { u16::from_le_bytes(b) })
    };
    let (n, d) = (u16_at(6), u16_at(8));
    Some((&req[12..12 + n], &req[12 + pad4(n)..12 + pad4(n) + d]))
}

/// A setup request in byte order `order` (`B` or `l`), protocol version `version` (4 bytes as
/// the client sent them), with this authorization.
fn setup_request(order: u8, version: &[u8], name: &[u8], data: &[u8]) -> Vec<u8> {
    // The names and data put here are a cookie's few bytes, or the task's own (bounded by MAX_SETUP).
    let len16 = |n: usize| {
        let n = u16::try_from(n).unwrap_or(u16::MAX);
        if order == b'B' {
            n.to_be_bytes()
        } else {
            n.to_le_bytes()
        }
    };
    let mut out = vec![order, 0];
    out.extend_from_slice(version);
    out.extend_from_slice(&len16(name.len()));
    out.extend_from_slice(&len16(data.len()));
    out.extend_from_slice(&[0, 0]);
    for field in [name, data] {
        out.extend_from_slice(field);
        out.resize(pad4(out.len()), 0);
    }
    out
}

/// The task's X connections, relayed to our display.
pub struct Forwarder {
    display: Arc<Display>,
    task: TaskId,
    tx: Outgoing,
    /// Each open stream's writer towards our X server (`None`: the task closed it).
    streams: HashMap<u32, mpsc::UnboundedSender<Option<Vec<u8>>>>,
    /// A roaming task's: where its X input and drawing are recorded for its manager.
    interaction: Option<InteractionLog>,
}

impl Forwarder {
    pub fn new(display: Display, task: TaskId, tx: Outgoing, interaction: Option<InteractionLog>) -> Forwarder {
        Forwarder { display: Arc::new(display), task, tx, streams: HashMap::new(), interaction }
    }

    /// One event of the task's X connections.
    pub fn handle(&mut self, ev: X11Event) {
        match ev {
            X11Event::Open(stream) => {
                let (w_tx, w_rx) = mpsc::unbounded_channel();
                self.streams.insert(stream, w_tx);
                tokio::spawn(relay(self.display.clone(), self.task, stream, w_rx, self.tx.clone(), self.interaction.clone()));
            }
            X11Event::Data(stream, data) => {
                if let Some(w) = self.streams.get(&stream) {
                    let _ = w.send(Some(data));
                }
            }
            X11Event::Close(stream) => {
                if let Some(w) = self.streams.remove(&stream) {
                    let _ = w.send(None);
                }
            }
        }
    }
}

/// A roaming task's connection's counts, for its manager.
#[derive(Clone)]
struct Sensed {
    stream: Arc<Mutex<XStream>>,
    log: InteractionLog,
}

impl Sensed {
    /// The program sent these bytes (after its setup request).
    fn task_sent(&self, bytes: &[u8]) {
        if self.stream.lock().unwrap().client_sent(bytes) > 0 {
            self.log.lock().unwrap().x.frame(std::time::Instant::now());
        }
    }

    /// The server sent these.
    fn server_sent(&self, bytes: &[u8]) {
        let inputs = self.stream.lock().unwrap().server_sent(bytes);
        if inputs > 0 {
            self.log.lock().unwrap().x.input(std::time::Instant::now(), inputs);
        }
    }
}

/// One X connection: the task's bytes (setup rewritten) to our server, its answers back.
async fn relay(
    display: Arc<Display>,
    task: TaskId,
    stream: u32,
    mut from_task: mpsc::UnboundedReceiver<Option<Vec<u8>>>,
    tx: Outgoing,
    interaction: Option<InteractionLog>,
) {
    let close = |why: String| {
        let tx = tx.clone();
        async move {
            log::warn!("task {task}: X connection {stream}: {why}");
            let _ = tx.send(Msg::X11Close { task, stream }).await;
        }
    };
    // The setup request first: it is checked and rewritten whole.
    let mut setup = Vec::new();
    let total = loop {
        if let Some(n) = setup_len(&setup) {
            if setup.len() >= n {
                break n;
            }
        }
        match from_task.recv().await {
            Some(Some(bytes)) if setup.len() + bytes.len() <= MAX_SETUP => setup.extend_from_slice(&bytes),
            Some(Some(_)) => return close("setup request too large".into()).await,
            // The task closed it before it was set up.
            Some(None) | None => return,
        }
    };
    let Some(request) = display.rewrite_setup(&setup[..total]) else {
        return close("refused: it did not present this task's authorization".into()).await;
    };
    let server = match display.connect().await {
        Ok(s) => s,
        Err(e) => return close(format!("cannot connect to the X server: {e}")).await,
    };
    let (mut from_server, mut to_server) = tokio::io::split(server);
    let sensed = interaction.map(|log| Sensed { stream: Arc::new(Mutex::new(XStream::new(setup[0]))), log });
    if let Some(s) = &sensed {
        s.task_sent(&setup[total..]);
    }
    if to_server.write_all(&request).await.is_err() || to_server.write_all(&setup[total..]).await.is_err() {
        return close("the X server closed the connection".into()).await;
    }
    let answers = {
        let tx = tx.clone();
        let sensed = sensed.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; READ_BYTES];
            loop {
                match from_server.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Some(s) = &sensed {
                            s.server_sent(&buf[..n]);
                        }
                        if tx.send(Msg::X11Data { task, stream, data: buf[..n].to_vec() }).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = tx.send(Msg::X11Close { task, stream }).await;
        })
    };
    let mut answers = answers;
    loop {
        tokio::select! {
            m = from_task.recv() => match m {
                Some(Some(bytes)) => {
                    if let Some(s) = &sensed {
                        s.task_sent(&bytes);
                    }
                    if to_server.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
                _ => break,
            },
            // The server closed it (our answers loop told the task's side).
            _ = &mut answers => break,
        }
    }
    answers.abort();
    let _ = to_server.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn display(real: Option<(&[u8], &[u8])>) -> Display {
        Display {
            parsed: x11rb_protocol::parse_display::parse_display(Some(":0")).unwrap(),
            real: real.map(|(n, d)| (n.to_vec(), d.to_vec())),
            stand_in: X11Forward { auth_name: COOKIE_NAME.into(), auth_data: vec![7; COOKIE_LEN] },
        }
    }

    #[test]
    fn the_stand_in_is_replaced_by_the_real_cookie_in_either_byte_order() {
        let d = display(Some((b"MIT-MAGIC-COOKIE-1", &[9; 16])));
        for order in [b'B', b'l'] {
            let sent = setup_request(order, &[0, 11, 0, 0], COOKIE_NAME.as_bytes(), &[7; COOKIE_LEN]);
            assert_eq!(sent.len(), 12 + 20 + 16, "name padded to 20 bytes");
            let got = d.rewrite_setup(&sent).expect("the stand-in is accepted");
            assert_eq!(parse_setup(&got), Some((&b"MIT-MAGIC-COOKIE-1"[..], &[9u8; 16][..])));
            assert_eq!(&got[..6], &sent[..6], "byte order and version kept");
        }
    }

    #[test]
    fn anything_but_the_stand_in_is_refused() {
        let d = display(Some((b"MIT-MAGIC-COOKIE-1", &[9; 16])));
        let wrong = setup_request(b'l', &[11, 0, 0, 0], COOKIE_NAME.as_bytes(), &[8; COOKIE_LEN]);
        assert_eq!(d.rewrite_setup(&wrong), None);
        let none = setup_request(b'l', &[11, 0, 0, 0], b"", b"");
        assert_eq!(d.rewrite_setup(&none), None);
        assert_eq!(d.rewrite_setup(b"Xl\0\0"), None, "not a setup request");
    }

    #[test]
    fn without_a_real_cookie_the_server_gets_no_authorization() {
        let d = display(None);
        let sent = setup_request(b'B', &[0, 11, 0, 0], COOKIE_NAME.as_bytes(), &[7; COOKIE_LEN]);
        let got = d.rewrite_setup(&sent).unwrap();
        assert_eq!(got, vec![b'B', 0, 0, 11, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}
