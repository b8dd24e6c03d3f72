//! The agent's side: have the zygote start the outer init, then signal, poll and wait.

use crate::program::TaskProgram;
use crate::{status, ExitStatus, SandboxSpec};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// A running sandbox. Dropping it without [`Sandboxed::wait`] kills the
/// sandbox (the outer init's lifeline closes) and reaps it.
#[derive(Debug)]
pub struct Sandboxed {
    /// The outer init: a child of this process (see [`crate::zygote`]).
    pid: u32,
    /// Read end of the status pipe (non-blocking): one record from the outer init.
    status_read: File,
    pidfd: Option<OwnedFd>,
    result: Option<ExitStatus>,
}

/// Start `spec` in a sandbox.
///
/// `exe` is the starling binary (the agent passes `/proc/self/exe`'s target).
/// The first call starts `exe __sandbox-init`, the zygote, which then forks
/// the outer init of this and every later sandbox as a child of this process
/// ([`crate::zygote`]): its stdio being `stdin`, `stdout` and `stderr`, the
/// spec in a memfd at fd 3 and the status pipe at fd 4. The outer init
/// starts a new session, so the task has no controlling terminal.
pub fn spawn(exe: &Path, spec: &SandboxSpec, stdin: OwnedFd, stdout: OwnedFd, stderr: OwnedFd) -> io::Result<Sandboxed> {
    spawn_inner(exe, spec, None, stdin, stdout, stderr)
}

/// As [`spawn`], but the task runs `program` (an open executable, e.g. a
/// memfd) with extra descriptors at fixed numbers; see [`crate::program`].
/// `spec.argv` is still the task's argv.
pub fn spawn_program(
    exe: &Path,
    spec: &SandboxSpec,
    program: TaskProgram,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
) -> io::Result<Sandboxed> {
    program.validate()?;
    spawn_inner(exe, spec, Some(program), stdin, stdout, stderr)
}

fn spawn_inner(
    exe: &Path,
    spec: &SandboxSpec,
    program: Option<TaskProgram>,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
) -> io::Result<Sandboxed> {
    spec.validate()?;
    let wire = program.as_ref().map(TaskProgram::wire);
    let encoded = bincode::serialize(&(spec, &wire)).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;

    let mut spec_file = File::from(memfd_create(c"starling-sandbox-spec", MemFdCreateFlag::MFD_CLOEXEC)?);
    spec_file.write_all(&encoded)?;
    // The child shares this open file description, hence its offset.
    spec_file.seek(SeekFrom::Start(0))?;

    let (status_read, status_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    // Only the read end (its own open file description) becomes non-blocking:
    // after reaping, the record is either already in the pipe or never coming.
    fcntl(status_read.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;

    // Placement: the cgroup files are opened here (the child only writes).
    let cgroup_files: Vec<File> = spec
        .placement
        .cgroup_procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .map_err(|e| io::Error::new(e.kind(), format!("joining the guest cgroup {}: {e}", p.display())))
        })
        .collect::<io::Result<_>>()?;
    let program_fds: Vec<RawFd> = program.as_ref().map(TaskProgram::sources).unwrap_or_default();
    let handoff = crate::zygote::Handoff {
        spec: spec_file.as_fd(),
        status: status_write.as_fd(),
        stdio: [stdin.as_fd(), stdout.as_fd(), stderr.as_fd()],
        cgroups: cgroup_files.iter().map(AsFd::as_fd).collect(),
        program: program_fds.iter().map(|&fd| unsafe_borrow(fd)).collect(),
        sched_idle: spec.placement.sched_idle,
        oom_score_adj: spec.placement.oom_score_adj.map(|v| v.to_string().into_bytes()),
    };
    let pid = crate::zygote::start_outer_init(exe, &handoff)?;
    drop(handoff);
    drop((status_write, spec_file, program, cgroup_files, stdin, stdout, stderr));

    let pidfd = pidfd_open(pid).ok();
    Ok(Sandboxed { pid, status_read: File::from(status_read), pidfd, result: None })
}

/// Borrow a raw descriptor owned by a live `OwnedFd` of the caller.
fn unsafe_borrow<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: only called on numbers of `OwnedFd`s in the `TaskProgram`,
    // which `spawn_inner` keeps alive until the child has been started.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.cast_signed(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh descriptor that nothing else owns
    // (pidfd_open sets close-on-exec itself).
    Ok(unsafe { OwnedFd::from_raw_fd(RawFd::try_from(fd).expect("pidfd_open returns an int")) })
}

/// SIGKILL the sandbox whose outer init is `outer` (an unreaped child of the
/// caller) so that it ends only once every process in it has ended.
///
/// The signal goes to the sandbox's PID 1 (the reaper, the outer init's
/// child): the kernel takes its whole PID namespace down (nested ones, such
/// as a hierarchical clone task's restorer namespace, included) before the
/// reaper's parent sees it die, and the outer init then reports
/// `Signal(SIGKILL)` and exits. Killing the outer init itself ended it at
/// once, while the namespace below was still dying: whoever waited on it
/// went on to tear down what those processes still used (a clone's fault
/// handler, whose loss made a clone fault on a zero page and die of SIGSEGV
/// instead of SIGKILL). With no reaper yet (the sandbox is still starting),
/// the outer init is killed, and the reaper follows by its parent-death
/// signal.
pub fn kill_sandbox(outer: u32) -> io::Result<()> {
    let outer_pid = i32::try_from(outer).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let children = std::fs::read_to_string(format!("/proc/{outer}/task/{outer}/children")).unwrap_or_default();
    let mut killed = false;
    for pid in children.split_whitespace().filter_map(|c| c.parse::<i32>().ok()) {
        // Pin the process first, then check it is still the outer init's
        // child: a pid read from /proc may have been reused meanwhile.
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let Ok(raw) = RawFd::try_from(raw) else { continue };
        if raw < 0 {
            continue;
        }
        // SAFETY: pidfd_open just returned this descriptor; nothing else owns it.
        let pidfd = unsafe { OwnedFd::from_raw_fd(raw) };
        if parent_of(pid) != Some(outer_pid) {
            continue;
        }
        // SAFETY: a signal number, no siginfo (NULL) and no flags, on the pidfd we own.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
        killed |= r == 0;
    }
    if killed {
        return Ok(());
    }
    // SAFETY: kill takes plain integers; the caller has not reaped `outer`.
    if unsafe { libc::kill(outer_pid, libc::SIGKILL) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The parent pid of `pid` (field 4 of /proc/PID/stat, after the command
/// name's closing parenthesis).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.get(stat.rfind(')')? + 1..)?.split_whitespace().nth(1)?.parse().ok()
}

impl Sandboxed {
    /// Pid of the outer `__sandbox-init` process (in the agent's PID namespace).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Send `signo` towards the task. SIGKILL kills the whole sandbox at once
    /// (the outer init dies, and with it everything below) and is reported as
    /// `Signal(9)`. SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2,
    /// SIGALRM, SIGWINCH and SIGCONT are relayed by both inits to the task;
    /// any other signal is refused (`InvalidInput`), since it would hit only
    /// the outer init.
    pub fn signal(&self, signo: i32) -> io::Result<()> {
        if signo != libc::SIGKILL && !crate::is_relayed(signo) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("signal {signo} cannot be relayed to a task")));
        }
        if self.result.is_some() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        if signo == libc::SIGKILL {
            return kill_sandbox(self.pid);
        }
        // SAFETY: kill takes plain integers; the pid is our unreaped child,
        // so it cannot have been reused by another process.
        if unsafe { libc::kill(self.pid.cast_signed(), signo) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A pidfd of the outer init: it becomes readable when the sandbox has
    /// ended, so an async caller can wrap it in `tokio::io::unix::AsyncFd`
    /// and then call [`Sandboxed::try_wait`]. `None` on kernels without pidfd.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|fd| fd.as_fd())
    }

    /// Block until the sandbox has ended; returns the task's status.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(st) = self.result {
            return Ok(st);
        }
        let raw = self.reap(None)?;
        Ok(self.finish(raw))
    }

    /// The task's status if the sandbox has ended, without blocking.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if let Some(st) = self.result {
            return Ok(Some(st));
        }
        Ok(match self.reap(Some(WaitPidFlag::WNOHANG))? {
            WaitStatus::StillAlive => None,
            raw => Some(self.finish(raw)),
        })
    }

    /// waitpid on the outer init (our child), retried on EINTR.
    fn reap(&self, flags: Option<WaitPidFlag>) -> io::Result<WaitStatus> {
        let pid = Pid::from_raw(self.pid.cast_signed());
        loop {
            match waitpid(pid, flags) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => return other.map_err(io::Error::from),
            }
        }
    }

    /// Combine the outer init's own wait status with its status record.
    fn finish(&mut self, raw: WaitStatus) -> ExitStatus {
        let mut record = [0u8; status::RECORD_LEN];
        let mut got = 0;
        while got < record.len() {
            match self.status_read.read(&mut record[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break, // WouldBlock: no record was written
            }
        }
        let st = status::decode(&record[..got]).unwrap_or(match raw {
            // Killed before it could report (e.g. `signal(SIGKILL)`).
            WaitStatus::Signaled(_, sig, _) => ExitStatus::Signal(sig as i32),
            WaitStatus::Exited(_, code) => ExitStatus::Code(code),
            _ => ExitStatus::Code(crate::EXIT_SETUP_FAILED),
        });
        self.result = Some(st);
        st
    }
}

impl Drop for Sandboxed {
    fn drop(&mut self) {
        if self.result.is_none() {
            // Killing the outer init takes the whole namespace down with it
            // (PDEATHSIG below it); then reap it so no zombie is left.
            // SAFETY: kill takes plain integers; the outer init is our
            // unreaped child, so its pid cannot have been reused.
            unsafe { libc::kill(self.pid.cast_signed(), libc::SIGKILL) };
            let _ = self.reap(None);
        }
    }
}
