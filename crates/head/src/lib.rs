//! The head: the single endpoint a client talks to (UCop's `remdis`).
//!
//! To the client it looks like one fast worker; to the agents it looks like
//! the client. It picks a host for each launch, assigns the task id, and
//! routes every task message between the client's connection and the
//! agent's. It notices a lost host (its connection drops) and tells the
//! client, and kills the tasks of a client that went away (but for tasks on
//! a terminal, which outlive it until `starling attach`: [`attach`]).
//!
//! ```text
//! client ──Launch──▶ head ──RunTask──▶ agent
//!        ◀─Started──      ◀─FileRequest── (file view faults)
//!        ──FileResponse─▶ ──────────────▶
//!        ◀─Output / ChangeChunks / Finished ─
//! ```
//!
//! By concern: [`routing`] (who talks to whom), [`queue`] (launches waiting
//! for cores), [`placement`] (which host, and fork tickets' grants),
//! [`relay`] (the shared content cache), [`jobs`] (job bindings). What the
//! head knows is read through [`Head::snapshot`].

mod attach;
mod dashboard;
mod eviction;
mod jobs;
mod linger;
mod migration;
mod placement;
mod ps;
mod queue;
mod metrics;
mod relay;
mod roam;
mod routing;

use starling_config::HeadSettings;
use starling_proto::conn::{establish, Outgoing};
use starling_proto::{ClusterStatus, HostInfo, Msg, ProtoError, Role, TaskId};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use starling_auth::{AuthDir, Cred, Identity, Issuer, Role as AuthRole, ServerTls, TlsAcceptor, TlsConnector, Trust};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener};

#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error("head: cannot listen on {addr}: {source}")]
    Listen { addr: String, #[source] source: std::io::Error },
    #[error("opening the relay cache {}: {source}", path.display())]
    RelayCache { path: std::path::PathBuf, #[source] source: std::io::Error },
    #[error("head: accepting connections: {0}")]
    Accept(#[source] std::io::Error),
    #[error("head: cannot serve /metrics on {addr}: {source}")]
    Metrics { addr: String, #[source] source: std::io::Error },
    #[error("head: the local clients' socket {}: {source}", path.display())]
    Socket { path: std::path::PathBuf, #[source] source: std::io::Error },
    #[error("head: {0}")]
    Auth(#[from] starling_auth::AuthError),
    #[error("head: reading the revocation list: {0}")]
    Revoked(String),
}

/// A connected host.
pub(crate) struct Host {
    pub(crate) info: HostInfo,
    pub(crate) tx: Outgoing,
    /// Cores held by tasks the head has placed here and not yet seen
    /// finish (a task holds one, a hierarchical clone task one per clone).
    pub(crate) cores_busy: u32,
    pub(crate) conn_id: u64,
}

/// A placed task: where its messages go.
pub(crate) struct Route {
    /// `None` once the client has gone (the task is being killed).
    pub(crate) client: Option<Outgoing>,
    pub(crate) client_conn: u64,
    pub(crate) host: String,
    pub(crate) host_conn: u64,
    /// Cores the task holds on its host (`TaskSpec::cores`).
    pub(crate) cores: u32,
    /// The user it runs as (only they, or root, may move it).
    pub(crate) uid: u32,
    /// For `starling ps`: the command line (shortened), job, start time.
    pub(crate) command: String,
    pub(crate) job: Option<String>,
    pub(crate) started: std::time::Instant,
    /// A remote-fork clone task (clones cannot move yet).
    pub(crate) clone_task: bool,
    /// A clone of an isolated ticket: the ticket, and what its launch asked of the ticket's
    /// network (`None` for other tasks). A move keeps it on hosts that can enforce that network
    /// and gives it the network there (`head::migration`).
    pub(crate) ticket_net: Option<TicketAsk>,
    /// The task's own Linger-Longer policy (`None`: its host's).
    pub(crate) policy: Option<starling_proto::GuestPolicy>,
    /// IE: what a rerun from the start needs (`None`: the task is not rerun).
    pub(crate) rerun: Option<Box<eviction::Rerun>>,
    /// On its way to another host.
    pub(crate) moving: Option<migration::Moving>,
    /// CPU seconds the task used on hosts it has left (moves).
    pub(crate) cpu_before: f64,
    /// File requests a move's target sent before the switch (marked id → host).
    pub(crate) target_file_ids: HashMap<u64, String>,
    /// A roaming task (`exec --roam`): why it runs where it does, its manager's decisions.
    pub(crate) roam: Option<starling_proto::RoamLog>,
    /// A task on a terminal: it outlives its client, and this is what its client has not seen
    /// (`None`: the task ends with its client).
    pub(crate) outlive: Option<attach::Replay>,    /// Stream messages of the task relayed here, both ways (`starling ps`: a task at home
    /// whose stream goes straight to its client adds none).
    pub(crate) relayed: u64,
}

/// A clone's ticket and what its launch asked of the ticket's own network (the ports its client
/// refuses too, `required`); the members are the head's to fill in wherever the clone runs.
pub(crate) struct TicketAsk {
    pub(crate) ticket: u64,
    pub(crate) asked: starling_proto::TicketNetwork,
}

impl Route {
    /// What the task's ticket asks of its network (`Off` for tasks that are not clones).
    pub(crate) fn isolation(&self) -> starling_proto::NetworkIsolation {
        match &self.ticket_net {
            None => starling_proto::NetworkIsolation::Off,
            Some(t) if t.asked.required => starling_proto::NetworkIsolation::Required,
            Some(_) => starling_proto::NetworkIsolation::On,
        }
    }
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) hosts: HashMap<String, Host>,
    /// Tasks placed and not yet ended; a task holds its cores until then.
    pub(crate) routes: HashMap<TaskId, Route>,
    pub(crate) queue: std::collections::VecDeque<queue::Queued>,
    /// Latest migrations' reports, oldest first.
    pub(crate) recent_migrations: std::collections::VecDeque<starling_proto::MigrationReport>,
    /// `ps` waiting for hosts' usage: (host connection, its tasks) by request nonce.
    pub(crate) usage_waiters: HashMap<u64, tokio::sync::mpsc::UnboundedSender<(u64, Vec<starling_proto::TaskUsage>)>>,
    /// Fork tickets granted and their hosts, by (client connection, ticket): a clone's
    /// ticket network is its grant's hosts and those its clones were moved to
    /// (`placement::ticket_hosts`; forgotten when the client goes).
    pub(crate) grants: HashMap<(u64, u64), Vec<String>>,
    /// Tasks on a terminal that ended with no client attached (their output and end kept for
    /// `starling attach`), or whose end is on its way to the client.
    pub(crate) ended: std::collections::BTreeMap<TaskId, attach::Ended>,
}

impl State {
    /// Retire a task's route and give back its cores.
    /// A move still under way gives back the target's cores too: the
    /// caller ends it with [`Head::move_outlived`].
    pub(crate) fn end_route(&mut self, task: TaskId) -> Option<Route> {
        let r = self.routes.remove(&task)?;
        if let Some(h) = self.hosts.get_mut(&r.host) {
            h.cores_busy = h.cores_busy.saturating_sub(r.cores);
        }
        if let Some(m) = r.moving.as_ref().filter(|m| !m.switched) {
            if let Some(h) = self.hosts.get_mut(&m.to) {
                h.cores_busy = h.cores_busy.saturating_sub(r.cores);
            }
        }
        Some(r)
    }
}

pub struct Head {
    me: Mutex<std::sync::Weak<Head>>,
    pub(crate) state: Mutex<State>,
    /// `None` when the relay cache is off (measurements).
    pub(crate) relay: Option<relay::Relay>,
    pub(crate) jobs: Mutex<jobs::Jobs>,
    pub(crate) next_task: AtomicU64,
    /// What `/metrics` counts (`metrics` module).
    pub(crate) counters: Arc<metrics::Counters>,
    /// Progress of jobs and tickets, for the dashboard.
    pub(crate) groups: Mutex<dashboard::Groups>,
    next_conn: AtomicU64,
    listen: String,
    /// TCP ports of the head's own listener and of the agents it dials: no clone of an
    /// isolated ticket may connect to them (`TicketNetwork::refused_ports`).
    control_ports: Vec<u16>,
    facts: Vec<(String, String)>,
    /// The LL policy's episodes and what it is doing per host.
    pub(crate) lingering: Mutex<linger::Lingering>,
    /// Whether tasks may run as root (`--no-root-tasks` refuses them).
    root_tasks: bool,
    /// The cluster's credentials directory (enrolments, enrolled hosts, revocations).
    auth: Option<AuthDir>,
    /// Serials of revoked certificates, as last read from the revocation list;
    /// every connection of a certificate watches it.
    revoked: tokio::sync::watch::Sender<Arc<HashSet<String>>>,
    /// The TLS of new connections: rebuilt when `ca.pem` changes (a CA rotation).
    tls: std::sync::RwLock<HeadTls>,
    /// The cluster's CAs, as last read (a new connection whose certificate's CA is retired is refused).
    trust: tokio::sync::watch::Sender<Arc<Trust>>,
    /// Certificates of a previous CA whose holders were sent a certificate of the current
    /// one over a live connection: serial → the new certificate (PEM).
    reissued: Mutex<HashMap<String, String>>,
    /// Live connections of agents holding a certificate: connection id → its certificate and
    /// where to send it new credentials.
    agent_certs: Mutex<HashMap<u64, (Identity, Outgoing)>>,
}

/// The TLS configurations the head uses for new connections.
#[derive(Clone, Default)]
struct HeadTls {
    acceptor: Option<TlsAcceptor>,
    /// For `--agent` (agents that listen); `None` when there are none.
    connector: Option<TlsConnector>,
}

impl HeadTls {
    fn load(auth: Option<&AuthDir>, dials_agents: bool) -> Result<HeadTls, starling_auth::AuthError> {
        let Some(a) = auth else { return Ok(HeadTls::default()) };
        Ok(HeadTls { acceptor: Some(a.head_acceptor()?), connector: if dials_agents { Some(a.connector(AuthRole::Head)?) } else { None } })
    }
}

/// What the head knows, at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub listen: String,
    /// Each host as it reported itself, with `running` = cores the head has
    /// placed there (exact; the agent's own count lags by a heartbeat).
    pub hosts: Vec<HostInfo>,
    /// Placed tasks: (task, host, cores held).
    pub tasks: Vec<(TaskId, String, u32)>,
    /// Launches waiting for cores.
    pub queued: usize,
    /// Jobs whose bindings the head holds.
    pub jobs: usize,
    pub relay_cache: bool,
    pub facts: Vec<(String, String)>,
}

/// Who is on the other end of a connection, as established below the
/// protocol (by the kernel or by a certificate), before any frame is read.
#[derive(Clone, Debug)]
pub(crate) enum Peer {
    /// A local user: on the head's Unix socket, or speaking through the link relay.
    Local(Cred),
    /// A TLS peer holding a certificate of the cluster's CA.
    Cert(Identity),
    /// Plain TCP to a head started without `--auth`: nothing is known.
    Unauthenticated,
}

/// Who a client is, for what it may launch: `Some`: tasks run as this user
/// whatever their spec says (a local user, or a user certificate's); `None`:
/// the spec's ids are believed (the administrator's client certificate, or a
/// head without `--auth`).
pub(crate) type ClientIdentity = Option<Cred>;

/// What a plain-TCP starling peer of an `--auth` head is told before it is closed.
const NEEDS_TLS: &str = "this head accepts only mutual-TLS connections with a certificate of its cluster; \
local users connect through its Unix socket (RUN_DIR/head.sock, found by `starling up`'s record), \
remote ones need a certificate (README, Authentication)";

/// Run the head until the process is killed.
pub async fn run(settings: HeadSettings) -> Result<(), HeadError> {
    let listener = TcpListener::bind(&settings.listen)
        .await
        .map_err(|source| HeadError::Listen { addr: settings.listen.clone(), source })?;
    let auth = settings.auth.as_ref().map(AuthDir::new);
    let tls = HeadTls::load(auth.as_ref(), !settings.agents.is_empty())?;
    let revoked = match &auth {
        Some(a) => a.revoked().map_err(|e| HeadError::Revoked(e.to_string()))?,
        None => HashSet::new(),
    };
    let trust = match &auth {
        Some(a) => a.trust()?,
        None => Trust::default(),
    };
    let unix = match &settings.socket {
        Some(path) => Some(bind_socket(path)?),
        None => None,
    };
    let counters = Arc::new(metrics::Counters::default());
    let metrics_listener = match &settings.metrics {
        Some(addr) => {
            Some(TcpListener::bind(addr).await.map_err(|source| HeadError::Metrics { addr: addr.clone(), source })?)
        }
        None => None,
    };
    let mut facts = settings.facts;
    if let Some(l) = &metrics_listener {
        if let Ok(a) = l.local_addr() {
            facts.push(("metrics".into(), format!("http://{a}/metrics")));
        }
    }
    facts.push(("auth".into(), if settings.auth.is_some() { "mutual TLS" } else { "none (TCP unauthenticated)" }.into()));
    if !settings.root_tasks {
        facts.push(("root_tasks".into(), "refused".into()));
    }
    let relay = if settings.relay_cache {
        let dir = settings.state.join("cache");
        Some(
            relay::Relay::open(&dir, settings.cache_mib << 20, settings.peer_referrals, counters.clone())
                .map_err(|source| HeadError::RelayCache { path: dir, source })?,
        )
    } else {
        None
    };
    let head = Arc::new(Head {
        me: Mutex::new(std::sync::Weak::new()),
        state: Mutex::new(State::default()),
        relay,
        jobs: Mutex::new(jobs::Jobs::default()),
        // Task ids are unique across head restarts too (hosts keep per-task dirs).
        next_task: AtomicU64::new(now_us()),
        counters,
        groups: Mutex::new(dashboard::Groups::default()),
        next_conn: AtomicU64::new(1),
        listen: settings.listen.clone(),
        control_ports: control_ports(&settings.listen, &settings.agents),
        facts,
        lingering: Mutex::new(linger::Lingering::default()),
        root_tasks: settings.root_tasks,
        auth,
        revoked: tokio::sync::watch::Sender::new(Arc::new(revoked)),
        tls: std::sync::RwLock::new(tls.clone()),
        trust: tokio::sync::watch::Sender::new(Arc::new(trust)),
        reissued: Mutex::default(),
        agent_certs: Mutex::default(),
    });
    if head.auth.is_some() {
        tokio::spawn(head.clone().watch_revocations());
        tokio::spawn(head.clone().watch_cas(!settings.agents.is_empty()));
    }
    *head.me.lock().unwrap() = Arc::downgrade(&head);
    if let Some(l) = metrics_listener {
        tokio::spawn(metrics::serve(head.clone(), l));
    }
    {
        let head = head.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(linger::TICK).await;
                head.linger_tick().await;
            }
        });
    }
    match &tls.acceptor {
        Some(_) => log::info!("head listening on {} (mutual TLS)", settings.listen),
        None => log::warn!(
            "head listening on {} WITHOUT authentication: anyone who reaches it runs tasks as any uid (start it with --auth DIR)",
            settings.listen
        ),
    }
    for addr in settings.agents {
        tokio::spawn(head.clone().dial_agent(addr));
    }
    if let Some((l, path)) = unix {
        log::info!("head listening on {} for local clients", path.display());
        let head = head.clone();
        tokio::spawn(async move {
            loop {
                let sock = match l.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        log::warn!("{}: accepting: {e}", path.display());
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let head = head.clone();
                tokio::spawn(async move {
                    let cred = match starling_auth::unix_peer(&sock) {
                        Ok(c) => c,
                        Err(e) => return log::warn!("local connection: cannot read its credentials: {e}"),
                    };
                    let uid = cred.uid;
                    if let Err(e) = head.serve(sock, Peer::Local(cred)).await {
                        log::info!("local connection of uid {uid}: {e}");
                    }
                });
            }
        });
    }
    loop {
        let (sock, peer) = listener.accept().await.map_err(HeadError::Accept)?;
        let _ = sock.set_nodelay(true);
        let head = head.clone();
        let acceptor = head.tls.read().unwrap().acceptor.clone();
        tokio::spawn(async move {
            let res = match acceptor {
                None => head.serve(sock, Peer::Unauthenticated).await,
                Some(acceptor) => match accept_tls(&acceptor, sock).await {
                    Ok(Some((tls, Some(id)))) => head.serve(tls, Peer::Cert(id)).await,
                    Ok(Some((mut tls, None))) => {
                        let auth = head.auth.as_ref().expect("TLS only with credentials");
                        return match tokio::time::timeout(HANDSHAKE, starling_auth::enrol::serve(&mut tls, auth)).await {
                            Ok(Ok(host)) => log::info!("enrolled host {host} (from {peer}) with a join token"),
                            Ok(Err(why)) => log::warn!("enrolment from {peer} refused: {why}"),
                            Err(_) => log::warn!("enrolment from {peer} refused: no request within {HANDSHAKE:?}"),
                        };
                    }
                    // A port probe (`starling up` waits for the port this way).
                    Ok(None) => return,
                    Err(why) => return log::warn!("connection from {peer} refused: {why}"),
                },
            };
            if let Err(e) = res {
                log::info!("connection from {peer}: {e}");
            }
        });
    }
}

/// Listen on the local clients' socket: any user may connect (mode 0666);
/// the kernel tells the head who they are.
fn bind_socket(path: &std::path::Path) -> Result<(UnixListener, std::path::PathBuf), HeadError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| HeadError::Socket { path: path.to_path_buf(), source };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let l = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(err)?;
    Ok((l, path.to_path_buf()))
}

/// The TLS handshake of a TCP peer, and who its certificate names (`None`:
/// it showed none, and may only enrol with a join token). A plain starling
/// peer (its first bytes are a frame's magic) is told why in one frame;
/// anything else that is not TLS, or shows a certificate not of the
/// cluster's CA, fails the handshake. Nothing it sent is parsed as a frame.
async fn accept_tls(acceptor: &TlsAcceptor, sock: TcpStream) -> Result<Option<(ServerTls<TcpStream>, Option<Identity>)>, String> {
    let mut first = [0u8; 4];
    let n = tokio::time::timeout(HANDSHAKE, sock.peek(&mut first)).await.map_err(|_| "no TLS handshake".to_string())?.map_err(|e| e.to_string())?;
    if n == 0 {
        return Ok(None);
    }
    if first[..n] == starling_proto::MAGIC[..n] {
        let mut sock = sock;
        // Take what it sent (so closing does not reset the connection before it reads our answer).
        let mut sink = [0u8; 4096];
        while matches!(sock.try_read(&mut sink), Ok(n) if n > 0) {}
        let _ = starling_proto::write_frame(&mut sock, &Msg::Error { task: None, message: NEEDS_TLS.into() }).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut sock).await;
        return Err("plain starling connection without TLS (told to use a certificate or the local socket)".into());
    }
    let tls = tokio::time::timeout(HANDSHAKE, acceptor.accept(sock))
        .await
        .map_err(|_| "TLS handshake timed out".to_string())?
        .map_err(|e| format!("TLS: {e}"))?;
    if tls.get_ref().1.peer_certificates().is_none() {
        return Ok(Some((tls, None)));
    }
    let id = starling_auth::ident::client_identity(&tls).ok_or("its certificate names no starling role")?;
    Ok(Some((tls, Some(id))))
}

/// How often the head looks at the files it follows ([`WatchedFile`]) for changes.
const WATCHED_FILE_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// A file the head follows (the CAs, the revocation list): commands change
/// it on disk, and its modification time and length say when to read it again.
struct WatchedFile {
    path: std::path::PathBuf,
    seen: Option<(Option<std::time::SystemTime>, u64)>,
}

impl WatchedFile {
    fn new(path: std::path::PathBuf) -> WatchedFile {
        let seen = Self::stamp(&path);
        WatchedFile { path, seen }
    }

    fn stamp(path: &std::path::Path) -> Option<(Option<std::time::SystemTime>, u64)> {
        std::fs::metadata(path).ok().map(|m| (m.modified().ok(), m.len()))
    }

    /// Return at the first poll that finds the file changed since the last return.
    async fn changed(&mut self) {
        loop {
            tokio::time::sleep(WATCHED_FILE_POLL).await;
            let now = Self::stamp(&self.path);
            if now != self.seen {
                self.seen = now;
                return;
            }
        }
    }
}

/// Who a certificate names, for the lines its holder is told.
fn holder(id: &Identity) -> String {
    match (&id.host, &id.user) {
        (Some(h), _) => format!("host {h}"),
        (_, Some(u)) => format!("user {}", u.name),
        _ => format!("a {:?} certificate", id.role),
    }
}

/// The one line a revoked certificate's holder is told.
fn revoked_line(id: &Identity) -> String {
    format!("the certificate of {} (serial {}) was revoked by this cluster's administrator; it is refused", holder(id), id.serial)
}

/// The one line the holder of a certificate of a retired CA is told.
fn retired_line(id: &Identity) -> String {
    format!(
        "the certificate of {} (serial {}) was issued by a CA this cluster has retired (`starling ca rotate`); it is refused: \
         use the credentials re-issued by the rotation, or get new ones (`starling user add`, `starling agent --join`)",
        holder(id),
        id.serial
    )
}

/// Bound on a peer's TLS handshake.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(30);

/// Microseconds since the epoch.
/// The ports of the head's listener and of the agents it dials (addresses that do not parse
/// as `IP:PORT` name none).
fn control_ports(listen: &str, agents: &[String]) -> Vec<u16> {
    std::iter::once(listen)
        .chain(agents.iter().map(String::as_str))
        .filter_map(|a| a.parse::<std::net::SocketAddr>().ok().map(|a| a.port()))
        .collect()
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl Head {
    /// Keep a connection to an agent started with `starling agent --listen`
    /// (over mutual TLS when the head has credentials: the agent must show
    /// an agent certificate, and is shown the head's).
    async fn dial_agent(self: Arc<Self>, addr: String) {
        loop {
            match TcpStream::connect(&addr).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    let tls = self.tls.read().unwrap().connector.clone();
                    let res = match &tls {
                        None => self.clone().serve(s, Peer::Unauthenticated).await,
                        Some(c) => match c.connect(starling_auth::server_name(AuthRole::Agent), s).await {
                            Ok(t) => match starling_auth::ident::server_identity(&t) {
                                Some(id) => self.clone().serve(t, Peer::Cert(id)).await,
                                None => Err(ProtoError::Refused("its agent certificate names no starling role".into())),
                            },
                            Err(e) => Err(ProtoError::Io(e)),
                        },
                    };
                    if let Err(e) = res {
                        log::warn!("agent {addr}: {e}");
                    }
                }
                Err(e) => log::debug!("dial {addr}: {e}"),
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }

    async fn serve<S>(self: Arc<Self>, sock: S, peer: Peer) -> Result<(), ProtoError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (mut r, mut w) = tokio::io::split(sock);
        if let Peer::Cert(id) = &peer {
            if let Some(why) = self.revoked_why(id).or_else(|| self.retired_why(id)) {
                let _ = starling_proto::write_frame(&mut w, &Msg::Error { task: None, message: why.clone() }).await;
                return Err(ProtoError::Refused(why));
            }
        }
        // The link relay speaks for a local user: its first frame says which.
        let peer = match peer {
            Peer::Cert(Identity { role: AuthRole::Relay, .. }) => match starling_proto::read_frame(&mut r).await? {
                Msg::OnBehalfOf { uid, gid, groups } => Peer::Local(Cred { uid, gid, groups }),
                _ => {
                    let e = "the link relay must first name the user it speaks for";
                    let _ = starling_proto::write_frame(&mut w, &Msg::Error { task: None, message: e.into() }).await;
                    return Err(ProtoError::Refused(e.into()));
                }
            },
            p => p,
        };
        let (hello, mut incoming, tx) = establish(r, w, Role::Head, "head").await?;
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let refuse = |why: String| async {
            let _ = tx.send(Msg::Error { task: None, message: why.clone() }).await;
            Err(ProtoError::Refused(why))
        };
        let cert = match &peer {
            Peer::Cert(id) => Some(id.clone()),
            _ => None,
        };
        match hello.role {
            Role::Agent => {
                let bound = match &peer {
                    Peer::Unauthenticated => None,
                    Peer::Cert(Identity { role: AuthRole::Agent, host, .. }) => host.clone(),
                    _ => return refuse(format!("only a holder of an agent certificate may serve as a host, not {peer:?}")).await,
                };
                if let Some(id) = &cert {
                    self.agent_certs.lock().unwrap().insert(conn, (id.clone(), tx.clone()));
                    let trust = self.trust.borrow().clone();
                    if trust.issuer(&id.cert) != Issuer::Current {
                        self.offer_credentials(id, &tx, &trust).await;
                    }
                }
                let served = self.serve_agent(conn, &mut incoming, tx.clone(), bound.as_deref());
                let served = async {
                    tokio::select! {
                        res = served => res,
                        () = self.send_revocations(&tx), if cert.is_some() => unreachable!("send_revocations never returns"),
                    }
                };
                let res = self.until_revoked(cert.as_ref(), &tx, served).await;
                self.agent_certs.lock().unwrap().remove(&conn);
                self.agent_gone(conn, &res).await;
                res
            }
            Role::Client => {
                let who: ClientIdentity = match peer {
                    Peer::Local(cred) => Some(cred),
                    Peer::Cert(Identity { role: AuthRole::User, user: Some(u), .. }) => {
                        Some(Cred { uid: u.uid, gid: u.gid, groups: u.task_groups() })
                    }
                    Peer::Cert(Identity { role: AuthRole::Client, .. }) | Peer::Unauthenticated => None,
                    Peer::Cert(id) => return refuse(format!("a {:?} certificate cannot be used by a client", id.role)).await,
                };
                let served = self.serve_client(conn, &mut incoming, tx.clone(), who);
                let res = self.until_revoked(cert.as_ref(), &tx, served).await;
                self.client_gone(conn).await;
                res
            }
            Role::Head => {
                let _ = tx.send(Msg::Error { task: None, message: "a head cannot connect to a head".into() }).await;
                Err(ProtoError::UnexpectedPeer { expected: Role::Agent, got: Role::Head })
            }
        }
    }

    /// The spec a client may launch: a known user's tasks run as that user
    /// (uid, gid and groups from the kernel, whatever the spec claims); root
    /// tasks only where the head allows them.
    pub(crate) fn admit(&self, who: &ClientIdentity, mut spec: starling_proto::TaskSpec) -> Result<starling_proto::TaskSpec, String> {
        if let Some(c) = who {
            spec.uid = c.uid;
            spec.gid = c.gid;
            spec.groups.clone_from(&c.groups);
        }
        if spec.uid == 0 && !self.root_tasks {
            return Err("this cluster refuses tasks that run as root (its head was started with --no-root-tasks); run as an ordinary user".into());
        }
        Ok(spec)
    }

    /// Why a certificate is refused: its serial is on the revocation list, read
    /// afresh (a certificate revoked a moment ago is refused at once; the
    /// list is a few lines, and a TLS handshake costs far more).
    fn revoked_why(&self, id: &Identity) -> Option<String> {
        let fresh = self.auth.as_ref().map(AuthDir::revoked);
        let revoked = match fresh {
            Some(Ok(set)) => set.contains(&id.serial),
            Some(Err(e)) => {
                log::warn!("reading the revocation list: {e}; using the last one read");
                self.revoked.borrow().contains(&id.serial)
            }
            None => false,
        };
        revoked.then(|| revoked_line(id))
    }

    /// Why a new connection's certificate is refused for its CA: one retired by a rotation.
    /// (Connections made before the window closed go on, and so do their tasks: a rotation
    /// replaces a CA, it does not distrust what it certified; revocation does that.)
    fn retired_why(&self, id: &Identity) -> Option<String> {
        match self.trust.borrow().issuer(&id.cert) {
            Issuer::Current | Issuer::Previous => None,
            // (Unknown: the handshake checked it against these very CAs, read again since.)
            Issuer::Retired | Issuer::Unknown => Some(retired_line(id)),
        }
    }

    /// Serve a certified connection until it ends or its certificate is
    /// revoked: then the peer is told so in one line and the connection ends.
    async fn until_revoked(
        &self,
        cert: Option<&Identity>,
        tx: &Outgoing,
        served: impl std::future::Future<Output = Result<(), ProtoError>>,
    ) -> Result<(), ProtoError> {
        let Some(id) = cert else { return served.await };
        let mut revoked = self.revoked.subscribe();
        let revocation = async move {
            // (The list's sender lives as long as the head.)
            if revoked.wait_for(|set| set.contains(&id.serial)).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            res = served => res,
            () = revocation => {
                let why = revoked_line(id);
                log::warn!("dropping a connection: {why}");
                let _ = tx.send(Msg::Error { task: None, message: why.clone() }).await;
                Err(ProtoError::Refused(why))
            }
        }
    }

    /// Keep a certified agent told the revocation list (now, then at each change): hosts serve each
    /// other chunks, and each refuses a host whose certificate is on it (`agent::peers`). Never
    /// returns; ends with the connection's future.
    async fn send_revocations(&self, tx: &Outgoing) {
        let mut revoked = self.revoked.subscribe();
        loop {
            let serials: Vec<String> = revoked.borrow_and_update().iter().cloned().collect();
            if tx.send(Msg::Revoked { serials }).await.is_err() || revoked.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Send a connected agent the CAs to trust and, if its certificate is not the current
    /// CA's, one that is, for its own key (made once per certificate: `reissued`).
    async fn offer_credentials(&self, id: &Identity, tx: &Outgoing, trust: &Trust) {
        let Some(auth) = &self.auth else { return };
        let certificate = match trust.issuer(&id.cert) {
            Issuer::Current => None,
            _ => {
                let known = self.reissued.lock().unwrap().get(&id.serial).cloned();
                match known {
                    Some(pem) => Some(pem),
                    None => match auth.reissue(id) {
                        Ok((pem, serial)) => {
                            log::info!("re-issued the certificate of {} (serial {} → {serial}) with the current CA", holder(id), id.serial);
                            self.reissued.lock().unwrap().insert(id.serial.clone(), pem.clone());
                            Some(pem)
                        }
                        Err(e) => return log::warn!("re-issuing the certificate of {}: {e}", holder(id)),
                    },
                }
            }
        };
        match auth.ca_bundle() {
            Ok(ca) => {
                let _ = tx.send(Msg::Credentials { certificate, ca }).await;
            }
            Err(e) => log::warn!("reading the CAs to send {}: {e}", holder(id)),
        }
    }

    /// Follow CA rotations: when `ca.pem` changes, reload the head's TLS, give every connected
    /// agent the new CAs (and a certificate of the current one), then use the new CAs.
    async fn watch_cas(self: Arc<Self>, dials_agents: bool) {
        let Some(auth) = self.auth.clone() else { return };
        let mut cas = WatchedFile::new(auth.ca_cert());
        loop {
            cas.changed().await;
            let (tls, trust) = match (HeadTls::load(Some(&auth), dials_agents), auth.trust()) {
                (Ok(tls), Ok(trust)) => (tls, trust),
                (Err(e), _) | (_, Err(e)) => {
                    log::warn!("reading the cluster's CAs again: {e}; keeping the last ones");
                    continue;
                }
            };
            *self.tls.write().unwrap() = tls;
            log::info!(
                "the cluster's CAs changed: {} trusted{}, {} retired",
                trust.trusted.len(),
                if trust.window_open() { " (a rotation's window is open)" } else { "" },
                trust.retired.len()
            );
            let agents: Vec<(Identity, Outgoing)> = self.agent_certs.lock().unwrap().values().cloned().collect();
            for (id, tx) in &agents {
                self.offer_credentials(id, tx, &trust).await;
            }
            self.trust.send_replace(Arc::new(trust));
        }
    }

    /// Whether a host's connection may register under `name`: a certificate
    /// issued to a host registers as that host only; the shared agent
    /// certificate (or no authentication) as any host not enrolled with a
    /// certificate of its own.
    pub(crate) fn may_register(&self, bound: Option<&str>, name: &str) -> Result<(), String> {
        match bound {
            Some(b) if b != name => Err(format!("this agent's certificate was issued to host {b}; it cannot register as host {name}")),
            Some(_) => Ok(()),
            None if self.auth.as_ref().is_some_and(|a| a.host_enrolled(name)) => Err(format!(
                "host {name} is enrolled with a certificate of its own; the shared agent certificate cannot register as it"
            )),
            None => Ok(()),
        }
    }

    /// Read the revocation list again whenever it changes (`starling host
    /// revoke`, `starling user revoke` append to it); connections of a newly
    /// revoked certificate end ([`Head::until_revoked`]).
    async fn watch_revocations(self: Arc<Self>) {
        let Some(auth) = self.auth.clone() else { return };
        let mut revoked = WatchedFile::new(auth.revoked_path());
        loop {
            revoked.changed().await;
            match auth.revoked() {
                Ok(set) => {
                    log::info!("revocation list read again: {} certificate(s) revoked", set.len());
                    self.revoked.send_replace(Arc::new(set));
                }
                Err(e) => log::warn!("reading the revocation list: {e}"),
            }
        }
    }

    pub(crate) fn self_arc(&self) -> Option<Arc<Head>> {
        self.me.lock().unwrap().upgrade()
    }

    /// What the head knows now (for `starling status` and dashboards).
    pub fn snapshot(&self) -> Snapshot {
        let st = self.state.lock().unwrap();
        let mut hosts: Vec<HostInfo> = st.hosts.values().map(|h| HostInfo { running: h.cores_busy, ..h.info.clone() }).collect();
        hosts.sort_by_key(|h| placement::natural_key(&h.name));
        let tasks = st.routes.iter().map(|(t, r)| (*t, r.host.clone(), r.cores)).collect();
        Snapshot {
            listen: self.listen.clone(),
            hosts,
            tasks,
            queued: st.queue.len(),
            jobs: self.jobs.lock().unwrap().len(),
            relay_cache: self.relay.is_some(),
            facts: self.facts.clone(),
        }
    }

    fn status(&self) -> ClusterStatus {
        let snap = self.snapshot();
        let mut facts = snap.facts;
        facts.push(("queued".into(), snap.queued.to_string()));
        facts.push(("relay_cache".into(), if snap.relay_cache { "on" } else { "off" }.into()));
        let mut hosts = snap.hosts;
        let lg = self.lingering.lock().unwrap();
        for h in &mut hosts {
            if let (Some(o), Some(d)) = (h.owner.as_mut(), lg.doing.get(&h.name)) {
                o.doing.clone_from(d);
            }
        }
        ClusterStatus { head: snap.listen, hosts, facts }
    }

    /// Tell a task's client it was lost, and give back its cores.
    pub(crate) async fn lose_task(&self, task: TaskId, why: &str) {
        let Some(mut r) = self.state.lock().unwrap().end_route(task) else { return };
        metrics::add(&self.counters.tasks_lost, 1);
        self.groups.lock().unwrap().lost(task);
        self.move_outlived(task, r.moving.take()).await;
        if let Some(c) = r.client {
            let _ = c.send(Msg::Error { task: Some(task), message: why.to_string() }).await;
        }
    }

    async fn agent_gone(&self, conn: u64, why: &Result<(), ProtoError>) {
        let (name, lost): (Option<String>, Vec<TaskId>) = {
            let mut st = self.state.lock().unwrap();
            let name = st.hosts.iter().find(|(_, h)| h.conn_id == conn).map(|(n, _)| n.clone());
            if let Some(n) = &name {
                if let (Some(h), Some(relay)) = (st.hosts.remove(n), &self.relay) {
                    relay.forget_peer(h.info.peer.as_deref());
                }
            }
            let lost = st.routes.iter().filter(|(_, r)| r.host_conn == conn).map(|(t, _)| *t).collect();
            (name, lost)
        };
        let Some(name) = name else { return };
        let reason = match why {
            Err(ProtoError::Closed) | Ok(()) => "connection closed".to_string(),
            Err(e) => e.to_string(),
        };
        log::warn!("host {name} lost ({reason}); {} task(s) affected", lost.len());
        for t in lost {
            if self.requeue(t, "lost its host").await {
                continue;
            }
            self.lose_task(t, &format!("host {name} was lost while running the task ({reason}); no changes were committed")).await;
        }
        self.fail_unplaceable(&name).await;
    }

    async fn client_gone(&self, conn: u64) {
        let orphans: Vec<(TaskId, Option<Outgoing>)> = {
            let mut st = self.state.lock().unwrap();
            st.queue.retain(|q| q.conn != conn);
            st.grants.retain(|(c, _), _| *c != conn);
            let st = &mut *st;
            // Reruns waiting in the queue have nothing to kill: they end here.
            st.routes.retain(|_, r| r.client_conn != conn || r.host != eviction::QUEUED_FOR_RERUN);
            // Keep the routes until the hosts report the ends: the cores stay busy until then.
            let end = st.detach_client(conn);
            end.into_iter().map(|t| (t, st.routes.get(&t).and_then(|r| st.hosts.get(&r.host)).map(|h| h.tx.clone()))).collect()
        };
        for (task, agent) in orphans {
            if let Some(a) = agent {
                // The client is gone: nobody can receive the results, so end the task.
                let _ = a.send(Msg::Signal { task, signo: libc::SIGKILL }).await;
            }
        }
    }
}
