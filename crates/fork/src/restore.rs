//! The restore stage: one restore of a process image, wherever it runs.
//!
//! [`Restore::start`] lowers the descriptor into a plan (in a memfd), makes
//! the handler socketpair, and starts a control thread that reads the
//! restorer's records (`starling_image::abi::restorer`): for each restored
//! process's userfaultfd it starts a handler thread running the caller's
//! [`Serve`] function, and it keeps each process's exit status. It returns
//! the [`RestoreProgram`] to run — the embedded restorer plus the
//! descriptors it expects at `PLAN_FD` and `HANDLER_FD` — which the caller
//! starts its own way: the local backend with a plain `Command`, a cluster
//! agent inside a task sandbox over the task's file view. When the restorer
//! has ended, [`Restore::finish`] stops the handlers and reports per
//! process.

use crate::fault::FaultStats;
use crate::{ForkError, RestorerChannelError, Result};
use starling_image::abi::counters::CloneCounters;
use starling_image::abi::restorer::{Record, RecordTag, HANDLER_FD, PLAN_FD, RECORD_SIZE};
use starling_image::{lower, Descriptor, PlanOptions};
use starling_proto::ExitStatus;
use std::collections::HashMap;
use std::io::{IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Serves one restored process's userfaultfd until `stop` becomes readable:
/// `(clone_id, uffd, counters to fill, stop)`. Runs on its own thread.
pub type Serve = Arc<dyn Fn(u32, OwnedFd, Arc<FaultStats>, BorrowedFd<'_>) -> Result<()> + Send + Sync>;

/// What to run: the restorer executable and the descriptors it expects.
pub struct RestoreProgram {
    /// The embedded restorer in a memfd (close-on-exec; run it as
    /// `/proc/self/fd/N` or with `execveat`).
    pub program: OwnedFd,
    /// `(PLAN_FD, plan)` and `(HANDLER_FD, restorer's end of the socket)`.
    pub fds: Vec<(i32, OwnedFd)>,
}

/// A restore in progress: its control thread and handlers.
pub struct Restore {
    /// Its processes: clone IDs `first .. first + count`.
    first: u32,
    count: u32,
    /// Closing it (the write end of a pipe every handler polls) stops them.
    stop: Option<OwnedFd>,
    control: Option<std::thread::JoinHandle<Control>>,
    /// Each handler's counters, readable while it runs.
    stats: Arc<Mutex<HashMap<u32, Arc<FaultStats>>>>,
    /// Processes that reported running, and whether the restorer is gone.
    running: Arc<(Mutex<Progress>, Condvar)>,
}

#[derive(Default)]
struct Progress {
    running: Vec<u32>,
    ended: bool,
}

/// How one restored process ended.
#[derive(Debug)]
pub struct Outcome {
    pub clone_id: u32,
    /// From the restorer's PID 1; None when it sent none (the whole
    /// restorer ended: its own status is the caller's to read).
    pub status: Option<ExitStatus>,
    pub counters: CloneCounters,
    /// The handler's failure, if it failed.
    pub handler_error: Option<ForkError>,
}

/// What the control thread saw.
#[derive(Default)]
struct Control {
    handlers: Vec<(u32, std::thread::JoinHandle<Result<()>>)>,
    statuses: HashMap<u32, ExitStatus>,
    error: Option<ForkError>,
}

impl Restore {
    /// Prepare a restore of `desc` (see the module docs).
    pub fn start(desc: &Descriptor, plan: PlanOptions, serve: Serve) -> Result<(RestoreProgram, Restore)> {
        let plan_fd = memfd("starling-plan", libc::MFD_CLOEXEC)?;
        {
            let mut f = std::fs::File::from(plan_fd.try_clone().map_err(|e| ForkError::io("dup plan fd", e))?);
            f.write_all(&lower(desc, plan)).map_err(|e| ForkError::io("write plan", e))?;
        }
        // SAFETY: lseek on our own memfd.
        unsafe { libc::lseek(plan_fd.as_raw_fd(), 0, libc::SEEK_SET) };
        let (ours, theirs) = handler_socketpair()?;
        let (stop_r, stop_w) = pipe()?;
        // A process tree's processes are clone IDs too: one per plan.
        let tree = u32::try_from(desc.processes().len()).unwrap_or(u32::MAX);
        let (first, count) = (plan.clone_id, plan.clone_count.max(tree).max(1));
        let stats: Arc<Mutex<HashMap<u32, Arc<FaultStats>>>> = Arc::default();
        let running: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
        let (registry, progress) = (stats.clone(), running.clone());
        let control = std::thread::Builder::new()
            .name(format!("restore-ctl-{first}"))
            .spawn(move || {
                let seen = control(ours, first..first + count, serve, Arc::new(stop_r), registry, &progress);
                progress.0.lock().unwrap_or_else(|p| p.into_inner()).ended = true;
                progress.1.notify_all();
                seen
            })
            .map_err(|e| ForkError::io("start the restore control thread", e))?;
        Ok((
            RestoreProgram { program: restorer_program()?, fds: vec![(PLAN_FD, plan_fd), (HANDLER_FD, theirs)] },
            Restore { first, count, stop: Some(stop_w), control: Some(control), stats, running },
        ))
    }

    /// Wait until process `clone_id` reports that it resumes (true), or the
    /// restorer ends without that (false).
    pub fn wait_running(&self, clone_id: u32) -> bool {
        let (lock, cv) = &*self.running;
        let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if p.running.contains(&clone_id) {
                return true;
            }
            if p.ended {
                return false;
            }
            p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait until every process of the restore (a tree's, a host's clones)
    /// reports that it resumes (true), or the restorer ends first (false).
    pub fn wait_all_running(&self) -> bool {
        (self.first..self.first + self.count).all(|id| self.wait_running(id))
    }

    /// Counters of process `clone_id`'s handler (live), if it has one.
    pub fn stats(&self, clone_id: u32) -> Option<Arc<FaultStats>> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).get(&clone_id).cloned()
    }

    /// After the restorer ended: stop the handlers, wait for them, and tell
    /// how each process ended. The error is the restorer channel's, if it broke.
    pub fn finish(mut self) -> (Vec<Outcome>, Option<ForkError>) {
        self.stop.take();
        let mut seen = match self.control.take().map(std::thread::JoinHandle::join) {
            Some(Ok(seen)) => seen,
            _ => Control { error: Some(ForkError::HandlerPanicked(self.first)), ..Control::default() },
        };
        let mut errors: HashMap<u32, ForkError> = HashMap::new();
        for (id, handler) in seen.handlers.drain(..) {
            let err = match handler.join() {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => ForkError::Handler { clone: id, source: Box::new(e) },
                Err(_) => ForkError::HandlerPanicked(id),
            };
            errors.insert(id, err);
        }
        let outcomes = (self.first..self.first + self.count)
            .map(|id| Outcome {
                clone_id: id,
                status: seen.statuses.get(&id).copied(),
                counters: self.stats(id).map(|s| s.snapshot()).unwrap_or_default(),
                handler_error: errors.remove(&id),
            })
            .collect();
        (outcomes, seen.error)
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        // Not finished (the restorer never started): stopping the handlers is
        // enough; the control thread ends once the restorer's end of the
        // socket is gone.
        self.stop.take();
    }
}

fn control(
    sock: OwnedFd,
    ids: std::ops::Range<u32>,
    serve: Serve,
    stop: Arc<OwnedFd>,
    registry: Arc<Mutex<HashMap<u32, Arc<FaultStats>>>>,
    progress: &(Mutex<Progress>, Condvar),
) -> Control {
    let mut seen = Control::default();
    loop {
        match recv_record(&sock) {
            // Every restorer process has ended (or closed the socket).
            Ok(None) => break,
            Ok(Some(RestorerRecord::Userfaultfd { clone_id, fd })) => {
                if !ids.contains(&clone_id) || seen.handlers.iter().any(|h| h.0 == clone_id) {
                    seen.error = Some(RestorerChannelError::UnexpectedUffd(clone_id).into());
                    continue;
                }
                let stats = Arc::new(FaultStats::default());
                stats.restorer_running_ns.store(starling_image::abi::counters::realtime_ns(), std::sync::atomic::Ordering::Relaxed);
                registry.lock().unwrap_or_else(|p| p.into_inner()).insert(clone_id, stats.clone());
                let (serve, stop) = (serve.clone(), stop.clone());
                let handler = std::thread::Builder::new()
                    .name(format!("fault-{clone_id}"))
                    .spawn(move || serve(clone_id, fd, stats, stop.as_fd()));
                match handler {
                    Ok(h) => seen.handlers.push((clone_id, h)),
                    Err(e) => seen.error = Some(ForkError::io(format!("start the fault handler of clone {clone_id}"), e)),
                }
            }
            Ok(Some(RestorerRecord::Exited { clone_id, status })) => {
                seen.statuses.insert(clone_id, status);
            }
            Ok(Some(RestorerRecord::Running { clone_id })) => {
                progress.0.lock().unwrap_or_else(|p| p.into_inner()).running.push(clone_id);
                progress.1.notify_all();
            }
            Err(e) => {
                seen.error = Some(e);
                break;
            }
        }
    }
    seen
}

/// A close-on-exec duplicate of the restorer memfd.
fn restorer_program() -> Result<OwnedFd> {
    let fd = restorer_memfd()?;
    // SAFETY: F_DUPFD_CLOEXEC on the process-wide memfd; the result is owned below.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return Err(ForkError::errno("dup restorer memfd"));
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// The restorer executable, written once per process into a memfd.
fn restorer_memfd() -> Result<RawFd> {
    static EXE: OnceLock<std::result::Result<OwnedFd, std::io::ErrorKind>> = OnceLock::new();
    let r = EXE.get_or_init(|| {
        // MFD_EXEC: kernels with vm.memfd_noexec default memfds to non-executable.
        let fd = memfd("starling-restorer", libc::MFD_CLOEXEC | 0x10)
            .or_else(|_| memfd("starling-restorer", libc::MFD_CLOEXEC))
            .map_err(|_| std::io::ErrorKind::Other)?;
        let mut f = std::fs::File::from(fd);
        f.write_all(starling_restorer::RESTORER_ELF).map_err(|e| e.kind())?;
        // Keep it at a high number: a launch moves the plan and socket to
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
            return Err(std::io::Error::last_os_error().kind());
        }
        // SAFETY: fresh fd owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(high) })
    });
    r.as_ref().map(|fd| fd.as_raw_fd()).map_err(|k| ForkError::io("restorer memfd", std::io::Error::from(*k)))
}

fn memfd(name: &str, flags: libc::c_uint) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).expect("no NUL in name");
    // SAFETY: memfd_create with a valid C string.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(ForkError::errno("memfd_create"));
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A close-on-exec AF_UNIX seqpacket socketpair: (handler end, restorer
/// end). Seqpacket keeps the restorer's records apart (one per message),
/// and its processes and their PID-1 reaper all write to the same end.
fn handler_socketpair() -> Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0; 2];
    // SAFETY: socketpair writes two fds into sv.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) } != 0 {
        return Err(ForkError::errno("socketpair"));
    }
    // SAFETY: fresh fds owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

pub(crate) fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ForkError::errno("pipe2"));
    }
    // SAFETY: fresh fds owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// What a restorer tells its handler.
#[derive(Debug)]
enum RestorerRecord {
    /// Process `clone_id` registered its memory: serve this userfaultfd.
    Userfaultfd { clone_id: u32, fd: OwnedFd },
    /// Process `clone_id` ended so.
    Exited { clone_id: u32, status: ExitStatus },
    /// Process `clone_id` is about to resume.
    Running { clone_id: u32 },
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
fn recv_record(sock: &OwnedFd) -> Result<Option<RestorerRecord>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut payload = [0u8; RECORD_SIZE];
    let mut iov = [IoSliceMut::new(&mut payload)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (bytes, fd) = loop {
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fd = None;
                for c in msg.cmsgs().map_err(RestorerChannelError::Recv)? {
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
            Err(e) => return Err(RestorerChannelError::Recv(e).into()),
        }
    };
    if bytes == 0 {
        return Ok(None);
    }
    if bytes != RECORD_SIZE {
        return Err(RestorerChannelError::RecordSize(bytes).into());
    }
    // SAFETY: exactly RECORD_SIZE bytes of a Record (three u64s, any bit
    // pattern valid); read_unaligned copes with the byte buffer's alignment.
    let rec: Record = unsafe { std::ptr::read_unaligned(payload.as_ptr().cast()) };
    let clone_id = u32::try_from(rec.clone_id).map_err(|_| RestorerChannelError::CloneId(rec.clone_id))?;
    match (RecordTag::from_u64(rec.tag), fd) {
        (Some(RecordTag::Userfaultfd), Some(fd)) => Ok(Some(RestorerRecord::Userfaultfd { clone_id, fd })),
        (Some(RecordTag::Userfaultfd), None) => Err(RestorerChannelError::MissingFd.into()),
        (Some(RecordTag::Running), _) => Ok(Some(RestorerRecord::Running { clone_id })),
        (Some(RecordTag::Exited), _) => {
            // The restorer sends the i32 wait status's bits in the low half
            // (`status as u32 as u64`): take them back.
            #[allow(clippy::cast_possible_truncation)]
            let raw = (rec.value as u32).cast_signed();
            Ok(Some(RestorerRecord::Exited { clone_id, status: exit_status(raw) }))
        }
        (None, _) => Err(RestorerChannelError::UnknownTag(rec.tag).into()),
    }
}
