//! Capture: a frozen process's complete image, read from outside.
//!
//! Threads: registers (`PTRACE_GETREGS`, with a system call the thread was
//! in prepared for restart, as `rt_sigreturn` does none), XSAVE area,
//! signal mask, queued signals, rseq and robust-list registrations via
//! ptrace; clear-tid address and altstack by injected calls. Process:
//! dispositions, interval timers and brk by injected calls; memory, fds,
//! credentials, limits and cwd from `/proc` (`starling_fork::dump`). Paths
//! are made relative to the task's root (the process runs chrooted there).
//!
//! A process tree moves together: the root and every descendant, each
//! captured alone, the tree's shape in the root's descriptor
//! (`Descriptor::descendants`). A pipe only processes of the tree hold is
//! captured once (`Descriptor::pipes`: its capacity and its unread bytes,
//! read with `tee` so nothing is taken out) and every process's ends of it
//! are `FdKind::TreePipe`s at their fd numbers; the task's stdio pipes stay
//! where the agent gives them (fds 0-2).
//!
//! Sessions and process groups: each process's, named by the process of
//! the tree that leads it ([`sessions`]); the restorer starts and joins them again.
//!
//! What cannot move is refused before anything is frozen ([`precheck`]) and
//! again at capture: a zombie or stopped process in the tree, a process of
//! the task outside it (an orphan), a process group whose leader has ended
//! or left it, a pipe shared
//! with a process outside it, more than `MAX_POSIX_TIMERS` POSIX
//! timers or one on a clock the restorer cannot give back (their IDs,
//! notifications and clocks come from `/proc/PID/timers`, their times from
//! injected `timer_gettime` calls), a descriptor that is not a regular file,
//! directory, sandbox device or pipe.

use crate::freeze::Frozen;
use crate::inject::Injector;
use crate::ptrace;
use crate::{MigrateError, Result};
use starling_fork::dump::{dump_process, regions_with, Layout, RegionOptions};
use starling_image::abi::process::{
    ITimer, PosixTimer, PosixTimers, TimeSpec, TimeVal, MAX_POSIX_TIMERS, SIGEV_NONE, SIGEV_SIGNAL, SIGEV_THREAD, SIGEV_THREAD_ID,
};
use starling_image::abi::regs::{GpRegs, FP_XSTATE_MAGIC1, FP_XSTATE_MAGIC2, FPX_SW_BYTES_OFFSET, FXSAVE_BYTES};
use starling_image::abi::signal::{Sigaction, SigactionTable};
use starling_image::abi::thread::{AltStack, RobustList, Rseq, ThreadCore};
use starling_image::{
    check_sessions, Descriptor, FdEntry, FdKind, PageClass, PageRuns, PipeImage, ProcessState, Region, RegionKind, SessionIds, ThreadState,
    DESCRIPTOR_VERSION,
};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where the process lives and how to classify its pages.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// The directory the process is chrooted into (`/` if none): paths in
    /// the image are relative to it.
    pub root: PathBuf,
    /// Fetch-avoidance heuristics for the page classes.
    pub heuristics: bool,
    /// Unix sockets that a proxy of the host serves again on the target.
    pub reconnect: Option<Reconnect>,
}

/// Which of a task's Unix sockets (by inode) are connections of a proxy of its host that the
/// target re-attaches (its X display, `exec --x11`): the path to reconnect to (inside the
/// task's root) and the hello that names the connection to the proxy ([`FdKind::Reconnect`]).
#[derive(Clone)]
pub struct Reconnect(pub std::sync::Arc<dyn Fn(u64) -> Option<(String, u32)> + Send + Sync>);

impl std::fmt::Debug for Reconnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reconnect(..)")
    }
}

/// Devices a task sandbox provides in its `/dev` (name, major, minor): a
/// descriptor open on one of them is reopened by name on the target.
const SANDBOX_DEVICES: [(&str, u64, u64); 5] = [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9)];

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| MigrateError::Proc { path: path.to_string(), source: e })
}

/// A path `/proc` shows for the process, as the process sees it. For a
/// process chrooted in its own mount namespace `/proc` already shows paths
/// relative to its root; a reader sharing its mounts sees them under
/// `root`, which is taken off.
fn inside(root: &Path, path: &str) -> String {
    match Path::new(path).strip_prefix(root) {
        Ok(rest) if root != Path::new("/") => format!("/{}", rest.to_string_lossy()),
        _ => path.to_string(),
    }
}

/// The files `pid` maps, as paths inside `root`: a target reads them ahead
/// (while memory is copied), so the restore does not wait for their bytes.
pub fn mapped_files(pid: i32, root: &Path) -> Vec<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mut paths: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.starts_with('/') && !p.ends_with("(deleted)"))
        .map(|p| inside(root, p))
        .collect();
    paths.sort_unstable();
    paths.dedup();
    paths
}

/// The ID of thread `tid` of `pid` in its own (innermost) PID namespace.
fn ns_id(pid: i32, tid: i32) -> Result<u64> {
    let status = read(&format!("/proc/{pid}/task/{tid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last()?.parse().ok())
        .ok_or_else(|| MigrateError::Unmovable(format!("thread {tid}: no NSpid in its status")))
}

/// The name of thread `tid` of `pid` (its `comm`, at most 15 bytes), NUL-padded
/// as [`ThreadCore::comm`] holds it; all zero if it cannot be read (the
/// restored thread then keeps the restorer's name, nothing else is lost).
fn thread_name(pid: i32, tid: i32) -> [u8; 16] {
    let mut comm = [0u8; 16];
    if let Ok(name) = read(&format!("/proc/{pid}/task/{tid}/comm")) {
        let name = name.strip_suffix('\n').unwrap_or(&name).as_bytes();
        let n = name.len().min(15);
        comm[..n].copy_from_slice(&name[..n]);
    }
    comm
}

/// A process of the task's tree: its PID (in our namespace) and the index
/// of its parent in the tree's list (None: the root).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub pid: i32,
    pub parent: Option<usize>,
}

/// The process tree `pid` is the root of, parents before their children,
/// or why it cannot move: a zombie (its parent has not reaped it: its exit
/// status cannot be given back) or a stopped process in it, or more than
/// `MAX_TREE_PROCESSES` processes.
pub fn tree(pid: i32) -> Result<Vec<Member>> {
    let mut out = vec![Member { pid, parent: None }];
    let mut i = 0;
    while i < out.len() {
        let p = out[i].pid;
        movable_state(p, i == 0)?;
        for c in children(p)? {
            out.push(Member { pid: c, parent: Some(i) });
        }
        not_too_many(out.len())?;
        i += 1;
    }
    no_orphans(&out)?;
    Ok(out)
}

/// Freeze the tree `pid` is the root of, each process before its children
/// are listed (a frozen process forks no more): the frozen processes and
/// the tree, as [`tree`] lists it. Any failure lets go of those frozen so far.
pub fn freeze_tree(pid: i32) -> Result<(Vec<Frozen>, Vec<Member>)> {
    let mut members = vec![Member { pid, parent: None }];
    let mut frozen = Vec::new();
    let mut i = 0;
    while i < members.len() {
        let p = members[i].pid;
        movable_state(p, i == 0)?;
        match Frozen::freeze(p) {
            Ok(f) => frozen.push(f),
            Err(MigrateError::Gone(_)) if i > 0 => {
                return Err(MigrateError::Unmovable(format!("process {p} of the task ended while the task was being frozen")))
            }
            Err(e) => return Err(e),
        }
        for c in children(p)? {
            members.push(Member { pid: c, parent: Some(i) });
        }
        not_too_many(members.len())?;
        i += 1;
    }
    no_orphans(&members)?;
    Ok((frozen, members))
}

/// Refuse a process of the task's PID namespace outside its tree: an
/// orphan, adopted by the namespace's init when a parent of it ended. Only
/// the tree moves; left behind, it would end with the source, where before
/// a move it runs until the task's first process ends.
fn no_orphans(members: &[Member]) -> Result<()> {
    let ns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let task_ns = ns(members[0].pid).ok_or(MigrateError::Gone(members[0].pid))?;
    if std::fs::read_link("/proc/self/ns/pid").ok().as_ref() == Some(&task_ns) {
        // A process moved from our own PID namespace (a local move, no sandbox): no init of its own
        // adopts anything, and every other process of ours is simply not the task's.
        return Ok(());
    }
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if members.iter().any(|m| m.pid == pid) || ns(pid).as_ref() != Some(&task_ns) {
            continue;
        }
        // The namespace's init is the sandbox's (or the restorer's); one ended meanwhile is no orphan.
        match ns_id(pid, pid) {
            Ok(1) | Err(_) => {}
            Ok(id) => return Err(MigrateError::Orphan(id)),
        }
    }
    Ok(())
}

fn not_too_many(n: usize) -> Result<()> {
    if n > starling_image::MAX_TREE_PROCESSES {
        return Err(MigrateError::Unmovable(format!("the task has more than {} processes", starling_image::MAX_TREE_PROCESSES)));
    }
    Ok(())
}

/// Refuse a zombie (its parent has not reaped it: its exit status cannot
/// be given back) or a stopped process; the root gone is `Gone`.
fn movable_state(p: i32, root: bool) -> Result<()> {
    match process_state(p) {
        Some('Z') => Err(MigrateError::Unmovable(format!(
            "process {p} of the task is a zombie (its parent has not waited for it): its exit status cannot move"
        ))),
        Some('T' | 't') => Err(MigrateError::Unmovable(format!("process {p} of the task is stopped"))),
        None | Some('X' | 'x') if root => Err(MigrateError::Gone(p)),
        None | Some('X' | 'x') => Err(MigrateError::Unmovable(format!("process {p} of the task ended while it was being looked at"))),
        _ => Ok(()),
    }
}

/// A process's state letter (`R`, `S`, `Z`, `T`…), None if it is gone.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// A process's parent, process group and session (`/proc/PID/stat`
/// fields 4-6, as this host numbers them).
fn stat_ids(pid: i32) -> Result<[i32; 3]> {
    let path = format!("/proc/{pid}/stat");
    let stat = read(&path)?;
    let fields: Vec<i32> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().skip(1).take(3).filter_map(|v| v.parse().ok()).collect()).unwrap_or_default();
    fields.try_into().map_err(|_| MigrateError::Proc { path, source: std::io::Error::from(std::io::ErrorKind::InvalidData) })
}

/// Each process's session and process group (`ProcessCore::sid`, `pgid`),
/// named by the PID the task sees of the process of the tree that leads
/// it, 0 for the sandbox's (the root's parent's, which the restorer runs
/// in); refused where the restorer cannot make them again
/// (`starling_image::check_sessions`): a group whose leader has ended or
/// left it.
pub fn sessions(members: &[Member]) -> Result<Vec<(u64, u64)>> {
    let stats = members.iter().map(|m| stat_ids(m.pid)).collect::<Result<Vec<_>>>()?;
    let ns = members.iter().map(|m| ns_id(m.pid, m.pid)).collect::<Result<Vec<_>>>()?;
    let [_, outside_group, outside_session] = stat_ids(stats[0][0])?;
    let name = |i: usize, what: &'static str, host_id: i32, outside: i32| -> Result<u64> {
        match members.iter().position(|m| m.pid == host_id) {
            Some(leader) => Ok(ns[leader]),
            None if host_id == outside => Ok(0),
            None => Err(MigrateError::LeaderOutside { pid: ns[i], what, host_id }),
        }
    };
    let mut tree = Vec::with_capacity(members.len());
    for (i, (m, [_, group, session])) in members.iter().zip(&stats).enumerate() {
        let sid = name(i, "session", *session, outside_session)?;
        let pgid = name(i, "process group", *group, outside_group)?;
        tree.push(SessionIds { parent: m.parent, pid: ns[i], sid, pgid });
    }
    check_sessions(&tree)?;
    Ok(tree.iter().map(|p| (p.sid, p.pgid)).collect())
}

/// The foreground process group of the terminal the root controls
/// (`/proc/PID/stat` field 8, `tpgid`), as the task numbers it
/// (`ProcessCore::tpgid`): 0 if it has no terminal or its own group is in
/// the foreground (taking the terminal back makes it so again). A group no
/// process of the task leads is refused: Ctrl-C would reach nobody after a move.
pub fn foreground_group(members: &[Member]) -> Result<u64> {
    let root = members[0].pid;
    let path = format!("/proc/{root}/stat");
    let stat = read(&path)?;
    // After the ")" closing comm: state ppid pgrp session tty_nr tpgid.
    let tpgid: i32 = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(5)?.parse().ok())
        .ok_or_else(|| MigrateError::Proc { path, source: std::io::Error::from(std::io::ErrorKind::InvalidData) })?;
    if tpgid <= 0 || tpgid == root {
        return Ok(0);
    }
    match members.iter().find(|m| m.pid == tpgid) {
        Some(m) => ns_id(m.pid, m.pid),
        None => Err(MigrateError::Unmovable(format!(
            "the terminal's foreground process group {tpgid} (as this host numbers it) is not led by a process of the task"
        ))),
    }
}

/// The task's stdio pipes (`pipe:[N]` of fds 0-2 of its root): the only
/// pipes at fds 0-2 a process of its tree may hold (at the same fd).
pub fn stdio_pipes(pid: i32) -> Vec<(i32, String)> {
    (0..=2)
        .filter_map(|fd| Some((fd, std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?.to_string_lossy().into_owned())))
        .filter(|(_, t)| t.starts_with("pipe:"))
        .collect()
}

/// Refuse what cannot move, without stopping anything: the process tree
/// `pid` is the root of, each of its processes' timers and descriptors.
pub fn precheck(pid: i32, opts: &CaptureOptions) -> Result<Vec<Member>> {
    let members = tree(pid)?;
    sessions(&members)?;
    foreground_group(&members)?;
    let mut ctx = TreeFds::new(&members);
    ctx.reconnect.clone_from(&opts.reconnect);
    for m in &members {
        listed_timers(m.pid)?;
        classify_fds(m.pid, &opts.root, &mut ctx)?;
    }
    Ok(members)
}

/// What classifying a tree's descriptors needs to know about the tree:
/// the task's stdio pipes (fds 0-2 of its root, which stay the task's:
/// a process of the tree may hold them at the same fd), every pipe's
/// holders, and the pipes between its processes found so far.
pub struct TreeFds {
    stdio: Vec<(i32, String)>,
    members: Vec<i32>,
    /// `pipe:[N]` → the processes holding it (one scan of every process's
    /// descriptors, made when a pipe other than the task's stdio is found).
    holders: Option<std::collections::HashMap<String, Vec<i32>>>,
    /// The tree's pipes by index: `pipe:[N]` and a descriptor on it.
    pub pipes: Vec<(String, String)>,
    /// Sockets a proxy of the host serves again on the target.
    pub reconnect: Option<Reconnect>,
}

impl TreeFds {
    pub fn new(members: &[Member]) -> TreeFds {
        TreeFds {
            stdio: stdio_pipes(members[0].pid),
            members: members.iter().map(|m| m.pid).collect(),
            holders: None,
            pipes: Vec::new(),
            reconnect: None,
        }
    }

    /// The index of pipe `target` (held at `link`) among the tree's.
    fn pipe(&mut self, target: &str, link: &str) -> u32 {
        let i = self.pipes.iter().position(|(t, _)| t == target).unwrap_or_else(|| {
            self.pipes.push((target.to_string(), link.to_string()));
            self.pipes.len() - 1
        });
        u32::try_from(i).unwrap_or(u32::MAX)
    }
}

/// Every process's pipes: `pipe:[N]` → the PIDs holding it.
fn pipe_holders() -> std::collections::HashMap<String, Vec<i32>> {
    let mut out: std::collections::HashMap<String, Vec<i32>> = std::collections::HashMap::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for f in fds.flatten() {
            if let Ok(t) = std::fs::read_link(f.path()) {
                let t = t.to_string_lossy();
                if t.starts_with("pipe:") {
                    let v = out.entry(t.into_owned()).or_default();
                    if v.last() != Some(&pid) {
                        v.push(pid);
                    }
                }
            }
        }
    }
    out
}

/// The unread bytes and the capacity of a pipe, read without taking them
/// out (`tee` into a pipe of ours): its processes are frozen.
fn pipe_content(target: &str, link: &str) -> Result<PipeImage> {
    let fail = |e: std::io::Error| MigrateError::Proc { path: format!("{link} ({target})"), source: e };
    // Opening a pipe through /proc gives a new end of the same pipe.
    let ours = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(link).map_err(fail)?;
    // SAFETY: fcntl on our own descriptor.
    let capacity = unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_GETPIPE_SZ) };
    let capacity = u32::try_from(capacity).map_err(|_| fail(std::io::Error::last_os_error()))?;
    let (copy_r, copy_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| fail(std::io::Error::from(e)))?;
    // SAFETY: fcntl on our own pipe (root may exceed pipe-max-size).
    unsafe { libc::fcntl(copy_w.as_raw_fd(), libc::F_SETPIPE_SZ, capacity) };
    let mut data = Vec::new();
    // SAFETY: tee between two pipes we hold; it duplicates, never consumes.
    let n = unsafe { libc::tee(ours.as_raw_fd(), copy_w.as_raw_fd(), capacity as usize, libc::SPLICE_F_NONBLOCK) };
    if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
        return Err(fail(std::io::Error::last_os_error()));
    }
    drop(copy_w);
    std::fs::File::from(copy_r).read_to_end(&mut data).map_err(fail)?;
    Ok(PipeImage { capacity, data })
}

/// A POSIX timer as `/proc/PID/timers` shows it; the time left comes from
/// an injected `timer_gettime`. `tid` is in the reader's PID namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ListedTimer {
    id: u64,
    clock: u64,
    notify: u64,
    signo: u64,
    sigval: u64,
    tid: u64,
}

/// Parse `/proc/PID/timers` (fs/proc/base.c `show_timer`): per timer
/// `ID: n`, `signal: SIGNO/SIGVAL-HEX`, `notify: signal|none|thread/pid|tid.N`,
/// `ClockID: c`. In ascending ID order (the kernel lists them newest first).
fn parse_timers(text: &str) -> std::result::Result<Vec<ListedTimer>, String> {
    let mut out: Vec<ListedTimer> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (key, value) = line.split_once(':').ok_or_else(|| format!("line {line:?}"))?;
        let value = value.trim();
        let bad = || format!("{key}: {value:?}");
        if key == "ID" {
            let id = value.parse().map_err(|_| bad())?;
            out.push(ListedTimer { id, clock: 0, notify: 0, signo: 0, sigval: 0, tid: 0 });
            continue;
        }
        let t = out.last_mut().ok_or_else(|| format!("{key} before any ID"))?;
        match key {
            "signal" => {
                let (signo, sigval) = value.split_once('/').ok_or_else(bad)?;
                t.signo = signo.parse().map_err(|_| bad())?;
                t.sigval = u64::from_str_radix(sigval.trim_start_matches("0x"), 16).map_err(|_| bad())?;
            }
            "notify" => {
                let (kind, target) = value.split_once('/').ok_or_else(bad)?;
                let (whom, id) = target.split_once('.').ok_or_else(bad)?;
                let base = match kind {
                    "signal" => SIGEV_SIGNAL,
                    "none" => SIGEV_NONE,
                    "thread" => SIGEV_THREAD,
                    _ => return Err(bad()),
                };
                match whom {
                    "pid" => t.notify = base,
                    "tid" => {
                        t.notify = base | SIGEV_THREAD_ID;
                        t.tid = id.parse().map_err(|_| bad())?;
                    }
                    _ => return Err(bad()),
                }
            }
            "ClockID" => t.clock = value.parse::<i64>().map_err(|_| bad())?.cast_unsigned(),
            _ => {} // a field a later kernel added
        }
    }
    out.sort_unstable_by_key(|t| t.id);
    Ok(out)
}

/// The POSIX timers of `pid`, or why they cannot move (too many, a clock
/// or a notification the restorer cannot give back).
fn listed_timers(pid: i32) -> Result<Vec<ListedTimer>> {
    let path = format!("/proc/{pid}/timers");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        // Without CONFIG_CHECKPOINT_RESTORE there is no list: nothing to read it by.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(MigrateError::Proc { path, source: e }),
    };
    let timers = parse_timers(&text).map_err(|e| MigrateError::Unmovable(format!("unreadable {path} ({e})")))?;
    if timers.len() > MAX_POSIX_TIMERS {
        return Err(MigrateError::Unmovable(format!(
            "the process has {} POSIX timers (timer_create); at most {MAX_POSIX_TIMERS} can move",
            timers.len()
        )));
    }
    for t in &timers {
        let probe = PosixTimer { id: t.id, clock: t.clock, notify: t.notify, signo: t.signo, sigval: t.sigval, tid: t.tid, ..PosixTimer::default() };
        if let Some(why) = probe.invalid() {
            return Err(MigrateError::Unmovable(format!(
                "POSIX timer {} (clock {}, notify {}) cannot move: unsupported {why}",
                t.id,
                t.clock.cast_signed(),
                t.notify
            )));
        }
    }
    Ok(timers)
}

/// Processes whose parent is `pid`.
fn children(pid: i32) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for t in crate::freeze::threads(pid)? {
        let path = format!("/proc/{pid}/task/{t}/children");
        if let Ok(s) = std::fs::read_to_string(&path) {
            out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
            continue;
        }
        // Without CONFIG_PROC_CHILDREN: look at every process's parent.
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<i32>().ok());
            if ppid == Some(pid) {
                out.push(p);
            }
        }
        break;
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// What a refused socket descriptor is ([`MigrateError::UnmovableFd`]'s `what`).
pub const SOCKET: &str = "a socket: network connections cannot move";

/// Whether `e` refuses a socket descriptor (and nothing else was found
/// unmovable before it): a task that opens short connections now and then
/// holds none a moment later.
pub fn refuses_socket(e: &MigrateError) -> bool {
    matches!(e, MigrateError::UnmovableFd { what, .. } if what.starts_with(SOCKET))
}

/// The first socket among the descriptors of `pids` that cannot move (one
/// the host's proxy re-attaches can), as `classify_fds` refuses it: only
/// the links of `/proc/PID/fd` are read, so this is cheap enough for the
/// pause.
pub fn held_socket(pids: &[i32], opts: &CaptureOptions) -> Result<()> {
    for &pid in pids {
        let dir = format!("/proc/{pid}/fd");
        let entries = std::fs::read_dir(&dir).map_err(|e| MigrateError::Proc { path: dir.clone(), source: e })?;
        for e in entries.flatten() {
            let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
            let Ok(target) = std::fs::read_link(e.path()) else { continue };
            let target = target.to_string_lossy().into_owned();
            let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) else { continue };
            let inode = inode.parse::<u64>().ok();
            if inode.zip(opts.reconnect.as_ref()).and_then(|(ino, r)| (r.0)(ino)).is_none() {
                return Err(MigrateError::UnmovableFd { fd, target, what: SOCKET.to_string() });
            }
        }
    }
    Ok(())
}

/// The process's descriptors as the image carries them, or the first one
/// that cannot move; the tree's pipes it holds are added to `ctx`.
pub fn classify_fds(pid: i32, root: &Path, ctx: &mut TreeFds) -> Result<Vec<FdEntry>> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&dir)
        .map_err(|e| MigrateError::Proc { path: dir.clone(), source: e })?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    // A clone's copy of its stdout/stderr (`FdKind::Stream`, restored as a
    // dup of fd 1/2) is the same pipe as that fd: it moves as such a copy.
    let std_pipes: Vec<(i32, String)> = [1, 2]
        .into_iter()
        .filter_map(|fd| Some((fd, std::fs::read_link(format!("{dir}/{fd}")).ok()?.to_string_lossy().into_owned())))
        .filter(|(_, t)| t.starts_with("pipe:"))
        .collect();
    let mut out = Vec::new();
    for fd in fds {
        let link = format!("{dir}/{fd}");
        let Ok(target) = std::fs::read_link(&link) else { continue }; // closed meanwhile
        let target = target.to_string_lossy().into_owned();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let flags = field("flags:").and_then(|v| u32::from_str_radix(v, 8).ok()).unwrap_or(0);
        let offset = field("pos:").and_then(|v| v.parse().ok()).unwrap_or(0);
        let refuse = |what: &str| Err(MigrateError::UnmovableFd { fd, target: target.clone(), what: what.to_string() });
        let kind = if target.starts_with("pipe:") {
            let write = flags & libc::O_ACCMODE as u32 == libc::O_WRONLY as u32;
            // A clone's copy of its stdout/stderr: a stream, as that fd.
            if let Some((of, _)) = std_pipes.iter().find(|(_, t)| *t == target).filter(|_| fd > 2 && write) {
                out.push(FdEntry { fd, kind: FdKind::Stream { of: *of } });
                continue;
            }
            if ctx.stdio.iter().any(|(_, t)| *t == target) {
                // The task's stdin/stdout/stderr: the agent holds its other
                // end, and the target's agent gives it again at fds 0-2.
                if !ctx.stdio.iter().any(|(n, t)| *n == fd && *t == target) {
                    return refuse("the task's stdio pipe at another fd number: it cannot move");
                }
                if write { FdKind::PipeWrite } else { FdKind::PipeRead }
            } else {
                // Any other pipe moves if only processes of the tree hold it.
                let holders = ctx.holders.get_or_insert_with(pipe_holders).get(&target).map(Vec::as_slice).unwrap_or(&[]);
                if let Some(outside) = holders.iter().find(|p| !ctx.members.contains(p)) {
                    return refuse(&format!("a pipe to process {outside}, which is not one of the task's"));
                }
                FdKind::TreePipe { pipe: ctx.pipe(&target, &link), write, flags }
            }
        } else if target.starts_with("socket:") {
            let inode = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')).and_then(|n| n.parse::<u64>().ok());
            match inode.zip(ctx.reconnect.as_ref()).and_then(|(ino, r)| (r.0)(ino)) {
                Some((path, hello)) => FdKind::Reconnect { path, hello, flags },
                None => return refuse(SOCKET),
            }
        } else if target.ends_with(" (deleted)") {
            return refuse("a deleted file");
        } else {
            let meta = std::fs::metadata(&link).map_err(|e| MigrateError::Proc { path: link.clone(), source: e })?;
            let ft = meta.file_type();
            if ft.is_char_device() {
                let (major, minor) = (u64::from(libc::major(meta.rdev())), u64::from(libc::minor(meta.rdev())));
                match SANDBOX_DEVICES.iter().find(|d| (d.1, d.2) == (major, minor)) {
                    Some(d) => FdKind::Reopen { path: format!("/dev/{}", d.0), flags, offset: 0 },
                    // The task's terminal (its pty's slave, or /dev/tty): on
                    // the target it is the new pty, the restored process's
                    // controlling terminal, which /dev/tty opens.
                    None if is_terminal_device(major, minor) => FdKind::Reopen { path: "/dev/tty".into(), flags, offset: 0 },
                    None => return refuse("a device"),
                }
            } else if ft.is_file() || ft.is_dir() {
                FdKind::Reopen { path: inside(root, &target), flags, offset }
            } else if target.starts_with("anon_inode:") {
                return refuse("a kernel object (eventfd, epoll, timerfd, signalfd, inotify…) that cannot move yet");
            } else {
                return refuse("of a kind that cannot move");
            }
        };
        out.push(FdEntry { fd, kind });
    }
    Ok(out)
}

/// A pty slave (Unix98: majors 136-143) or `/dev/tty` (5, 0).
fn is_terminal_device(major: u64, minor: u64) -> bool {
    (136..=143).contains(&major) || (major, minor) == (5, 0)
}

/// A system call the thread was in, prepared for `rt_sigreturn` (which
/// does not restart calls): the kernel's own restart decision, applied now
/// (CRIU's `compel_get_task_regs`).
pub fn prepare_restart(r: &mut GpRegs) {
    const ERESTARTSYS: i64 = -512;
    const ERESTARTNOINTR: i64 = -513;
    const ERESTARTNOHAND: i64 = -514;
    const ERESTART_RESTARTBLOCK: i64 = -516;
    if r.orig_rax.cast_signed() < 0 {
        return;
    }
    match r.rax.cast_signed() {
        ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND => {
            r.rax = r.orig_rax;
            r.rip -= 2;
        }
        // The restart block is kernel state that does not move: the call
        // returns EINTR (a relative sleep reports what is left if asked).
        ERESTART_RESTARTBLOCK => r.rax = (-i64::from(libc::EINTR)).cast_unsigned(),
        _ => {}
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The XCR0 feature mask of this CPU (what XSAVE areas here may hold).
fn xcr0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: xgetbv(0) reads XCR0; every x86-64 CPU that XSAVEs has it,
    // and we only call it for an area larger than FXSAVE (so XSAVE is on).
    unsafe { core::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// The components a signal frame of an ordinary process carries, and that
/// frame's XSAVE size (standard format): XCR0 without the components behind
/// XFD (AMX tiles), which a process has only after asking for them
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). `rt_sigreturn` restores only the
/// legacy x87/SSE part from a frame larger than the process's own, which
/// lost every AVX-512 register on this CPU.
fn frame_features() -> (u64, usize) {
    let mut mask = xcr0();
    let mut size = FXSAVE_BYTES + 64; // legacy area + XSAVE header
    for i in 2..63u32 {
        if mask & (1 << i) == 0 {
            continue;
        }
        // CPUID leaf 0xD: the component's size (EAX), offset (EBX) and whether XFD covers it (ECX bit 2).
        let c = core::arch::x86_64::__cpuid_count(0xD, i);
        if c.ecx & (1 << 2) != 0 {
            mask &= !(1 << i); // XFD-capable: off unless the process asked for it
            continue;
        }
        size = size.max(c.ebx as usize + c.eax as usize);
    }
    (mask, size)
}

/// A thread's FPU area as a signal frame carries it: an XSAVE area (the
/// ptrace format keeps XCR0 where a frame has its software bytes) with its
/// software bytes and `FP_XSTATE_MAGIC2` after it, or a plain FXSAVE.
pub fn fpu_area(mut x: Vec<u8>) -> Vec<u8> {
    if x.len() <= FXSAVE_BYTES {
        x.resize(FXSAVE_BYTES, 0);
        return x;
    }
    let (features, size) = frame_features();
    let size = size.clamp(FXSAVE_BYTES + 64, x.len());
    x.truncate(size);
    // Components outside the frame are left in their initial state.
    let bv = u64::from_le_bytes(x[512..520].try_into().expect("8 bytes")) & features;
    x[512..520].copy_from_slice(&bv.to_le_bytes());
    let sw = FPX_SW_BYTES_OFFSET;
    // magic1, extended_size (area + magic2), xfeatures, xstate_size.
    x[sw..sw + 4].copy_from_slice(&FP_XSTATE_MAGIC1.to_le_bytes());
    x[sw + 4..sw + 8].copy_from_slice(&u32::try_from(size + 4).unwrap_or(u32::MAX).to_le_bytes());
    x[sw + 8..sw + 16].copy_from_slice(&features.to_le_bytes());
    x[sw + 16..sw + 20].copy_from_slice(&u32::try_from(size).unwrap_or(u32::MAX).to_le_bytes());
    x.extend_from_slice(&FP_XSTATE_MAGIC2.to_le_bytes());
    x
}

/// What the injected calls read, before the injection is cleaned up.
struct Inside {
    threads: Vec<ThreadState>,
    sigactions: SigactionTable,
    itimers: [ITimer; 3],
    timers: PosixTimers,
    brk: u64,
}

fn read_inside(f: &Frozen) -> Result<Inside> {
    let mut inj = Injector::new(f)?;
    let scratch = inj.scratch()?;
    let u64_at = |inj: &Injector<'_>, addr: u64| -> Result<u64> {
        Ok(u64::from_le_bytes(inj.read(addr, 8)?.try_into().expect("8 bytes")))
    };
    let mut threads = Vec::with_capacity(f.tids.len());
    for &tid in &f.tids {
        let mut regs = ptrace::get_regs(tid)?;
        prepare_restart(&mut regs);
        let fpu = fpu_area(ptrace::get_xstate(tid)?);
        let sigmask = ptrace::get_sigmask(tid)?;
        let mut pending = Vec::new();
        if let Some(i) = f.caught.get(&tid) {
            pending.push(*i);
        }
        pending.extend(ptrace::pending(tid, false)?);
        let (addr, len, sig) = ptrace::rseq(tid)?;
        let (head, rlen) = ptrace::robust_list(tid)?;
        inj.call(tid, libc::SYS_prctl, [libc::PR_GET_TID_ADDRESS as u64, scratch, 0, 0, 0, 0])?;
        let tid_address = u64_at(&inj, scratch)?;
        inj.call(tid, libc::SYS_sigaltstack, [0, scratch + 8, 0, 0, 0, 0])?;
        let ss = inj.read(scratch + 8, 24)?;
        let ss_flags = u64::from(u32_at(&ss, 8));
        let altstack = if ss_flags & libc::SS_DISABLE as u64 != 0 {
            AltStack::default()
        } else {
            AltStack {
                sp: u64::from_le_bytes(ss[0..8].try_into().expect("8 bytes")),
                flags: ss_flags,
                size: u64::from_le_bytes(ss[16..24].try_into().expect("8 bytes")),
            }
        };
        let core = ThreadCore {
            tid: ns_id(f.pid, tid)?,
            regs,
            tid_address,
            robust: RobustList { head, len: rlen },
            rseq: Rseq { addr, len, sig },
            sigmask,
            altstack,
            comm: thread_name(f.pid, tid),
        };
        threads.push(ThreadState { core, fpu, pending });
    }
    let pid = f.pid;
    let mut sigactions = SigactionTable::default();
    for (i, slot) in sigactions.0.iter_mut().enumerate() {
        inj.call(pid, libc::SYS_rt_sigaction, [i as u64 + 1, 0, scratch, 8, 0, 0])?;
        let b = inj.read(scratch, 32)?;
        let w = |k: usize| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
        *slot = Sigaction { handler: w(0), flags: w(1), restorer: w(2), mask: w(3) };
    }
    let mut itimers = [ITimer::default(); 3];
    for (which, slot) in itimers.iter_mut().enumerate() {
        inj.call(pid, libc::SYS_getitimer, [which as u64, scratch, 0, 0, 0, 0])?;
        let b = inj.read(scratch, 32)?;
        let w = |k: usize| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
        let interval = TimeVal { sec: w(0), usec: w(1) };
        let mut value = TimeVal { sec: w(2), usec: w(3) };
        if value == TimeVal::default() && interval != TimeVal::default() {
            // It fired and its SIGALRM is still queued: the kernel re-arms
            // a periodic timer only when that signal is taken, so it reads
            // as disarmed. It goes on ticking one interval after.
            value = interval;
        }
        *slot = ITimer { interval, value };
    }
    let mut timers = PosixTimers::default();
    for (listed, slot) in listed_timers(pid)?.iter().zip(timers.table.iter_mut()) {
        let tid = if listed.notify & SIGEV_THREAD_ID != 0 {
            let Some(&reader_tid) = f.tids.iter().find(|&&t| i64::from(t).cast_unsigned() == listed.tid) else {
                return Err(MigrateError::Unmovable(format!(
                    "POSIX timer {} signals thread {}, which is not one of the process's",
                    listed.id, listed.tid
                )));
            };
            ns_id(pid, reader_tid)?
        } else {
            0
        };
        inj.call(pid, libc::SYS_timer_gettime, [listed.id, scratch, 0, 0, 0, 0])?;
        let b = inj.read(scratch, 32)?;
        let w = |k: usize| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
        // A periodic timer that fired and whose signal still waits reads as
        // 1 ns left: it fires again right after the restore (the waiting
        // signal is queued again too). Its overrun count is not carried
        // (a restored timer starts with none).
        *slot = PosixTimer {
            id: listed.id,
            clock: listed.clock,
            notify: listed.notify,
            signo: listed.signo,
            sigval: listed.sigval,
            tid,
            interval: TimeSpec { sec: w(0), nsec: w(1) },
            remaining: TimeSpec { sec: w(2), nsec: w(3) },
        };
        timers.count += 1;
    }
    let brk = inj.call(pid, libc::SYS_brk, [0; 6])?;
    inj.finish()?;
    Ok(Inside { threads, sigactions, itimers, timers, brk })
}

/// What was read of a process while it ran, so that frozen only what
/// changed since is read again: both reads walk its page tables, whose
/// cost grows with its memory.
pub struct ReadAhead {
    pub pid: i32,
    /// Its memory map (`smaps`; see [`Layout::refresh`]).
    pub layout: Layout,
    /// Its regions with their page classes (`pagemap`), as read then.
    pub regions: Vec<Region>,
    /// Ranges every write to which since `regions` was read is in
    /// `written` (write tracking's, see [`crate::dirty::DirtyTracker`]).
    pub tracked: Vec<(u64, u64)>,
    /// Pages written since `regions` was read, sorted.
    pub written: Vec<u64>,
}

impl ReadAhead {
    /// The page classes of `now` (a region of the frozen process without
    /// its pages): those read while it ran, with the pages written since
    /// as `Fetch`. None if they may have changed otherwise: a region that
    /// is not the same one, not tracked whole, or a stack (its dead part
    /// below the stack pointer is only known frozen).
    pub fn classes(&self, now: &Region) -> Option<PageRuns> {
        if now.growsdown || matches!(&now.kind, RegionKind::Anonymous { name } if name == "[stack]") {
            return None;
        }
        let i = self.regions.binary_search_by_key(&now.start, |r| r.start).ok()?;
        let then = &self.regions[i];
        if (then.end, then.prot, then.shared, &then.kind) != (now.end, now.prot, now.shared, &now.kind) {
            return None;
        }
        let t = self.tracked.partition_point(|r| r.1 <= now.start);
        if !self.tracked.get(t).is_some_and(|r| r.0 <= now.start && now.end <= r.1) {
            return None;
        }
        let (from, to) = (self.written.partition_point(|&a| a < now.start), self.written.partition_point(|&a| a < now.end));
        let written = &self.written[from..to];
        if written.is_empty() {
            return Some(then.pages.clone());
        }
        let mut classes = then.pages.expand();
        for &a in written {
            if let Some(c) = usize::try_from((a - now.start) / starling_image::PAGE_SIZE).ok().and_then(|k| classes.get_mut(k)) {
                *c = PageClass::Fetch;
            }
        }
        let mut runs = PageRuns::default();
        classes.into_iter().for_each(|c| runs.push(c));
        Some(runs)
    }
}

/// The complete image of a frozen process tree (`frozen[i]` is the
/// process `members[i]`, as [`tree`] lists them). `ahead`: what was read
/// of them while they ran, by PID; a process without it is read whole.
pub fn capture(frozen: &[Frozen], members: &[Member], opts: &CaptureOptions, ahead: &[ReadAhead]) -> Result<Descriptor> {
    let mut ctx = TreeFds::new(members);
    ctx.reconnect.clone_from(&opts.reconnect);
    let mut images = Vec::with_capacity(frozen.len());
    for (f, (sid, pgid)) in frozen.iter().zip(sessions(members)?) {
        let mut d = capture_process(f, opts, &mut ctx, ahead.iter().find(|a| a.pid == f.pid))?;
        (d.process.core.sid, d.process.core.pgid) = (sid, pgid);
        images.push(d);
    }
    let mut images = images.into_iter();
    let mut root = images.next().ok_or(MigrateError::Gone(0))?;
    root.process.core.tpgid = foreground_group(members)?;
    root.descendants = members
        .iter()
        .skip(1)
        .zip(images)
        .map(|(m, d)| (u32::try_from(m.parent.unwrap_or(0)).unwrap_or(u32::MAX), d))
        .collect();
    root.pipes = ctx.pipes.iter().map(|(target, link)| pipe_content(target, link)).collect::<Result<_>>()?;
    log::info!(
        "pid {}: {} processes, {} pipes between them holding {} bytes",
        frozen[0].pid,
        members.len(),
        root.pipes.len(),
        root.pipes.iter().map(|p| p.data.len()).sum::<usize>()
    );
    root.validate()?;
    Ok(root)
}

/// The image of one frozen process (without descendants).
fn capture_process(f: &Frozen, opts: &CaptureOptions, ctx: &mut TreeFds, ahead: Option<&ReadAhead>) -> Result<Descriptor> {
    let pid = f.pid;
    listed_timers(pid)?;
    let fds = classify_fds(pid, &opts.root, ctx)?;
    let inside_state = read_inside(f)?;
    let leader_rsp = inside_state.threads[0].core.regs.rsp;
    let region_opts = RegionOptions { heuristics: opts.heuristics, stack_pointer: leader_rsp, check_inode: false, own_write_tracking: true };
    let layout = match ahead {
        Some(a) => a.layout.refresh(pid)?,
        None => Layout::read(pid)?,
    };
    let mut regions = regions_with(pid, &layout, region_opts, &mut |r| ahead.and_then(|a| a.classes(r)))?;
    for r in &mut regions {
        if let RegionKind::File { path, .. } = &mut r.kind {
            *path = inside(&opts.root, path);
        }
    }
    let (mut core, cwd, groups) = dump_process(pid, inside_state.brk)?;
    core.pid = inside_state.threads[0].core.tid;
    core.itimers = inside_state.itimers;
    core.timers = inside_state.timers;
    let cwd = inside(&opts.root, &cwd);
    let proc_err = |path: String| move |source| MigrateError::Proc { path, source };
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).map_err(proc_err(format!("/proc/{pid}/exe")))?;
    // An executable without a path is not set again: a remote-fork clone's
    // is its restorer's memfd (a program whose file was deleted has a
    // mapping of it, which the region dump refuses).
    let exe = exe.to_string_lossy();
    let exe = if exe.ends_with(" (deleted)") { String::new() } else { inside(&opts.root, &exe) };
    let auxv = std::fs::read(format!("/proc/{pid}/auxv")).map_err(proc_err(format!("/proc/{pid}/auxv")))?;
    let auxv = auxv.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().expect("chunks of 8"))).collect();
    let d = Descriptor {
        version: DESCRIPTOR_VERSION,
        regions,
        fds,
        threads: inside_state.threads,
        sigactions: inside_state.sigactions,
        process: ProcessState { core, cwd, groups, pending: ptrace::pending(pid, true)?, exe, auxv },
        descendants: Vec::new(),
        pipes: Vec::new(),
    };
    Ok(d)
}

#[cfg(test)]
// Test values (timer fields, small sizes) fit the types they are cast to.
#[allow(clippy::cast_sign_loss, clippy::cast_possible_wrap)]
mod tests {
    use super::*;

    #[test]
    fn restart_is_prepared_as_the_kernel_would() {
        let mut r = GpRegs { orig_rax: 202, rax: (-512i64) as u64, rip: 0x1002, ..GpRegs::default() };
        prepare_restart(&mut r);
        assert_eq!((r.rax, r.rip), (202, 0x1000), "ERESTARTSYS: the call runs again");
        let mut r = GpRegs { orig_rax: 35, rax: (-516i64) as u64, rip: 0x2002, ..GpRegs::default() };
        prepare_restart(&mut r);
        assert_eq!((r.rax as i64, r.rip), (-4, 0x2002), "RESTARTBLOCK: EINTR");
        let mut r = GpRegs { orig_rax: u64::MAX, rax: (-512i64) as u64, rip: 0x3002, ..GpRegs::default() };
        prepare_restart(&mut r);
        assert_eq!(r.rip, 0x3002, "not in a system call: untouched");
    }

    #[test]
    fn xsave_area_gets_signal_frame_bytes() {
        // As PTRACE_GETREGSET(NT_X86_XSTATE) gives it: XCR0 at 464, every component marked in use.
        let mut x = vec![0u8; 16 << 10];
        x[FPX_SW_BYTES_OFFSET..FPX_SW_BYTES_OFFSET + 8].copy_from_slice(&xcr0().to_le_bytes());
        x[512..520].copy_from_slice(&u64::MAX.to_le_bytes());
        let f = fpu_area(x);
        let size = u32_at(&f, FPX_SW_BYTES_OFFSET + 16) as usize;
        assert!((FXSAVE_BYTES + 64..16 << 10).contains(&size), "{size}");
        assert_eq!(f.len(), size + 4, "the area, then magic2");
        assert_eq!(u32_at(&f, FPX_SW_BYTES_OFFSET), FP_XSTATE_MAGIC1);
        assert_eq!(u32_at(&f, size), FP_XSTATE_MAGIC2);
        assert_eq!(u32_at(&f, FPX_SW_BYTES_OFFSET + 4) as usize, size + 4, "extended size");
        let features = u64::from_le_bytes(f[FPX_SW_BYTES_OFFSET + 8..FPX_SW_BYTES_OFFSET + 16].try_into().unwrap());
        assert_eq!(features & 0b111, 0b111 & xcr0(), "x87, SSE (and AVX where enabled) are carried");
        let bv = u64::from_le_bytes(f[512..520].try_into().unwrap());
        assert_eq!(bv & !features, 0, "no component in use that the frame does not carry");
        assert_eq!(fpu_area(vec![1u8; 300]).len(), FXSAVE_BYTES);
    }

    #[test]
    fn proc_timers_are_parsed_in_ascending_id_order() {
        // As Linux 6.18 shows a process's timers (newest first).
        let text = "ID: 2\nsignal: 12/0000000000001234\nnotify: none/pid.11697\nClockID: -6\n\
                    ID: 1\nsignal: 12/00000000deadbeef\nnotify: signal/tid.11698\nClockID: 0\n\
                    ID: 0\nsignal: 10/0000000000000000\nnotify: signal/pid.11697\nClockID: 1\n";
        let t = parse_timers(text).unwrap();
        assert_eq!(t.iter().map(|t| t.id).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(t[0], ListedTimer { id: 0, clock: 1, notify: 0, signo: 10, sigval: 0, tid: 0 });
        assert_eq!(t[1], ListedTimer { id: 1, clock: 0, notify: 4, signo: 12, sigval: 0xdead_beef, tid: 11698 });
        assert_eq!(t[2], ListedTimer { id: 2, clock: (-6i64) as u64, notify: 1, signo: 12, sigval: 0x1234, tid: 0 });
        assert!(parse_timers("").unwrap().is_empty());
        assert!(parse_timers("signal: 10/0\n").is_err(), "a field before any ID");
        assert!(parse_timers("ID: 0\nnotify: bogus/pid.1\n").is_err());
    }

    #[test]
    fn paths_are_made_relative_to_the_root() {
        let root = Path::new("/var/lib/starling/tasks/7/root");
        assert_eq!(inside(root, "/var/lib/starling/tasks/7/root/home/u/x"), "/home/u/x");
        assert_eq!(inside(root, "/var/lib/starling/tasks/7/root"), "/");
        assert_eq!(inside(root, "/etc/passwd"), "/etc/passwd", "shown relative to the process's own root");
        assert_eq!(inside(Path::new("/"), "/etc/passwd"), "/etc/passwd");
    }
}
