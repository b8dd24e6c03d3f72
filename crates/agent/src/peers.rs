//! Host-to-host chunk sharing: each agent serves the chunks it holds to the
//! other agents of its cluster, and fetches from them the chunks the head's
//! relay refers it to (`FindChunks` → `ChunkSource::Peer`), so a file read
//! by many hosts leaves the head about once.
//!
//! The wire is the proto's own: `Hello` (role `Agent` both ways), then
//! `FileRequest { GetChunks }` answered by `FileResponse { Chunks }` listing
//! the chunks this host has, in the order asked (those it has not are left
//! out). With `--auth` the connection is mutual TLS and both sides must show
//! an agent certificate of the cluster's CA that is not revoked: the head
//! sends each agent the revocation list (`Msg::Revoked`) when it registers
//! and at every change; a host then refuses a revoked peer's connections,
//! drops the live ones, and dials it no more.
//!
//! A host referred to a peer that is still fetching the chunk itself (it
//! asked the head first, a moment ago) waits for it: the peer answers once
//! the chunk is written into its assembled file, or leaves it out when its
//! own fetch ends without it. The asking host verifies every chunk against
//! its name exactly as it does the head's, and gets whatever the peer did
//! not deliver (refused, left out, connection lost) from the head.
//!
//! A peer that hangs (stopped, partitioned: its connection stays open but
//! nothing arrives) is bounded by progress, not by a deadline per request:
//! a host waiting on a peer that has sent no byte for `agent.peer_stall_s`
//! drops its connection (every request on it then goes to the head) and
//! does not dial it again for [`SHUN`]. A peer waiting for its own fetch
//! of the chunks is not silent: it sends a `Ping` every [`KEEPALIVE`].

use crate::waiters::Waiters;
use starling_auth::Role as AuthRole;
use starling_proto::conn::{establish, Outgoing};
use starling_proto::{ChunkData, FileReq, FileResp, Hash, Msg, ProtoError, Role, TaskId};
use starling_store::HostCache;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The longest a peer waits for its own fetch of a chunk it was asked for
/// before leaving it out of its answer (the asking host then gets it from
/// the head; it has usually dropped a peer this slow already, see
/// `agent.peer_stall_s`).
const PENDING_WAIT: Duration = Duration::from_secs(120);

/// While a peer waits for its own fetch of chunks it was asked for, it
/// sends the asking host a `Ping` this often: bytes that say it is alive, so
/// a slow upstream (the head fetching from a client over a slow link) is
/// not taken for a hang (`agent.peer_stall_s` is 1 s or more).
const KEEPALIVE: Duration = Duration::from_millis(500);

/// How long a peer dropped for stalling is not dialled again: long enough
/// that a stopped host costs the others one stall, not one per batch; short
/// enough that a host that was only busy is used again within the job.
pub(crate) const SHUN: Duration = Duration::from_secs(60);

/// Chunks this host has asked for and not yet written (or given up on):
/// a peer asking for one of them is answered when it lands.
pub(crate) struct Pending {
    chunks: Mutex<HashMap<Hash, u32>>,
    /// Bumped whenever chunks stop being pending.
    changed: watch::Sender<u64>,
}

impl Default for Pending {
    fn default() -> Self {
        Pending { chunks: Mutex::default(), changed: watch::channel(0).0 }
    }
}

impl Pending {
    pub(crate) fn add(&self, hashes: &[Hash]) {
        let mut map = self.chunks.lock().unwrap();
        for h in hashes {
            *map.entry(*h).or_insert(0) += 1;
        }
    }

    pub(crate) fn remove(&self, hashes: &[Hash]) {
        if hashes.is_empty() {
            return;
        }
        let mut map = self.chunks.lock().unwrap();
        for h in hashes {
            if let Some(n) = map.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    map.remove(h);
                }
            }
        }
        drop(map);
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    fn contains(&self, h: &Hash) -> bool {
        self.chunks.lock().unwrap().contains_key(h)
    }
}

/// One connection to a peer, shared by every task fetching from it.
struct PeerConn {
    tx: Outgoing,
    waiters: Arc<Waiters>,
    closed: Arc<AtomicBool>,
    /// Bytes received from the peer so far: its progress.
    received: Arc<AtomicU64>,
    /// The task reading the peer's answers (aborted to drop a stalled peer).
    reader: tokio::task::AbortHandle,
    /// The serial of the peer's certificate (with `--auth`): dropped if it is revoked.
    serial: Option<String>,
}

impl PeerConn {
    /// End the connection: every request waiting on it ends at once.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.reader.abort();
        self.waiters.fail_all();
    }
}

/// A request to a peer: its answer comes on `rx` (dropped without one if
/// the peer cannot be reached or its connection ends).
pub(crate) struct Asked {
    addr: String,
    conn: Option<Arc<PeerConn>>,
    rx: std::sync::mpsc::Receiver<FileResp>,
}

/// This host's side of chunk sharing: what it is fetching, and its
/// connections to peers.
pub(crate) struct Peers {
    pub(crate) pending: Pending,
    cache: Arc<HostCache>,
    name: String,
    /// Replaced when the head sends new credentials (a CA rotation).
    tls: std::sync::RwLock<Option<(starling_auth::TlsConnector, starling_auth::TlsAcceptor)>>,
    conns: Mutex<HashMap<String, Arc<PeerConn>>>,
    rt: tokio::runtime::Handle,
    /// How long a peer owing chunks may send nothing (`agent.peer_stall_s`).
    stall: Duration,
    /// Peers dropped for stalling (or not answering a dial), and when.
    shunned: Mutex<HashMap<String, Instant>>,
    /// Serials of revoked certificates, as the head last sent them.
    revoked: watch::Sender<Arc<HashSet<String>>>,
}

#[derive(Debug, thiserror::Error)]
enum PeerError {
    #[error("connecting: {0}")]
    Connect(#[source] std::io::Error),
    #[error("{0}")]
    Proto(#[from] ProtoError),
    #[error("a peer that is not an agent ({0:?})")]
    NotAnAgent(Role),
    #[error("a connection whose certificate is not an agent's")]
    NotAnAgentCertificate,
    #[error("no answer to the connection's greeting within {0:?}")]
    Silent(Duration),
    #[error("{0}")]
    Revoked(String),
}

/// The one line a host whose certificate was revoked is told, and logged.
fn revoked_line(id: &starling_auth::Identity) -> String {
    let who = id.host.as_deref().map_or_else(|| "the shared agent certificate".to_string(), |h| format!("host {h}"));
    format!("the certificate of {who} (serial {}) was revoked by this cluster's administrator; this host refuses it", id.serial)
}

impl Peers {
    pub(crate) fn new(cache: Arc<HostCache>, name: String, auth: Option<&starling_auth::AuthDir>, stall: Duration) -> Result<Peers, starling_auth::AuthError> {
        let tls = match auth {
            Some(a) => Some((a.connector(AuthRole::Agent)?, a.acceptor(AuthRole::Agent)?)),
            None => None,
        };
        Ok(Peers {
            pending: Pending::default(),
            cache,
            name,
            tls: std::sync::RwLock::new(tls),
            conns: Mutex::default(),
            rt: tokio::runtime::Handle::current(),
            stall,
            shunned: Mutex::default(),
            revoked: watch::Sender::new(Arc::default()),
        })
    }

    /// The head's revocation list, new or changed: drop every connection to a peer on it (those from
    /// one end as they see the change; [`Peers::serve_one`]).
    pub(crate) fn set_revoked(&self, serials: Vec<String>) {
        let revoked: HashSet<String> = serials.into_iter().collect();
        self.conns.lock().unwrap().retain(|addr, c| {
            let keep = !c.serial.as_ref().is_some_and(|s| revoked.contains(s));
            if !keep {
                log::warn!("peer {addr}: its certificate was revoked; dropping it");
                c.close();
            }
            keep
        });
        self.revoked.send_replace(Arc::new(revoked));
    }

    fn is_revoked(&self, id: Option<&starling_auth::Identity>) -> Option<String> {
        id.filter(|id| self.revoked.borrow().contains(&id.serial)).map(revoked_line)
    }

    /// Use the credentials now in `auth` for the next connections.
    pub(crate) fn reload(&self, auth: &starling_auth::AuthDir) -> Result<(), starling_auth::AuthError> {
        let tls = (auth.connector(AuthRole::Agent)?, auth.acceptor(AuthRole::Agent)?);
        *self.tls.write().unwrap() = Some(tls);
        Ok(())
    }

    /// Ask peer `addr` for `hashes` (on behalf of `task`); [`Peers::answer`]
    /// waits for what it sends. Called from FUSE threads (blocking).
    pub(crate) fn ask(self: &Arc<Self>, addr: &str, task: TaskId, hashes: Vec<Hash>) -> Asked {
        let conn = self.conn(addr);
        let rx = match &conn {
            Some(conn) => {
                let (id, rx) = conn.waiters.register();
                if conn.closed.load(Ordering::SeqCst) || conn.tx.blocking_send(Msg::FileRequest { task, id, req: FileReq::GetChunks { hashes } }).is_err() {
                    conn.waiters.complete_none(id);
                }
                rx
            }
            None => std::sync::mpsc::channel().1,
        };
        Asked { addr: addr.to_string(), conn, rx }
    }

    /// Wait for a peer's answer: the chunks it sent (unverified), none on
    /// any failure. A peer that sends nothing at all for the stall time is
    /// dropped; one that is sending (this answer or others on the same
    /// connection, however slowly) is waited for.
    pub(crate) fn answer(&self, asked: Asked) -> Vec<ChunkData> {
        let Some(conn) = &asked.conn else { return Vec::new() };
        let mut seen = conn.received.load(Ordering::SeqCst);
        loop {
            match asked.rx.recv_timeout(self.stall) {
                Ok(FileResp::Chunks(c)) => return c,
                Ok(_) | Err(RecvTimeoutError::Disconnected) => return Vec::new(),
                Err(RecvTimeoutError::Timeout) => {
                    let now = conn.received.load(Ordering::SeqCst);
                    if now == seen {
                        log::warn!(
                            "peer {}: nothing received for {:?} while it owes chunks; dropping it for {SHUN:?} (its chunks come from the head)",
                            asked.addr,
                            self.stall
                        );
                        self.drop_stalled(&asked.addr, conn);
                        return Vec::new();
                    }
                    seen = now;
                }
            }
        }
    }

    /// Close a stalled peer's connection (every request waiting on it ends
    /// at once) and dial it no more for [`SHUN`].
    fn drop_stalled(&self, addr: &str, conn: &Arc<PeerConn>) {
        self.shunned.lock().unwrap().insert(addr.to_string(), Instant::now());
        conn.close();
        let mut conns = self.conns.lock().unwrap();
        if conns.get(addr).is_some_and(|c| Arc::ptr_eq(c, conn)) {
            conns.remove(addr);
        }
    }

    /// The open connection to `addr`, dialled if there is none; none for a
    /// peer shunned for stalling, or one that cannot be reached (or does not
    /// greet) within the stall time.
    fn conn(self: &Arc<Self>, addr: &str) -> Option<Arc<PeerConn>> {
        if let Some(c) = self.conns.lock().unwrap().get(addr) {
            if !c.closed.load(Ordering::SeqCst) {
                return Some(c.clone());
            }
        }
        {
            let mut shunned = self.shunned.lock().unwrap();
            match shunned.get(addr) {
                Some(since) if since.elapsed() < SHUN => return None,
                Some(_) => {
                    shunned.remove(addr);
                }
                None => {}
            }
        }
        let me = self.clone();
        let target = addr.to_string();
        let stall = self.stall;
        let dialled = self.rt.block_on(async move {
            tokio::time::timeout(stall, me.dial(&target)).await.unwrap_or(Err(PeerError::Silent(stall)))
        });
        match dialled {
            Ok(c) => {
                self.conns.lock().unwrap().insert(addr.to_string(), c.clone());
                Some(c)
            }
            Err(e) => {
                if matches!(e, PeerError::Silent(_)) {
                    self.shunned.lock().unwrap().insert(addr.to_string(), Instant::now());
                }
                log::warn!("peer {addr}: {e}; fetching from the head instead");
                None
            }
        }
    }

    async fn dial(&self, addr: &str) -> Result<Arc<PeerConn>, PeerError> {
        let sock = TcpStream::connect(addr).await.map_err(PeerError::Connect)?;
        let _ = sock.set_nodelay(true);
        let tls = self.tls.read().unwrap().clone();
        match &tls {
            None => self.start(sock, None).await,
            Some((c, _)) => {
                let s = c.connect(starling_auth::server_name(AuthRole::Agent), sock).await.map_err(PeerError::Connect)?;
                let id = starling_auth::ident::server_identity(&s);
                if let Some(why) = self.is_revoked(id.as_ref()) {
                    return Err(PeerError::Revoked(why));
                }
                self.start(s, id.map(|id| id.serial)).await
            }
        }
    }

    async fn start<S>(&self, sock: S, serial: Option<String>) -> Result<Arc<PeerConn>, PeerError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (r, w) = tokio::io::split(sock);
        let received = Arc::new(AtomicU64::new(0));
        let counter = received.clone();
        let r = tokio_util::io::InspectReader::new(r, move |bytes: &[u8]| {
            counter.fetch_add(u64::try_from(bytes.len()).unwrap_or(u64::MAX), Ordering::SeqCst);
        });
        let (peer, mut incoming, tx) = establish(r, w, Role::Agent, &self.name).await?;
        if peer.role != Role::Agent {
            return Err(PeerError::NotAnAgent(peer.role));
        }
        let (waiters, closed) = (Arc::new(Waiters::default()), Arc::new(AtomicBool::new(false)));
        let (reader_waiters, reader_closed) = (waiters.clone(), closed.clone());
        let reader = tokio::spawn(async move {
            let (waiters, closed) = (reader_waiters, reader_closed);
            loop {
                match incoming.recv().await {
                    Ok(Msg::FileResponse { id, resp, .. }) => waiters.complete(id, resp),
                    Ok(_) => {}
                    Err(e) => {
                        if !matches!(e, ProtoError::Closed) {
                            log::warn!("peer {}: {e}", peer.name);
                        }
                        break;
                    }
                }
            }
            closed.store(true, Ordering::SeqCst);
            waiters.fail_all();
        });
        Ok(Arc::new(PeerConn { tx, waiters, closed, received, reader: reader.abort_handle(), serial }))
    }

    /// Serve other hosts' requests on `listener` until the agent ends.
    pub(crate) async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (sock, from) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    log::warn!("peer listener: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = sock.set_nodelay(true);
            let me = self.clone();
            let tls = me.tls.read().unwrap().clone();
            tokio::spawn(async move {
                let res = match &tls {
                    None => me.clone().serve_one(sock, from, None).await,
                    Some((_, a)) => match a.accept(sock).await {
                        Ok(mut s) if starling_auth::client_role(&s) == Some(AuthRole::Agent) => {
                            let id = starling_auth::ident::client_identity(&s);
                            match me.is_revoked(id.as_ref()) {
                                Some(why) => {
                                    // Logged before the peer is told, so the refusal is on record once the peer sees it.
                                    log::info!("peer connection from {from}: {why}");
                                    let _ = starling_proto::write_frame(&mut s, &Msg::Error { task: None, message: why }).await;
                                    Ok(())
                                }
                                None => me.clone().serve_one(s, from, id).await,
                            }
                        }
                        Ok(_) => Err(PeerError::NotAnAgentCertificate),
                        Err(e) => Err(PeerError::Connect(e)),
                    },
                };
                if let Err(e) = res {
                    log::info!("peer connection from {from}: {e}");
                }
            });
        }
    }

    /// Serve one peer (`id`: its certificate, with `--auth`) until it leaves or its certificate is revoked.
    async fn serve_one<S>(self: Arc<Self>, sock: S, from: std::net::SocketAddr, id: Option<starling_auth::Identity>) -> Result<(), PeerError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (r, w) = tokio::io::split(sock);
        let (peer, incoming, tx) = establish(r, w, Role::Agent, &self.name).await?;
        if peer.role != Role::Agent {
            let _ = tx.send(Msg::Error { task: None, message: "only agents fetch chunks from agents".into() }).await;
            return Err(PeerError::NotAnAgent(peer.role));
        }
        let Some(id) = id else { return self.serve_requests(incoming, tx).await };
        let mut revoked = self.revoked.subscribe();
        tokio::select! {
            res = self.clone().serve_requests(incoming, tx.clone()) => res,
            Ok(()) = async { revoked.wait_for(|set| set.contains(&id.serial)).await.map(|_| ()) } => {
                let why = revoked_line(&id);
                log::info!("peer connection from {from}: {why}");
                let _ = tx.send(Msg::Error { task: None, message: why }).await;
                Ok(())
            }
        }
    }

    /// Answer a peer's chunk requests until it leaves.
    async fn serve_requests<R>(self: Arc<Self>, mut incoming: starling_proto::conn::Incoming<R>, tx: Outgoing) -> Result<(), PeerError>
    where
        R: tokio::io::AsyncRead + Unpin + Send,
    {
        loop {
            match incoming.recv().await {
                Ok(Msg::FileRequest { task, id, req: FileReq::GetChunks { hashes } }) => {
                    let (me, tx) = (self.clone(), tx.clone());
                    tokio::spawn(async move {
                        let held = me.held(&hashes);
                        tokio::pin!(held);
                        let mut alive = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
                        let chunks = loop {
                            tokio::select! {
                                c = &mut held => break c,
                                _ = alive.tick() => {
                                    let _ = tx.send(Msg::Ping { nonce: id }).await;
                                }
                            }
                        };
                        let _ = tx.send(Msg::FileResponse { task, id, resp: FileResp::Chunks(chunks) }).await;
                    });
                }
                Ok(Msg::FileRequest { task, id, .. }) => {
                    let _ = tx.send(Msg::FileResponse { task, id, resp: FileResp::Errno(libc::EINVAL) }).await;
                }
                Ok(Msg::Ping { nonce }) => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Ok(_) => {}
                Err(ProtoError::Closed) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Of `hashes`, those this host has, in order, waiting for those it is
    /// fetching right now.
    async fn held(&self, hashes: &[Hash]) -> Vec<ChunkData> {
        let mut out = Vec::with_capacity(hashes.len());
        let mut changed = self.pending.changed.subscribe();
        for h in hashes {
            loop {
                changed.borrow_and_update();
                // Taken before looking: a chunk stops being pending only after it is written.
                let pending = self.pending.contains(h);
                let cache = self.cache.clone();
                let hash = *h;
                let found = tokio::task::spawn_blocking(move || cache.chunk_for_peer(&hash)).await;
                if let Ok(Ok(Some(bytes))) = found {
                    // Sent as read: the asking host verifies it (and CPU on this hop is not spent compressing).
                    out.push(ChunkData::seal_named(*h, bytes, false));
                    break;
                }
                if !pending {
                    break;
                }
                if tokio::time::timeout(PENDING_WAIT, changed.changed()).await.is_err() {
                    break;
                }
            }
        }
        out
    }
}
