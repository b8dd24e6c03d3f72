//! The local backend: restores clones on this machine.
//!
//! For each clone it lowers the descriptor into a plan, runs the embedded
//! static restorer (from a memfd) with the plan on fd 3 and one end of a
//! socketpair on fd 4, and starts a fault-handler thread that receives the
//! clone's userfaultfd over that socket and serves it from the page server.
//! The restorer creates a PID namespace so the clone gets the template's PID.
//!
//! The cluster backend will do the same on an agent, inside the file view;
//! the stages it needs ([`crate::plan::build_plan`], the restorer, and
//! [`crate::fault::FaultHandler`]) do not depend on this module.

use crate::descriptor::Descriptor;
use crate::fault::{FaultHandler, FaultStats};
use crate::page_server::PageClient;
use crate::plan::{build_plan, PlanOptions};
use crate::{ForkError, Result};
use starling_proto::ExitStatus;
use std::io::{IoSliceMut, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};

/// A close-on-exec duplicate of the restorer memfd (for the cluster agent,
/// which hands it to a sandbox as the task's program).
pub fn restorer_program() -> Result<OwnedFd> {
    let fd = restorer_memfd()?;
    // SAFETY: F_DUPFD_CLOEXEC on the process-wide memfd; the result is owned below.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return Err(ForkError::errno("dup restorer memfd"));
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// The plan for clones `id .. id + count` of `desc` (one restore; see
/// `PlanHeader::clone_count`) in a memfd, positioned at its start.
pub fn plan_memfd(desc: &Descriptor, id: u32, count: u32) -> Result<OwnedFd> {
    let plan = build_plan(desc, PlanOptions { clone_id: id, clone_count: count, new_pid_namespace: true });
    let plan_fd = memfd("starling-plan")?;
    {
        let mut f = std::fs::File::from(plan_fd.try_clone().map_err(|e| ForkError::io("dup plan fd", e))?);
        f.write_all(&plan).map_err(|e| ForkError::io("write plan", e))?;
    }
    // SAFETY: lseek on our own memfd.
    unsafe { libc::lseek(plan_fd.as_raw_fd(), 0, libc::SEEK_SET) };
    Ok(plan_fd)
}

/// A close-on-exec AF_UNIX seqpacket socketpair: (handler end, restorer
/// end). Seqpacket keeps the restorer's records apart (one per message),
/// and its clones and their PID-1 reaper all write to the same end.
pub fn handler_socketpair() -> Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0; 2];
    // SAFETY: socketpair writes two fds into sv.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) } != 0 {
        return Err(ForkError::errno("socketpair"));
    }
    // SAFETY: fresh fds owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// The restorer executable, written once per process into a memfd.
fn restorer_memfd() -> Result<RawFd> {
    static EXE: OnceLock<std::result::Result<OwnedFd, String>> = OnceLock::new();
    let r = EXE.get_or_init(|| {
        // MFD_EXEC: kernels with vm.memfd_noexec default memfds to non-executable.
        let fd = memfd_flags("starling-restorer", libc::MFD_CLOEXEC | 0x10)
            .or_else(|_| memfd("starling-restorer"))
            .map_err(|e| e.to_string())?;
        let mut f = std::fs::File::from(fd);
        f.write_all(starling_restorer::RESTORER_ELF).map_err(|e| e.to_string())?;
        // Keep it at a high number: the launch moves the plan and socket to
        // fds 3 and 4 (and temporaries at 100+) before exec'ing this path.
        // Above 4 is what matters: a process whose RLIMIT_NOFILE is below
        // 1001 (EINVAL for 1000) gets the lowest free fd from 5 on instead.
        // SAFETY: F_DUPFD_CLOEXEC on our own fd; the result is owned below.
        let mut high = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 1000) };
        if high < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // SAFETY: as above.
            high = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 5) };
        }
        if high < 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        // SAFETY: fresh fd owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(high) })
    });
    r.as_ref().map(|fd| fd.as_raw_fd()).map_err(|e| ForkError::Other(format!("restorer memfd: {e}")))
}

fn memfd(name: &str) -> Result<OwnedFd> {
    memfd_flags(name, libc::MFD_CLOEXEC)
}

fn memfd_flags(name: &str, flags: libc::c_uint) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).expect("no NUL in name");
    // SAFETY: memfd_create with a valid C string.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(ForkError::errno("memfd_create"));
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One clone restored on this machine.
pub struct LocalClone {
    pub id: u32,
    /// PID (in our namespace) of the restorer process that relays the clone's status.
    pub restorer_pid: i32,
    pub stats: Arc<FaultStats>,
    status: Option<i32>,
    stop_handler: Option<OwnedFd>,
    handler: Option<std::thread::JoinHandle<Result<()>>>,
}

impl LocalClone {
    /// Start clone `id` of the template described by `desc`, whose pages
    /// are served at `server`.
    pub fn launch(desc: &Descriptor, id: u32, server: SocketAddr) -> Result<LocalClone> {
        let exe = restorer_memfd()?;
        let plan_fd = plan_memfd(desc, id, 1)?;
        let (ours, theirs) = handler_socketpair()?;
        let (plan_raw, sock_raw) = (plan_fd.as_raw_fd(), theirs.as_raw_fd());
        let mut cmd = Command::new(format!("/proc/self/fd/{exe}"));
        cmd.arg0("starling-restorer").env_clear().stdin(Stdio::null());
        // SAFETY: runs in the forked child before exec; only async-signal-safe
        // fcntl/dup2 calls on fds the child inherited.
        unsafe {
            cmd.pre_exec(move || {
                // Move both out of the way first: either may already be 3 or 4.
                let p = libc::fcntl(plan_raw, libc::F_DUPFD_CLOEXEC, 100);
                let s = libc::fcntl(sock_raw, libc::F_DUPFD_CLOEXEC, 100);
                if p < 0 || s < 0 || libc::dup2(p, 3) < 0 || libc::dup2(s, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| ForkError::io("spawn restorer", e))?;
        let restorer_pid = child.id() as i32;
        drop(theirs);
        drop(plan_fd);
        let stats = Arc::new(FaultStats::default());
        let (stop_r, stop_w) = pipe()?;
        let desc = desc.clone();
        let stats2 = stats.clone();
        let handler = std::thread::Builder::new()
            .name(format!("sf-fault-{id}"))
            .spawn(move || -> Result<()> {
                let uffd = loop {
                    match recv_record(&ours)? {
                        None => return Ok(()),
                        Some(RestorerRecord::Userfaultfd { fd, .. }) => break fd,
                        // Its status also comes from waitpid (see `wait`).
                        Some(RestorerRecord::Exited { .. }) => {}
                    }
                };
                let client = PageClient::connect(server)?;
                FaultHandler::new(uffd, &desc, client, stats2).run(stop_r.as_fd())
            })
            .map_err(|e| ForkError::io("spawn fault handler", e))?;
        drop(child); // reaped by `wait` with waitpid
        Ok(LocalClone { id, restorer_pid, stats, status: None, stop_handler: Some(stop_w), handler: Some(handler) })
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
        self.stop_handler.take();
        if let Some(h) = self.handler.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(ForkError::Other(format!("fault handler of clone {}: {e}", self.id))),
                Err(_) => return Err(ForkError::Other(format!("fault handler of clone {} panicked", self.id))),
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

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ForkError::errno("pipe2"));
    }
    // SAFETY: fresh fds owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// What a restorer tells its fault handler (`starling_restorer::plan::RECORD_*`).
#[derive(Debug)]
pub enum RestorerRecord {
    /// Clone `clone_id` registered its memory: serve this userfaultfd.
    Userfaultfd { clone_id: u32, fd: OwnedFd },
    /// Clone `clone_id` ended so.
    Exited { clone_id: u32, status: ExitStatus },
}

/// A raw wait(2) status of a process that ended.
pub fn exit_status(raw: i32) -> ExitStatus {
    if libc::WIFEXITED(raw) {
        ExitStatus::Code(libc::WEXITSTATUS(raw))
    } else {
        ExitStatus::Signal(libc::WTERMSIG(raw))
    }
}

/// Receive the next record from a restorer; None once every restorer
/// process has closed its end (they all ended).
pub fn recv_record(sock: &OwnedFd) -> Result<Option<RestorerRecord>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use starling_restorer::plan::{RECORD_EXIT, RECORD_SIZE, RECORD_UFFD};
    let mut payload = [0u8; RECORD_SIZE];
    let mut iov = [IoSliceMut::new(&mut payload)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (bytes, fd) = loop {
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fd = None;
                for c in msg.cmsgs().map_err(|e| ForkError::Other(format!("cmsgs: {e}")))? {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        for (i, &raw) in fds.iter().enumerate() {
                            // SAFETY: the kernel just installed these fds for us;
                            // the first is kept, any extra is closed by its OwnedFd.
                            let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                            if i == 0 {
                                fd = Some(owned);
                            }
                        }
                    }
                }
                break (msg.bytes, fd);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(ForkError::Other(format!("recvmsg from restorer: {e}"))),
        }
    };
    if bytes == 0 {
        return Ok(None);
    }
    if bytes != RECORD_SIZE {
        return Err(ForkError::Protocol(format!("restorer record of {bytes} bytes")));
    }
    let word = |i: usize| u64::from_le_bytes(payload[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let clone_id = u32::try_from(word(1)).map_err(|_| ForkError::Protocol("restorer record: clone id".into()))?;
    match (word(0), fd) {
        (RECORD_UFFD, Some(fd)) => Ok(Some(RestorerRecord::Userfaultfd { clone_id, fd })),
        (RECORD_UFFD, None) => Err(ForkError::Protocol("restorer message without an fd".into())),
        (RECORD_EXIT, _) => Ok(Some(RestorerRecord::Exited { clone_id, status: exit_status(word(2) as u32 as i32) })),
        (tag, _) => Err(ForkError::Protocol(format!("unknown restorer record {tag}"))),
    }
}
