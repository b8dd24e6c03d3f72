//! Running one task: view → overlay → sandbox → changes.

use crate::remote::RemoteSource;
use crate::Agent;
use crate::{io_step, AgentError, Result, Step};
use starling_proto::conn::Outgoing;
use starling_proto::{Base, Change, ChunkData, Hash, Lookup, Msg, Stream, TaskId, TaskSpec, WirePath};
use starling_view::UpperEntry;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Bytes of file content per ChangeChunks message.
const CHANGE_BATCH_BYTES: usize = 8 << 20;

pub(crate) async fn run(
    agent: Arc<Agent>,
    task: TaskId,
    spec: TaskSpec,
    tx: Outgoing,
    port: TaskPort,
) {
    agent.running.fetch_add(1, Ordering::Relaxed);
    let dir = agent.cfg.settings.state.join("tasks").join(task.to_string());
    let res = {
        let agent = agent.clone();
        let tx = tx.clone();
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || run_blocking(&agent, task, spec, &tx, &dir, port)).await
    };
    let err = match res {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(e) => Some(format!("task runner crashed: {e}")),
    };
    if let Some(message) = err {
        log::warn!("task {task}: {message}");
        let _ = tx.send(Msg::Error { task: Some(task), message: format!("host {}: {message}", agent.cfg.name) }).await;
    }
    agent.tasks.lock().unwrap().remove(&task);
    let _ = std::fs::remove_dir_all(&dir);
    agent.running.fetch_sub(1, Ordering::Relaxed);
}

/// The running task's end of its `TaskCtl`: stdin from the head, where its
/// sandbox's pid goes, and a signal that arrived before the sandbox existed.
pub(crate) struct TaskPort {
    pub stdin: std::sync::mpsc::Receiver<Option<Vec<u8>>>,
    pub pid: Arc<AtomicU32>,
    pub pending_signal: Arc<std::sync::atomic::AtomicI32>,
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| AgentError::Io { step: Step::Pipe, source: e.into() })
}

fn pump_output(task: TaskId, stream: Stream, fd: OwnedFd, tx: Outgoing) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(fd);
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match f.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(Msg::Output { task, stream, data: buf[..n].to_vec() }).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

fn run_blocking(
    agent: &Arc<Agent>,
    task: TaskId,
    spec: TaskSpec,
    tx: &Outgoing,
    dir: &std::path::Path,
    port: TaskPort,
) -> Result<()> {
    let TaskPort { stdin: stdin_rx, pid, pending_signal } = port;
    let view_dir = dir.join("view");
    std::fs::create_dir_all(&view_dir).map_err(io_step(Step::CreateDir(view_dir.clone())))?;
    let source = Arc::new(RemoteSource { task, tx: tx.clone(), waiters: agent.waiters.clone(), cache: agent.cache.clone() });
    // A clone's own files are prethrown (its restorer finds them without a
    // round trip), so fewer request loops do: starting each costs a thread
    // and its 16 MiB buffer, which adds up when a ticket starts many clones.
    let options = starling_view::ViewOptions { threads: if spec.clone.is_some() { 2 } else { 4 }, ..Default::default() };
    let view = starling_view::mount_with(source, &view_dir, options).map_err(io_step(Step::MountView))?;
    view.preload(spec.prethrow.clone());
    view.preload_listings(spec.listings.clone());
    let overlay = starling_view::Overlay::mount(&view_dir, dir).map_err(io_step(Step::MountOverlay))?;

    let (stdin_r, stdin_w) = pipe()?;
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    let mut sb = starling_sandbox::SandboxSpec {
        root: overlay.root().to_path_buf(),
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        cwd: spec.cwd.as_bytes().to_vec(),
        umask: spec.umask,
        uid: spec.uid,
        gid: spec.gid,
        groups: spec.groups.clone(),
        rlimits: spec.rlimits.clone(),
        hostname: None,
    };
    // A clone (remote fork) runs the restorer instead of argv: see crate::clone.
    let (child, clone_run) = match &spec.clone {
        None => (starling_sandbox::spawn(&agent.cfg.exe, &sb, stdin_r, stdout_w, stderr_w), None),
        Some(c) => {
            let (program, run) = crate::clone::prepare(c, overlay.root(), agent.page_distribution.clone(), &agent.cfg.fork)?;
            // The restorer drops to the template's credentials itself, after
            // the steps that need root (PID namespace, set_tid, userfaultfd).
            (sb.uid, sb.gid, sb.groups) = (0, 0, Vec::new());
            (starling_sandbox::spawn_program(&agent.cfg.exe, &sb, program, stdin_r, stdout_w, stderr_w), Some(run))
        }
    };
    let mut child = child.map_err(io_step(Step::StartSandbox))?;
    pid.store(child.pid(), Ordering::SeqCst);
    // A signal that arrived during setup (e.g. an early Ctrl-C) is delivered now.
    let early = pending_signal.load(Ordering::SeqCst);
    if early > 0 {
        let _ = child.signal(early);
    }
    log::info!("task {task} started: {:?} (pid {})", String::from_utf8_lossy(&spec.argv[0]), child.pid());

    std::thread::spawn(move || {
        let mut w = std::fs::File::from(stdin_w);
        while let Ok(Some(data)) = stdin_rx.recv() {
            if w.write_all(&data).is_err() {
                // The task closed its stdin: drain the rest silently.
                while let Ok(Some(_)) = stdin_rx.recv() {}
                return;
            }
        }
    });
    let out = pump_output(task, Stream::Stdout, stdout_r, tx.clone());
    let err = pump_output(task, Stream::Stderr, stderr_r, tx.clone());
    let status = child.wait().map_err(io_step(Step::WaitTask))?;
    let _ = out.join();
    let _ = err.join();
    pid.store(0, Ordering::SeqCst);
    if let Some(run) = clone_run {
        run.finish(task, tx);
    }

    let bindings = view.bindings();
    let stats = view.stats();
    let accessed = view.accessed_paths();
    overlay.unmount().map_err(io_step(Step::UnmountOverlay))?;
    let changes = collect_changes(task, &dir.join("upper"), &bindings, &agent.cfg, tx)?;
    drop(view);
    log::info!("task {task} ended {status:?}: {} change(s); view {:?}", changes.len(), stats);
    tx.blocking_send(Msg::Finished { task, status, changes, accessed }).map_err(|_| AgentError::HeadLost)?;
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
