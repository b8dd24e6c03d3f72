//! Extension: a task whose program is an open file (e.g. an in-memory ELF)
//! and which receives extra descriptors at fixed numbers.
//!
//! Why: a remote-fork clone is a task whose program is the static restorer.
//! It is embedded in the agent, not a file of the client's view, and it
//! takes its restore plan on fd 3 and a socket to the agent's fault handler
//! on fd 4. The agent opens both (and a memfd holding the restorer) before
//! the sandbox chroots, so they travel as descriptors:
//!
//! ```text
//! agent ──fd 5 (program), fd 6.. (extras)──▶ outer init ──fork──▶ reaper ──fork──▶ task
//!                                                              task: extras → targets, execveat(program, AT_EMPTY_PATH)
//! ```
//!
//! Everything else about the task (namespaces, chroot, `/proc`, `/dev`,
//! credentials, cwd, umask, rlimits, status) is exactly as for `exec` tasks.

use nix::fcntl::{fcntl, FcntlArg};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Where the outer init finds the program descriptor; extras follow it.
pub(crate) const PROGRAM_FD: RawFd = 5;
/// Most extra descriptors (they are parked at 6..=9, below the spawn's
/// parking area).
pub const MAX_EXTRA_FDS: usize = 4;

/// A count of descriptors as a descriptor offset (they are at most [`MAX_EXTRA_FDS`] + 1).
pub(crate) fn fd_count(n: usize) -> RawFd {
    RawFd::try_from(n).expect("a handful of descriptors")
}

/// What the agent hands over: the program and the extras (target number, fd).
#[derive(Debug)]
pub struct TaskProgram {
    /// An executable open file (a memfd with an ELF): run with `execveat(fd,
    /// "", AT_EMPTY_PATH)` instead of searching `argv[0]` under the root.
    pub program: OwnedFd,
    /// Descriptors the task receives at these numbers (each ≥ 3, distinct).
    pub fds: Vec<(RawFd, OwnedFd)>,
}

/// The part that travels in the encoded spec: targets of fds 6, 7, ...
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub(crate) struct ProgramWire {
    pub targets: Vec<RawFd>,
}

impl TaskProgram {
    pub(crate) fn validate(&self) -> io::Result<()> {
        let invalid = |what: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, what.to_string()));
        if self.fds.len() > MAX_EXTRA_FDS {
            return invalid("too many extra descriptors for the task");
        }
        let mut seen = Vec::new();
        for (target, _) in &self.fds {
            if *target < 3 || *target >= 100 || seen.contains(target) {
                return invalid("extra descriptor targets must be distinct numbers in 3..100");
            }
            seen.push(*target);
        }
        Ok(())
    }

    pub(crate) fn wire(&self) -> ProgramWire {
        ProgramWire { targets: self.fds.iter().map(|(t, _)| *t).collect() }
    }

    /// Raw numbers in the agent, in the order of fds 5, 6, ...
    pub(crate) fn sources(&self) -> Vec<RawFd> {
        std::iter::once(self.program.as_raw_fd()).chain(self.fds.iter().map(|(_, f)| f.as_raw_fd())).collect()
    }
}

/// Number of descriptors at 5.. the outer init holds for `wire`.
pub(crate) fn count(wire: &Option<ProgramWire>) -> RawFd {
    wire.as_ref().map_or(0, |w| 1 + fd_count(w.targets.len()))
}

/// In a fork child that no longer needs them (outer init, reaper): close
/// its copies, so the agent sees the task's end of a socket close with it.
pub(crate) fn close_copies(wire: &Option<ProgramWire>) {
    for fd in PROGRAM_FD..PROGRAM_FD + count(wire) {
        // SAFETY: these numbers hold only the inherited program/extras, which
        // nothing in this process wraps in a live owner.
        unsafe { libc::close(fd) };
    }
}

/// In the task (PID 2), instead of closing everything above stdio: move the
/// extras to their targets, keep the program (close-on-exec) and close the
/// rest. Returns the program's descriptor number.
pub(crate) fn install(wire: &ProgramWire) -> Result<RawFd, String> {
    const PARK: RawFd = 100;
    let mut parked = Vec::new();
    for (i, src) in (PROGRAM_FD..PROGRAM_FD + 1 + fd_count(wire.targets.len())).enumerate() {
        let p = fcntl(src, FcntlArg::F_DUPFD_CLOEXEC(PARK + fd_count(i)))
            .map_err(|e| format!("task descriptor {src} missing: {e}"))?;
        parked.push(p);
    }
    close_range(3, PARK - 1);
    for (&target, &p) in wire.targets.iter().zip(&parked[1..]) {
        // dup2 clears close-on-exec on the new number: the program keeps it.
        // SAFETY: plain descriptor numbers owned by this process.
        if unsafe { libc::dup2(p, target) } < 0 {
            return Err(format!("cannot place descriptor {target}: {}", io::Error::last_os_error()));
        }
    }
    let program = parked[0];
    close_range(program + 1, RawFd::MAX);
    Ok(program)
}

fn close_range(first: RawFd, last: RawFd) {
    // SAFETY: close_range only closes descriptors this process owns and that
    // nothing wraps in a live owner at this point (see `install`).
    unsafe { libc::syscall(libc::SYS_close_range, first.cast_unsigned(), last.cast_unsigned(), 0 as libc::c_uint) };
}

/// execveat(program, "", argv, envp, AT_EMPTY_PATH); returns only on failure.
pub(crate) fn exec_program(program: RawFd, argv: &[CString], envp: &[CString]) -> nix::errno::Errno {
    let mut a: Vec<*const libc::c_char> = argv.iter().map(|s| s.as_ptr()).collect();
    a.push(std::ptr::null());
    let mut e: Vec<*const libc::c_char> = envp.iter().map(|s| s.as_ptr()).collect();
    e.push(std::ptr::null());
    // SAFETY: argv/envp are NULL-terminated arrays of pointers to C strings
    // that outlive the call; "" with AT_EMPTY_PATH executes `program` itself.
    unsafe { libc::syscall(libc::SYS_execveat, program, c"".as_ptr(), a.as_ptr(), e.as_ptr(), libc::AT_EMPTY_PATH) };
    nix::errno::Errno::last()
}
