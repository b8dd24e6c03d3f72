//! The local backend: restores clones on this machine.
//!
//! Each clone is one [`Restore`] (plan, embedded restorer, a fault-handler
//! thread fetching from the page server), started here with a plain
//! `Command` — the cluster backend's agents run the same stage inside a task
//! sandbox. The restorer creates a PID namespace so the clone gets the
//! template's PID.

use crate::fault::FaultHandler;
use crate::host::HostTicket;
use starling_image::abi::counters::CloneCounters;
use crate::page_server::PageClient;
use crate::restore::{exit_status, Restore, RestoreProgram, Serve};
use crate::{Descriptor, ForkError, Result};
use starling_image::PlanOptions;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;

/// One clone restored on this machine.
pub struct LocalClone {
    pub id: u32,
    /// PID (in our namespace) of the restorer process that relays the clone's status.
    pub restorer_pid: i32,
    status: Option<i32>,
    restore: Option<Restore>,
    /// The handler's counters once the clone ended.
    counters: Option<CloneCounters>,
}

impl LocalClone {
    /// Start clone `id` of the template described by `desc`, one of the
    /// clones of `host`'s ticket here (its page server, key and options).
    pub fn launch(desc: &Descriptor, id: u32, host: &Arc<HostTicket>) -> Result<LocalClone> {
        let handler_desc = Arc::new(desc.clone());
        let host = host.clone();
        let serve: Serve = Arc::new(move |_id, uffd, stats, stop| {
            let client = PageClient::connect(host.server(), host.key(), host.options().encrypt)?;
            FaultHandler::on_host(uffd, &handler_desc, client, stats, &host).run(stop)
        });
        let plan = PlanOptions { clone_id: id, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: true, seccomp: &[], terminal: false, join_groups: 0 };
        let (program, restore) = Restore::start(desc, plan, serve)?;
        let restorer_pid = spawn(&program)?;
        Ok(LocalClone { id, restorer_pid, status: None, restore: Some(restore), counters: None })
    }

    /// The clone's fault-handler counters: live while it runs (once it
    /// registered memory), final after [`LocalClone::wait`].
    pub fn counters(&self) -> Option<CloneCounters> {
        self.counters.or_else(|| Some(self.restore.as_ref()?.stats(self.id)?.snapshot()))
    }

    /// Exit status once finished (exit code, or 128+signal).
    pub fn status(&self) -> Option<i32> {
        self.status
    }

    /// Block until the clone has exited; returns its status.
    pub fn wait(&mut self) -> Result<i32> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let mut st = 0;
        loop {
            // SAFETY: waits for our own child; st is a live local.
            let r = unsafe { libc::waitpid(self.restorer_pid, &mut st, 0) };
            if r == self.restorer_pid {
                break;
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return Err(ForkError::errno(format!("waitpid restorer {}", self.restorer_pid)));
            }
        }
        let status = exit_status(st).shell_code();
        self.status = Some(status);
        if let Some(restore) = self.restore.take() {
            // Its status is the restorer's (PID 1 relays the clone's); a
            // broken channel or handler is this clone's error.
            let (outcomes, channel) = restore.finish();
            let mut error = channel;
            for o in outcomes {
                self.counters = Some(o.counters);
                error = error.or(o.handler_error);
            }
            if let Some(e) = error {
                return Err(e);
            }
        }
        Ok(status)
    }

    pub fn kill(&mut self) {
        if self.status.is_none() {
            // SAFETY: signals our own child; its PID-ns init dies with it
            // (PDEATHSIG) and takes the clone along.
            unsafe { libc::kill(self.restorer_pid, libc::SIGKILL) };
        }
    }
}

/// Run the restorer with its descriptors at their numbers; returns its PID
/// (reaped by [`LocalClone::wait`] with waitpid).
fn spawn(p: &RestoreProgram) -> Result<i32> {
    let raw: Vec<(i32, i32)> = p.fds.iter().map(|(n, fd)| (*n, fd.as_raw_fd())).collect();
    let mut cmd = Command::new(format!("/proc/self/fd/{}", p.program.as_raw_fd()));
    cmd.arg0("starling-restorer").env_clear().stdin(Stdio::null());
    // SAFETY: runs in the forked child before exec; only async-signal-safe
    // fcntl/dup2 calls on fds the child inherited.
    unsafe {
        cmd.pre_exec(move || {
            // Move all out of the way first: any may already sit at a target number.
            let mut moved = [(0, 0); 2];
            for (slot, &(target, fd)) in moved.iter_mut().zip(&raw) {
                let m = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100);
                if m < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                *slot = (target, m);
            }
            for &(target, fd) in &moved[..raw.len()] {
                if libc::dup2(fd, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| ForkError::io("spawn restorer", e))?;
    Ok(child.id().cast_signed())
}
