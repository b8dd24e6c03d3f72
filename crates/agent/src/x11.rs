//! A task's X display (`exec --x11`, as `ssh -X`): the agent listens on a Unix socket at
//! `/tmp/.X11-unix/XN` inside the task's own root and gives the task `DISPLAY=:N`; each
//! connection a program opens there is relayed as its own stream (`Msg::X11Open`, `X11Data`,
//! `X11Close`, numbered per task) over the task's channel to its client, which connects to the
//! user's real X server and pumps both ways.
//!
//! Why a socket file in the task's root rather than TCP `127.0.0.1:6000+N`: the task shares its
//! host's network namespace with every other task there, so a TCP port (or an abstract socket)
//! would offer the user's display to all of them; the file exists only in this task's root.
//! `N` is chosen so that neither a file nor an abstract socket of that name exists in the
//! host's namespace (Xlib tries the abstract name first, and must find none).
//!
//! Authorization: the task's `XAUTHORITY` is a file next to the socket holding the client's
//! stand-in cookie (`TaskSpec::x11`, any address: family wild); the client checks it in each
//! connection's setup and swaps in the real one, which never reaches this host. The socket, the
//! file and the directory if we made it are removed before the task's changes are scanned, so
//! none of them is ever committed to the client.
//!
//! A move keeps the connections (the real X connection never moves, only this leg): at the
//! freeze each connection's pump forwards what the program sent and stops ([`freeze`]); what
//! it was sent and had not read yet (peeked from its socket, so a failed move loses nothing)
//! and what was still queued for it travel in the handover. The capture knows each program
//! socket by the inode of its peer, one of ours ([`reconnect`], `sock_diag`); the restorer
//! connects a new socket at the same fd to the target's re-attach socket
//! (`/tmp/.X11-unix/.starling-XN-reattach`) and says which stream it is; the target serves the
//! same display number ([`reopen`]) and gives each re-attached stream its bytes first.

use crate::{io_step, Agent, AgentError, Result, Step};
use serde::{Deserialize, Serialize};
use starling_proto::conn::Outgoing;
use starling_proto::{Msg, TaskId, X11Forward};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

/// The first display number tried (as sshd's `X11DisplayOffset`: clear of local servers).
const FIRST_DISPLAY: u32 = 10;
/// Display numbers tried before giving up.
const DISPLAYS_TRIED: u32 = 1000;
/// Bytes read from a program's connection per message.
const READ_BYTES: usize = 64 << 10;
/// Xauthority's family of an entry valid for any address.
const FAMILY_WILD: u16 = 0xffff;

/// What a connection's pump is told.
enum Ctl {
    /// Bytes from the X server, for the program.
    Data(Vec<u8>),
    /// The X server closed it (or the display closes): close the program's end.
    Close,
    /// The task freezes for a move: forward what the program sent, then stop and hand back.
    Freeze(Sender<Frozen>),
}

/// A stopped pump: its connection, its control queue, and what it had not written yet.
struct Frozen {
    conn: UnixStream,
    rx: Receiver<Ctl>,
    wake: OwnedFd,
    pending: Vec<u8>,
}

/// One X connection of the task, as the display holds it.
struct StreamCtl {
    tx: Sender<Ctl>,
    /// An eventfd that wakes the pump after a message.
    wake: OwnedFd,
    /// The program's socket (the peer of ours): how a move's capture recognises it.
    peer_inode: Option<u64>,
}

impl StreamCtl {
    fn send(&self, m: Ctl) {
        let _ = self.tx.send(m);
        // SAFETY: writes 8 bytes from a live local to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), 1u64.to_ne_bytes().as_ptr().cast(), 8) };
    }
}

/// The open connections of one task's display, by stream number.
#[derive(Default)]
struct Streams {
    next: u32,
    open: HashMap<u32, StreamCtl>,
    /// Streams of a moved task waiting for the restored process to re-attach: their control
    /// queue and what the program is owed first.
    waiting: HashMap<u32, (Receiver<Ctl>, OwnedFd, Vec<u8>)>,
    /// Pumps stopped for a move (started again if it fails).
    frozen: HashMap<u32, Frozen>,
}

/// One task's display on this host. Dropping it closes every connection and removes its files.
pub(crate) struct Display {
    number: u32,
    listeners: [UnixListener; 2],
    socket: PathBuf,
    reattach: PathBuf,
    auth: PathBuf,
    /// `/tmp/.X11-unix` of the task's root, when we made it (removed again at the end).
    made_dir: Option<PathBuf>,
    streams: Arc<Mutex<Streams>>,
}

/// The task's display as it moves (in the agents' handover).
#[derive(Serialize, Deserialize)]
pub(crate) struct DisplayHandover {
    pub number: u32,
    /// The source's agent made the task's `/tmp/.X11-unix` (it goes at the end).
    pub made_dir: bool,
    /// The next stream number.
    pub next: u32,
    /// Each open connection and the bytes its program is owed first (sent to it, not read).
    pub streams: Vec<(u32, Vec<u8>)>,
}

/// The task's paths (inside its root) and the display number it is given.
pub(crate) struct DisplayEnv {
    pub number: u32,
}

impl DisplayEnv {
    /// Set `DISPLAY` and `XAUTHORITY` in a task's environment (replacing the client's).
    pub(crate) fn apply(&self, env: &mut Vec<(Vec<u8>, Vec<u8>)>) {
        env.retain(|(k, _)| k != b"DISPLAY" && k != b"XAUTHORITY");
        env.push((b"DISPLAY".to_vec(), format!(":{}", self.number).into_bytes()));
        env.push((b"XAUTHORITY".to_vec(), format!("/tmp/.X11-unix/{}", auth_name(self.number)).into_bytes()));
    }
}

fn auth_name(number: u32) -> String {
    format!(".starling-X{number}.Xauthority")
}

fn reattach_name(number: u32) -> String {
    format!(".starling-X{number}-reattach")
}

/// Abstract Unix socket names bound in this network namespace (`@name` in `/proc/net/unix`).
fn abstract_names() -> Vec<String> {
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter_map(|p| p.strip_prefix('@'))
        .map(str::to_string)
        .collect()
}

/// One Xauthority entry (big-endian lengths): any address, display `number`, `name`, `data`.
fn xauthority_entry(number: u32, x: &X11Forward) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&FAMILY_WILD.to_be_bytes());
    let number = number.to_string();
    for field in [&b""[..], number.as_bytes(), x.auth_name.as_bytes(), &x.auth_data] {
        // The spec's fields are bounded (X11_AUTH_MAX), the number is a few digits.
        let len = u16::try_from(field.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(field);
    }
    out
}

/// `/tmp/.X11-unix` in the task's root: (its path, whether we made it now).
fn socket_dir(root: &Path) -> Result<(PathBuf, bool)> {
    let dir = root.join("tmp/.X11-unix");
    if std::fs::symlink_metadata(&dir).is_ok() {
        return Ok((dir, false));
    }
    std::fs::create_dir(&dir).map_err(io_step(Step::CreateDir(dir.clone())))?;
    // As an X server leaves it: anyone may make a socket there, nobody remove another's.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).map_err(io_step(Step::CreateDir(dir.clone())))?;
    Ok((dir, true))
}

/// Listen at `dir/name`. A task's root lies deep in the state directory: bind through a
/// descriptor of the directory, since a socket's path must fit in 108 bytes. Anyone who can
/// reach it may connect: the stand-in cookie is what admits a connection to the display.
fn listen(dir: &Path, name: &str) -> Result<UnixListener> {
    let dir_fd = std::fs::File::open(dir).map_err(io_step(Step::X11))?;
    let _ = std::fs::remove_file(dir.join(name));
    let listener = UnixListener::bind(format!("/proc/self/fd/{}/{name}", dir_fd.as_raw_fd())).map_err(io_step(Step::X11))?;
    std::fs::set_permissions(dir.join(name), std::os::unix::fs::PermissionsExt::from_mode(0o666)).map_err(io_step(Step::X11))?;
    Ok(listener)
}

/// Open the task's display in its root `root` (the overlay the sandbox will chroot to) and
/// register it with the agent; the caller puts the returned variables in the task's environment.
pub(crate) fn open(agent: &Agent, task: TaskId, x: &X11Forward, root: &Path, uid: u32, gid: u32, tx: &Outgoing) -> Result<DisplayEnv> {
    let (dir, made) = socket_dir(root)?;
    let taken = abstract_names();
    let number = (FIRST_DISPLAY..FIRST_DISPLAY + DISPLAYS_TRIED)
        .find(|n| {
            let name = format!("X{n}");
            std::fs::symlink_metadata(dir.join(&name)).is_err() && !taken.iter().any(|t| *t == format!("/tmp/.X11-unix/{name}"))
        })
        .ok_or(AgentError::X11NoDisplay)?;
    write_auth(&dir.join(auth_name(number)), number, x, uid, gid, agent.cfg.rootless)?;
    serve(agent, task, &dir, number, made, Streams::default(), tx)?;
    Ok(DisplayEnv { number })
}

/// A moved task's display here: the same number, its Xauthority already among its files, its
/// connections waiting for the restored process to re-attach them.
pub(crate) fn reopen(agent: &Agent, task: TaskId, h: &DisplayHandover, root: &Path, tx: &Outgoing) -> Result<()> {
    let (dir, _) = socket_dir(root)?;
    if abstract_names().iter().any(|t| *t == format!("/tmp/.X11-unix/X{}", h.number)) {
        // Xlib would reach that server instead of ours for the task's new connections.
        log::warn!("task {task}: display :{} is taken by an abstract socket here; new X connections may go astray", h.number);
    }
    let mut streams = Streams { next: h.next, ..Default::default() };
    for (stream, owed) in &h.streams {
        let (ctl, rx, wake) = stream_ctl()?;
        streams.open.insert(*stream, ctl);
        streams.waiting.insert(*stream, (rx, wake, owed.clone()));
    }
    serve(agent, task, &dir, h.number, h.made_dir, streams, tx)
}

fn stream_ctl() -> Result<(StreamCtl, Receiver<Ctl>, OwnedFd)> {
    // SAFETY: eventfd with flags only; the result is a fresh fd we own.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if efd < 0 {
        return Err(io_step(Step::X11)(std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let wake = unsafe { OwnedFd::from_raw_fd(efd) };
    let theirs = wake.try_clone().map_err(io_step(Step::X11))?;
    let (tx, rx) = std::sync::mpsc::channel();
    Ok((StreamCtl { tx, wake, peer_inode: None }, rx, theirs))
}

/// Listen for the task's connections and re-attachments, and register the display.
fn serve(agent: &Agent, task: TaskId, dir: &Path, number: u32, made: bool, streams: Streams, tx: &Outgoing) -> Result<()> {
    let listeners = [listen(dir, &format!("X{number}"))?, listen(dir, &reattach_name(number))?];
    let display = Display {
        number,
        socket: dir.join(format!("X{number}")),
        reattach: dir.join(reattach_name(number)),
        auth: dir.join(auth_name(number)),
        made_dir: made.then(|| dir.to_path_buf()),
        streams: Arc::new(Mutex::new(streams)),
        listeners,
    };
    for (i, l) in display.listeners.iter().enumerate() {
        let l = l.try_clone().map_err(io_step(Step::X11))?;
        let (streams, tx) = (display.streams.clone(), tx.clone());
        let reattaching = i == 1;
        std::thread::Builder::new()
            .name(format!("x11-{task}"))
            .spawn(move || accept_loop(task, &l, reattaching, &streams, &tx))
            .map_err(io_step(Step::X11))?;
    }
    agent.displays.lock().unwrap().insert(task, display);
    log::info!("task {task}: X display :{number}");
    Ok(())
}

/// The task's Xauthority: readable by the task's user only.
fn write_auth(path: &Path, number: u32, x: &X11Forward, uid: u32, gid: u32, rootless: bool) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io_step(Step::X11))?;
    f.write_all(&xauthority_entry(number, x)).map_err(io_step(Step::X11))?;
    // Without root the agent is the task's user already (and may not give files away).
    if !rootless {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid)).map_err(io_step(Step::X11))?;
    }
    Ok(())
}

/// Close the task's display, if it has one: every connection, and its files.
pub(crate) fn close(agent: &Agent, task: TaskId) {
    drop(agent.displays.lock().unwrap().remove(&task));
}

/// From the client: bytes from the X server for one of the task's connections, or (`None`)
/// the server closed it.
pub(crate) fn deliver(agent: &Agent, task: TaskId, stream: u32, data: Option<Vec<u8>>) {
    let displays = agent.displays.lock().unwrap();
    let Some(d) = displays.get(&task) else { return };
    let mut streams = d.streams.lock().unwrap();
    match data {
        Some(bytes) => {
            if let Some(c) = streams.open.get(&stream) {
                c.send(Ctl::Data(bytes));
            }
        }
        None => {
            if let Some(c) = streams.open.remove(&stream) {
                c.send(Ctl::Close);
            }
        }
    }
}

/// What a move's capture does with the task's sockets: its display's connections (by the
/// inode of the program's end) reconnect to the re-attach socket, saying their stream.
pub(crate) fn reconnect(agent: &Agent, task: TaskId) -> Option<starling_migrate::capture::Reconnect> {
    let displays = agent.displays.lock().unwrap();
    let d = displays.get(&task)?;
    let (streams, path) = (d.streams.clone(), format!("/tmp/.X11-unix/{}", reattach_name(d.number)));
    Some(starling_migrate::capture::Reconnect(Arc::new(move |inode| {
        let s = streams.lock().unwrap();
        s.open.iter().find(|(_, c)| c.peer_inode == Some(inode)).map(|(id, _)| (path.clone(), *id))
    })))
}

/// The task is frozen for a move: stop every connection's pump (what the program sent is
/// forwarded first) and say what travels. `pids`: the task's processes (their sockets hold
/// what they were sent and had not read, which is peeked, not taken).
pub(crate) fn freeze(agent: &Agent, task: TaskId, pids: &[i32]) -> Option<DisplayHandover> {
    let (number, made_dir, streams) = {
        let displays = agent.displays.lock().unwrap();
        let d = displays.get(&task)?;
        (d.number, d.made_dir.is_some(), d.streams.clone())
    };
    // Asked under the lock, awaited without it (a pump that ends meanwhile takes it).
    let asked: Vec<(u32, Option<u64>, Receiver<Frozen>)> = {
        let s = streams.lock().unwrap();
        s.open
            .iter()
            .map(|(id, c)| {
                let (reply, got) = std::sync::mpsc::channel();
                c.send(Ctl::Freeze(reply));
                (*id, c.peer_inode, got)
            })
            .collect()
    };
    let mut handed = Vec::new();
    let mut stopped = Vec::new();
    for (id, inode, got) in asked {
        // Gone: its program had closed it.
        let Ok(frozen) = got.recv() else { continue };
        let mut owed = inode.and_then(|i| unread_by_program(pids, i)).unwrap_or_default();
        owed.extend_from_slice(&frozen.pending);
        handed.push((id, owed));
        stopped.push((id, frozen));
    }
    let mut s = streams.lock().unwrap();
    s.frozen.extend(stopped);
    // A moved task's streams that never re-attached here travel on as they came.
    for (id, (_, _, owed)) in &s.waiting {
        handed.push((*id, owed.clone()));
    }
    Some(DisplayHandover { number, made_dir, next: s.next, streams: handed })
}

/// The move failed: the stopped pumps go on here.
pub(crate) fn thaw(agent: &Agent, task: TaskId, tx: &Outgoing) {
    let displays = agent.displays.lock().unwrap();
    let Some(d) = displays.get(&task) else { return };
    let mut s = d.streams.lock().unwrap();
    for (id, f) in s.frozen.drain().collect::<Vec<_>>() {
        start_pump(task, id, f, &d.streams, tx);
    }
}

/// What the program at the other end of a connection of ours (its socket: `inode`) was sent
/// and has not read, peeked from its socket (the process is frozen).
fn unread_by_program(pids: &[i32], inode: u64) -> Option<Vec<u8>> {
    let link = format!("socket:[{inode}]");
    let (pid, fd) = pids.iter().find_map(|&pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten().find_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            (target.as_os_str() == link.as_str()).then(|| e.file_name().to_str()?.parse::<i32>().ok()).flatten().map(|fd| (pid, fd))
        })
    })?;
    // SAFETY: pidfd_open and pidfd_getfd take integers; each result is a fresh fd we own.
    let sock = unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        let pidfd = OwnedFd::from_raw_fd(i32::try_from(pidfd).ok().filter(|f| *f >= 0)?);
        let fd = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        OwnedFd::from_raw_fd(i32::try_from(fd).ok().filter(|f| *f >= 0)?)
    };
    let mut queued: libc::c_int = 0;
    // SAFETY: FIONREAD writes an int through the live pointer.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &raw mut queued) } < 0 {
        return None;
    }
    let mut buf = vec![0u8; usize::try_from(queued).ok()?];
    // SAFETY: recv writes at most buf.len() bytes into the live buffer.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    buf.truncate(usize::try_from(n).ok()?);
    Some(buf)
}

/// The inode of the socket `fd`.
fn inode_of(fd: &impl AsRawFd) -> std::io::Result<u64> {
    // SAFETY: stat is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into the live stat we pass.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

/// The inode of the socket at the other end of our Unix socket `sock`'s connection, as the
/// kernel's `sock_diag` tells it (what `ss -x` shows as the peer).
fn peer_inode(sock: &UnixStream) -> std::io::Result<u64> {
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const UDIAG_SHOW_PEER: u32 = 4;
    const UNIX_DIAG_PEER: u16 = 2;
    const NLMSG_ERROR: u16 = 2;
    const NLM_F_REQUEST: u16 = 1;
    const FAMILY_UNIX: u8 = 1;
    #[repr(C)]
    struct Request {
        header: libc::nlmsghdr,
        family: u8,
        protocol: u8,
        pad: u16,
        states: u32,
        inode: u32,
        show: u32,
        cookie: [u32; 2],
    }
    let inode = u32::try_from(inode_of(sock)?).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))?;
    // SAFETY: socket(2) takes integers; the result is a fresh fd we own.
    let nl = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if nl < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let nl = unsafe { OwnedFd::from_raw_fd(nl) };
    let req = Request {
        header: libc::nlmsghdr {
            nlmsg_len: u32::try_from(std::mem::size_of::<Request>()).unwrap_or(u32::MAX),
            nlmsg_type: SOCK_DIAG_BY_FAMILY,
            nlmsg_flags: NLM_F_REQUEST,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        family: FAMILY_UNIX,
        protocol: 0,
        pad: 0,
        states: u32::MAX,
        inode,
        show: UDIAG_SHOW_PEER,
        cookie: [u32::MAX; 2],
    };
    // SAFETY: send reads the live request, `size_of` bytes.
    if unsafe { libc::send(nl.as_raw_fd(), (&raw const req).cast(), std::mem::size_of::<Request>(), 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = [0u8; 8192];
    // SAFETY: recv writes at most buf.len() bytes into the live buffer.
    let n = unsafe { libc::recv(nl.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let n = usize::try_from(n).map_err(|_| std::io::Error::last_os_error())?;
    let reply = &buf[..n];
    let u16_at = |i: usize| reply.get(i..i + 2).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let u32_at = |i: usize| reply.get(i..i + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    if u16_at(4) == Some(NLMSG_ERROR) {
        let errno = u32_at(16).map_or(libc::EIO, |e| e.cast_signed().saturating_neg());
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    // nlmsghdr (16 bytes), unix_diag_msg (16 bytes), then attributes (length, type, value).
    let mut at = 32;
    while let (Some(len), Some(kind)) = (u16_at(at), u16_at(at + 2)) {
        if kind == UNIX_DIAG_PEER {
            return u32_at(at + 4).map(u64::from).ok_or_else(|| std::io::ErrorKind::InvalidData.into());
        }
        if len < 4 {
            break;
        }
        at += usize::from(len).next_multiple_of(4);
    }
    Err(std::io::ErrorKind::NotFound.into())
}

impl Drop for Display {
    fn drop(&mut self) {
        for l in &self.listeners {
            // Wakes the accept loop (accept fails on a shut-down listener).
            // SAFETY: shutdown(2) on a listener we own.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let mut s = self.streams.lock().unwrap();
        for (_, c) in s.open.drain() {
            c.send(Ctl::Close);
        }
        s.waiting.clear();
        s.frozen.clear();
        for f in [&self.socket, &self.reattach, &self.auth] {
            let _ = std::fs::remove_file(f);
        }
        if let Some(d) = &self.made_dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn accept_loop(task: TaskId, listener: &UnixListener, reattaching: bool, streams: &Arc<Mutex<Streams>>, tx: &Outgoing) {
    loop {
        let mut conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // Shut down: the task ended.
            Err(_) => return,
        };
        let peer = peer_inode(&conn).map_err(|e| log::warn!("task {task}: an X connection's peer: {e}; it cannot move")).ok();
        if reattaching {
            // A restored process's connection: which stream it is comes first.
            let mut hello = [0u8; 4];
            if conn.read_exact(&mut hello).is_err() {
                continue;
            }
            let stream = u32::from_le_bytes(hello);
            let mut s = streams.lock().unwrap();
            let Some((rx, wake, owed)) = s.waiting.remove(&stream) else {
                log::warn!("task {task}: re-attached X connection {stream} is not one of its own");
                continue;
            };
            if let Some(c) = s.open.get_mut(&stream) {
                c.peer_inode = peer;
            }
            drop(s);
            start_pump(task, stream, Frozen { conn, rx, wake, pending: owed }, streams, tx);
            continue;
        }
        let Ok((mut ctl, rx, wake)) = stream_ctl() else { continue };
        ctl.peer_inode = peer;
        let stream = {
            let mut s = streams.lock().unwrap();
            let id = s.next;
            s.next += 1;
            s.open.insert(id, ctl);
            id
        };
        // The client must hear of the stream before its first bytes.
        if tx.blocking_send(Msg::X11Open { task, stream }).is_err() {
            return;
        }
        start_pump(task, stream, Frozen { conn, rx, wake, pending: Vec::new() }, streams, tx);
    }
}

fn start_pump(task: TaskId, stream: u32, f: Frozen, streams: &Arc<Mutex<Streams>>, tx: &Outgoing) {
    let (streams, tx) = (streams.clone(), tx.clone());
    let spawned = std::thread::Builder::new().name(format!("x11-{task}-{stream}")).spawn(move || pump(task, stream, f, &streams, &tx));
    if let Err(e) = spawned {
        log::warn!("task {task}: X connection {stream}: {e}");
    }
}

/// One connection both ways: the program's requests to the client, the X server's answers
/// (`Ctl::Data`) to the program, until either end closes or a move stops it.
fn pump(task: TaskId, stream: u32, f: Frozen, streams: &Mutex<Streams>, tx: &Outgoing) {
    let Frozen { mut conn, rx, wake, mut pending } = f;
    if conn.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = vec![0u8; READ_BYTES];
    // Forward what the program sent; false once its end is closed.
    let mut forward = |conn: &mut UnixStream| -> Option<bool> {
        match conn.read(&mut buf) {
            Ok(0) => Some(false),
            Ok(n) => tx.blocking_send(Msg::X11Data { task, stream, data: buf[..n].to_vec() }).ok().map(|()| true),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => None,
            Err(_) => Some(false),
        }
    };
    loop {
        let mut busy = false;
        while let Ok(m) = rx.try_recv() {
            match m {
                Ctl::Data(d) => pending.extend_from_slice(&d),
                Ctl::Close => {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                    return;
                }
                Ctl::Freeze(reply) => {
                    // The program is frozen: what it sent is all in our socket now.
                    while let Some(true) = forward(&mut conn) {}
                    let _ = conn.set_nonblocking(false);
                    let _ = reply.send(Frozen { conn, rx, wake, pending });
                    return;
                }
            }
        }
        if !pending.is_empty() {
            match conn.write(&pending) {
                Ok(n) => {
                    pending.drain(..n);
                    busy = n > 0;
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {}
                Err(_) => break,
            }
        }
        match forward(&mut conn) {
            Some(true) => busy = true,
            Some(false) => break,
            None => {}
        }
        if busy {
            continue;
        }
        let out = if pending.is_empty() { 0 } else { libc::POLLOUT };
        let mut fds = [
            libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN | out, revents: 0 },
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: polls two descriptors we hold.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        let mut drained = [0u8; 8];
        // SAFETY: reads (and so resets) our eventfd's 8-byte counter into a live local.
        unsafe { libc::read(wake.as_raw_fd(), drained.as_mut_ptr().cast(), 8) };
    }
    // The program closed it. Said once, by whichever end closed first: the server's close
    // already removed it.
    if streams.lock().unwrap().open.remove(&stream).is_some() {
        let _ = tx.blocking_send(Msg::X11Close { task, stream });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xauthority_entry_is_the_files_layout() {
        let x = X11Forward { auth_name: "MIT-MAGIC-COOKIE-1".into(), auth_data: vec![1, 2, 3] };
        let mut want = vec![0xff, 0xff, 0, 0, 0, 2, b'1', b'2', 0, 18];
        want.extend_from_slice(b"MIT-MAGIC-COOKIE-1");
        want.extend_from_slice(&[0, 3, 1, 2, 3]);
        assert_eq!(xauthority_entry(12, &x), want);
    }

    #[test]
    fn the_peer_of_a_connection_is_the_other_sockets_inode() {
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(peer_inode(&a).unwrap(), inode_of(&b).unwrap());
        assert_eq!(peer_inode(&b).unwrap(), inode_of(&a).unwrap());
        assert_ne!(inode_of(&a).unwrap(), inode_of(&b).unwrap());
    }
}
