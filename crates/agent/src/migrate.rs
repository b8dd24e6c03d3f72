//! Live migration of a task between hosts: this host as the source ([`send`])
//! or as the target ([`accept`]).
//!
//! The process itself moves with `starling-migrate` (pre-copy, freeze,
//! restore, post-copy) over a direct connection between the two agents.
//! What the agent adds is the task around it, as payloads of that
//! connection:
//!
//! * before pre-copy ([`Prepare`]): the task's spec and the bindings and
//!   listings its file view has so far, so the target mounts the same view
//!   while memory is copied;
//! * at the freeze ([`Handover`]): the rest of the view, the files the task
//!   wrote so far (its overlay upper: the target writes them through its own
//!   overlay, so its commit at exit is the one the source would have made),
//!   the stdin the task had not read yet, and the paths it looked at.
//!
//! Around the freeze the head holds what the client sends the task, the
//! source's output pumps drain into the head connection before the source
//! says `MigrateHandedOver`, and the head lets the target's output through
//! only after that: nothing is lost, repeated or reordered.

use crate::io::{OutputPump, StdinHandover, StdinMsg};
use crate::remote::RemoteSource;
use crate::task::{end_task, sandbox_spec, stdio_pipes, LiveTask, TaskLife};
use crate::{io_step, Agent, AgentError, Step, TaskCtl};
use serde::{Deserialize, Serialize};
use starling_fork::restore::Restore;
use starling_image::PlanOptions;
use starling_migrate::capture::CaptureOptions;
use starling_migrate::source::{migrate_out, SourceHooks, SourceOptions};
use starling_proto::conn::Outgoing;
use starling_proto::{DirEntry, Lookup, MigrationReport, Msg, Stream, TaskId, TaskSpec, WirePath};
use starling_view::UpperEntry;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a target waits for its source to connect.
const CONNECT_WAIT: Duration = Duration::from_secs(60);
/// How long a source waits for the head to hold the task's input.
const HOLD_WAIT: Duration = Duration::from_secs(30);
/// How long a clone may take to fetch the rest of its memory before it moves.
const MATERIALIZE_WAIT: Duration = Duration::from_secs(600);

/// Sent before pre-copy.
#[derive(Serialize, Deserialize)]
struct Prepare {
    spec: TaskSpec,
    bindings: Vec<(WirePath, Lookup)>,
    listings: Vec<(WirePath, Vec<DirEntry>)>,
    /// Seconds the task has run.
    age_seconds: f64,
    /// Files it maps (paths in its view), read ahead by the target.
    mapped: Vec<String>,
}

/// A node of the task's overlay upper, with a file's bytes.
#[derive(Serialize, Deserialize)]
enum UpperItem {
    File { path: WirePath, mode: u32, mtime_ns: i64, data: Vec<u8> },
    Dir { path: WirePath, mode: u32, opaque: bool },
    Symlink { path: WirePath, target: Vec<u8> },
    Whiteout { path: WirePath },
}

/// Sent at the freeze.
#[derive(Serialize, Deserialize)]
struct Handover {
    bindings: Vec<(WirePath, Lookup)>,
    listings: Vec<(WirePath, Vec<DirEntry>)>,
    accessed: Vec<WirePath>,
    upper: Vec<UpperItem>,
    /// What the client sent that the task had not read yet.
    stdin: Vec<u8>,
    /// The client closed stdin (or the task closed its end).
    stdin_closed: bool,
    /// A terminal task: its pty's window size and modes now, the target's
    /// new pty gets them (`stdin` is then what was typed and not read yet,
    /// put back into the new pty's input queue without a second echo).
    terminal: Option<starling_proto::TerminalSize>,
    /// An X11-forwarded task's display: its number and connections, and what each
    /// connection's program is owed (`crate::x11`).
    display: Option<crate::x11::DisplayHandover>,
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    bincode::serialize(v).map_err(|e| e.to_string())
}

fn decode<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, String> {
    bincode::deserialize(b).map_err(|e| format!("undecodable migration payload: {e}"))
}

// ---------------------------------------------------------------------------
// source

/// A move the head asked for.
pub(crate) struct Move {
    pub migration: u64,
    pub task: TaskId,
    pub to_host: String,
    /// The target agent's migration listener.
    pub to_addr: String,
    pub stop_and_copy: bool,
    /// The move's secret (proved to the target, and the page server's key).
    pub key: starling_proto::SecretKey,
}

/// The source's part: move the task to the target, then tell the head how
/// it went.
pub(crate) fn send(agent: &Arc<Agent>, tx: &Outgoing, how: &Move) {
    let started = Instant::now();
    let (migration, task, to_host) = (how.migration, how.task, how.to_host.as_str());
    let result = send_inner(agent, tx, how).map(|(r, state_bytes)| MigrationReport {
        task,
        from: agent.cfg.name.clone(),
        to: to_host.to_string(),
        threads: u32::try_from(r.threads).unwrap_or(u32::MAX),
        pause_ms: r.pause_ms,
        total_ms: started.elapsed().as_secs_f64() * 1e3,
        rounds: r.rounds,
        footprint_pages: r.footprint_pages,
        precopy_pages: r.precopy_pages,
        freeze_pages: r.freeze_pages,
        postcopy_pages: r.postcopy_pages,
        discarded_pages: r.discarded_pages,
        memory_bytes: r.bytes,
        state_bytes,
        postcopy_faults: r.postcopy_faults,
        fault_p50_us: r.fault_p50_us,
        fault_p99_us: r.fault_p99_us,
        phases_ms: r.phases_ms,
        unisolated: None,
    });
    if let Err(e) = &result {
        log::warn!("task {task}: migration to {to_host}: {e}");
    }
    let _ = tx.blocking_send(Msg::MigrateDone { migration, task, result });
}

fn send_inner(agent: &Arc<Agent>, tx: &Outgoing, how: &Move) -> Result<(starling_migrate::source::SourceReport, u64), String> {
    let (migration, task, to_addr) = (how.migration, how.task, how.to_addr.as_str());
    let (stdin, life) = {
        let tasks = agent.tasks.lock().unwrap();
        let t = tasks.get(&task).ok_or_else(|| format!("no task {task} runs on {}", agent.cfg.name))?;
        (t.stdin.clone(), t.life.clone())
    };
    let live = life.live.lock().unwrap().clone().ok_or("the task has not started yet")?;
    if live.spec.terminal.is_some() {
        terminal_movable(live.process()?)?;
    }
    if let Some(m) = &live.materialize {
        // A clone started here has part of its memory still at its parent's
        // page server: fetch all of it first, so what moves is an ordinary
        // process. (A clone moved here had it all fetched after its move.)
        m.request(MATERIALIZE_WAIT).map_err(|why| format!("the clone's memory could not be made its own: {why}"))?;
    }
    let pid = live.process()?;
    let stream = TcpStream::connect_timeout(
        &to_addr.parse().map_err(|_| format!("bad target address {to_addr:?}"))?,
        Duration::from_secs(10),
    )
    .map_err(|e| format!("cannot reach the target at {to_addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let secrecy = {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let s = starling_fork::page_server::prove_client(&how.key, agent.cfg.fork.encrypt, &mut &stream, &mut &stream)
            .map_err(|e| format!("the target at {to_addr} did not take the move's key: {e}"))?;
        let _ = stream.set_read_timeout(None);
        s
    };
    let local_ip = stream.local_addr().map_err(|e| e.to_string())?.ip();
    let mut opts = SourceOptions::new(CaptureOptions { root: live.root.clone(), heuristics: agent.cfg.fork.heuristics, reconnect: crate::x11::reconnect(agent, task) }, local_ip);
    opts.stop_and_copy = how.stop_and_copy;
    opts.key = how.key;
    opts.encrypt = agent.cfg.fork.encrypt;
    let mut hooks = Source {
        agent: agent.clone(),
        tx: tx.clone(),
        task_tx: crate::direct::sender_of(agent, task).unwrap_or_else(|| tx.clone()),
        migration,
        task,
        pid,
        stdin,
        live: live.clone(),
        life: life.clone(),
        saved: None,
        switched: false,
        state_bytes: 0,
    };
    let conn = starling_fork::page_server::halves(stream, secrecy).map_err(|e| e.to_string())?;
    match migrate_out(pid, conn, &opts, &mut hooks) {
        Ok(r) => Ok((r, hooks.state_bytes)),
        Err(e) => {
            if !hooks.switched {
                hooks.undo();
            }
            // Its process exited while it was being copied: the move ends with
            // it. Also when the copy failed otherwise and the process is gone
            // now: a task ending during the capture is torn down under it (its
            // files unmounted), and what the capture then saw missing is a
            // symptom of that end, not the move's own failure.
            // (Another process of its tree gone is the move's failure, named.)
            let ended = matches!(e, starling_migrate::MigrateError::Gone(p) if p == pid) || !process_lives(pid);
            Err(if ended { "the task ended before it could move".to_string() } else { e.to_string() })
        }
    }
}

/// Whether process `pid` (in our PID namespace) still exists and is not a zombie.
fn process_lives(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rfind(')').and_then(|i| stat.get(i + 1..)).and_then(|rest| rest.split_whitespace().next());
    !matches!(state, None | Some("Z" | "X" | "x"))
}

/// A terminal task moves as its session's leader (as `exec -t` starts it):
/// the target recreates that session on a new pty, with the foreground
/// group it had (its own, or a group of its tree: `capture::foreground_group`).
fn terminal_movable(pid: i32) -> Result<(), String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("reading the task's state: {e}"))?;
    // After the command: state, ppid, pgrp, session.
    let session: Option<i64> = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(3)?.parse().ok());
    let Some(session) = session else { return Err("unreadable /proc stat of the task".into()) };
    if session != i64::from(pid) {
        return Err(format!(
            "the task runs on a terminal but does not lead its session (pid {pid}, session {session}): only such a terminal task can move"
        ));
    }
    Ok(())
}

/// What the freeze took from the task here, to give back if the move fails.
struct Saved {
    stdin: Option<StdinHandover>,
    unread: Vec<u8>,
    outputs: Vec<(Stream, OwnedFd)>,
}

struct Source {
    agent: Arc<Agent>,
    tx: Outgoing,
    /// What the task's own messages go through (its output's way: `direct::task_sender`).
    task_tx: Outgoing,
    migration: u64,
    task: TaskId,
    /// The program (in our PID namespace).
    pid: i32,
    stdin: std::sync::mpsc::Sender<StdinMsg>,
    live: Arc<LiveTask>,
    life: Arc<TaskLife>,
    saved: Option<Saved>,
    switched: bool,
    state_bytes: u64,
}

impl Source {
    /// Stop feeding the task's stdin; what it has not read yet comes out of
    /// its pipe (it is frozen, so nothing else reads it).
    fn take_stdin(&self) -> (Option<StdinHandover>, Vec<u8>) {
        let (reply, handed) = std::sync::mpsc::channel();
        let _ = self.stdin.send(StdinMsg::Handover(reply));
        if self.live.spec.terminal.is_some() {
            // Its stdin is the pty (the pump writes the master, which never
            // blocks for long): what was typed and not read is taken from
            // the pty's input queue in `at_freeze`.
            return (handed.recv().ok(), Vec::new());
        }
        let mut pipe = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(format!("/proc/{}/fd/0", self.pid))
            .ok();
        let mut unread = Vec::new();
        let mut drain = |unread: &mut Vec<u8>| {
            let mut buf = [0u8; 64 << 10];
            while let Some(Ok(n @ 1..)) = pipe.as_mut().map(|p| p.read(&mut buf)) {
                unread.extend_from_slice(&buf[..n]);
            }
        };
        // The pump may be blocked writing into a full pipe: keep emptying it
        // until the pump has taken the handover.
        let state = loop {
            drain(&mut unread);
            match handed.recv_timeout(Duration::from_millis(5)) {
                Ok(s) => break Some(s),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break None,
            }
        };
        drain(&mut unread);
        (state, unread)
    }

    /// The move failed before the switch: the task goes on here.
    fn undo(&mut self) {
        // Its client may talk to it directly again (a task at home).
        crate::direct::stay_home(&self.agent, self.task);
        // Its X connections go on here.
        crate::x11::thaw(&self.agent, self.task, &self.task_tx);
        let Some(saved) = self.saved.take() else { return };
        for (stream, fd) in saved.outputs {
            match OutputPump::start(self.task, stream, fd, self.task_tx.clone()) {
                Ok(p) => self.live.outputs.lock().unwrap().push(p),
                Err(e) => log::warn!("task {}: restarting its output: {e}", self.task),
            }
        }
        if let Some(st) = saved.stdin {
            // Give back what we took out of the pipe, before anything newer.
            let mut writer = st.writer;
            let mut prefill = saved.unread;
            if self.live.spec.terminal.is_some() {
                // Typed but unread: back into the pty's input queue, unechoed.
                if let Some(m) = writer.as_ref() {
                    use std::os::fd::AsFd;
                    if let Err(e) = starling_sandbox::terminal::give_pending_input(m.as_fd(), &prefill) {
                        log::warn!("task {}: giving back its typed input: {e}", self.task);
                    }
                }
                prefill.clear();
            }
            if writer.is_none() && !prefill.is_empty() {
                if let Ok(mut w) = std::fs::OpenOptions::new().write(true).open(format!("/proc/{}/fd/0", self.pid)) {
                    let _ = w.write_all(&prefill);
                }
                prefill.clear();
            }
            writer.as_mut().map(|w| w.flush());
            crate::io::start_stdin(writer, st.rx, prefill);
        }
    }
}

impl SourceHooks for Source {
    fn prepare(&mut self) -> Result<Vec<u8>, String> {
        encode(&Prepare {
            spec: self.live.spec.clone(),
            bindings: self.live.view.bindings().into_iter().collect(),
            listings: self.live.view.listings(),
            age_seconds: self.live.started.elapsed().as_secs_f64(),
            mapped: {
                // Every process of the task's tree maps its own.
                let pids = starling_migrate::capture::tree(self.pid).map(|t| t.iter().map(|m| m.pid).collect()).unwrap_or_else(|_| vec![self.pid]);
                let mut all: Vec<String> = pids.into_iter().flat_map(|p| starling_migrate::capture::mapped_files(p, &self.live.root)).collect();
                all.sort_unstable();
                all.dedup();
                all
            },
        })
    }

    fn at_freeze(&mut self) -> Result<Vec<u8>, String> {
        // 0. A task at home: its stream goes through the head from here, once the client's
        // last direct input is in.
        crate::direct::close_for_move(&self.agent, self.task, HOLD_WAIT);
        // 1. The head holds what the client sends the task from now on.
        let (held_tx, held) = std::sync::mpsc::channel();
        self.agent.held_waiters.lock().unwrap().insert(self.migration, held_tx);
        self.tx
            .blocking_send(Msg::MigrateFreezing { migration: self.migration, task: self.task })
            .map_err(|_| "the head connection is gone".to_string())?;
        held.recv_timeout(HOLD_WAIT).map_err(|_| "the head did not hold the task's input".to_string())?;
        // 2. Its stdin, and 3. everything it printed (it is frozen).
        let (stdin, unread) = self.take_stdin();
        let mut outputs = Vec::new();
        let pumps = std::mem::take(&mut *self.live.outputs.lock().unwrap());
        // stdout, stderr, and a terminal task's pty master (its output).
        for (pump, stream) in pumps.into_iter().zip([Stream::Stdout, Stream::Stderr, Stream::Stdout]) {
            if let Some(fd) = pump.stop() {
                outputs.push((stream, fd));
            }
        }
        let mut unread = unread;
        let terminal = match (&self.live.spec.terminal, stdin.as_ref().and_then(|s| s.writer.as_ref())) {
            (Some(_), Some(master)) => {
                use std::os::fd::AsFd;
                let state = || -> Result<(starling_proto::TerminalSize, Vec<u8>), starling_sandbox::TerminalError> {
                    let modes = starling_sandbox::terminal::get_modes(master.as_fd())?;
                    let (rows, cols) = starling_sandbox::terminal::get_size(master.as_fd())?;
                    let typed = starling_sandbox::terminal::take_pending_input(master.as_fd())?;
                    Ok((starling_proto::TerminalSize { rows, cols, modes: Some(modes) }, typed))
                };
                match state() {
                    Ok((size, typed)) => {
                        unread = typed;
                        Some(size)
                    }
                    Err(e) => {
                        self.saved = Some(Saved { stdin, unread, outputs });
                        return Err(format!("the task's terminal: {e}"));
                    }
                }
            }
            _ => None,
        };
        let stdin_closed = stdin.as_ref().is_none_or(|s| s.writer.is_none());
        // 4. Its X connections: what the program sent goes to the client now, what it was sent
        // and has not read travels.
        let pids = starling_migrate::capture::tree(self.pid).map(|t| t.iter().map(|m| m.pid).collect()).unwrap_or_else(|_| vec![self.pid]);
        let display = crate::x11::freeze(&self.agent, self.task, &pids);
        let handover = Handover {
            bindings: self.live.view.bindings().into_iter().collect(),
            listings: self.live.view.listings(),
            accessed: [self.live.earlier_accessed.clone(), self.live.view.accessed_paths()].concat(),
            upper: read_upper(&self.live.dir.join("upper"))?,
            stdin: unread.clone(),
            stdin_closed,
            terminal,
            display,
        };
        self.saved = Some(Saved { stdin, unread, outputs });
        let bytes = encode(&handover)?;
        self.state_bytes = bytes.len() as u64;
        Ok(bytes)
    }

    fn resumed(&mut self) {
        self.switched = true;
        // Its end here is not its end any more.
        self.life.moved.store(true, Ordering::SeqCst);
        // The source's copy is still there (stopped): its CPU counters are final.
        let cpu_seconds = u32::try_from(self.pid).map_or(0.0, |p| crate::tree_usage(p).cpu_seconds);
        // After the task's output here (its path sender's order).
        let _ = self.task_tx.blocking_send(Msg::MigrateHandedOver { migration: self.migration, task: self.task, cpu_seconds });
    }
}

/// The task's overlay upper with every file's bytes.
fn read_upper(upper: &Path) -> Result<Vec<UpperItem>, String> {
    let entries = starling_view::scan_upper(upper).map_err(|e| format!("reading the task's files: {e}"))?;
    entries
        .into_iter()
        .map(|e| {
            Ok(match e {
                UpperEntry::File { path, host_path, mode, mtime_ns, .. } => {
                    let data = std::fs::read(&host_path).map_err(|e| format!("reading {}: {e}", host_path.display()))?;
                    UpperItem::File { path, mode, mtime_ns, data }
                }
                UpperEntry::Dir { path, mode, opaque } => UpperItem::Dir { path, mode, opaque },
                UpperEntry::Symlink { path, target } => UpperItem::Symlink { path, target },
                UpperEntry::Whiteout { path } => UpperItem::Whiteout { path },
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------
// target

/// The target's part: listen for the source, tell the head where, and take
/// the task when it comes. `network`: a clone's ticket network here, the head's word (not the
/// one its source ran it with, which lacks the ticket's network if the source could not enforce it).
pub(crate) async fn accept(
    agent: Arc<Agent>,
    tx: Outgoing,
    migration: u64,
    task: TaskId,
    from: String,
    key: starling_proto::SecretKey,
    network: Option<starling_proto::TicketNetwork>,
) {
    let ip = agent.addr.lock().unwrap().clone();
    let listener = match TcpListener::bind((ip.as_str(), 0)) {
        Ok(l) => l,
        Err(e) => {
            let _ = tx.send(Msg::MigrateInReady { migration, result: Err(format!("cannot listen on {ip}: {e}")) }).await;
            return;
        }
    };
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let abort = Arc::new(AtomicBool::new(false));
    agent.incoming.lock().unwrap().insert(migration, abort.clone());
    let _ = tx.send(Msg::MigrateInReady { migration, result: Ok(addr) }).await;
    log::info!("task {task}: taking it from {from}");
    let dir = agent.cfg.settings.state.join("tasks").join(task.to_string());
    let body = {
        let (agent, tx, dir) = (agent.clone(), tx.clone(), dir.clone());
        move || {
            let r = receive(&agent, &tx, task, &dir, listener, &key, network, &abort);
            agent.incoming.lock().unwrap().remove(&migration);
            r
        }
    };
    crate::task::supervise(agent, task, tx, dir, body).await;
}

/// Wait for the source's connection (until `abort` or [`CONNECT_WAIT`]):
/// the first that proves the move's `key`. Others are closed at once,
/// before a byte of theirs is decoded, and the wait goes on. `encrypt`:
/// this host's `fork.encrypt` (the stream is encrypted if either side asks).
fn wait_for_source(
    listener: &TcpListener,
    key: &starling_proto::SecretKey,
    encrypt: bool,
    abort: &AtomicBool,
) -> Result<starling_fork::page_server::Halves, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let until = Instant::now() + CONNECT_WAIT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                let _ = s.set_nodelay(true);
                // A peer that says nothing must not hold the listener.
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                match starling_fork::page_server::prove_server(key, encrypt, &mut &s, &mut &s) {
                    Ok(secrecy) => {
                        let _ = s.set_read_timeout(None);
                        return starling_fork::page_server::halves(s, secrecy).map_err(|e| e.to_string());
                    }
                    Err(e) => log::warn!("migration listener: a connection without the move's key was refused ({e})"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if abort.load(Ordering::SeqCst) || Instant::now() > until {
                    return Err("the source never came".into());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The view a moved task finds here, mounted while its memory arrives.
struct Prepared {
    spec: TaskSpec,
    view: Arc<starling_view::ViewMount>,
    age: Duration,
}

#[allow(clippy::too_many_arguments)] // what the head's MigrateIn said, and where the task goes
fn receive(
    agent: &Arc<Agent>,
    tx: &Outgoing,
    task: TaskId,
    dir: &Path,
    listener: TcpListener,
    key: &starling_proto::SecretKey,
    network: Option<starling_proto::TicketNetwork>,
    abort: &AtomicBool,
) -> crate::Result<()> {
    // Until the task resumes here it is the source's: a failure is logged
    // (the source reports it), never sent as the task's end.
    let gave_up = |why: String| {
        log::warn!("task {task}: not taken from its source: {why}");
        Ok(())
    };
    let conn = match wait_for_source(&listener, key, agent.cfg.fork.encrypt, abort) {
        Ok(s) => s,
        Err(why) => return gave_up(why),
    };
    let mut prepared: Option<Prepared> = None;
    let incoming = starling_migrate::target::receive(conn, *key, agent.cfg.fork.encrypt, &mut |payload| {
        let mut p: Prepare = decode(&payload)?;
        if let Some(c) = p.spec.clone.as_mut() {
            c.network.clone_from(&network);
        }
        let view_dir = dir.join("view");
        std::fs::create_dir_all(&view_dir).map_err(|e| e.to_string())?;
        let source = Arc::new(RemoteSource { task, tx: tx.clone(), waiters: agent.waiters.clone(), cache: agent.cache.clone(), peers: agent.peers.as_ref().map(|(p, _)| p.clone()) });
        let view = starling_view::mount_with(source, &view_dir, starling_view::ViewOptions::default()).map_err(|e| e.to_string())?;
        view.preload(p.bindings);
        view.preload_listings(p.listings);
        // Bring the mapped files' bytes to this host before the freeze (an
        // open assembles a file in the host cache): the restore maps them
        // during the pause.
        for path in p.mapped {
            if let Err(e) = std::fs::File::open(view_dir.join(path.trim_start_matches('/'))) {
                log::debug!("task {task}: reading {path} ahead: {e}");
            }
        }
        prepared = Some(Prepared { spec: p.spec, view: Arc::new(view), age: Duration::from_secs_f64(p.age_seconds.max(0.0)) });
        Ok(())
    });
    let incoming = match incoming {
        Ok(i) => i,
        Err(e) => return gave_up(e.to_string()),
    };
    let Some(prepared) = prepared else {
        incoming.failed("no prepare payload");
        return gave_up("the source sent no prepare payload".into());
    };
    match restore_here(agent, tx, task, dir, &incoming, prepared) {
        Ok(()) => Ok(()),
        Err((e, resumed)) => {
            crate::x11::close(agent, task);
            if !resumed {
                incoming.failed(&e.to_string());
                return gave_up(e.to_string());
            }
            Err(e)
        }
    }
}

/// Restore the task here; on failure, whether it had resumed already.
fn restore_here(
    agent: &Arc<Agent>,
    tx: &Outgoing,
    task: TaskId,
    dir: &Path,
    incoming: &starling_migrate::target::Incoming,
    prepared: Prepared,
) -> Result<(), (AgentError, bool)> {
    let early = |e: AgentError| (e, false);
    let t0 = Instant::now();
    let h: Handover = decode(&incoming.payload).map_err(|e| early(AgentError::Migration(e)))?;
    let Prepared { spec, view, age } = prepared;
    // The task's messages from here (at home: its path sender, whose first message, held by
    // the head until the switch, tells the client to talk to it directly).
    let tx = &crate::direct::task_sender(agent, task, &spec, tx);
    view.preload(h.bindings);
    view.preload_listings(h.listings);
    let overlay = starling_view::Overlay::mount(&dir.join("view"), dir).map_err(|e| early(io_step(Step::MountOverlay)(e)))?;
    apply_upper(overlay.root(), h.upper).map_err(|e| early(AgentError::Migration(format!("writing the task's files: {e}"))))?;
    // Its display, before the restorer re-attaches the connections to it.
    if let Some(d) = &h.display {
        crate::x11::reopen(agent, task, d, overlay.root(), tx).map_err(early)?;
    }
    let t_files = Instant::now();

    // From here the task is this host's: register it before the head lets
    // its input through (which happens after the switch).
    let (ctl, port) = TaskCtl::new();
    let life = ctl.life.clone();
    agent.tasks.lock().unwrap().insert(task, ctl);
    let [(stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w)] = stdio_pipes().map_err(early)?;
    // A terminal task gets a new pty here (made by its sandbox, as for any
    // terminal task, with the source's size and modes now); its stdin pump
    // starts on the master once the sandbox has sent it.
    let terminal = h.terminal.filter(|_| spec.terminal.is_some() && spec.clone.is_none());
    let (line, stdin_r, pending) = match &terminal {
        Some(_) => {
            drop(stdin_w);
            let (line, theirs) = starling_sandbox::TerminalLine::new().map_err(|e| early(AgentError::Terminal(e)))?;
            (Some(line), theirs, Some((port.stdin, h.stdin)))
        }
        None => {
            let writer = (!h.stdin_closed).then(|| File::from(stdin_w));
            crate::io::start_stdin(writer, port.stdin, h.stdin);
            (None, stdin_r, None)
        }
    };

    let pid_slot = port.pid.clone();
    let on_lost: starling_migrate::target::OnLost = {
        let (life, pid_slot) = (life.clone(), pid_slot.clone());
        Arc::new(move |why: String| {
            log::warn!("task {task}: lost: {why}");
            *life.lost.lock().unwrap() = Some(why);
            let pid = pid_slot.load(Ordering::SeqCst);
            if pid > 0 {
                let _ = starling_sandbox::kill_sandbox(pid);
            }
        })
    };
    let handler_desc = crate::clone::rooted(&incoming.descriptor, overlay.root());
    let serve = incoming.serve(handler_desc, agent.cfg.fork.prefetch, on_lost);
    // A moved task (exec task or clone) gets its filter back from the restorer.
    let seccomp = starling_sandbox::harden::task_filter_bytes().map_err(|e| early(AgentError::Filter(e)))?;
    // The restore runs outside the guest's CPU (cpu.idle) and freezer groups: the restored
    // process joins them as its last step, before its own code runs (`Guest::join_restored`).
    let (placement, at_resume) = agent.linger.restore_placement(spec.policy);
    let join_fds = at_resume
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new().write(true).open(p).map(OwnedFd::from).map_err(|e| {
                early(AgentError::Migration(format!("opening the guest group {}: {e}", p.display())))
            })
        })
        .collect::<Result<Vec<OwnedFd>, _>>()?;
    let plan = PlanOptions {
        clone_id: 0,
        clone_count: 1,
        new_pid_namespace: true,
        clone_id_in_rax: false,
        seccomp: &seccomp,
        terminal: terminal.is_some(),
        join_groups: u32::try_from(join_fds.len()).unwrap_or(u32::MAX),
    };
    let (mut program, restore) =
        Restore::start(&incoming.descriptor, plan, serve).map_err(|e| early(crate::fork_step(Step::PrepareRestore)(e)))?;
    program.fds.extend((starling_image::abi::restorer::JOIN_FD..).zip(join_fds));
    let mut sb = sandbox_spec(agent, &spec, overlay.root());
    sb.placement = placement;
    sb.terminal.clone_from(&terminal);
    // A clone of an isolated ticket is in its ticket's network here (the head's `MigrateIn` said
    // which; held until it ends here or moves on).
    let ticket_net = match spec.clone.as_ref().and_then(|c| Some((c, c.network.as_ref()?))) {
        // The notice is in this host's log: the clone's stderr went with it from its first host.
        Some((c, n)) => crate::ticket_net::enter(agent, c, n, &mut sb, |_| {}).map_err(early)?,
        None => None,
    };
    // The restorer drops to the task's credentials itself.
    (sb.uid, sb.gid, sb.groups) = (0, 0, Vec::new());
    // Its program is the restorer, which needs root; it installs the filter
    // in `seccomp` (no_new_privs included) itself as the task resumes.
    sb.confinement = starling_sandbox::Confinement::Restorer;
    let program = starling_sandbox::TaskProgram { program: program.program, fds: program.fds };
    let t_plan = Instant::now();
    let mut child = starling_sandbox::spawn_program(&agent.cfg.exe, &sb, program, stdin_r, stdout_w, stderr_w)
        .map_err(|e| early(io_step(Step::StartSandbox)(e)))?;
    pid_slot.store(child.pid(), Ordering::SeqCst);
    let mut master_out = None;
    if let (Some(line), Some((stdin_rx, typed))) = (line, pending) {
        // None: the sandbox failed before it made the pty (the restore fails below).
        match line.receive_master() {
            Ok(Some(m)) => {
                use std::os::fd::AsFd;
                // What was typed on the source and not read: in the new pty's
                // input queue before the task resumes, not echoed twice.
                if let Err(e) = starling_sandbox::terminal::give_pending_input(m.as_fd(), &typed) {
                    log::warn!("task {task}: its typed input: {e}");
                }
                let w = m.try_clone().map_err(|e| early(io_step(Step::Pipe)(e)))?;
                crate::io::start_stdin(Some(File::from(w)), stdin_rx, Vec::new());
                master_out = Some(m);
            }
            Ok(None) => drop(crate::io::start_stdin(None, stdin_rx, Vec::new())),
            Err(e) => return Err(early(AgentError::Terminal(starling_sandbox::TerminalError::Line(e)))),
        }
    }
    let t_spawned = Instant::now();
    // Every process of the task's tree (the switch waits for all of them).
    let running = restore.wait_all_running();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let t_running = Instant::now();
    let phases_ms: Vec<(String, f64)> = vec![
        ("overlay + files".into(), ms(t0, t_files)),
        ("plan".into(), ms(t_files, t_plan)),
        ("sandbox".into(), ms(t_plan, t_spawned)),
        ("restorer to running".into(), ms(t_spawned, t_running)),
    ];
    log::info!("task {task}: restore: {phases_ms:?}");
    if !running {
        let st = child.wait();
        let (_, channel) = restore.finish();
        return Err(early(AgentError::Migration(format!(
            "the restore failed ({st:?}{})",
            channel.map(|e| format!("; {e}")).unwrap_or_default()
        ))));
    }
    incoming.resumed(phases_ms).map_err(|e| (AgentError::Migration(e.to_string()), true))?;
    log::info!("task {task}: runs here now (pid {})", child.pid());
    let mut outputs = vec![
        OutputPump::start(task, Stream::Stdout, stdout_r, tx.clone()).map_err(|e| (io_step(Step::Pipe)(e), true))?,
        OutputPump::start(task, Stream::Stderr, stderr_r, tx.clone()).map_err(|e| (io_step(Step::Pipe)(e), true))?,
    ];
    if let Some(m) = master_out {
        // The pty's output (after the pipes', as `task::run` orders them: a
        // further move stops them in that order).
        outputs.push(OutputPump::start(task, Stream::Stdout, m, tx.clone()).map_err(|e| (io_step(Step::Pipe)(e), true))?);
    }
    let live = Arc::new(LiveTask {
        spec,
        dir: dir.to_path_buf(),
        root: overlay.root().to_path_buf(),
        view,
        outputs: Mutex::new(outputs),
        sandbox_pid: child.pid(),
        depth: 4,
        started: Instant::now().checked_sub(age).unwrap_or_else(Instant::now),
        earlier_accessed: h.accessed,
        materialize: None,
    });
    *life.live.lock().unwrap() = Some(live.clone());
    let sandbox_status = child.wait().map_err(|e| (io_step(Step::WaitTask)(e), true))?;
    pid_slot.store(0, Ordering::SeqCst);
    // The restorer's PID 1 saw how the program itself ended (the sandbox
    // only sees the restorer's relayed code).
    let (outcomes, _) = restore.finish();
    let status = outcomes.first().and_then(|o| o.status).unwrap_or(sandbox_status);
    drop(ticket_net);
    if let Some(c) = &live.spec.clone {
        // A moved clone's parent learns its end as a clone's (its counters
        // stayed with the host it was cloned on).
        let _ = tx.blocking_send(Msg::CloneStats { task, clone_id: c.clone_id, status: Some(status), counters: Default::default() });
    }
    end_task(agent, task, tx, &life, &live, overlay, status, None).map_err(|e| (e, true))
}

/// Write a moved task's files through its new overlay, so that its upper
/// ends up as the source's was. This runs as root outside the task's chroot:
/// nothing is followed through a symlink (an absolute one would resolve on
/// this host), neither on the way to an item (the move is refused) nor at
/// the item itself (the symlink is replaced).
fn apply_upper(root: &Path, items: Vec<UpperItem>) -> std::io::Result<()> {
    let at = |p: &WirePath| -> std::io::Result<PathBuf> {
        let rel = p.as_path().strip_prefix("/").unwrap_or(p.as_path());
        let mut way = root.to_path_buf();
        if let Some(parent) = rel.parent() {
            for comp in parent.components() {
                way.push(comp);
                if std::fs::symlink_metadata(&way).is_ok_and(|m| m.file_type().is_symlink()) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{p}: a directory on its way is a symlink here; refusing to follow it"),
                    ));
                }
            }
        }
        Ok(root.join(rel))
    };
    let is_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    for item in items {
        match item {
            UpperItem::Dir { path, mode, opaque } => {
                let p = at(&path)?;
                if opaque {
                    let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
                }
                if !is_dir(&p) {
                    let _ = std::fs::remove_file(&p);
                    std::fs::create_dir_all(&p)?;
                }
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o7777))?;
            }
            UpperItem::File { path, mode, mtime_ns, data } => {
                let p = at(&path)?;
                if is_dir(&p) {
                    std::fs::remove_dir_all(&p)?;
                } else if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
                    std::fs::remove_file(&p)?;
                }
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&p)?;
                f.write_all(&data)?;
                f.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))?;
                let t = std::time::UNIX_EPOCH + Duration::from_nanos(u64::try_from(mtime_ns).unwrap_or(0));
                f.set_times(std::fs::FileTimes::new().set_modified(t))?;
            }
            UpperItem::Symlink { path, target } => {
                let p = at(&path)?;
                if is_dir(&p) {
                    std::fs::remove_dir_all(&p)?;
                } else {
                    let _ = std::fs::remove_file(&p);
                }
                std::os::unix::fs::symlink(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&target), &p)?;
            }
            UpperItem::Whiteout { path } => {
                let p = at(&path)?;
                if is_dir(&p) {
                    std::fs::remove_dir_all(&p)?;
                } else if p.symlink_metadata().is_ok() {
                    std::fs::remove_file(&p)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(p: &str) -> WirePath {
        WirePath::new(p.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn a_moved_tasks_files_are_never_written_through_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, outside) = (tmp.path().join("root"), tmp.path().join("outside"));
        std::fs::create_dir_all(root.join("w")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("passwd"), "host\n").unwrap();
        // A symlink item, then items "under" it: the move is refused, nothing outside is touched.
        let items = vec![
            UpperItem::Symlink { path: wire("/w/d"), target: outside.as_os_str().as_encoded_bytes().to_vec() },
            UpperItem::File { path: wire("/w/d/passwd"), mode: 0o644, mtime_ns: 0, data: b"pwned\n".to_vec() },
        ];
        let err = apply_upper(&root, items).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
        assert_eq!(std::fs::read_to_string(outside.join("passwd")).unwrap(), "host\n");
        // A symlink where a file goes (as a lower view may have): replaced, not followed.
        std::os::unix::fs::symlink(outside.join("passwd"), root.join("w/out")).unwrap();
        let items = vec![UpperItem::File { path: wire("/w/out"), mode: 0o600, mtime_ns: 0, data: b"mine\n".to_vec() }];
        apply_upper(&root, items).unwrap();
        assert_eq!(std::fs::read_to_string(root.join("w/out")).unwrap(), "mine\n");
        assert!(!std::fs::symlink_metadata(root.join("w/out")).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read_to_string(outside.join("passwd")).unwrap(), "host\n");
    }
}
