//! The host agent (`starling agent`): the daemon that runs work on a host.
//!
//! It connects to the head (or, with `--listen`, waits for the head to
//! connect), advertises cores, memory and load, and runs each task it is
//! given:
//!
//! ```text
//!  RunTask ─▶ view (FUSE, read-only mirror of the client's /)   ◀── faults ──▶ client
//!               └─ overlay (per-task copy-on-write upper dir)
//!                    └─ sandbox (mount+PID namespace, chroot, creds) ─▶ the command
//!  exit ─▶ scan upper dir ─▶ ChangeChunks + Finished ─▶ client commits
//! ```
//!
//! File contents land in the host cache ([`starling_store::HostCache`]),
//! shared by every task on the host and bounded in size.

mod clone;
mod direct;
mod io;
mod linger;
mod migrate;
mod peers;
mod remote;
mod task;
mod ticket_net;
mod x11;
mod waiters;

use starling_proto::conn::{establish, Outgoing};
use starling_proto::{HostInfo, Msg, ProtoError, Role, TaskId};
use starling_config::{AgentSettings, ForkSettings};
use starling_store::HostCache;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use starling_auth::Role as AuthRole;
use tokio::net::{TcpListener, TcpStream};

pub use waiters::Waiters;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{step}: {source}")]
    Io { step: Step, #[source] source: std::io::Error },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, #[source] source: std::io::Error },
    #[error("agent needs --head ADDR or --listen ADDR")]
    NoHead,
    #[error("head connection lost")]
    HeadLost,
    #[error("bad page server address {0:?}")]
    PageServerAddress(String),
    #[error("{step}: {source}")]
    Fork { step: Step, #[source] source: Box<starling_fork::ForkError> },
    #[error("taking a moved task: {0}")]
    Migration(String),
    #[error("the moved task's seccomp filter: {0}")]
    Filter(#[source] starling_sandbox::HardenError),
    #[error("agent: {0}")]
    Auth(#[from] starling_auth::AuthError),
    #[error("this agent runs without root and cannot open /dev/userfaultfd ({0}): its clones need kernel-mode userfaultfd; an admin grants it once, e.g. `setfacl -m u:$(id -un):rw /dev/userfaultfd` (or run the agent as root)")]
    RootlessClone(std::io::Error),
    #[error("the task's terminal: {0}")]
    Terminal(#[source] starling_sandbox::TerminalError),
    #[error("no free X display number for the task (tried :10 to :1009)")]
    X11NoDisplay,
    #[error("the clone's ticket network, which its job requires (fork.isolate_network = required): {0}")]
    TicketNet(#[from] ticket_net::TicketNetError),
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;

/// What the agent was doing when something failed.
#[derive(Debug)]
pub enum Step {
    CreateDir(PathBuf),
    OpenCache,
    Accept,
    Pipe,
    MountView,
    MountOverlay,
    UnmountOverlay,
    StartSandbox,
    WaitTask,
    ReadChanges,
    FetchDescriptor,
    DecodeDescriptor,
    PrepareRestore,
    StartControlThread,
    Signals,
    /// Serving the task's X display (`exec --x11`).
    X11,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::CreateDir(p) => write!(f, "cannot create {}", p.display()),
            Step::OpenCache => f.write_str("opening the host cache"),
            Step::Accept => f.write_str("accepting a head connection"),
            Step::Pipe => f.write_str("making a pipe"),
            Step::MountView => f.write_str("mounting the file view"),
            Step::MountOverlay => f.write_str("mounting the task's copy-on-write layer"),
            Step::UnmountOverlay => f.write_str("unmounting the task's copy-on-write layer"),
            Step::StartSandbox => f.write_str("starting the task sandbox"),
            Step::WaitTask => f.write_str("waiting for the task"),
            Step::ReadChanges => f.write_str("reading the task's changes"),
            Step::FetchDescriptor => f.write_str("fetching the clone's process descriptor from its page server"),
            Step::DecodeDescriptor => f.write_str("the clone's process descriptor"),
            Step::PrepareRestore => f.write_str("preparing the clone's restore"),
            Step::StartControlThread => f.write_str("starting the clone's control thread"),
            Step::Signals => f.write_str("installing the SIGTERM handler"),
            Step::X11 => f.write_str("serving the task's X display"),
        }
    }
}

/// `map_err` for an I/O step.
pub(crate) fn io_step(step: Step) -> impl FnOnce(std::io::Error) -> AgentError {
    move |source| AgentError::Io { step, source }
}

/// `map_err` for a step of the remote fork.
pub(crate) fn fork_step(step: Step) -> impl FnOnce(starling_fork::ForkError) -> AgentError {
    move |source| AgentError::Fork { step, source: Box::new(source) }
}

pub struct AgentConfig {
    /// The head to connect to (or where to listen for it), the state
    /// directory, the cache bound and how output files are chunked. The
    /// state directory must be on a local disk file system (ext4, xfs), not
    /// on overlayfs: FUSE passthrough backing files and per-task overlay
    /// upper dirs live there.
    pub settings: AgentSettings,
    /// `settings.name`, or the machine's hostname.
    pub name: String,
    /// The clones' fault handlers: prefetch, and whether multicast is refused.
    pub fork: ForkSettings,
    /// The starling binary (re-executed as `__sandbox-init`).
    pub exe: PathBuf,
    pub compress: bool,
    /// Running without root, inside a user namespace of its own where the
    /// user is 0 (see `starling agent`): tasks run as that user and views
    /// show the client's files as theirs.
    pub rootless: bool,
    /// The user's own machine (`agent --home`): the head places here only what names this
    /// site (a roaming task), and its tasks are the user's own work, not guests (no guest
    /// cgroup, no starvation priority, no owner monitor).
    pub home: bool,
}

pub(crate) struct TaskCtl {
    pub stdin: std::sync::mpsc::Sender<io::StdinMsg>,
    pub pid: Arc<AtomicU32>,
    /// A signal that arrived before the sandbox existed; delivered once it does.
    pub pending_signal: Arc<std::sync::atomic::AtomicI32>,
    pub life: Arc<task::TaskLife>,
}

impl TaskCtl {
    /// A task's control block and its runner's end of it.
    pub(crate) fn new() -> (TaskCtl, task::TaskPort) {
        let (stdin_tx, stdin_rx) = std::sync::mpsc::channel();
        let pid = Arc::new(AtomicU32::new(0));
        let pending = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let life = Arc::new(task::TaskLife::default());
        let port = task::TaskPort { stdin: stdin_rx, pid: pid.clone(), pending_signal: pending.clone(), life: life.clone() };
        (TaskCtl { stdin: stdin_tx, pid, pending_signal: pending, life }, port)
    }
}

pub(crate) struct Agent {
    pub cfg: AgentConfig,
    pub cache: Arc<HostCache>,
    pub tasks: Mutex<HashMap<TaskId, TaskCtl>>,
    pub waiters: Arc<Waiters>,
    pub running: AtomicU32,
    /// Page distribution of the last clone's fault handler (for `starling status`).
    pub page_distribution: Arc<std::sync::Mutex<Option<String>>>,
    /// The fork tickets with clones on this host: what their clones share
    /// (descriptor, multicast receiver).
    pub host_tickets: starling_fork::host::HostTickets,
    /// Our address towards the head (other hosts reach us there).
    pub addr: Mutex<String>,
    /// Migrations out waiting for the head to hold their task's input.
    pub held_waiters: Mutex<HashMap<u64, std::sync::mpsc::Sender<()>>>,
    /// Migrations in not yet arrived: set to give up on one.
    pub incoming: Mutex<HashMap<u64, Arc<std::sync::atomic::AtomicBool>>>,
    /// The guest cgroup every task runs in, and the owner monitor's report.
    pub linger: linger::Linger,
    /// Chunk sharing with the other hosts, and the port this host serves them on.
    pub peers: Option<(Arc<peers::Peers>, u16)>,
    /// The X displays of the tasks started with `exec --x11`.
    pub displays: Mutex<HashMap<TaskId, x11::Display>>,
    /// The fork tickets' own networks (nftables + a cgroup per ticket with clones here).
    pub ticket_nets: Arc<ticket_net::TicketNets>,
    /// Why this host cannot enforce a ticket's own network (found at start), told the head.
    pub cannot_isolate: Option<String>,
    /// A home agent's tasks' two paths to their clients (`direct`).
    pub paths: Mutex<HashMap<TaskId, Arc<direct::TaskPath>>>,
}

fn read_meminfo_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn cores() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
}

fn read_load() -> f32 {
    std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0.0)
}

impl Agent {
    fn host_info(&self, addr: &str) -> HostInfo {
        HostInfo {
            name: self.cfg.name.clone(),
            addr: addr.to_string(),
            pid: std::process::id(),
            cores: cores(),
            mem_bytes: read_meminfo_total(),
            load: read_load(),
            running: self.running.load(Ordering::Relaxed),
            page_distribution: self.page_distribution.lock().map(|m| m.clone()).unwrap_or(None),
            owner: self.linger.report.lock().map(|r| r.clone()).unwrap_or(None),
            home: self.cfg.home,
            peer: self.peers.as_ref().and_then(|(_, port)| Some(std::net::SocketAddr::new(addr.parse().ok()?, *port).to_string())),
            cannot_isolate: self.cannot_isolate.clone(),
        }
    }

    /// Serve one head connection until it drops.
    async fn serve(self: &Arc<Self>, sock: TcpStream, tls: &Tls) -> Result<(), ProtoError> {
        let addr = sock.local_addr().map(|a| a.ip().to_string()).unwrap_or_default();
        let _ = sock.set_nodelay(true);
        match tls {
            Tls::Off => self.serve_stream(sock, addr).await,
            Tls::Dial(c) => {
                let s = c.connect(starling_auth::server_name(AuthRole::Head), sock).await?;
                self.serve_stream(s, addr).await
            }
            Tls::Accept(a) => {
                let s = a.accept(sock).await?;
                if starling_auth::client_role(&s) != Some(AuthRole::Head) {
                    return Err(ProtoError::Refused("a connection whose certificate is not the head's".into()));
                }
                self.serve_stream(s, addr).await
            }
        }
    }

    /// New credentials from the head after a CA rotation: installed for the next
    /// connections (to the head and to other hosts); this one goes on.
    fn install_credentials(&self, certificate: Option<&str>, ca: &str) {
        let Some(dir) = &self.cfg.settings.auth else {
            return log::warn!("the head sent credentials, but this agent has no --auth directory to keep them");
        };
        let auth = starling_auth::AuthDir::new(dir);
        match auth.install(AuthRole::Agent, certificate, ca) {
            Ok(()) => {
                log::info!(
                    "installed {} from the head (CA rotation) in {}",
                    if certificate.is_some() { "a new certificate and CAs" } else { "new CAs" },
                    dir.display()
                );
                if let Some((peers, _)) = &self.peers {
                    if let Err(e) = peers.reload(&auth) {
                        log::warn!("reloading the TLS for other hosts: {e}");
                    }
                }
            }
            Err(e) => log::warn!("the head's new credentials were not installed: {e}"),
        }
    }

    async fn serve_stream<S>(self: &Arc<Self>, sock: S, addr: String) -> Result<(), ProtoError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (r, w) = tokio::io::split(sock);
        let (peer, mut incoming, tx) = establish(r, w, Role::Agent, &self.cfg.name).await?;
        if peer.role != Role::Head {
            let _ = tx.send(Msg::Error { task: None, message: "agents only accept a head".into() }).await;
            return Err(ProtoError::UnexpectedPeer { expected: Role::Head, got: peer.role });
        }
        log::info!("connected to head {}", peer.name);
        addr.clone_into(&mut self.addr.lock().unwrap());
        let _ = tx.send(Msg::HostInfo(self.host_info(&addr))).await;
        let beat = {
            let me = self.clone();
            let tx = tx.clone();
            let addr = addr.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                    if tx.send(Msg::HostInfo(me.host_info(&addr))).await.is_err() {
                        return;
                    }
                }
            })
        };
        let res = self.dispatch(&mut incoming, &tx).await;
        beat.abort();
        // Without a head nobody can receive results: end every task.
        self.kill_all();
        res
    }

    async fn dispatch<R: tokio::io::AsyncRead + Unpin>(
        self: &Arc<Self>,
        incoming: &mut starling_proto::conn::Incoming<R>,
        tx: &Outgoing,
    ) -> Result<(), ProtoError> {
        loop {
            match incoming.recv().await? {
                Msg::RunTask { task, spec } => {
                    // Register before setting up: stdin and signals may arrive
                    // while the view is still being mounted.
                    let (ctl, port) = TaskCtl::new();
                    self.tasks.lock().unwrap().insert(task, ctl);
                    let me = self.clone();
                    let tx = direct::task_sender(self, task, &spec, tx);
                    tokio::spawn(async move { task::run(me, task, spec, tx, port).await });
                }
                Msg::UsageRequest { nonce } => {
                    let _ = tx.send(Msg::UsageReply { nonce, tasks: self.usage() }).await;
                }
                Msg::MigrateIn { migration, task, from, key, network } => {
                    tokio::spawn(migrate::accept(self.clone(), tx.clone(), migration, task, from, key, network));
                }
                // Awaited: the head's next word on the ticket's members must not overtake this one.
                Msg::TicketMembers { ticket, members } => {
                    let nets = self.ticket_nets.clone();
                    match tokio::task::spawn_blocking(move || nets.set_members(ticket, &members)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => log::warn!("ticket {ticket}: its clones' rules here keep the members they had: {e}"),
                        Err(e) => log::warn!("ticket {ticket}: updating its members: {e}"),
                    }
                }
                Msg::MigrateAbort { migration } => {
                    if let Some(flag) = self.incoming.lock().unwrap().remove(&migration) {
                        flag.store(true, Ordering::SeqCst);
                    }
                }
                Msg::MigrateOut { migration, task, to_host, to_addr, stop_and_copy, key } => {
                    let (me, tx) = (self.clone(), tx.clone());
                    let how = migrate::Move { migration, task, to_host, to_addr, stop_and_copy, key };
                    tokio::task::spawn_blocking(move || {
                        let boosted = me.linger.boost(&me.task_pids(how.task));
                        migrate::send(&me, &tx, &how);
                        me.linger.unboost(&boosted);
                    });
                }
                Msg::MigrateHeld { migration } => {
                    if let Some(w) = self.held_waiters.lock().unwrap().remove(&migration) {
                        let _ = w.send(());
                    }
                }
                Msg::FileResponse { id, resp, .. } => self.waiters.complete(id, resp),
                m @ (Msg::Stdin { .. }
                | Msg::StdinEof { .. }
                | Msg::Resize { .. }
                | Msg::X11Data { .. }
                | Msg::X11Close { .. }
                | Msg::Signal { .. }
                | Msg::PathSwitch { .. }) => direct::input(self, false, m),
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::Committed { .. } | Msg::Pong { .. } => {}
                Msg::Credentials { certificate, ca } => self.install_credentials(certificate.as_deref(), &ca),
                Msg::Revoked { serials } => {
                    // Kept for the next start: a restarted agent refuses revoked peers before it
                    // reaches the head again.
                    if let Some(dir) = &self.cfg.settings.auth {
                        if let Err(e) = starling_auth::AuthDir::new(dir).save_seen_revocations(&serials) {
                            log::warn!("keeping the revocation list: {e}");
                        }
                    }
                    if let Some((peers, _)) = &self.peers {
                        peers.set_revoked(serials);
                    }
                }
                // The head ends the connection after an error of no task (e.g. a revoked certificate).
                Msg::Error { task: None, message } => return Err(ProtoError::Refused(message)),
                Msg::Error { message, .. } => log::warn!("head says: {message}"),
                other => log::warn!("unexpected message from head: {:?}", std::mem::discriminant(&other)),
            }
        }
    }

    /// A client's message for one of our tasks' input (stdin, window size, signals, X), in the
    /// order the client sent it (`direct::input` orders the two paths of a task at home).
    pub(crate) fn deliver_input(self: &Arc<Self>, m: Msg) {
        match m {
            Msg::Stdin { task, data } => {
                if let Some(t) = self.tasks.lock().unwrap().get(&task) {
                    let _ = t.stdin.send(io::StdinMsg::Data(data));
                }
            }
            Msg::StdinEof { task } => {
                if let Some(t) = self.tasks.lock().unwrap().get(&task) {
                    let _ = t.stdin.send(io::StdinMsg::Eof);
                }
            }
            Msg::Resize { task, rows, cols } => {
                if let Some(t) = self.tasks.lock().unwrap().get(&task) {
                    let _ = t.stdin.send(io::StdinMsg::Resize(rows, cols));
                }
            }
            Msg::X11Data { task, stream, data } => x11::deliver(self, task, stream, Some(data)),
            Msg::X11Close { task, stream } => x11::deliver(self, task, stream, None),
            Msg::Signal { task, signo } => {
                if let Some(t) = self.tasks.lock().unwrap().get(&task) {
                    t.pending_signal.store(signo, Ordering::SeqCst);
                    let pid = t.pid.load(Ordering::SeqCst);
                    if pid > 0 && signo == libc::SIGKILL {
                        // Its whole PID namespace at once: the sandbox ends (and the
                        // task's runner goes on to stop a clone's fault handlers) only
                        // when every process in it has.
                        let _ = starling_sandbox::kill_sandbox(pid);
                    } else if pid > 0 {
                        // SAFETY: kill(2) on the sandbox we started and have not reaped yet
                        // (the pid is cleared before the task is reaped).
                        unsafe { libc::kill(pid.cast_signed(), signo) };
                    }
                }
            }
            _ => {}
        }
    }

    /// What each running task's processes use now (for `starling ps`).
    fn usage(&self) -> Vec<starling_proto::TaskUsage> {
        let tasks = self.tasks.lock().unwrap();
        tasks
            .iter()
            .filter_map(|(task, t)| {
                let root = t.pid.load(Ordering::SeqCst);
                (root > 0).then(|| {
                    let u = tree_usage(root);
                    starling_proto::TaskUsage {
                        task: *task,
                        cpu_seconds: u.cpu_seconds,
                        rss_bytes: u.rss_bytes,
                        runnable: u.runnable,
                        direct: direct::is_direct(self, *task),
                    }
                })
            })
            .collect()
    }

    /// Every process of a running task (its sandbox and all below it).
    fn task_pids(&self, task: TaskId) -> Vec<i32> {
        let root = self.tasks.lock().unwrap().get(&task).map_or(0, |t| t.pid.load(Ordering::SeqCst));
        if root == 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut stack = vec![root];
        while let Some(p) = stack.pop() {
            out.extend(i32::try_from(p));
            for t in std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten() {
                if let Ok(kids) = std::fs::read_to_string(t.path().join("children")) {
                    stack.extend(kids.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
                }
            }
        }
        out
    }

    fn kill_all(&self) {
        for t in self.tasks.lock().unwrap().values() {
            t.pending_signal.store(libc::SIGKILL, Ordering::SeqCst);
            let pid = t.pid.load(Ordering::SeqCst);
            if pid > 0 {
                let _ = starling_sandbox::kill_sandbox(pid);
            }
        }
        self.waiters.fail_all();
    }
}

/// What a process tree uses now.
pub(crate) struct TreeUsage {
    pub cpu_seconds: f64,
    pub rss_bytes: u64,
    /// Threads in state R.
    pub runnable: u32,
}

/// CPU seconds, resident bytes and runnable threads of process `root` and everything below it.
pub(crate) fn tree_usage(root: u32) -> TreeUsage {
    // SAFETY: sysconf with a constant name.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut u = TreeUsage { cpu_seconds: 0.0, rss_bytes: 0, runnable: 0 };
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            let f: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
            // utime, stime: fields 14 and 15 (index 11 and 12 after the comm); rss pages: field 24.
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            u.cpu_seconds += (num(11) + num(12)) as f64 / ticks;
            u.rss_bytes += num(21) * 4096;
        }
        for t in std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten() {
            // Each thread's state: the field after its comm.
            let state = std::fs::read_to_string(t.path().join("stat")).ok();
            if state.as_deref().and_then(|s| s.rsplit_once(')')).is_some_and(|(_, r)| r.trim_start().starts_with('R')) {
                u.runnable += 1;
            }
            if let Ok(kids) = std::fs::read_to_string(t.path().join("children")) {
                stack.extend(kids.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
            }
        }
    }
    u
}

/// Remove task directories left by a previous run of this agent (crash, kill -9).
fn clean_stale_tasks(state: &std::path::Path) {
    let tasks = state.join("tasks");
    let Ok(rd) = std::fs::read_dir(&tasks) else { return };
    for e in rd.flatten() {
        let dir = e.path();
        for m in ["root", "view"] {
            let p = dir.join(m);
            let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Run the agent until killed.
pub async fn run(cfg: AgentConfig) -> Result<()> {
    let state = &cfg.settings.state;
    std::fs::create_dir_all(state.join("tasks")).map_err(io_step(Step::CreateDir(state.clone())))?;
    clean_stale_tasks(state);
    let cache = Arc::new(HostCache::open(&state.join("cache"), cfg.settings.cache_mib << 20).map_err(io_step(Step::OpenCache))?);
    let linger = if cfg.home { linger::Linger::none() } else { linger::Linger::start(&cfg.settings, &cfg.name, cores()) };
    let ticket_nets = Arc::new(ticket_net::TicketNets::new(cfg.settings.cgroup.as_deref().unwrap_or(&cfg.name)));
    // A killed agent's ticket tables and groups are still here.
    ticket_nets.sweep();
    let cannot_isolate = match ticket_nets.probe() {
        Ok(()) => None,
        Err(e) => {
            log::warn!("agent {}: cannot enforce a fork ticket's own network, so its clones run with this host's network (fork.isolate_network = required refuses this host): {e}", cfg.name);
            Some(e.to_string())
        }
    };
    let auth = cfg.settings.auth.as_ref().map(starling_auth::AuthDir::new);
    // Other hosts fetch the chunks this one holds here (announced to the head).
    // Home (the user's own machine) is no cluster host: it serves no one.
    let peers = if cfg.home || !cfg.settings.peers {
        log::info!("agent {}: chunk sharing with other hosts off; every chunk comes from the head", cfg.name);
        None
    } else {
        let addr = format!("0.0.0.0:{}", cfg.settings.peer_port);
        match TcpListener::bind(&addr).await {
            Ok(l) => {
                let port = l.local_addr().map_err(io_step(Step::Accept))?.port();
                let stall = std::time::Duration::from_secs(cfg.settings.peer_stall_s);
                let p = Arc::new(peers::Peers::new(cache.clone(), cfg.name.clone(), auth.as_ref(), stall)?);
                // The last list the head sent, before any peer is served: the head may be out of
                // reach, and until it answers this host would otherwise trust every certificate.
                match auth.as_ref().map(starling_auth::AuthDir::seen_revocations).transpose() {
                    Ok(Some(serials)) if !serials.is_empty() => {
                        log::info!("agent {}: {} revoked certificates known from before this start", cfg.name, serials.len());
                        p.set_revoked(serials);
                    }
                    Ok(_) => {}
                    Err(e) => log::warn!("agent {}: the revocation list kept from before: {e}", cfg.name),
                }
                tokio::spawn(p.clone().serve(l));
                log::info!("agent {}: serving chunks to other hosts on port {port}", cfg.name);
                Some((p, port))
            }
            // A port the admin chose is a promise to the other hosts: not keeping it is an error.
            Err(source) if cfg.settings.peer_port != 0 => return Err(AgentError::Listen { addr, source }),
            Err(e) => {
                log::warn!("agent {}: no port for other hosts to fetch chunks from ({e}); every chunk comes from the head", cfg.name);
                None
            }
        }
    };
    let agent = Arc::new(Agent {
        cfg,
        cache,
        tasks: Mutex::new(HashMap::new()),
        waiters: Arc::new(Waiters::default()),
        running: AtomicU32::new(0),
        page_distribution: Arc::new(std::sync::Mutex::new(None)),
        host_tickets: Default::default(),
        addr: Mutex::new(String::new()),
        held_waiters: Mutex::new(HashMap::new()),
        incoming: Mutex::new(HashMap::new()),
        linger,
        peers,
        displays: Mutex::new(HashMap::new()),
        ticket_nets,
        cannot_isolate,
        paths: Mutex::new(HashMap::new()),
    });
    // At SIGTERM/SIGINT: end every task and remove the agent's cgroups.
    {
        let me = agent.clone();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io_step(Step::Signals))?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            log::info!("agent {} stopping", me.cfg.name);
            me.kill_all();
            tokio::task::spawn_blocking(move || {
                me.ticket_nets.sweep();
                me.linger.remove()
            })
            .await
            .ok();
            std::process::exit(0);
        });
    }
    if agent.cfg.home {
        // The client on this machine reaches its tasks here without the link to the head.
        tokio::spawn(direct::serve(agent.clone()));
    }
    if auth.is_none() {
        log::warn!("agent {}: no --auth: its head connection is not authenticated (a head of this cluster gives it credentials: README, Authentication)", agent.cfg.name);
    }
    // The TLS is built afresh for each head connection: a CA rotation replaces the files.
    if let Some(listen) = agent.cfg.settings.listen.clone() {
        let l = TcpListener::bind(&listen).await.map_err(|source| AgentError::Listen { addr: listen.clone(), source })?;
        log::info!("agent {} listening on {listen} for a head", agent.cfg.name);
        loop {
            let (s, peer) = l.accept().await.map_err(io_step(Step::Accept))?;
            let tls = match &auth {
                Some(a) => Tls::Accept(a.acceptor(AuthRole::Agent)?),
                None => Tls::Off,
            };
            if let Err(e) = agent.serve(s, &tls).await {
                log::warn!("head connection from {peer}: {e}");
            }
        }
    }
    let head = agent.cfg.settings.head.clone().ok_or(AgentError::NoHead)?;
    // A lost head is dialled again, ever less often (the process, its cache and its task
    // directories stay); a connection that was up (not refused) starts the backoff over.
    let mut backoff = RECONNECT_MIN;
    loop {
        let tls = match &auth {
            Some(a) => Tls::Dial(a.connector(AuthRole::Agent)?),
            None => Tls::Off,
        };
        match TcpStream::connect(&head).await {
            Ok(s) => {
                match agent.serve(s, &tls).await {
                    // Refused (e.g. a revoked certificate): dial again, ever less often.
                    Err(e @ ProtoError::Refused(_)) => log::warn!("head connection: {e}"),
                    res => {
                        backoff = RECONNECT_MIN;
                        if let Err(e) = res {
                            log::warn!("head connection: {e}");
                        }
                    }
                }
                log::info!("lost the head {head}; reconnecting (backoff {RECONNECT_MIN:?} to {RECONNECT_MAX:?})");
            }
            Err(e) => log::debug!("cannot reach head {head}: {e}; next try in {backoff:?}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = next_backoff(backoff);
    }
}

/// How the head connection is secured.
enum Tls {
    /// Plain TCP (an agent without `--auth`).
    Off,
    /// Dial the head: it must show the head's certificate, we show the agent's.
    Dial(starling_auth::TlsConnector),
    /// `--listen`: the head dials us and must show the head's certificate.
    Accept(starling_auth::TlsAcceptor),
}

/// First and longest wait between attempts to reach a lost head.
const RECONNECT_MIN: std::time::Duration = std::time::Duration::from_millis(500);
const RECONNECT_MAX: std::time::Duration = std::time::Duration::from_secs(8);

/// The wait after `cur`: doubled, at most [`RECONNECT_MAX`].
fn next_backoff(cur: std::time::Duration) -> std::time::Duration {
    (cur * 2).min(RECONNECT_MAX)
}

#[cfg(test)]
mod reconnect_tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_its_bound() {
        let waits: Vec<u128> = std::iter::successors(Some(RECONNECT_MIN), |d| Some(next_backoff(*d))).take(7).map(|d| d.as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 8000, 8000, 8000]);
    }
}
