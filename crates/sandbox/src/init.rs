//! The sandbox's side: the outer init, the reaper (PID 1) and the task (PID 2).
//!
//! Everything here runs in forks of the single-threaded `__sandbox-init`
//! zygote, which is what makes `fork()` followed by ordinary Rust
//! (allocation included) sound.

use crate::program::ProgramWire;
use crate::{status, ExitStatus, SandboxSpec, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, EXIT_SETUP_FAILED, RELAYED, SPEC_FD, STATUS_FD};
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::mount::{mount, MsFlags};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, sigaction, SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::Mode;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{chdir, chroot, fork, getpid, getppid, setgid, setgroups, setsid, setuid, ForkResult, Gid, Pid, Uid};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Host devices made visible in the sandbox's `/dev`, with their numbers
/// for when the host's node cannot be bind-mounted.
const DEVICES: [(&str, u64, u64); 6] =
    [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// Upper bound on a serialized spec (argv + env are bounded by ARG_MAX anyway).
const MAX_SPEC_BYTES: u64 = 64 << 20;

/// Report a setup failure on the task's stderr and give up with status 125.
fn die(msg: impl std::fmt::Display) -> ! {
    let _ = writeln!(std::io::stderr(), "starling: {msg}");
    std::process::exit(EXIT_SETUP_FAILED)
}

/// The outer init, in a child of the zygote; never returns.
///
/// Reads the spec from fd 3, sets the namespaces up, supervises PID 1 and
/// finally writes the task's status record to fd 4 and exits with the
/// shell-style code (`n`, or `128 + signal`).
pub(crate) fn outer_init_main() -> ! {
    let status = outer_init();
    std::process::exit(status.shell_code())
}

/// The outer init: never panics on bad input, always ends in a status.
fn outer_init() -> ExitStatus {
    if fcntl(SPEC_FD, FcntlArg::F_GETFD).is_err() || fcntl(STATUS_FD, FcntlArg::F_GETFD).is_err() {
        die("__sandbox-init is internal: it is started by the starling agent with the spec on fd 3")
    }
    // SAFETY: both descriptors were just checked to be open; the agent
    // handed them to this process and nothing else in it owns them.
    let (spec_fd, status_fd) = unsafe { (OwnedFd::from_raw_fd(SPEC_FD), OwnedFd::from_raw_fd(STATUS_FD)) };
    for fd in [&spec_fd, &status_fd] {
        let _ = fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
    }
    let report = |st: ExitStatus| -> ExitStatus {
        // A 5-byte write to a pipe is atomic; if the agent is gone, so be it.
        let _ = nix::unistd::write(&status_fd, &status::encode(st));
        st
    };

    let (spec, program) = match read_spec(spec_fd) {
        Ok(spec) => spec,
        Err(msg) => {
            close_from(STATUS_FD + 1);
            let _ = writeln!(std::io::stderr(), "starling: {msg}");
            return report(ExitStatus::Code(EXIT_SETUP_FAILED));
        }
    };
    // Whatever else the agent leaked must not keep pipes open for the
    // lifetime of this sandbox, nor reach the task (the program extension's
    // descriptors sit right above the status pipe).
    close_from(STATUS_FD + 1 + crate::program::count(&program));
    match start_and_supervise(&spec, &program, &status_fd) {
        Ok(Some(st)) => report(st),
        // The agent is gone: nobody is left to report to.
        Ok(None) => ExitStatus::Signal(libc::SIGKILL),
        Err(msg) => {
            let _ = writeln!(std::io::stderr(), "starling: {msg}");
            report(ExitStatus::Code(EXIT_SETUP_FAILED))
        }
    }
}

fn read_spec(fd: OwnedFd) -> Result<(SandboxSpec, Option<ProgramWire>), String> {
    let mut bytes = Vec::new();
    File::from(fd)
        .take(MAX_SPEC_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read the sandbox spec: {e}"))?;
    let (spec, program): (SandboxSpec, Option<ProgramWire>) =
        bincode::deserialize(&bytes).map_err(|e| format!("malformed sandbox spec: {e}"))?;
    spec.validate().map_err(|e| format!("invalid sandbox spec: {e}"))?;
    Ok((spec, program))
}

fn relayed_and_chld() -> SigSet {
    let mut set = SigSet::empty();
    for s in RELAYED {
        set.add(s);
    }
    set.add(Signal::SIGCHLD);
    set
}

/// Create the namespaces, fork PID 1 and relay signals to it until it ends.
/// `Ok(None)` means the agent went away and the sandbox was killed.
fn start_and_supervise(
    spec: &SandboxSpec,
    program: &Option<ProgramWire>,
    status_fd: &OwnedFd,
) -> Result<Option<ExitStatus>, String> {
    // Blocked before the fork so none is lost: they queue until read from a
    // signalfd, and a blocked signal reaches a namespace's PID 1 even
    // though it has no handler.
    let mask = relayed_and_chld();
    mask.thread_block().map_err(|e| format!("cannot block signals: {e}"))?;
    let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| format!("signalfd: {e}"))?;

    let mut flags = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWIPC;
    if spec.hostname.is_some() {
        flags |= CloneFlags::CLONE_NEWUTS;
    }
    unshare(flags).map_err(|e| format!("cannot create the sandbox namespaces: {e}"))?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(|e| format!("cannot make mounts private: {e}"))?;

    let (report_read, report_write) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("cannot create the report pipe: {e}"))?;
    // SAFETY: this process is single-threaded (a fork of the single-threaded
    // zygote, which never starts a thread), so the child may run arbitrary code.
    let pid1 = match unsafe { fork() } {
        Err(e) => return Err(format!("cannot fork the sandbox's init: {e}")),
        Ok(ForkResult::Child) => {
            // The reaper keeps only what it needs: the report pipe's write end.
            drop(sigfd);
            drop(report_read);
            // SAFETY: STATUS_FD is the agent's status pipe, owned by the outer
            // init's `OwnedFd`; closing the child's copy does not touch the
            // parent's, and the child never uses that `OwnedFd` again.
            unsafe { libc::close(status_fd.as_raw_fd()) };
            reaper_main(spec, program, report_write)
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    crate::program::close_copies(program);
    if spec.terminal.is_some() {
        // Our stdin is the agent's terminal line: only PID 1 may answer on it,
        // and the agent must see it close if PID 1 dies without answering.
        null_stdin();
    }
    drop(report_write);
    fcntl(report_read.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).map_err(|e| format!("fcntl: {e}"))?;
    let mut report = File::from(report_read);
    let mut record = Vec::new();
    // Whether PID 1 may still write its report. Once its end is closed (PID 1
    // is exiting) the pipe is left out of the poll: it would report POLLHUP
    // on every call, and this loop would spin for as long as PID 1's exit
    // takes (its mount namespace being torn down), until SIGCHLD.
    let mut report_open = true;

    loop {
        let mut fds = vec![
            PollFd::new(sigfd.as_fd(), PollFlags::POLLIN),
            // A pipe's write end reports POLLERR once no reader is left:
            // the agent has died or dropped its `Sandboxed`.
            PollFd::new(status_fd.as_fd(), PollFlags::empty()),
        ];
        if report_open {
            fds.push(PollFd::new(report.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                let _ = kill(pid1, Signal::SIGKILL);
                return Err(format!("poll: {e}"));
            }
        }
        let ready = |i: usize| fds.get(i).and_then(|f| f.revents()).unwrap_or(PollFlags::empty());
        let (signals_ready, agent_gone, report_ready) = (
            !ready(0).is_empty(),
            ready(1).intersects(PollFlags::POLLERR | PollFlags::POLLHUP),
            ready(2),
        );
        if agent_gone {
            let _ = kill(pid1, Signal::SIGKILL);
            let _ = waitpid(pid1, None);
            return Ok(None);
        }
        if !report_ready.is_empty() {
            drain(&mut report, &mut record);
            report_open = !report_ready.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
        }
        if signals_ready {
            while let Ok(Some(info)) = sigfd.read_signal() {
                let signo = info.ssi_signo.cast_signed();
                if signo != libc::SIGCHLD {
                    // SAFETY: kill takes plain integers; pid1 is our unreaped child.
                    unsafe { libc::kill(pid1.as_raw(), signo) };
                }
            }
            match waitpid(pid1, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {}
                Ok(ws) => {
                    drain(&mut report, &mut record);
                    return Ok(Some(status::decode(&record).unwrap_or_else(|| unreported_pid1_status(ws))));
                }
                Err(e) => return Err(format!("waitpid: {e}")),
            }
        }
    }
}

/// Read whatever the (non-blocking) pipe holds, up to one record.
fn drain(pipe: &mut File, record: &mut Vec<u8>) {
    let mut buf = [0u8; status::RECORD_LEN];
    while record.len() < status::RECORD_LEN {
        match pipe.read(&mut buf[..status::RECORD_LEN - record.len()]) {
            Ok(0) | Err(_) => break,
            Ok(n) => record.extend_from_slice(&buf[..n]),
        }
    }
}

/// PID 1 ended without reporting: it was killed from outside, or crashed.
fn unreported_pid1_status(ws: WaitStatus) -> ExitStatus {
    match ws {
        WaitStatus::Signaled(_, sig, _) => ExitStatus::Signal(sig as i32),
        WaitStatus::Exited(_, code) => ExitStatus::Code(code),
        _ => ExitStatus::Code(EXIT_SETUP_FAILED),
    }
}

/// PID 1 of the new namespace: prepare the root, start the task, reap
/// everything, relay signals, report the task's status.
fn reaper_main(spec: &SandboxSpec, program: &Option<ProgramWire>, report_write: OwnedFd) -> ! {
    // Armed first, then checked: if the outer init died before the death
    // signal was armed, its end of the report pipe is already closed.
    // (getppid() cannot tell: a parent outside our PID namespace reads as 0.)
    let armed = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_ok();
    let mut fds = [PollFd::new(report_write.as_fd(), PollFlags::empty())];
    let outer_gone = matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0);
    if !armed || outer_gone {
        std::process::exit(EXIT_SETUP_FAILED)
    }
    let mut report = File::from(report_write);
    let mut exit_with = |st: ExitStatus| -> ! { report_and_exit(&mut report, st) };
    if let Err(msg) = prepare_root(spec) {
        let _ = writeln!(std::io::stderr(), "starling: {msg}");
        exit_with(ExitStatus::Code(EXIT_SETUP_FAILED))
    }
    // Blocking reads: PID 1 has nothing else to do but wait for signals.
    let sigfd = match SignalFd::with_flags(&relayed_and_chld(), SfdFlags::SFD_CLOEXEC) {
        Ok(fd) => fd,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "starling: signalfd: {e}");
            exit_with(ExitStatus::Code(EXIT_SETUP_FAILED))
        }
    };
    // A terminal task: the pty is made here, in the sandbox's own devpts,
    // and its master goes to the agent on our stdin (see crate::terminal).
    let slave = match &spec.terminal {
        None => None,
        Some(term) => match start_terminal(spec, term) {
            Ok(slave) => Some(slave),
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "starling: {e}");
                exit_with(ExitStatus::Code(EXIT_SETUP_FAILED))
            }
        },
    };
    let reaper_pid = getpid();
    // SAFETY: PID 1 is a fork of a single-threaded process and started no
    // thread, so the child may run arbitrary code.
    let task = match unsafe { fork() } {
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "starling: cannot fork the task: {e}");
            exit_with(ExitStatus::Code(EXIT_SETUP_FAILED))
        }
        Ok(ForkResult::Child) => {
            drop(sigfd);
            task_main(spec, program, reaper_pid, slave)
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    // The task holds the terminal now: its end (EIO on the master) is the task's.
    drop(slave);
    crate::program::close_copies(program);
    loop {
        let signo = match sigfd.read_signal() {
            Ok(Some(info)) => info.ssi_signo.cast_signed(),
            Ok(None) | Err(Errno::EINTR) | Err(Errno::EAGAIN) => continue,
            Err(e) => {
                let _ = kill(task, Signal::SIGKILL);
                let _ = writeln!(std::io::stderr(), "starling: reading signals: {e}");
                exit_with(ExitStatus::Code(EXIT_SETUP_FAILED))
            }
        };
        if signo != libc::SIGCHLD {
            // SAFETY: kill takes plain integers; the task is our child and is
            // reaped only by this loop, so its pid cannot be reused meanwhile.
            unsafe { libc::kill(task.as_raw(), signo) };
            continue;
        }
        // Signals coalesce: reap every child that is ready, orphans included.
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == task => task_ended(ExitStatus::Code(code), &mut report),
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == task => {
                    task_ended(ExitStatus::Signal(sig as i32), &mut report)
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    }
}

/// Make the task's pty and send its master to the agent; returns the slave.
fn start_terminal(spec: &SandboxSpec, term: &starling_proto::TerminalSize) -> Result<OwnedFd, crate::TerminalError> {
    let owner = if spec.rootless { None } else { Some(spec.uid) };
    let (master, slave) = crate::terminal::open_pty(term, owner)?;
    // SAFETY: fd 0 is the agent's terminal line, open for this process's life.
    let line = unsafe { std::os::fd::BorrowedFd::borrow_raw(0) };
    crate::terminal::send_fd(line, master.as_fd())?;
    drop(master);
    null_stdin();
    Ok(slave)
}

/// Put /dev/null on fd 0 (closing what was there).
fn null_stdin() {
    // SAFETY: open(2) of a literal path; dup2 onto fd 0, which no owned
    // value in this process holds; then the temporary descriptor is closed.
    unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::dup2(fd, 0);
            libc::close(fd);
        } else {
            libc::close(0);
        }
    }
}

/// The task is gone: end the rest of the namespace with it and report.
fn task_ended(st: ExitStatus, report: &mut File) -> ! {
    // From a namespace's PID 1, kill(-1) reaches every other process in it;
    // PID 1's own exit would too, but this way they die before the report.
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    report_and_exit(report, st)
}

/// PID 1's last act: hand the task's status to the outer init.
fn report_and_exit(report: &mut File, st: ExitStatus) -> ! {
    let _ = report.write_all(&status::encode(st));
    std::process::exit(0)
}

/// Mount /proc and a minimal /dev in the root, set the host name, chroot.
fn prepare_root(spec: &SandboxSpec) -> Result<(), String> {
    let root = &spec.root;
    if !root.is_dir() {
        return Err(format!("sandbox root {} is not a directory", root.display()));
    }
    let mount_point = |name: &str| -> Result<PathBuf, String> {
        let p = root.join(name);
        if p.is_dir() {
            Ok(p)
        } else {
            Err(format!("sandbox root {} has no /{name} directory to mount on", root.display()))
        }
    };
    let proc_dir = mount_point("proc")?;
    let dev = mount_point("dev")?;
    let nosuid_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;

    mount(Some("proc"), &proc_dir, Some("proc"), nosuid_noexec | MsFlags::MS_NODEV, None::<&str>)
        .map_err(|e| format!("cannot mount proc on {}: {e}", proc_dir.display()))?;
    // No MS_NODEV here: the device nodes below must work.
    mount(Some("tmpfs"), &dev, Some("tmpfs"), nosuid_noexec, Some("mode=755,size=1m"))
        .map_err(|e| format!("cannot mount a tmpfs on {}: {e}", dev.display()))?;
    for (name, major, minor) in DEVICES {
        add_device(&dev, name, major, minor)?;
    }
    // Without root, a clone's restorer makes its userfaultfd through the device (which an admin
    // granted the agent's user); the task gains nothing its user did not already have.
    if spec.rootless && Path::new("/dev/userfaultfd").exists() {
        add_device(&dev, "userfaultfd", 10, 257)?;
    }
    let pts = dev.join("pts");
    mkdir(&pts, 0o755)?;
    let pts_options = if spec.rootless { "newinstance,ptmxmode=0666,mode=0620" } else { "newinstance,ptmxmode=0666,mode=0620,gid=5" };
    mount(Some("devpts"), &pts, Some("devpts"), nosuid_noexec, Some(pts_options))
        .map_err(|e| format!("cannot mount devpts on {}: {e}", pts.display()))?;
    let shm = dev.join("shm");
    mkdir(&shm, 0o1777)?;
    mount(Some("tmpfs"), &shm, Some("tmpfs"), nosuid_noexec | MsFlags::MS_NODEV, Some("mode=1777"))
        .map_err(|e| format!("cannot mount a tmpfs on {}: {e}", shm.display()))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(link)).map_err(|e| format!("cannot create /dev/{link}: {e}"))?;
    }

    if let Some(name) = &spec.hostname {
        nix::unistd::sethostname(name).map_err(|e| format!("cannot set the host name to {name:?}: {e}"))?;
    }
    chroot(root).map_err(|e| format!("cannot chroot into {}: {e}", root.display()))?;
    chdir("/").map_err(|e| format!("cannot enter the sandbox root: {e}"))?;
    Ok(())
}

fn mkdir(path: &Path, mode: u32) -> Result<(), String> {
    std::fs::create_dir(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    // Set explicitly: the inherited umask would have trimmed the mode.
    nix::sys::stat::fchmodat(None, path, Mode::from_bits_truncate(mode), nix::sys::stat::FchmodatFlags::FollowSymlink)
        .map_err(|e| format!("cannot chmod {}: {e}", path.display()))
}

/// Give the sandbox `/dev/name`: bind-mount the host's node (works wherever
/// this process may mount), else create the node.
fn add_device(dev: &Path, name: &str, major: u64, minor: u64) -> Result<(), String> {
    let target = dev.join(name);
    let host = Path::new("/dev").join(name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&target)
        .map_err(|e| format!("cannot create {}: {e}", target.display()))?;
    if mount(Some(&host), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>).is_ok() {
        return Ok(());
    }
    std::fs::remove_file(&target).map_err(|e| format!("cannot replace {}: {e}", target.display()))?;
    nix::sys::stat::mknod(
        &target,
        nix::sys::stat::SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(major, minor),
    )
    .map_err(|e| format!("cannot provide /dev/{name}: {e}"))?;
    nix::sys::stat::fchmodat(None, &target, Mode::from_bits_truncate(0o666), nix::sys::stat::FchmodatFlags::FollowSymlink)
        .map_err(|e| format!("cannot chmod {}: {e}", target.display()))
}

/// Close every descriptor from `first` up.
fn close_from(first: RawFd) {
    // SAFETY: close_range only closes descriptors; callers own every
    // descriptor at or above `first` (nothing above is wrapped in a live
    // `OwnedFd` at that point).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first.cast_unsigned(), libc::c_uint::MAX, 0 as libc::c_uint) };
    if rc < 0 {
        // Kernels before 5.9: close them one by one.
        // SAFETY: sysconf has no memory arguments.
        let max = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(1024, 1 << 20) as RawFd;
        for fd in first..max {
            // SAFETY: as above; EBADF for unused numbers is harmless.
            unsafe { libc::close(fd) };
        }
    }
}

/// PID 2: become the client, then exec the command. Never returns.
fn task_main(spec: &SandboxSpec, program: &Option<ProgramWire>, reaper_pid: Pid, terminal: Option<OwnedFd>) -> ! {
    // A terminal task: its own session, the pty its controlling terminal on 0/1/2.
    // A moved terminal task's restorer only gets the slave on 0/1/2: the
    // restored process makes it its controlling terminal in its own session
    // (PLAN_FLAG_TERMINAL), which must find no session holding it.
    if let Some(slave) = terminal {
        let made = if spec.confinement == crate::Confinement::Restorer {
            crate::terminal::put_on_stdio(&slave)
        } else {
            crate::terminal::make_controlling(&slave, false)
        };
        if let Err(e) = made {
            die(e)
        }
    }
    // Only the three stdio descriptors may reach the task (plus, for the
    // program extension, its descriptors at their fixed numbers).
    let program_fd = match program {
        None => {
            close_from(3);
            None
        }
        Some(w) => match crate::program::install(w) {
            Ok(fd) => Some(fd),
            Err(e) => die(e),
        },
    };
    if nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_err() || getppid() != reaper_pid {
        std::process::exit(EXIT_SETUP_FAILED)
    }
    let _ = setsid();
    for &(resource, soft, hard) in &spec.rlimits {
        set_rlimit(resource, soft, hard);
    }
    let confined = spec.confinement == crate::Confinement::Task;
    // Built before anything is dropped, so a failure is reported plainly.
    let filter = if confined { Some(crate::harden::task_filter().unwrap_or_else(|e| die(e))) } else { None };
    let drop_caps = confined && spec.uid != 0;
    if drop_caps {
        // Still root here: the bounding set needs CAP_SETPCAP to shrink.
        if let Err(e) = crate::harden::drop_privileged_sets() {
            die(e)
        }
    }
    if spec.no_network_admin {
        if let Err(e) = crate::harden::drop_network_admin() {
            die(e)
        }
    }
    // A rootless agent's tasks keep its ids (the only ones its user namespace has).
    if !spec.rootless {
        let groups: Vec<Gid> = spec.groups.iter().map(|&g| Gid::from_raw(g)).collect();
        if let Err(e) = setgroups(&groups) {
            die(format_args!("cannot set supplementary groups {:?}: {e}", spec.groups))
        }
        if let Err(e) = setgid(Gid::from_raw(spec.gid)) {
            die(format_args!("cannot set gid {}: {e}", spec.gid))
        }
        if let Err(e) = setuid(Uid::from_raw(spec.uid)) {
            die(format_args!("cannot set uid {}: {e}", spec.uid))
        }
    }
    nix::sys::stat::umask(Mode::from_bits_truncate(spec.umask as libc::mode_t));
    // After dropping credentials: entering the directory is checked as the client.
    let cwd = if spec.cwd.is_empty() { &b"/"[..] } else { &spec.cwd[..] };
    if let Err(e) = chdir(OsStr::from_bytes(cwd)) {
        die(format_args!("cannot change directory to {}: {}", String::from_utf8_lossy(cwd), e.desc()))
    }

    let argv: Vec<CString> = spec.argv.iter().map(|a| CString::new(a.clone()).unwrap_or_default()).collect();
    let envp: Vec<CString> = spec
        .env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone();
            kv.push(b'=');
            kv.extend_from_slice(v);
            CString::new(kv).unwrap_or_default()
        })
        .collect();
    let path_var = spec.env_var(b"PATH").unwrap_or(b"/bin:/usr/bin");

    if drop_caps {
        if let Err(e) = crate::harden::clear_capabilities() {
            die(e)
        }
    }
    if let Some(filter) = &filter {
        if let Err(e) = crate::harden::install_filter(filter) {
            die(e)
        }
    }

    restore_default_signals();
    let (code, why) = match program_fd {
        Some(fd) => (EXIT_NOT_EXECUTABLE, crate::program::exec_program(fd, &argv, &envp).desc().to_string()),
        None => exec_command(&argv, &envp, path_var),
    };
    let _ = writeln!(std::io::stderr(), "starling: {}: {why}", String::from_utf8_lossy(&spec.argv[0]));
    std::process::exit(code)
}

/// Apply one rlimit. Raising a hard limit needs CAP_SYS_RESOURCE, which a
/// host may lack: then the request is clamped to the host's hard limit
/// rather than refusing to run the task.
fn set_rlimit(resource: u32, soft: u64, hard: u64) {
    let wanted = libc::rlimit { rlim_cur: soft.min(hard), rlim_max: hard };
    // SAFETY: the pointer is to a live, initialised rlimit on our stack.
    if unsafe { libc::setrlimit(resource as _, &wanted) } == 0 {
        return;
    }
    let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: the pointer is to a live rlimit on our stack, filled by the call.
    if unsafe { libc::getrlimit(resource as _, &mut current) } != 0 {
        return; // unknown resource: nothing to clamp to
    }
    let hard = hard.min(current.rlim_max);
    let clamped = libc::rlimit { rlim_cur: soft.min(hard), rlim_max: hard };
    // SAFETY: as above.
    unsafe { libc::setrlimit(resource as _, &clamped) };
}

/// Undo what the init processes changed: Rust's runtime ignores SIGPIPE and
/// the inits block the relayed signals; the task must start like any
/// freshly exec'd program, with default dispositions and nothing blocked.
fn restore_default_signals() {
    let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    for sig in Signal::iterator() {
        if sig != Signal::SIGKILL && sig != Signal::SIGSTOP {
            // SAFETY: installing SIG_DFL involves no handler code at all.
            let _ = unsafe { sigaction(sig, &default) };
        }
    }
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
}

/// execvpe(3) with the task's own PATH, resolved inside the chroot. Returns
/// only on failure, with the shell-like status and message.
fn exec_command(argv: &[CString], envp: &[CString], path_var: &[u8]) -> (i32, String) {
    let name = argv[0].as_bytes();
    if name.is_empty() {
        return (EXIT_NOT_FOUND, "command not found".into());
    }
    if name.contains(&b'/') {
        let err = exec_file(&argv[0], argv, envp);
        let code = if err == Errno::ENOENT { EXIT_NOT_FOUND } else { EXIT_NOT_EXECUTABLE };
        return (code, err.desc().into());
    }
    let mut saw_eacces = false;
    for dir in path_var.split(|&c| c == b':') {
        // An empty PATH entry means the current directory, as in execvp.
        let mut candidate = if dir.is_empty() { b".".to_vec() } else { dir.to_vec() };
        candidate.push(b'/');
        candidate.extend_from_slice(name);
        let Ok(candidate) = CString::new(candidate) else { continue };
        match exec_file(&candidate, argv, envp) {
            Errno::EACCES => saw_eacces = true,
            Errno::ENOENT | Errno::ENOTDIR | Errno::ESTALE | Errno::ENODEV | Errno::ETIMEDOUT | Errno::ELOOP
            | Errno::ENAMETOOLONG => {}
            other => return (EXIT_NOT_EXECUTABLE, other.desc().into()),
        }
    }
    if saw_eacces {
        (EXIT_NOT_EXECUTABLE, Errno::EACCES.desc().into())
    } else {
        (EXIT_NOT_FOUND, "command not found".into())
    }
}

/// execve `path`; a file without a binary format is run by /bin/sh, as
/// execvp does. Returns the error when nothing could be executed.
fn exec_file(path: &CString, argv: &[CString], envp: &[CString]) -> Errno {
    let err = match nix::unistd::execve(path, argv, envp) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    if err != Errno::ENOEXEC {
        return err;
    }
    let mut sh_argv = vec![c"/bin/sh".to_owned(), path.clone()];
    sh_argv.extend_from_slice(&argv[1..]);
    match nix::unistd::execve(c"/bin/sh", &sh_argv, envp) {
        Err(_) => Errno::ENOEXEC,
        Ok(never) => match never {},
    }
}
