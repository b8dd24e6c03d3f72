//! Running one task: view → overlay → sandbox → changes.

use crate::io::{OutputPump, StdinMsg};
use crate::remote::RemoteSource;
use crate::Agent;
use crate::{io_step, AgentError, Result, Step};
use starling_proto::conn::Outgoing;
use starling_proto::{Base, Change, ChunkData, ExitStatus, Hash, Lookup, Msg, Stream, TaskId, TaskSpec, WirePath};
use starling_view::UpperEntry;
use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Bytes of file content per ChangeChunks message.
const CHANGE_BATCH_BYTES: usize = 8 << 20;

pub(crate) async fn run(agent: Arc<Agent>, task: TaskId, spec: TaskSpec, tx: Outgoing, port: TaskPort) {
    let received_ns = starling_fork::image::abi::counters::realtime_ns();
    let dir = agent.cfg.settings.state.join("tasks").join(task.to_string());
    let run = {
        let (agent, tx, dir) = (agent.clone(), tx.clone(), dir.clone());
        move || run_blocking(&agent, task, spec, &tx, &dir, port, received_ns)
    };
    supervise(agent, task, tx, dir, run).await;
}

/// Run a task's blocking body, report its failure, and clean up after it.
pub(crate) async fn supervise(
    agent: Arc<Agent>,
    task: TaskId,
    tx: Outgoing,
    dir: PathBuf,
    body: impl FnOnce() -> Result<()> + Send + 'static,
) {
    agent.running.fetch_add(1, Ordering::Relaxed);
    let err = match tokio::task::spawn_blocking(body).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(e) => Some(format!("task runner crashed: {e}")),
    };
    if let Some(message) = err {
        log::warn!("task {task}: {message}");
        let _ = tx.send(Msg::Error { task: Some(task), message: format!("host {}: {message}", agent.cfg.name) }).await;
    }
    let t = Instant::now();
    // A task that failed before its end still had its display open.
    crate::x11::close(&agent, task);
    crate::direct::forget(&agent, task, &tx);
    agent.tasks.lock().unwrap().remove(&task);
    let _ = std::fs::remove_dir_all(&dir);
    agent.running.fetch_sub(1, Ordering::Relaxed);
    log::info!("task {task} cleanup_ms: {:.3}", t.elapsed().as_secs_f64() * 1000.0);
}

/// The running task's end of its `TaskCtl`: stdin from the head, where its
/// sandbox's pid goes, a signal that arrived before the sandbox existed,
/// and what a migration of it needs once it runs.
pub(crate) struct TaskPort {
    pub stdin: std::sync::mpsc::Receiver<StdinMsg>,
    pub pid: Arc<AtomicU32>,
    pub pending_signal: Arc<std::sync::atomic::AtomicI32>,
    pub life: Arc<TaskLife>,
}

/// A running task as a migration sees it (shared by its `TaskCtl` and its runner).
pub(crate) struct LiveTask {
    pub spec: TaskSpec,
    /// The task's directory (`view/`, `upper/`, `root/`).
    pub dir: PathBuf,
    /// The overlay root the sandbox runs in (paths of the task are under it).
    pub root: PathBuf,
    pub view: Arc<starling_view::ViewMount>,
    /// stdout and stderr pumps.
    pub outputs: Mutex<Vec<OutputPump>>,
    /// The sandbox's outer init.
    pub sandbox_pid: u32,
    /// Processes from the sandbox's outer init down to the program: 2 for a
    /// task started here (outer init, PID 1), 4 for a clone or a task moved
    /// here (also the restorer and its PID namespace's init).
    pub depth: usize,
    pub started: Instant,
    /// Paths the task looked at on the hosts it ran on before (a moved task).
    pub earlier_accessed: Vec<WirePath>,
    /// A remote-fork clone's: fetches the rest of its memory before it moves.
    pub materialize: Option<starling_fork::fault::Materialize>,
}

/// What happens to a task beyond its own run: set by migrations.
#[derive(Default)]
pub(crate) struct TaskLife {
    pub live: Mutex<Option<Arc<LiveTask>>>,
    /// It moved to another host: its end here is not its end.
    pub moved: AtomicBool,
    /// It cannot go on here (its memory could not be moved): why.
    pub lost: Mutex<Option<String>>,
}

impl LiveTask {
    /// The program's PID (in our namespace): the sandbox's only chain of
    /// processes, `depth` levels down.
    pub fn process(&self) -> std::result::Result<i32, String> {
        let mut pid = i32::try_from(self.sandbox_pid).map_err(|_| "no sandbox".to_string())?;
        for _ in 0..self.depth {
            let kids: Vec<i32> = match std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
                Ok(kids) => kids,
                // A link of the chain has gone (reaped): the task ended under us.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err("the task has ended".into()),
                Err(e) => return Err(format!("reading the children of {pid}: {e}")),
            }
            .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect();
            match kids.as_slice() {
                [one] => pid = *one,
                [] => return Err("the task has ended".into()),
                // The task's first process and an orphan of it, adopted by the sandbox's init.
                many => {
                    return Err(format!(
                        "{} processes of the task run outside its first process's tree (orphaned: a parent of theirs ended); only that tree moves",
                        many.len() - 1
                    ))
                }
            }
        }
        Ok(pid)
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| AgentError::Io { step: Step::Pipe, source: e.into() })
}

/// The pipes of a task's stdio: (stdin read, stdin write), (stdout read,
/// stdout write), (stderr read, stderr write).
pub(crate) type Stdio = [(OwnedFd, OwnedFd); 3];

pub(crate) fn stdio_pipes() -> Result<Stdio> {
    Ok([pipe()?, pipe()?, pipe()?])
}

/// `received_ns`: when the launch arrived (CLOCK_REALTIME ns: a clone's critical-path stamp).
fn run_blocking(
    agent: &Arc<Agent>,
    task: TaskId,
    spec: TaskSpec,
    tx: &Outgoing,
    dir: &Path,
    port: TaskPort,
    received_ns: u64,
) -> Result<()> {
    let TaskPort { stdin: stdin_rx, pid, pending_signal, life } = port;
    let mut stages = Stages::start();
    if agent.cfg.rootless && spec.clone.is_some() {
        // The restorer will need the device (crates/restorer: register_regions): say so now, in
        // one line naming the fix, rather than as a restorer exit code.
        std::fs::OpenOptions::new().read(true).write(true).open("/dev/userfaultfd").map_err(AgentError::RootlessClone)?;
    }
    let view_dir = dir.join("view");
    std::fs::create_dir_all(&view_dir).map_err(io_step(Step::CreateDir(view_dir.clone())))?;
    let source = Arc::new(RemoteSource { task, tx: tx.clone(), waiters: agent.waiters.clone(), cache: agent.cache.clone(), peers: agent.peers.as_ref().map(|(p, _)| p.clone()) });
    // A clone's own files are prethrown (its restorer finds them without a
    // round trip), so fewer request loops do: starting each costs a thread
    // and its 16 MiB buffer, which adds up when a ticket starts many clones.
    let options = starling_view::ViewOptions {
        threads: if spec.clone.is_some() { 2 } else { 4 },
        single_owner: agent.cfg.rootless,
        ..Default::default()
    };
    let view = Arc::new(starling_view::mount_with(source, &view_dir, options).map_err(io_step(Step::MountView))?);
    stages.stamp("view_mount");
    view.preload(spec.prethrow.clone());
    view.preload_listings(spec.listings.clone());
    stages.stamp("preload");
    let overlay = starling_view::Overlay::mount(&view_dir, dir).map_err(io_step(Step::MountOverlay))?;
    stages.stamp("overlay");
    let mut host_stamps = crate::clone::HostStamps {
        launch_received_ns: received_ns,
        view_mounted_ns: starling_fork::image::abi::counters::realtime_ns(),
        sandbox_ready_ns: 0,
    };

    let [(stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w)] = stdio_pipes()?;
    let mut sb = sandbox_spec(agent, &spec, overlay.root());
    sb.rootless = agent.cfg.rootless;
    if let Some(x) = spec.x11.as_ref().filter(|_| spec.clone.is_none()) {
        crate::x11::open(agent, task, x, overlay.root(), spec.uid, spec.gid, tx)?.apply(&mut sb.env);
    }
    // A terminal task's stdin is the line its sandbox sends the pty's master on.
    let (line, stdin_r) = match &sb.terminal {
        Some(_) => {
            let (line, theirs) = starling_sandbox::TerminalLine::new().map_err(AgentError::Terminal)?;
            (Some(line), theirs)
        }
        None => (None, stdin_r),
    };
    // A clone (remote fork) runs the restorer instead of argv: see crate::clone.
    let mut ticket_net = None;
    let (child, mut clone_run) = match &spec.clone {
        None => (starling_sandbox::spawn(&agent.cfg.exe, &sb, stdin_r, stdout_w, stderr_w), None),
        Some(c) => {
            // Its ticket's own network: held until the clones ended (the last hold removes it).
            if let Some(n) = &c.network {
                ticket_net = crate::ticket_net::enter(agent, c, n, &mut sb, |line| {
                    let _ = nix::unistd::write(&stderr_w, line.as_bytes());
                })?;
            }
            let (program, run) = crate::clone::prepare(c, overlay.root(), agent.page_distribution.clone(), &agent.host_tickets, &agent.cfg.fork, agent.cfg.rootless)?;
            // The restorer drops to the template's credentials itself, after
            // the steps that need root (PID namespace, set_tid, userfaultfd).
            (sb.uid, sb.gid, sb.groups) = (0, 0, Vec::new());
            sb.confinement = starling_sandbox::Confinement::Restorer;
            (starling_sandbox::spawn_program(&agent.cfg.exe, &sb, program, stdin_r, stdout_w, stderr_w), Some(run))
        }
    };
    let mut child = child.map_err(io_step(Step::StartSandbox))?;
    // Its clones' counters go to the head while they run (the dashboard's live fault rate).
    if let Some(run) = clone_run.as_mut() {
        run.report_progress(task, tx);
    }
    stages.stamp("spawn");
    host_stamps.sandbox_ready_ns = starling_fork::image::abi::counters::realtime_ns();
    pid.store(child.pid(), Ordering::SeqCst);
    // A signal that arrived during setup (e.g. an early Ctrl-C) is delivered now.
    let early = pending_signal.load(Ordering::SeqCst);
    if early > 0 {
        let _ = child.signal(early);
    }
    log::info!("task {task} started: {:?} (pid {})", String::from_utf8_lossy(&spec.argv[0]), child.pid());
    let mut outputs = vec![
        OutputPump::start(task, Stream::Stdout, stdout_r, tx.clone()).map_err(io_step(Step::Pipe))?,
        OutputPump::start(task, Stream::Stderr, stderr_r, tx.clone()).map_err(io_step(Step::Pipe))?,
    ];
    match line {
        None => drop(crate::io::start_stdin(Some(std::fs::File::from(stdin_w)), stdin_rx, Vec::new())),
        Some(line) => {
            drop(stdin_w);
            // None: the sandbox failed before it made the pty (its stderr says why).
            let master = line.receive_master().map_err(|e| AgentError::Terminal(starling_sandbox::TerminalError::Line(e)))?;
            let writer = match master {
                Some(m) => {
                    let w = m.try_clone().map_err(io_step(Step::Pipe))?;
                    // The pty's output (the task's stdout and stderr together).
                    outputs.push(OutputPump::start(task, Stream::Stdout, m, tx.clone()).map_err(io_step(Step::Pipe))?);
                    Some(std::fs::File::from(w))
                }
                None => None,
            };
            drop(crate::io::start_stdin(writer, stdin_rx, Vec::new()));
        }
    }
    let live = Arc::new(LiveTask {
        spec,
        dir: dir.to_path_buf(),
        root: overlay.root().to_path_buf(),
        view,
        outputs: Mutex::new(outputs),
        sandbox_pid: child.pid(),
        // A clone runs under the restorer's PID 1, like a task moved here.
        depth: if clone_run.is_some() { 4 } else { 2 },
        started: Instant::now(),
        earlier_accessed: Vec::new(),
        materialize: clone_run.as_ref().and_then(|r| r.materialize.clone()),
    });
    *life.live.lock().unwrap() = Some(live.clone());
    stages.stamp("pumps_start");
    let status = child.wait().map_err(io_step(Step::WaitTask))?;
    stages.stamp("run");
    pid.store(0, Ordering::SeqCst);
    if let Some(run) = clone_run {
        // The clones' last output goes out before their statuses: the parent's
        // join returns on the statuses, and must find every byte its clones
        // wrote relayed already (one channel to the head keeps the order).
        for pump in std::mem::take(&mut *live.outputs.lock().unwrap()) {
            pump.join();
        }
        run.finish(task, tx, life.moved.load(Ordering::SeqCst), &host_stamps);
    }
    drop(ticket_net);
    end_task(agent, task, tx, &life, &live, overlay, status, Some(stages))
}

/// Wall time of each stage of a task here, logged when it ends (`bench/exec_bench.py` reads it).
pub(crate) struct Stages {
    last: Instant,
    done: Vec<(&'static str, std::time::Duration)>,
}

impl Stages {
    pub(crate) fn start() -> Self {
        Stages { last: Instant::now(), done: Vec::new() }
    }

    /// The stage `name` ends now.
    pub(crate) fn stamp(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }

    fn line(&self) -> String {
        self.done.iter().map(|(k, d)| format!(" {k}={:.3}", d.as_secs_f64() * 1000.0)).collect()
    }
}

/// How the task's sandbox is set up from its spec (in the agent's guest cgroup).
pub(crate) fn sandbox_spec(agent: &Agent, spec: &TaskSpec, root: &Path) -> starling_sandbox::SandboxSpec {
    starling_sandbox::SandboxSpec {
        root: root.to_path_buf(),
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        cwd: spec.cwd.as_bytes().to_vec(),
        umask: spec.umask,
        uid: spec.uid,
        gid: spec.gid,
        groups: spec.groups.clone(),
        rlimits: spec.rlimits.clone(),
        hostname: None,
        rootless: false,
        placement: agent.linger.placement(spec.policy),
        confinement: starling_sandbox::Confinement::Task,
        // Clones restore a process: they keep the descriptors it had.
        terminal: if spec.clone.is_none() { spec.terminal.clone() } else { None },
        // Set with the ticket's network (crate::ticket_net::enter).
        no_network_admin: false,
    }
}

/// After the task's processes ended here: its output is sent, its changes
/// go to the client with `Finished` — unless it moved away (its end is
/// another host's to report) or was lost.
#[allow(clippy::too_many_arguments)] // one call site per way a task ends here; a struct would only rename them
pub(crate) fn end_task(
    agent: &Arc<Agent>,
    task: TaskId,
    tx: &Outgoing,
    life: &TaskLife,
    live: &LiveTask,
    overlay: starling_view::Overlay,
    status: ExitStatus,
    mut stages: Option<Stages>,
) -> Result<()> {
    let mut stamp = |name| {
        if let Some(s) = stages.as_mut() {
            s.stamp(name);
        }
    };
    for pump in std::mem::take(&mut *live.outputs.lock().unwrap()) {
        pump.join();
    }
    // Its display's socket and files go before the scan: they are never the task's changes.
    crate::x11::close(agent, task);
    stamp("pumps_join");
    if life.moved.load(Ordering::SeqCst) {
        log::info!("task {task} moved away; nothing of it is left here");
        overlay.unmount().map_err(io_step(Step::UnmountOverlay))?;
        return Ok(());
    }
    if let Some(why) = life.lost.lock().unwrap().take() {
        let _ = overlay.unmount();
        let message = format!("host {}: the task was lost: {why}; no changes were committed", agent.cfg.name);
        tx.blocking_send(Msg::Error { task: Some(task), message }).map_err(|_| AgentError::HeadLost)?;
        return Ok(());
    }
    let bindings = live.view.bindings();
    let stats = live.view.stats();
    let mut accessed = live.earlier_accessed.clone();
    accessed.extend(live.view.accessed_paths());
    stamp("view_stats");
    // The upper dir is read while the overlay is still mounted: every process
    // of the sandbox is gone (its PID namespace ended with the outer init), so
    // nothing writes through the overlay any more, and reading the upper dir
    // directly is allowed. The unmount then happens after the reply, off the
    // task's critical path.
    let changes = match collect_changes(task, &live.dir.join("upper"), &bindings, &agent.cfg, tx) {
        Ok(c) => c,
        Err(e) => {
            let _ = overlay.unmount();
            return Err(e);
        }
    };
    stamp("exit_scan");
    log::info!("task {task} ended {status:?}: {} change(s); view {:?}", changes.len(), stats);
    let sent = tx.blocking_send(Msg::Finished { task, status, changes, accessed }).map_err(|_| AgentError::HeadLost);
    stamp("send");
    if let Err(e) = overlay.unmount() {
        log::warn!("task {task}: unmounting its overlay: {e}");
    }
    stamp("overlay_unmount");
    sent?;
    if let Some(s) = &stages {
        log::info!("task {task} stages_ms:{}", s.line());
    }
    Ok(())
}

fn base_of(bindings: &HashMap<WirePath, Lookup>, path: &WirePath) -> Base {
    match bindings.get(path) {
        Some(Lookup::File(_, n)) => Base::File(*n),
        Some(Lookup::Dir(_)) => Base::Dir,
        Some(Lookup::Symlink(_, t)) => Base::Symlink(t.clone()),
        Some(Lookup::Special(_)) => Base::Special,
        // Never looked up: it lies under a directory the task created.
        Some(Lookup::Absent) | None => Base::Absent,
    }
}

/// Whether the upper file at `host_path` is exactly the file the task was bound
/// (`bound`): same recipe — bytes, mode, owner and mtime. The overlay copies a
/// file up when it is opened for writing, written or not (a clone reopens every
/// descriptor its parent had open for writing, e.g. the log pytest keeps on a
/// spare fd). Committing such a copy would replace the file by rename and cut
/// off whoever holds it open on the client — the clone's own parent, writing
/// its log — so an untouched copy is no change. Only a copy whose size and
/// mtime match is read to compare; anything else is a change without reading.
fn unchanged_copy_up(
    bound: Option<&Lookup>,
    host_path: &std::path::Path,
    meta: &std::fs::Metadata,
    chunking: starling_store::chunker::Chunking,
) -> Result<bool> {
    let Some(Lookup::File(attr, name)) = bound else { return Ok(false) };
    if attr.size != meta.len() || attr.mtime_ns != starling_store::chunker::mtime_ns(meta) {
        return Ok(false);
    }
    let recipe = starling_store::chunker::chunk_file(host_path, meta, chunking, |_, _| {}).map_err(io_step(Step::ReadChanges))?;
    Ok(recipe.name() == *name)
}

/// Turn the overlay's upper dir into changes, sending file contents ahead.
fn collect_changes(
    task: TaskId,
    upper: &std::path::Path,
    bindings: &HashMap<WirePath, Lookup>,
    cfg: &crate::AgentConfig,
    tx: &Outgoing,
) -> Result<Vec<Change>> {
    let compress = cfg.compress;
    let entries = starling_view::scan_upper(upper).map_err(io_step(Step::ReadChanges))?;
    let mut changes = Vec::new();
    let mut sent: HashSet<Hash> = HashSet::new();
    let mut batch: Vec<ChunkData> = Vec::new();
    let mut batch_bytes = 0usize;
    let flush = |batch: &mut Vec<ChunkData>, batch_bytes: &mut usize| -> Result<()> {
        if !batch.is_empty() {
            tx.blocking_send(Msg::ChangeChunks { task, chunks: std::mem::take(batch) })
                .map_err(|_| AgentError::HeadLost)?;
            *batch_bytes = 0;
        }
        Ok(())
    };
    for e in entries {
        match e {
            UpperEntry::File { path, host_path, .. } => {
                let meta = std::fs::symlink_metadata(&host_path).map_err(io_step(Step::ReadChanges))?;
                if unchanged_copy_up(bindings.get(&path), &host_path, &meta, cfg.settings.chunking)? {
                    continue;
                }
                let mut err = None;
                let recipe = starling_store::chunker::chunk_file(&host_path, &meta, cfg.settings.chunking, |c, bytes| {
                    if err.is_some() || !sent.insert(c.hash) {
                        return;
                    }
                    batch_bytes += bytes.len();
                    batch.push(ChunkData::seal(bytes, compress));
                    if batch_bytes >= CHANGE_BATCH_BYTES {
                        if let Err(e) = flush(&mut batch, &mut batch_bytes) {
                            err = Some(e);
                        }
                    }
                })
                .map_err(io_step(Step::ReadChanges))?;
                if let Some(e) = err {
                    return Err(e);
                }
                let base = base_of(bindings, &path);
                changes.push(Change::File { path, recipe, base });
            }
            UpperEntry::Dir { path, mode, opaque } => {
                let lower = bindings.get(&path);
                match (lower, opaque) {
                    (Some(Lookup::Dir(a)), false) => {
                        if a.mode & 0o7777 != mode & 0o7777 {
                            changes.push(Change::Chmod { path, mode });
                        }
                    }
                    (Some(Lookup::Dir(_)), true) => {
                        // The task removed the directory and made a new one in its place.
                        changes.push(Change::Remove { path: path.clone(), base: Base::Dir });
                        changes.push(Change::Mkdir { path, mode, base: Base::Absent });
                    }
                    _ => {
                        let base = base_of(bindings, &path);
                        if base != Base::Absent {
                            changes.push(Change::Remove { path: path.clone(), base });
                        }
                        changes.push(Change::Mkdir { path, mode, base: Base::Absent });
                    }
                }
            }
            UpperEntry::Symlink { path, target } => {
                let base = base_of(bindings, &path);
                changes.push(Change::Symlink { path, target, base });
            }
            UpperEntry::Whiteout { path } => {
                let base = base_of(bindings, &path);
                if base != Base::Absent {
                    changes.push(Change::Remove { path, base });
                }
            }
        }
    }
    flush(&mut batch, &mut batch_bytes)?;
    Ok(changes)
}
