//! Freezing a process from outside: every thread seized and stopped.
//!
//! CRIU's way without a freezer cgroup: list `/proc/PID/task`, seize and
//! interrupt each thread, and list again until no new thread appears (a
//! running thread may create one until it is stopped itself).

use crate::ptrace::{self, Stop};
use crate::{MigrateError, Result};
use starling_image::abi::signal::SigInfo;
use std::collections::HashMap;

/// Passes over `/proc/PID/task` before giving up on a process that keeps
/// creating threads faster than they can be stopped.
const MAX_PASSES: usize = 16;

/// A process whose threads are all stopped under our ptrace.
#[derive(Debug)]
pub struct Frozen {
    /// Its PID (in our namespace).
    pub pid: i32,
    /// Its threads (in our namespace), the leader first.
    pub tids: Vec<i32>,
    /// Signals a thread was about to take when it stopped: dequeued by the
    /// kernel, so ours to keep (they go into the image as pending) or to
    /// deliver when we let go.
    pub caught: HashMap<i32, SigInfo>,
    released: bool,
}

/// The threads of `pid` (in our namespace).
pub fn threads(pid: i32) -> Result<Vec<i32>> {
    let dir = format!("/proc/{pid}/task");
    let mut tids: Vec<i32> = std::fs::read_dir(&dir)
        .map_err(|e| MigrateError::Proc { path: dir.clone(), source: e })?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    // The leader first.
    if let Some(i) = tids.iter().position(|&t| t == pid) {
        tids.remove(i);
        tids.insert(0, pid);
    }
    Ok(tids)
}

/// Whether thread `tid` of `pid` is gone or exiting (a zombie, dead).
fn exiting(pid: i32, tid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) {
        Err(_) => true,
        Ok(stat) => matches!(stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()), Some("Z" | "X" | "x")),
    }
}

impl Frozen {
    /// Stop every thread of `pid`.
    pub fn freeze(pid: i32) -> Result<Frozen> {
        let mut f = Frozen { pid, tids: Vec::new(), caught: HashMap::new(), released: false };
        // Threads found exiting: not ours to stop, not new either.
        let mut gone: Vec<i32> = Vec::new();
        for _ in 0..MAX_PASSES {
            let listed = threads(pid).map_err(|_| MigrateError::Gone(pid))?;
            let fresh: Vec<i32> = listed.into_iter().filter(|t| !f.tids.contains(t) && !gone.contains(t)).collect();
            if fresh.is_empty() {
                if f.tids.first() != Some(&pid) {
                    return Err(MigrateError::Gone(pid));
                }
                return Ok(f);
            }
            let mut seized = Vec::new();
            for tid in fresh {
                match ptrace::seize(tid).and_then(|_| ptrace::interrupt(tid)) {
                    Ok(()) => seized.push(tid),
                    // Exited meanwhile (EPERM: exiting right now).
                    Err(MigrateError::Ptrace { source, .. })
                        if source.raw_os_error() == Some(libc::ESRCH)
                            || (source.raw_os_error() == Some(libc::EPERM) && exiting(pid, tid)) =>
                    {
                        if tid == pid {
                            return Err(MigrateError::Gone(pid));
                        }
                        gone.push(tid);
                    }
                    Err(e) => return Err(e),
                }
            }
            for tid in seized {
                match ptrace::wait_stop(tid)? {
                    Stop::Event => f.tids.push(tid),
                    Stop::Signal(_) => {
                        f.caught.insert(tid, ptrace::get_siginfo(tid)?);
                        f.tids.push(tid);
                    }
                    Stop::Exited if tid == pid => return Err(MigrateError::Gone(pid)),
                    Stop::Exited => gone.push(tid),
                }
            }
            f.tids.sort_by_key(|&t| (t != pid, t));
        }
        Err(MigrateError::ThreadStorm(pid))
    }

    /// Let the process run on as if nothing happened (signals we caught
    /// are delivered).
    pub fn thaw(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut first = Ok(());
        for &tid in &self.tids {
            let sig = self.caught.get(&tid).map_or(0, |i| i.signo().cast_signed());
            if let Err(e) = ptrace::detach(tid, sig) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Kill the process (it moved away) and wait until its threads are gone.
    pub fn kill(mut self) {
        self.released = true;
        // SAFETY: kill takes plain integers; the process is ours to end.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        // Traced threads report their exit to us first; the leader only
        // once the others are gone, so it comes last.
        for &tid in self.tids.iter().filter(|&&t| t != self.pid) {
            while !matches!(ptrace::wait_stop(tid), Ok(Stop::Exited) | Err(_)) {
                let _ = ptrace::cont(tid, 0);
            }
        }
        if is_our_child(self.pid) {
            // Reaping it is its parent's business (our own caller's): only
            // wait until it has exited.
            let mut info: libc::siginfo_t = unsafe_zeroed_siginfo();
            // SAFETY: waitid writes a siginfo; WNOWAIT leaves the zombie.
            unsafe { libc::waitid(libc::P_PID, self.pid.cast_unsigned(), &mut info, libc::WEXITED | libc::WNOWAIT | libc::__WALL) };
        } else {
            // Released to its real parent (the sandbox's reaper).
            while !matches!(ptrace::wait_stop(self.pid), Ok(Stop::Exited) | Err(_)) {
                let _ = ptrace::cont(self.pid, 0);
            }
        }
    }
}

fn unsafe_zeroed_siginfo() -> libc::siginfo_t {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Whether `pid`'s parent is this process.
fn is_our_child(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
    ppid == Some(std::process::id())
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            log::warn!("migration: letting process {} go: {e}", self.pid);
        }
    }
}
