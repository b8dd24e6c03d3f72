//! A client session: one connection to the head carrying any number of
//! tasks. The session answers every task's file faults from this machine,
//! collects each task's output files and commits them when it finishes, so
//! a caller only launches tasks and consumes their [`TaskEvent`]s.
//!
//! `starling exec` uses one task per session; `starling run`/`batch` and the
//! fork API launch many tasks over one session (one process, one connection,
//! however many tasks). Launches are matched to their tasks by a reference
//! the session chooses, since the head may queue a launch until a core is
//! free and so start tasks out of order.

use crate::commit::{self, CommitReport};
use crate::discover::{Target, NO_CLUSTER};
use crate::files::FileServer;
use starling_config::Chunking;
use starling_proto::conn::{establish, open_pipelined, Outgoing};
use starling_proto::{ExitStatus, Hash, JobTask, Msg, ProtoError, Role, Stream, TaskId, TaskSpec, WirePath};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("opening the recipe cache {}: {source}", path.display())]
    RecipeCache { path: PathBuf, #[source] source: std::io::Error },
    #[error("{NO_CLUSTER} (the cluster recorded at {addr} does not answer: {source})")]
    RecordedHeadGone { addr: String, #[source] source: std::io::Error },
    #[error("cannot reach the starling cluster at {addr}: {source}")]
    Unreachable { addr: String, #[source] source: std::io::Error },
    #[error("connecting to the cluster head: {0}")]
    Handshake(#[source] ProtoError),
    #[error("the cluster head accepts TCP clients only with a certificate, and {} is not readable by you: on the cluster's machine use its local socket (`starling up`'s record names it), elsewhere ask its admin for a client certificate", key.display())]
    NoCertificate { key: PathBuf },
    #[error("the cluster's credentials: {0}")]
    Auth(#[source] starling_auth::AuthError),
    #[error("TLS with the cluster head at {addr}: {source}")]
    Tls { addr: String, #[source] source: std::io::Error },
    #[error("lost connection to the cluster head")]
    LostHead,
    #[error("protocol error from the cluster head: {0}")]
    HeadProtocol(#[source] Arc<ProtoError>),
    /// The head could not place a launch (its reason).
    #[error("{0}")]
    Refused(String),
    /// A task was lost (the head's reason).
    #[error("{0}")]
    Lost(String),
    #[error("the cluster refused the ticket: {0}")]
    TicketRefused(String),
}

pub type Result<T, E = SessionError> = std::result::Result<T, E>;

/// What happens to a launch, in order: `Started` (or `Refused`), output,
/// then exactly one of `Finished` or `Lost`.
#[derive(Debug)]
pub enum TaskEvent {
    /// A host has a core for it and it is starting. `job_fresh`: the head
    /// held no bindings for the launch's job (see [`Msg::Started`]).
    Started { task: TaskId, host: String, job_fresh: bool },
    /// The head could not place it (no such host, no hosts).
    Refused(String),
    Output(Stream, Vec<u8>),
    /// The task ended and its changes were committed (or the commit failed: Err).
    /// `accessed`: the paths it looked at (for prethrow profiles).
    Finished { status: ExitStatus, commit: Result<CommitReport, Arc<commit::CommitError>>, accessed: Vec<WirePath> },
    /// The task is gone without a result (host lost, head lost); nothing was committed.
    Lost(String),
    /// One clone of a clone task ended (clone tasks only, before `Finished`):
    /// its status if its restorer reported one, and its fault-handler counters.
    CloneStats { clone_id: u32, status: Option<ExitStatus>, counters: starling_proto::CloneCounters },
    /// An X connection of an X11-forwarded task (`exec --x11`), on the task's side.
    X11(X11Event),
}

/// What happened to one X connection of a task (`stream`: its number within the task).
#[derive(Debug)]
pub enum X11Event {
    /// The task's program connected to its display.
    Open(u32),
    /// It sent these bytes to its X server.
    Data(u32, Vec<u8>),
    /// It closed the connection.
    Close(u32),
}

impl TaskEvent {
    fn is_last(&self) -> bool {
        matches!(self, TaskEvent::Refused(_) | TaskEvent::Finished { .. } | TaskEvent::Lost(_))
    }
}

/// A started task.
pub struct TaskHandle {
    pub task: TaskId,
    pub host: String,
    /// The head held no bindings for this launch's job.
    pub job_fresh: bool,
    pub events: mpsc::UnboundedReceiver<TaskEvent>,
    tx: Outgoing,
    /// Where to acknowledge the output handed to `events` (a terminal task's).
    written: Option<Arc<Mutex<Written>>>,
}

/// A terminal task's output handed over and not acknowledged yet: bytes by where their
/// acknowledgement goes (the path the output came by: the head, or the home site directly; `None`:
/// nowhere), in order.
#[derive(Default)]
struct Written(VecDeque<(Option<Outgoing>, u64)>);

impl Written {
    fn push(&mut self, to: Option<Outgoing>, bytes: u64) {
        let same = |a: &Option<Outgoing>| match (a, &to) {
            (Some(a), Some(b)) => a.same_channel(b),
            (a, b) => a.is_none() && b.is_none(),
        };
        match self.0.back_mut() {
            Some((last, n)) if same(last) => *n += bytes,
            _ => self.0.push_back((to, bytes)),
        }
    }

    /// The next `bytes` were written: how many to acknowledge where.
    fn take(&mut self, mut bytes: u64) -> Vec<(Option<Outgoing>, u64)> {
        let mut acks = Vec::new();
        while bytes > 0 {
            let Some((to, n)) = self.0.front_mut() else { break };
            let now = bytes.min(*n);
            *n -= now;
            bytes -= now;
            acks.push((to.clone(), now));
            if *n == 0 {
                self.0.pop_front();
            }
        }
        acks
    }
}

impl TaskHandle {
    pub async fn stdin(&self, data: Vec<u8>) -> Result<()> {
        self.tx.send(Msg::Stdin { task: self.task, data }).await.map_err(|_| SessionError::LostHead)
    }
    pub async fn stdin_eof(&self) {
        let _ = self.tx.send(Msg::StdinEof { task: self.task }).await;
    }
    pub async fn signal(&self, signo: i32) {
        let _ = self.tx.send(Msg::Signal { task: self.task, signo }).await;
    }
    /// A sender usable from a plain thread (e.g. a blocking stdin reader).
    pub fn sender(&self) -> Outgoing {
        self.tx.clone()
    }
    /// `bytes` more of the task's output (its `Output` events, in order) were written to the user:
    /// acknowledged (`Msg::OutputAck`) on the path each came by, so the head and the home site
    /// each keep only what was not written (`starling_proto::path`). Nothing for a task not on
    /// a terminal.
    pub async fn written(&self, bytes: u64) {
        let Some(w) = &self.written else { return };
        let acks = w.lock().unwrap().take(bytes);
        for (to, bytes) in acks {
            if let Some(to) = to {
                let _ = to.send(Msg::OutputAck { task: self.task, bytes }).await;
            }
        }
    }
}

/// A launched job task: its events start with `Started` or `Refused`.
pub struct Pending {
    pub index: usize,
    pub events: mpsc::UnboundedReceiver<TaskEvent>,
}

struct TaskSink {
    events: mpsc::UnboundedSender<TaskEvent>,
    chunks: HashMap<Hash, Vec<u8>>,
    /// `Finished` arrived; its commit is under way (a closing connection can no longer lose it).
    finishing: bool,
    /// Its messages go through a path sender from its start (a task with a [`TaskHandle`]).
    with_paths: bool,
    /// A terminal task: its output is acknowledged ([`TaskHandle::written`]).
    acked: bool,
}

/// A head's answer to a ticket request.
#[derive(Clone, Debug)]
pub struct Grant {
    pub ticket: u64,
    /// (host, clones there).
    pub placement: Vec<(String, u32)>,
    /// Granted hosts that cannot enforce the ticket's own network: their clones get their host's.
    pub unisolated: Vec<starling_proto::Unisolated>,
}

#[derive(Default)]
struct State {
    next_ref: u64,
    sinks: HashMap<u64, TaskSink>,
    by_task: HashMap<TaskId, u64>,
    tickets: VecDeque<oneshot::Sender<Result<Grant>>>,
    /// `holds` queries waiting for their answers, by nonce.
    holds: HashMap<u64, oneshot::Sender<Vec<starling_proto::Hash>>>,
    next_holds: u64,
    /// Why the session ended, once it has.
    closed: Option<Closed>,
    /// The path senders of tasks with a handle (`starling exec`, `attach`): their stream may go
    /// straight to the home site while they run there (`starling_proto::path`).
    paths: HashMap<TaskId, TaskPaths>,
}

/// A started task's sender and the direct connection waiting for it.
struct TaskPaths {
    sender: mpsc::WeakSender<Msg>,
    slot: starling_proto::path::DirectSlot,
    /// The sender until its handle takes it.
    unclaimed: Option<Outgoing>,
    /// Where its output's acknowledgements go (a terminal task's).
    written: Option<Arc<Mutex<Written>>>,
}

/// How a task's stream arrives: from which path, and whether we answered the home site's
/// switch away from the direct one (with ours, so it knows our direct input is all in).
#[derive(Default)]
struct Arrival {
    merge: starling_proto::path::PathMerge,
    answered: bool,
    /// Which direct connection is the task's (an earlier one may still be closing).
    conn: u64,
    /// That connection, while output may still come on it (acknowledged there).
    acks: Option<Outgoing>,
}

/// Why a session ended.
#[derive(Clone, Debug)]
enum Closed {
    HeadClosed,
    Protocol(Arc<ProtoError>),
}

impl Closed {
    fn error(&self) -> SessionError {
        match self {
            Closed::HeadClosed => SessionError::LostHead,
            Closed::Protocol(e) => SessionError::HeadProtocol(e.clone()),
        }
    }
}

#[derive(Clone)]
pub struct Session {
    /// Where the head was reached.
    pub head_addr: String,
    /// Names this cluster in client-side records of what it holds.
    pub cluster_id: String,
    tx: Outgoing,
    files: Arc<FileServer>,
    state: Arc<Mutex<State>>,
    /// Tasks with a direct path: the order their stream arrives in (locked while what it
    /// releases is handled, so the two paths' readers never interleave).
    arrivals: Arc<Mutex<HashMap<TaskId, Arrival>>>,
}

pub struct SessionOptions {
    /// zstd on chunk transfers and on frames over the link (frames on the
    /// head's own local socket never are: see [`Target::head_is_local`]).
    pub compress: bool,
    /// Where the recipe cache lives (`client.cache_dir`).
    pub cache_dir: PathBuf,
    /// How files are cut into chunks (recipes of both kinds never mix).
    pub chunking: Chunking,
}

/// Whatever carries a connection to the head: the local Unix socket, TLS
/// over TCP, or plain TCP.
pub trait HeadIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> HeadIo for T {}

/// The reading half of a connection to the head.
pub type HeadReader = tokio::io::ReadHalf<Box<dyn HeadIo>>;

/// Connect to the head and introduce ourselves as a client (waiting for the head's hello).
pub async fn connect(target: &Target) -> Result<(starling_proto::conn::Incoming<HeadReader>, Outgoing)> {
    let sock = dial(target).await?;
    let (r, w) = tokio::io::split(sock);
    let (_peer, incoming, tx) = establish(r, w, Role::Client, "client").await.map_err(SessionError::Handshake)?;
    Ok((incoming, tx))
}

/// Reach the head: through the cluster's local socket when there is one
/// (the kernel tells the head who we are), else over TCP — mutual TLS with
/// the client certificate when the cluster has credentials.
async fn dial(target: &Target) -> Result<Box<dyn HeadIo>> {
    if let Some(path) = target.socket.as_ref().filter(|p| p.exists()) {
        let addr = path.display().to_string();
        return match tokio::net::UnixStream::connect(path).await {
            Ok(s) => Ok(Box::new(s)),
            Err(source) if target.record.is_some() => Err(SessionError::RecordedHeadGone { addr, source }),
            Err(source) => Err(SessionError::Unreachable { addr, source }),
        };
    }
    let addr = target.head_addr.clone();
    let connector = match &target.auth {
        Some(dir) => {
            let auth = starling_auth::AuthDir::new(dir);
            let role = starling_auth::Role::Client;
            if std::fs::File::open(auth.key(role)).is_err() {
                return Err(SessionError::NoCertificate { key: auth.key(role) });
            }
            Some(auth.connector(role).map_err(SessionError::Auth)?)
        }
        None => None,
    };
    let sock = match TcpStream::connect(&addr).await {
        Ok(s) => s,
        Err(source) if target.record.is_some() => return Err(SessionError::RecordedHeadGone { addr, source }),
        Err(source) => return Err(SessionError::Unreachable { addr, source }),
    };
    sock.set_nodelay(true).map_err(|source| SessionError::Unreachable { addr: addr.clone(), source })?;
    match connector {
        None => Ok(Box::new(sock)),
        Some(c) => match c.connect(starling_auth::server_name(starling_auth::Role::Head), sock).await {
            Ok(t) => Ok(Box::new(t)),
            Err(source) => Err(SessionError::Tls { addr, source }),
        },
    }
}

impl Session {
    pub async fn connect(target: &Target, opts: SessionOptions) -> Result<Session> {
        // Recipes made with chunking switched off must not mix with the normal ones.
        let recipes = opts.cache_dir.join(match opts.chunking {
            Chunking::ContentDefined => "recipes",
            Chunking::Fixed => "recipes-fixed",
        });
        let cache = starling_store::RecipeCache::open(&recipes, opts.chunking)
            .map_err(|source| SessionError::RecipeCache { path: recipes, source })?;
        let files = Arc::new(FileServer::new(cache, opts.compress));
        // Pipelined: the launch can follow our hello in the same flight.
        let sock = dial(target).await?;
        let (r, w) = tokio::io::split(sock);
        let compress_frames = opts.compress && !target.head_is_local();
        let (incoming, tx) =
            open_pipelined(r, w, Role::Client, "client", compress_frames).await.map_err(SessionError::Handshake)?;
        let session = Session {
            head_addr: target.head_addr.clone(),
            cluster_id: target.cluster_id.clone(),
            tx,
            files,
            state: Arc::new(Mutex::new(State::default())),
            arrivals: Arc::default(),
        };
        let s = session.clone();
        tokio::spawn(async move { s.read_loop(incoming).await });
        Ok(session)
    }

    pub fn files(&self) -> &Arc<FileServer> {
        &self.files
    }

    /// Register `n` launches; returns the first reference and their event streams.
    fn register(&self, n: usize, with_paths: bool, acked: bool) -> Result<(u64, Vec<mpsc::UnboundedReceiver<TaskEvent>>)> {
        let mut st = self.state.lock().unwrap();
        if let Some(why) = &st.closed {
            return Err(why.error());
        }
        let first = st.next_ref;
        st.next_ref += n as u64;
        let mut rxs = Vec::with_capacity(n);
        for i in 0..n as u64 {
            let (tx, rx) = mpsc::unbounded_channel();
            st.sinks.insert(first + i, TaskSink { events: tx, chunks: HashMap::new(), finishing: false, with_paths, acked });
            rxs.push(rx);
        }
        Ok((first, rxs))
    }

    /// Start a task; resolves once a host has started it.
    pub async fn launch(&self, spec: TaskSpec) -> Result<TaskHandle> {
        let (reference, mut rxs) = self.register(1, true, spec.terminal.is_some())?;
        let events = rxs.pop().expect("one receiver");
        self.tx.send(Msg::Launch { spec, reference }).await.map_err(|_| SessionError::LostHead)?;
        self.started(events).await
    }

    /// Become the client of a task on a terminal whose own client went away (`starling
    /// attach`): its events go on from the first output byte that client had not written.
    /// `force`: take it over from a client still attached.
    pub async fn attach(&self, task: TaskId, force: bool) -> Result<TaskHandle> {
        // (Only a terminal task outlives its client.)
        let (reference, mut rxs) = self.register(1, true, true)?;
        let events = rxs.pop().expect("one receiver");
        self.tx.send(Msg::Attach { task, reference, force }).await.map_err(|_| SessionError::LostHead)?;
        self.started(events).await
    }

    async fn started(&self, mut events: mpsc::UnboundedReceiver<TaskEvent>) -> Result<TaskHandle> {
        match events.recv().await {
            Some(TaskEvent::Started { task, host, job_fresh }) => {
                let mut st = self.state.lock().unwrap();
                let paths = st.paths.get_mut(&task);
                let written = paths.as_ref().and_then(|p| p.written.clone());
                let tx = paths.and_then(|p| p.unclaimed.take());
                Ok(TaskHandle { task, host, job_fresh, events, tx: tx.unwrap_or_else(|| self.tx.clone()), written })
            }
            Some(TaskEvent::Refused(why)) => Err(SessionError::Refused(why)),
            Some(TaskEvent::Lost(why)) => Err(SessionError::Lost(why)),
            _ => Err(SessionError::LostHead),
        }
    }

    /// Start a task without waiting for it to start: its events begin with
    /// `Started` (or `Refused`).
    pub async fn launch_pending(&self, spec: TaskSpec, index: usize) -> Result<Pending> {
        let (reference, mut rxs) = self.register(1, false, false)?;
        self.tx.send(Msg::Launch { spec, reference }).await.map_err(|_| SessionError::LostHead)?;
        Ok(Pending { index, events: rxs.pop().expect("one receiver") })
    }

    /// Start a job: one message and one prethrow for all its tasks. Each
    /// task's events begin with `Started` once a host has a core for it.
    pub async fn launch_job(&self, spec: TaskSpec, tasks: Vec<JobTask>) -> Result<Vec<Pending>> {
        let (first_reference, rxs) = self.register(tasks.len(), false, false)?;
        self.tx.send(Msg::LaunchJob { spec, tasks, first_reference }).await.map_err(|_| SessionError::LostHead)?;
        Ok(rxs.into_iter().enumerate().map(|(index, events)| Pending { index, events }).collect())
    }

    /// Forward a signal to a started task.
    pub async fn signal(&self, task: TaskId, signo: i32) {
        let _ = self.tx.send(Msg::Signal { task, signo }).await;
    }

    /// Send content ahead of a launch, in the same flight (in frames of at
    /// most 16 MiB of chunk data).
    pub async fn push(&self, mut recipes: Vec<starling_proto::Recipe>, chunks: Vec<starling_proto::ChunkData>) -> Result<()> {
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        for c in chunks {
            bytes += c.data.len();
            batch.push(c);
            if bytes >= 16 << 20 || batch.len() >= starling_proto::MAX_BATCH {
                let m = Msg::Push { recipes: std::mem::take(&mut recipes), chunks: std::mem::take(&mut batch) };
                self.tx.send(m).await.map_err(|_| SessionError::LostHead)?;
                bytes = 0;
            }
        }
        if !batch.is_empty() || !recipes.is_empty() {
            self.tx.send(Msg::Push { recipes, chunks: batch }).await.map_err(|_| SessionError::LostHead)?;
        }
        Ok(())
    }

    /// Of `names` (recipe and chunk names), those the head's relay cache
    /// already holds: one round trip, worth it before a large push.
    pub async fn holds(&self, names: Vec<starling_proto::Hash>) -> Result<Vec<starling_proto::Hash>> {
        let mut held = Vec::new();
        for part in names.chunks(starling_proto::MAX_HOLDS_QUERY) {
            let (done_tx, done_rx) = oneshot::channel();
            let nonce = {
                let mut st = self.state.lock().unwrap();
                if let Some(why) = &st.closed {
                    return Err(why.error());
                }
                st.next_holds += 1;
                let n = st.next_holds;
                st.holds.insert(n, done_tx);
                n
            };
            self.tx.send(Msg::HoldsQuery { nonce, names: part.to_vec() }).await.map_err(|_| SessionError::LostHead)?;
            held.extend(done_rx.await.map_err(|_| SessionError::LostHead)?);
        }
        Ok(held)
    }

    /// Reserve up to `n` clones (the fork API's `sf_request_ticket`).
    pub async fn request_ticket(&self, n: u32, hierarchical: bool, isolation: starling_proto::NetworkIsolation) -> Result<Grant> {
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = &st.closed {
                return Err(why.error());
            }
            st.tickets.push_back(done_tx);
        }
        self.tx.send(Msg::TicketRequest { n, hierarchical, isolation }).await.map_err(|_| SessionError::LostHead)?;
        done_rx.await.map_err(|_| SessionError::LostHead)?
    }

    /// Tell the head how a `starling.Executor` on `ticket` stands (shown on its dashboard).
    pub async fn executor_progress(&self, ticket: u64, progress: starling_proto::ExecutorProgress) -> Result<()> {
        self.tx.send(Msg::ExecutorProgress { ticket, progress }).await.map_err(|_| SessionError::LostHead)
    }

    /// Deliver an event to a launch; a final event retires it.
    fn emit_ref(&self, reference: u64, ev: TaskEvent) {
        let mut st = self.state.lock().unwrap();
        let last = ev.is_last();
        if let Some(sink) = st.sinks.get(&reference) {
            let _ = sink.events.send(ev);
        }
        if last {
            st.sinks.remove(&reference);
            let st = &mut *st;
            let paths = &mut st.paths;
            st.by_task.retain(|t, r| {
                if *r == reference {
                    paths.remove(t);
                }
                *r != reference
            });
        }
    }

    fn emit(&self, task: TaskId, ev: TaskEvent) {
        let r = self.state.lock().unwrap().by_task.get(&task).copied();
        if let Some(r) = r {
            self.emit_ref(r, ev);
        }
    }

    /// A task's message from the head's path (`via_direct` false) or its direct one: handled in
    /// the order of the task's stream.
    fn arrived(&self, via_direct: bool, m: Msg) {
        let Some(task) = m.task() else { return };
        let mut arrivals = self.arrivals.lock().unwrap();
        let Some(a) = arrivals.get_mut(&task) else {
            drop(arrivals);
            return self.task_msg(m, Some(self.tx.clone()));
        };
        for (via_direct, m) in a.merge.arrived(via_direct, m) {
            self.task_msg(m, if via_direct { a.acks.clone() } else { Some(self.tx.clone()) });
        }
        if a.merge.left_direct() {
            a.acks = None;
        }
        if a.merge.left_direct() && !a.answered {
            // The home site switched away from the direct path: our input follows (our switch
            // there says the last of it is sent).
            a.answered = true;
            self.switch_sender(task, Msg::PathSwitch { task });
        }
    }

    /// Send a switch into task `task`'s path sender (its place in the order: now, before
    /// anything our handling of what arrived until now makes the task's client send).
    fn switch_sender(&self, task: TaskId, m: Msg) {
        let sender = self.state.lock().unwrap().paths.get(&task).and_then(|p| p.sender.upgrade());
        if let Some(s) = sender {
            if let Err(mpsc::error::TrySendError::Full(m)) = s.try_send(m) {
                tokio::spawn(async move {
                    let _ = s.send(m).await;
                });
            }
        }
    }

    /// One of a task's messages, in its order; an output's acknowledgement goes to `ack_to`
    /// (the way it came).
    fn task_msg(&self, msg: Msg, ack_to: Option<Outgoing>) {
        match msg {
            Msg::Error { task: Some(task), message } => self.emit(task, TaskEvent::Lost(message)),
            Msg::Output { task, stream, data } => {
                let written = self.state.lock().unwrap().paths.get(&task).and_then(|p| p.written.clone());
                if let Some(w) = written.filter(|_| !data.is_empty()) {
                    w.lock().unwrap().push(ack_to, data.len() as u64);
                }
                self.emit(task, TaskEvent::Output(stream, data))
            }
            Msg::X11Open { task, stream } => self.emit(task, TaskEvent::X11(X11Event::Open(stream))),
            Msg::X11Data { task, stream, data } => self.emit(task, TaskEvent::X11(X11Event::Data(stream, data))),
            Msg::X11Close { task, stream } => self.emit(task, TaskEvent::X11(X11Event::Close(stream))),
            Msg::CloneStats { task, clone_id, status, counters } => {
                self.emit(task, TaskEvent::CloneStats { clone_id, status, counters })
            }
            Msg::FileRequest { task, id, req } => {
                let files = self.files.clone();
                let tx = self.tx.clone();
                tokio::task::spawn_blocking(move || {
                    let resp = files.answer(&req);
                    let _ = tx.blocking_send(Msg::FileResponse { task, id, resp });
                });
            }
            Msg::ChangeChunks { task, chunks } => {
                let mut st = self.state.lock().unwrap();
                let Some(r) = st.by_task.get(&task).copied() else { return };
                let Some(sink) = st.sinks.get_mut(&r) else { return };
                for c in chunks {
                    match c.open() {
                        Ok(bytes) => {
                            sink.chunks.insert(c.hash, bytes);
                        }
                        // The commit then finds the chunk missing and commits nothing.
                        Err(e) => log::warn!("task {task}: output chunk rejected: {e}"),
                    }
                }
            }
            Msg::Finished { task, status, changes, accessed } => {
                let chunks = {
                    let mut st = self.state.lock().unwrap();
                    let Some(r) = st.by_task.get(&task).copied() else { return };
                    let Some(sink) = st.sinks.get_mut(&r) else { return };
                    sink.finishing = true;
                    std::mem::take(&mut sink.chunks)
                };
                let files = self.files.clone();
                let tx = self.tx.clone();
                let me = self.clone();
                tokio::spawn(async move {
                    let commit = tokio::task::spawn_blocking(move || commit::apply(&files, &changes, &chunks))
                        .await
                        .unwrap_or(Err(commit::CommitError::Interrupted))
                        .map_err(Arc::new);
                    let conflicts =
                        commit.as_ref().map(|r| r.conflicts.iter().map(|c| c.path.clone()).collect()).unwrap_or_default();
                    let _ = tx.send(Msg::Committed { task, conflicts }).await;
                    me.emit(task, TaskEvent::Finished { status, commit, accessed });
                });
            }
            Msg::AtHome { task, socket } => {
                let me = self.clone();
                tokio::spawn(async move { me.open_direct(task, socket).await });
            }
            _ => {}
        }
    }

    /// The task runs on the home site (this machine): carry its stream over the home agent's
    /// socket instead of through the head. Any failure leaves it going through the head.
    async fn open_direct(&self, task: TaskId, socket: String) {
        let Some(slot) = self.state.lock().unwrap().paths.get(&task).map(|p| p.slot.clone()) else { return };
        let sock = match tokio::net::UnixStream::connect(&socket).await {
            Ok(s) => s,
            Err(e) => return log::info!("task {task}: the home site's socket {socket}: {e}; its stream goes through the head"),
        };
        let (r, w) = tokio::io::split(sock);
        let Ok((_, mut incoming, direct)) = establish(r, w, Role::Client, "client").await else { return };
        let conn = {
            // Before the home site can agree: its switch through the head may come before its echo.
            // (The stream is read from the head's path until that switch.)
            let mut arrivals = self.arrivals.lock().unwrap();
            let a = arrivals.entry(task).or_default();
            a.merge.opened();
            a.answered = false;
            a.conn += 1;
            a.acks = Some(direct.clone());
            a.conn
        };
        // (Its entry stays, reading the head's path: nothing comes on this one.)
        let refused = |why: String| log::info!("task {task}: {why}; its stream goes through the head");
        if direct.send(Msg::DirectOpen { task }).await.is_err() {
            return refused("the home site's connection closed".into());
        }
        match incoming.recv().await {
            Ok(Msg::DirectOpen { .. }) => {}
            Ok(Msg::Error { message, .. }) => return refused(format!("the home site: {message}")),
            _ => return refused("the home site did not agree".into()),
        }
        *slot.lock().unwrap() = Some(starling_proto::path::Direct { tx: direct, kept: None });
        // Before any switch back is answered (that one is sent from where the stream arrives).
        let sender = self.state.lock().unwrap().paths.get(&task).and_then(|p| p.sender.upgrade());
        if let Some(s) = sender {
            let _ = s.send(Msg::DirectOpen { task }).await;
        }
        log::info!("task {task}: its stream goes straight to the home site");
        loop {
            match incoming.recv().await {
                Ok(m) if m.task() == Some(task) => self.arrived(true, m),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let mut arrivals = self.arrivals.lock().unwrap();
        // (Unless a later connection is the task's now: this one had switched away before.)
        if let Some(a) = arrivals.get_mut(&task).filter(|a| a.conn == conn) {
            a.acks = None;
            for (_, m) in a.merge.lost_direct() {
                self.task_msg(m, Some(self.tx.clone()));
            }
            if !a.answered {
                a.answered = true;
                self.switch_sender(task, Msg::PathSwitch { task });
            }
        }
    }

    async fn read_loop(self, mut incoming: starling_proto::conn::Incoming<HeadReader>) {
        let why = loop {
            let msg = match incoming.recv().await {
                Ok(m) => m,
                Err(ProtoError::Closed) => break Closed::HeadClosed,
                Err(e) => break Closed::Protocol(Arc::new(e)),
            };
            match msg {
                Msg::Started { task, host, reference, job_fresh } => {
                    let mut st = self.state.lock().unwrap();
                    st.by_task.insert(task, reference);
                    if let Some(sink) = st.sinks.get(&reference).filter(|s| s.with_paths) {
                        let written = sink.acked.then(Arc::default);
                        // Before the task's next message (which may say it is at home).
                        let slot = starling_proto::path::DirectSlot::default();
                        let on_direct = Arc::new(std::sync::atomic::AtomicBool::new(false));
                        let tx = starling_proto::path::spawn_sender(task, self.tx.clone(), slot.clone(), on_direct);
                        st.paths.insert(task, TaskPaths { sender: tx.downgrade(), slot, unclaimed: Some(tx), written });
                    }
                    drop(st);
                    self.emit_ref(reference, TaskEvent::Started { task, host, job_fresh });
                }
                Msg::LaunchFailed { reference, message } => self.emit_ref(reference, TaskEvent::Refused(message)),
                Msg::HoldsReply { nonce, held } => {
                    if let Some(w) = self.state.lock().unwrap().holds.remove(&nonce) {
                        let _ = w.send(held);
                    }
                }
                Msg::TicketGrant { ticket, granted, unisolated } => {
                    if let Some(w) = self.state.lock().unwrap().tickets.pop_front() {
                        let grant = granted.map(|placement| Grant { ticket, placement, unisolated });
                        let _ = w.send(grant.map_err(SessionError::TicketRefused));
                    }
                }
                // The head ends the connection after an error of no task (e.g. a revoked certificate).
                Msg::Error { task: None, message } => break Closed::Protocol(Arc::new(ProtoError::Refused(message))),
                Msg::Ping { nonce } => {
                    let _ = self.tx.send(Msg::Pong { nonce }).await;
                }
                m => self.arrived(false, m),
            }
        };
        let refs: Vec<u64> = {
            let mut st = self.state.lock().unwrap();
            st.closed = Some(why.clone());
            for w in st.tickets.drain(..) {
                let _ = w.send(Err(why.error()));
            }
            // Dropping the senders ends the waiting queries (LostHead).
            st.holds.clear();
            st.sinks.iter().filter(|(_, s)| !s.finishing).map(|(r, _)| *r).collect()
        };
        for r in refs {
            self.emit_ref(r, TaskEvent::Lost(format!("{}; no changes were committed", why.error())));
        }
    }
}
