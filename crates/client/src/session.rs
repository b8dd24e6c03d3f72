//! A client session: one connection to the head carrying any number of
//! tasks. The session answers every task's file faults from this machine,
//! collects each task's output files and commits them when it finishes, so
//! a caller only launches tasks and consumes their [`TaskEvent`]s.
//!
//! `starling exec` uses one task per session; `starling run`/`batch` and the
//! fork API launch many tasks over one session (one process, one connection,
//! however many tasks).

use crate::commit::{self, CommitReport};
use crate::discover;
use crate::files::FileServer;
use anyhow::{anyhow, Context, Result};
use starling_proto::conn::{establish, open_pipelined, Outgoing};
use starling_proto::{ExitStatus, Hash, JobTask, Msg, ProtoError, Role, Stream, TaskId, TaskSpec, WirePath};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// What happens to a task, in order: output, then exactly one of `Finished` or `Lost`.
#[derive(Debug)]
pub enum TaskEvent {
    Output(Stream, Vec<u8>),
    /// The task ended and its changes were committed (or the commit failed: Err).
    /// `accessed`: the paths it looked at (for prethrow profiles).
    Finished { status: ExitStatus, commit: Result<CommitReport, String>, accessed: Vec<WirePath> },
    /// The task is gone without a result (host lost, head lost); nothing was committed.
    Lost(String),
}

pub struct TaskHandle {
    pub task: TaskId,
    pub host: String,
    pub events: mpsc::UnboundedReceiver<TaskEvent>,
    tx: Outgoing,
}

impl TaskHandle {
    pub async fn stdin(&self, data: Vec<u8>) -> Result<()> {
        self.tx.send(Msg::Stdin { task: self.task, data }).await.map_err(|_| anyhow!("lost connection to the cluster head"))
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
}

/// Where a task's events go. Events that arrive before `launch` has
/// returned the handle wait in `backlog`.
#[derive(Default)]
struct TaskSink {
    events: Option<mpsc::UnboundedSender<TaskEvent>>,
    backlog: Vec<TaskEvent>,
    chunks: HashMap<Hash, Vec<u8>>,
    /// `Finished` arrived; its commit is under way (a closing connection can no longer lose it).
    finishing: bool,
}

/// A head's answer to a ticket request: the ticket id and (host, clones there).
pub type Grant = (u64, Vec<(String, u32)>);

#[derive(Default)]
struct State {
    launches: VecDeque<oneshot::Sender<Result<(TaskId, String), String>>>,
    tickets: VecDeque<oneshot::Sender<Result<Grant, String>>>,
    tasks: HashMap<TaskId, TaskSink>,
    closed: Option<String>,
}

#[derive(Clone)]
pub struct Session {
    tx: Outgoing,
    files: Arc<FileServer>,
    state: Arc<Mutex<State>>,
}

pub struct SessionOptions {
    pub cluster: Option<String>,
    /// zstd on chunk transfers.
    pub compress: bool,
}

pub fn cache_dir() -> std::path::PathBuf {
    if let Ok(d) = std::env::var("STARLING_CACHE") {
        return d.into();
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| "/tmp".into());
    base.join("starling")
}

/// Connect to the head and introduce ourselves as a client (waiting for the head's hello).
pub async fn connect(
    cluster: Option<&str>,
) -> Result<(starling_proto::conn::Incoming<tokio::net::tcp::OwnedReadHalf>, Outgoing)> {
    let sock = dial(cluster).await?;
    let (r, w) = sock.into_split();
    let (_peer, incoming, tx) = establish(r, w, Role::Client, "client").await.context("handshake with the cluster head")?;
    Ok((incoming, tx))
}

async fn dial(cluster: Option<&str>) -> Result<TcpStream> {
    let addr = discover::head_addr(cluster)?;
    let sock = match TcpStream::connect(&addr).await {
        Ok(s) => s,
        Err(e) if cluster.is_none() && std::env::var_os("STARLING_CLUSTER").is_none() => {
            return Err(anyhow!("{} (the cluster recorded at {addr} does not answer: {e})", discover::no_cluster_message()))
        }
        Err(e) => return Err(anyhow!("cannot reach the starling cluster at {addr}: {e}")),
    };
    sock.set_nodelay(true)?;
    Ok(sock)
}

impl Session {
    pub async fn connect(opts: SessionOptions) -> Result<Session> {
        let files = Arc::new(FileServer::new(
            starling_store::RecipeCache::open(&cache_dir().join("recipes")).context("opening the recipe cache")?,
            opts.compress,
        ));
        // Pipelined: the launch can follow our hello in the same flight.
        let sock = dial(opts.cluster.as_deref()).await?;
        let (r, w) = sock.into_split();
        let (incoming, tx) = open_pipelined(r, w, Role::Client, "client", opts.compress).await.context("connecting to the cluster head")?;
        let session = Session { tx, files, state: Arc::new(Mutex::new(State::default())) };
        let s = session.clone();
        tokio::spawn(async move { s.read_loop(incoming).await });
        Ok(session)
    }

    pub fn files(&self) -> &Arc<FileServer> {
        &self.files
    }

    /// Start a task; resolves once the head has placed it.
    pub async fn launch(&self, spec: TaskSpec) -> Result<TaskHandle> {
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = &st.closed {
                return Err(anyhow!("{why}"));
            }
            st.launches.push_back(done_tx);
        }
        self.tx.send(Msg::Launch { spec }).await.map_err(|_| anyhow!("lost connection to the cluster head"))?;
        let (task, host) = done_rx.await.map_err(|_| anyhow!("lost connection to the cluster head"))?.map_err(|e| anyhow!("{e}"))?;
        Ok(self.register(task, host))
    }

    /// Hand out the handle for a placed task, delivering what arrived before it.
    fn register(&self, task: TaskId, host: String) -> TaskHandle {
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let mut st = self.state.lock().unwrap();
        let sink = st.tasks.entry(task).or_default();
        let mut ended = false;
        for ev in sink.backlog.drain(..) {
            ended |= matches!(ev, TaskEvent::Finished { .. } | TaskEvent::Lost(_));
            let _ = ev_tx.send(ev);
        }
        if ended {
            st.tasks.remove(&task);
        } else {
            sink.events = Some(ev_tx);
        }
        TaskHandle { task, host, events: ev_rx, tx: self.tx.clone() }
    }

    /// Start a job: one message, one prethrow, many tasks. Resolves once
    /// every task is placed; a task the head refused is an `Err` in its slot.
    pub async fn launch_job(&self, spec: TaskSpec, tasks: Vec<JobTask>) -> Result<Vec<Result<TaskHandle, String>>> {
        let mut waits = Vec::with_capacity(tasks.len());
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = &st.closed {
                return Err(anyhow!("{why}"));
            }
            for _ in 0..tasks.len() {
                let (done_tx, done_rx) = oneshot::channel();
                st.launches.push_back(done_tx);
                waits.push(done_rx);
            }
        }
        self.tx.send(Msg::LaunchJob { spec, tasks }).await.map_err(|_| anyhow!("lost connection to the cluster head"))?;
        let mut out = Vec::with_capacity(waits.len());
        for w in waits {
            match w.await {
                Ok(Ok((task, host))) => out.push(Ok(self.register(task, host))),
                Ok(Err(e)) => out.push(Err(e)),
                Err(_) => out.push(Err("lost connection to the cluster head".into())),
            }
        }
        Ok(out)
    }

    /// Send content ahead of a launch, in the same flight.
    pub async fn push(&self, recipes: Vec<starling_proto::Recipe>, chunks: Vec<starling_proto::ChunkData>) -> Result<()> {
        self.tx.send(Msg::Push { recipes, chunks }).await.map_err(|_| anyhow!("lost connection to the cluster head"))
    }

    /// Reserve up to `n` clones (the fork API's `sf_request_ticket`).
    pub async fn request_ticket(&self, n: u32, hierarchical: bool) -> Result<Grant> {
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = &st.closed {
                return Err(anyhow!("{why}"));
            }
            st.tickets.push_back(done_tx);
        }
        self.tx.send(Msg::TicketRequest { n, hierarchical }).await.map_err(|_| anyhow!("lost connection to the cluster head"))?;
        done_rx.await.map_err(|_| anyhow!("lost connection to the cluster head"))?.map_err(|e| anyhow!("{e}"))
    }

    /// Deliver an event (or park it until the handle exists). A final event
    /// retires the task.
    fn emit(&self, task: TaskId, ev: TaskEvent) {
        let last = matches!(ev, TaskEvent::Finished { .. } | TaskEvent::Lost(_));
        let mut st = self.state.lock().unwrap();
        let Some(sink) = st.tasks.get_mut(&task) else { return };
        match &sink.events {
            Some(tx) => {
                let _ = tx.send(ev);
                if last {
                    st.tasks.remove(&task);
                }
            }
            None => sink.backlog.push(ev),
        }
    }

    async fn read_loop(self, mut incoming: starling_proto::conn::Incoming<tokio::net::tcp::OwnedReadHalf>) {
        let why = loop {
            let msg = match incoming.recv().await {
                Ok(m) => m,
                Err(ProtoError::Closed) => break "lost connection to the cluster head".to_string(),
                Err(e) => break format!("protocol error from the cluster head: {e}"),
            };
            match msg {
                Msg::Started { task, host } => {
                    let mut st = self.state.lock().unwrap();
                    st.tasks.entry(task).or_default();
                    if let Some(w) = st.launches.pop_front() {
                        let _ = w.send(Ok((task, host)));
                    }
                }
                Msg::TicketGrant { ticket, granted } => {
                    if let Some(w) = self.state.lock().unwrap().tickets.pop_front() {
                        let _ = w.send(granted.map(|g| (ticket, g)));
                    }
                }
                Msg::Error { task: None, message } => {
                    let w = self.state.lock().unwrap().launches.pop_front();
                    match w {
                        Some(w) => {
                            let _ = w.send(Err(message));
                        }
                        None => log::warn!("head: {message}"),
                    }
                }
                Msg::Error { task: Some(task), message } => self.emit(task, TaskEvent::Lost(message)),
                Msg::Output { task, stream, data } => self.emit(task, TaskEvent::Output(stream, data)),
                Msg::FileRequest { task, id, req } => {
                    let files = self.files.clone();
                    let tx = self.tx.clone();
                    tokio::task::spawn_blocking(move || {
                        let resp = files.answer(&req);
                        let _ = tx.blocking_send(Msg::FileResponse { task, id, resp });
                    });
                }
                Msg::ChangeChunks { task, chunks } => {
                    let mut bad = None;
                    {
                        let mut st = self.state.lock().unwrap();
                        if let Some(sink) = st.tasks.get_mut(&task) {
                            for c in chunks {
                                match c.open() {
                                    Ok(bytes) => {
                                        sink.chunks.insert(c.hash, bytes);
                                    }
                                    Err(e) => bad = Some(e.to_string()),
                                }
                            }
                        }
                    }
                    if let Some(e) = bad {
                        log::warn!("task {task}: output chunk rejected: {e}");
                    }
                }
                Msg::Finished { task, status, changes, accessed } => {
                    let chunks = match self.state.lock().unwrap().tasks.get_mut(&task) {
                        Some(sink) => {
                            sink.finishing = true;
                            std::mem::take(&mut sink.chunks)
                        }
                        None => continue,
                    };
                    let files = self.files.clone();
                    let tx = self.tx.clone();
                    let me = self.clone();
                    tokio::spawn(async move {
                        let commit = tokio::task::spawn_blocking(move || commit::apply(&files, &changes, &chunks))
                            .await
                            .map_err(|e| e.to_string())
                            .and_then(|r| r.map_err(|e| format!("{e:#}")));
                        let conflicts = commit.as_ref().map(|r| r.conflicts.iter().map(|c| c.path.clone()).collect()).unwrap_or_default();
                        let _ = tx.send(Msg::Committed { task, conflicts }).await;
                        me.emit(task, TaskEvent::Finished { status, commit, accessed });
                    });
                }
                Msg::Ping { nonce } => {
                    let _ = self.tx.send(Msg::Pong { nonce }).await;
                }
                _ => {}
            }
        };
        let tasks: Vec<TaskId> = {
            let mut st = self.state.lock().unwrap();
            st.closed = Some(why.clone());
            st.tasks.iter().filter(|(_, s)| !s.finishing).map(|(t, _)| *t).collect()
        };
        for t in tasks {
            self.emit(t, TaskEvent::Lost(format!("{why}; no changes were committed")));
        }
        let mut st = self.state.lock().unwrap();
        for w in st.launches.drain(..) {
            let _ = w.send(Err(why.clone()));
        }
        for w in st.tickets.drain(..) {
            let _ = w.send(Err(why.clone()));
        }
    }
}
