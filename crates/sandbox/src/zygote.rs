//! The sandbox zygote: one `starling __sandbox-init` process per binary,
//! executed once, that forks every sandbox's outer init.
//!
//! Executing the starling binary for each task cost a fork of the whole
//! multi-threaded agent (its page tables), the exec of a 100 MiB binary, its
//! dynamic relocations and runtime start, and the teardown of the forked
//! copy: about 2 ms of CPU per task (issue 18). The zygote is executed once,
//! stays single-threaded, and per request forks a child that is in exactly
//! the state an executed `__sandbox-init` used to start in (stdio, the spec
//! on fd 3, the status pipe on fd 4, the program's descriptors at
//! [`crate::program::PROGRAM_FD`], a new session, placed in its cgroups), then
//! runs the same outer init. A fork of a single-threaded process may run
//! ordinary Rust, which is why the zygote must never start a thread.
//!
//! A sandbox starts in the mount namespace of the thread that asked for it
//! (its root is under mounts that thread made): there is one zygote per
//! binary and mount namespace, started by the first thread that asks from
//! that namespace. The agent has one (its threads share its namespace).
//!
//! The child is forked with `CLONE_PARENT`: its parent is the zygote's parent,
//! the process that called [`crate::spawn`], which therefore waits for it, signals
//! it and sees it in `/proc/PID/task/PID/children` exactly as before.
//!
//! Requests travel on a `SOCK_SEQPACKET` socket (the zygote's fd 3): one
//! message each, a bincode [`Request`] with the descriptors as `SCM_RIGHTS`
//! (spec, status pipe, stdin, stdout, stderr, cgroup files, program); the
//! reply is an `i32`: the outer init's pid, or `-errno`. When the caller's
//! process ends, the socket closes and the zygote exits. A zygote that died
//! (killed by hand, say) is replaced at the next request.

use crate::{status, ExitStatus, EXIT_SETUP_FAILED, SPEC_FD, STATUS_FD};
use nix::fcntl::{fcntl, FcntlArg};
use nix::sys::socket::{recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType};
use serde::{Deserialize, Serialize};
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

/// The zygote's end of its request socket.
const SOCKET_FD: RawFd = 3;

/// Lowest number received descriptors are parked at before the child moves
/// them into place (above fds 0-4 and the program's, which end below 10).
const PARK_FD_MIN: RawFd = 10;

/// Descriptors one request may carry: 5 fixed, cgroup files, the program's.
const MAX_FDS: usize = 32;

/// What a request says besides its descriptors.
#[derive(Serialize, Deserialize, Debug)]
struct Request {
    /// `cgroup.procs` files (after the 5 fixed descriptors) to write `0` into.
    cgroups: usize,
    /// Program descriptors (after the cgroup files), moved to `PROGRAM_FD`, ...
    program: usize,
    sched_idle: bool,
    /// Text written to `/proc/self/oom_score_adj`.
    oom_score_adj: Option<Vec<u8>>,
}

/// What the caller hands the zygote for one sandbox.
pub(crate) struct Handoff<'a> {
    pub spec: BorrowedFd<'a>,
    pub status: BorrowedFd<'a>,
    pub stdio: [BorrowedFd<'a>; 3],
    pub cgroups: Vec<BorrowedFd<'a>>,
    pub program: Vec<BorrowedFd<'a>>,
    pub sched_idle: bool,
    pub oom_score_adj: Option<Vec<u8>>,
}

struct Zygote {
    exe: PathBuf,
    /// Its mount namespace (inode of `/proc/thread-self/ns/mnt`).
    mount_ns: u64,
    process: Child,
    socket: OwnedFd,
}

/// The zygotes this process started, one per binary and mount namespace.
static ZYGOTES: Mutex<Vec<Zygote>> = Mutex::new(Vec::new());

/// Start a sandbox's outer init through the zygote of `exe`; returns its pid
/// (a child of this process).
pub(crate) fn start_outer_init(exe: &Path, handoff: &Handoff<'_>) -> io::Result<u32> {
    let mount_ns = std::fs::metadata("/proc/thread-self/ns/mnt").map(|m| m.ino())?;
    let mut zygotes = ZYGOTES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut fresh = false;
    loop {
        let i = match zygotes.iter().position(|z| z.exe == exe && z.mount_ns == mount_ns) {
            Some(i) => i,
            None => {
                zygotes.push(Zygote::start(exe, mount_ns)?);
                fresh = true;
                zygotes.len() - 1
            }
        };
        match zygotes[i].request(handoff) {
            Err(e) if !fresh && is_gone(&e) => {
                // It died since the last request: reap it and start another.
                let mut dead = zygotes.swap_remove(i);
                let _ = dead.process.kill();
                let _ = dead.process.wait();
            }
            result => return result,
        }
    }
}

/// Whether the zygote was gone before it read the request: sending failed
/// (`EPIPE`), or it closed with the request still unread (`ECONNRESET` on
/// the reply). Only then is the request sent again: a zygote that died after
/// reading it (the reply reads as the end) may have started the sandbox.
fn is_gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ENOTCONN | libc::ECONNREFUSED | libc::ECONNRESET))
}

impl Zygote {
    fn start(exe: &Path, mount_ns: u64) -> io::Result<Zygote> {
        let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = Command::new(exe);
        cmd.arg(crate::INIT_SUBCOMMAND).env_clear().current_dir("/").stdin(Stdio::null()).stdout(Stdio::null());
        // SAFETY: the closure runs in the forked child before exec and only
        // calls dup2, which is async-signal-safe, on a descriptor that stays
        // open in the parent until `spawn` returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(theirs_raw, SOCKET_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let process = cmd.spawn()?;
        drop(theirs);
        Ok(Zygote { exe: exe.to_path_buf(), mount_ns, process, socket: ours })
    }

    fn request(&self, h: &Handoff<'_>) -> io::Result<u32> {
        let header = bincode::serialize(&Request {
            cgroups: h.cgroups.len(),
            program: h.program.len(),
            sched_idle: h.sched_idle,
            oom_score_adj: h.oom_score_adj.clone(),
        })
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let fds: Vec<RawFd> = [h.spec, h.status, h.stdio[0], h.stdio[1], h.stdio[2]]
            .iter()
            .chain(&h.cgroups)
            .chain(&h.program)
            .map(AsRawFd::as_raw_fd)
            .collect();
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one sandbox"));
        }
        sendmsg::<()>(self.socket.as_raw_fd(), &[IoSlice::new(&header)], &[ControlMessage::ScmRights(&fds)], MsgFlags::MSG_NOSIGNAL, None)?;
        let mut reply = [0u8; 4];
        let got = loop {
            match nix::unistd::read(self.socket.as_raw_fd(), &mut reply) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other?,
            }
        };
        if got != reply.len() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        match i32::from_ne_bytes(reply) {
            pid if pid > 0 => Ok(pid.cast_unsigned()),
            errno => Err(io::Error::from_raw_os_error(-errno)),
        }
    }
}

/// Entry point of `starling __sandbox-init`: serve requests until the
/// socket on fd 3 closes. Never returns.
pub(crate) fn zygote_main() -> ! {
    let is_socket = nix::sys::stat::fstat(SOCKET_FD).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK);
    if !is_socket {
        let _ = writeln!(io::stderr(), "starling: __sandbox-init is internal: it is started by the starling agent");
        std::process::exit(EXIT_SETUP_FAILED)
    }
    // SAFETY: fd 3 was just checked to be open; the caller gave it to this
    // process and nothing else here owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(SOCKET_FD) };
    let _ = fcntl(SOCKET_FD, FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
    loop {
        let reply = match receive(&socket) {
            Ok(Some((request, fds))) => match fork_outer_init(&request, &fds) {
                Ok(pid) => pid,
                Err(e) => -(e as i32),
            },
            Ok(None) => std::process::exit(0),
            Err(e) => -(e as i32),
        };
        // If the caller is gone, the next receive sees the end.
        let _ = nix::sys::socket::send(socket.as_raw_fd(), &reply.to_ne_bytes(), MsgFlags::MSG_NOSIGNAL);
    }
}

/// One request and its descriptors (parked at ≥ [`PARK_FD_MIN`]); `None` at the end.
fn receive(socket: &OwnedFd) -> Result<Option<(Request, Vec<OwnedFd>)>, nix::errno::Errno> {
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (bytes, fds, truncated) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(|_| nix::errno::Errno::EINVAL)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: SCM_RIGHTS just installed these descriptors in this process.
                        fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                    }
                }
                let truncated = msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (msg.bytes, fds, truncated);
            }
        }
    };
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if truncated {
        return Err(nix::errno::Errno::EMSGSIZE);
    }
    let request: Request = bincode::deserialize(&buf[..bytes]).map_err(|_| nix::errno::Errno::EINVAL)?;
    if fds.len() != 5 + request.cgroups + request.program {
        return Err(nix::errno::Errno::EINVAL);
    }
    let parked = fds
        .iter()
        .map(|fd| {
            let raw = fcntl(fd.as_raw_fd(), FcntlArg::F_DUPFD_CLOEXEC(PARK_FD_MIN))?;
            // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; we own it.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        })
        .collect::<Result<Vec<_>, nix::errno::Errno>>()?;
    Ok(Some((request, parked)))
}

/// Fork the outer init as a sibling of this zygote (`CLONE_PARENT`).
fn fork_outer_init(request: &Request, fds: &[OwnedFd]) -> Result<i32, nix::errno::Errno> {
    // SAFETY: a raw clone without a new stack behaves as fork(2) (glibc's
    // fork() cannot pass CLONE_PARENT); this process is single-threaded, so
    // the child may run arbitrary code. The thread id glibc caches stays the
    // zygote's in the child; nothing the outer init calls relies on it
    // (getpid and abort ask the kernel, and its own forks use glibc's fork).
    let pid = unsafe {
        libc::syscall(libc::SYS_clone, libc::CLONE_PARENT | libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize)
    };
    match pid {
        -1 => Err(nix::errno::Errno::last()),
        0 => become_outer_init(request, fds),
        pid => Ok(i32::try_from(pid).map_err(|_| nix::errno::Errno::EOVERFLOW)?),
    }
}

/// In the forked child: put the descriptors where an executed
/// `__sandbox-init` found them, place the process, then run the outer init.
fn become_outer_init(request: &Request, fds: &[OwnedFd]) -> ! {
    let (fixed, rest) = fds.split_at(5);
    let (cgroups, program) = rest.split_at(request.cgroups);
    let targets = [SPEC_FD, STATUS_FD, 0, 1, 2].into_iter().chain((0..program.len()).map(|i| crate::program::PROGRAM_FD + crate::program::fd_count(i)));
    for (fd, target) in fixed.iter().chain(program).zip(targets) {
        // SAFETY: dup2 onto a number below PARK_FD_MIN, where no parked
        // descriptor is; the previous holder of the number (the zygote's
        // socket at 3, /dev/null on 0-2) is closed in this child only.
        if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
            std::process::exit(EXIT_SETUP_FAILED)
        }
    }
    if let Err(msg) = place(request, cgroups) {
        let _ = writeln!(io::stderr(), "starling: {msg}");
        // SAFETY: STATUS_FD was just put in place; this process ends below.
        let status = unsafe { BorrowedFd::borrow_raw(STATUS_FD) };
        let _ = nix::unistd::write(status.as_fd(), &status::encode(ExitStatus::Code(EXIT_SETUP_FAILED)));
        std::process::exit(EXIT_SETUP_FAILED)
    }
    let _ = nix::unistd::setsid();
    crate::init::outer_init_main()
}

/// Join the guest cgroup(s) first (everything after runs there), then the
/// scheduling class and OOM priority.
fn place(request: &Request, cgroups: &[OwnedFd]) -> Result<(), String> {
    for fd in cgroups {
        nix::unistd::write(fd.as_fd(), b"0").map_err(|e| format!("cannot join the guest cgroup: {e}"))?;
    }
    if request.sched_idle {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: a pointer to a live sched_param on our stack.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) } < 0 {
            return Err(format!("cannot switch to SCHED_IDLE: {}", io::Error::last_os_error()));
        }
    }
    if let Some(text) = &request.oom_score_adj {
        std::fs::write("/proc/self/oom_score_adj", text).map_err(|e| format!("cannot set oom_score_adj: {e}"))?;
    }
    Ok(())
}
