//! A task's terminal: a pseudo-terminal made in the sandbox's own devpts
//! instance, whose slave becomes the task's controlling terminal on fds
//! 0/1/2 and whose master goes back to the agent.
//!
//! How the master travels: when [`crate::SandboxSpec::terminal`] is set, the
//! agent gives the sandbox one end of a Unix socket pair as its stdin
//! ([`TerminalLine::new`]). The sandbox's PID 1, once it is chrooted (so
//! `/dev/ptmx` is the sandbox's own `newinstance` devpts), opens the pty
//! ([`open_pty`]), sends the master down that socket with `SCM_RIGHTS`, and
//! starts the task on the slave ([`make_controlling`]). The agent receives it
//! with [`TerminalLine::receive_master`]. If the sandbox fails before that, the
//! socket just closes and the agent gets `None` (the failure is on the
//! sandbox's stderr pipe, as for any task).

use starling_proto::{TerminalModes, TerminalSize};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Errors of terminal handling.
#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    #[error("cannot open /dev/ptmx: {0}")]
    OpenMaster(#[source] io::Error),
    #[error("cannot unlock the pty: {0}")]
    Unlock(#[source] io::Error),
    #[error("cannot open the pty's slave: {0}")]
    OpenSlave(#[source] io::Error),
    #[error("cannot set the terminal's modes: {0}")]
    Modes(#[source] io::Error),
    #[error("cannot set the terminal's window size: {0}")]
    Size(#[source] io::Error),
    #[error("cannot make the pty the controlling terminal: {0}")]
    Controlling(#[source] io::Error),
    #[error("cannot pass the pty's master to the agent: {0}")]
    Send(#[source] io::Error),
    #[error("cannot create the terminal line to the sandbox: {0}")]
    Line(#[source] io::Error),
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

/// A new pty in the devpts instance `/dev/ptmx` leads to, with `term`'s
/// modes and window size: (master, slave), both close-on-exec.
/// `owner`: give the slave's device node to this uid (as grantpt does), so
/// a program that reopens its tty by name may.
pub fn open_pty(term: &TerminalSize, owner: Option<u32>) -> Result<(OwnedFd, OwnedFd), TerminalError> {
    // SAFETY: open(2) with a NUL-terminated literal path and flags.
    let m = unsafe { libc::open(c"/dev/ptmx".as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if m < 0 {
        return Err(TerminalError::OpenMaster(last_error()));
    }
    // SAFETY: open just returned this descriptor; nothing else owns it.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int through the pointer, which is live.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &raw const unlock) } < 0 {
        return Err(TerminalError::Unlock(last_error()));
    }
    // TIOCGPTPEER opens the slave of this very master (no path lookup, so
    // no confusion between devpts instances).
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor.
    let s = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if s < 0 {
        return Err(TerminalError::OpenSlave(last_error()));
    }
    // SAFETY: the ioctl just returned this descriptor; nothing else owns it.
    let slave = unsafe { OwnedFd::from_raw_fd(s) };
    if let Some(uid) = owner {
        // Best effort, as grantpt: the group stays devpts' gid option (tty).
        // SAFETY: fchown on a descriptor we own; -1 leaves the group as is.
        unsafe { libc::fchown(slave.as_raw_fd(), uid, u32::MAX) };
    }
    if let Some(modes) = &term.modes {
        set_modes(slave.as_fd(), modes)?;
    }
    set_size(master.as_fd(), term.rows, term.cols)?;
    Ok((master, slave))
}

/// A terminal's current modes (works on a master or a slave).
pub fn get_modes(fd: BorrowedFd<'_>) -> Result<TerminalModes, TerminalError> {
    // SAFETY: termios is plain old data; all-zero is a valid value.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes into the live termios we pass.
    if unsafe { libc::tcgetattr(fd.as_raw_fd(), &raw mut t) } < 0 {
        return Err(TerminalError::Modes(last_error()));
    }
    Ok(TerminalModes::from_termios(&t))
}

/// Set a terminal's modes, at once.
pub fn set_modes(fd: BorrowedFd<'_>, modes: &TerminalModes) -> Result<(), TerminalError> {
    // SAFETY: termios is plain old data; all-zero is a valid value.
    let mut base: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes into the live termios we pass.
    if unsafe { libc::tcgetattr(fd.as_raw_fd(), &raw mut base) } < 0 {
        return Err(TerminalError::Modes(last_error()));
    }
    let t = modes.to_termios(&base);
    // SAFETY: tcsetattr reads the live termios we pass.
    if unsafe { libc::tcsetattr(fd.as_raw_fd(), libc::TCSANOW, &raw const t) } < 0 {
        return Err(TerminalError::Modes(last_error()));
    }
    Ok(())
}

/// Set a terminal's window size (TIOCSWINSZ). On a master, the kernel
/// sends SIGWINCH to the slave's foreground process group when it changed.
pub fn set_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> Result<(), TerminalError> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize through the pointer, which is live.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &raw const ws) } < 0 {
        return Err(TerminalError::Size(last_error()));
    }
    Ok(())
}

/// A terminal's window size (rows, cols).
pub fn get_size(fd: BorrowedFd<'_>) -> Result<(u16, u16), TerminalError> {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes a winsize through the pointer, which is live.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &raw mut ws) } < 0 {
        return Err(TerminalError::Size(last_error()));
    }
    Ok((ws.ws_row, ws.ws_col))
}

/// In the task's process, before it execs: start a new session whose
/// controlling terminal is `slave`, and put the slave on fds 0, 1 and 2.
/// `steal`: take the terminal even if another session has it (TIOCSCTTY's
/// argument 1; needs CAP_SYS_ADMIN).
pub fn make_controlling(slave: &OwnedFd, steal: bool) -> Result<(), TerminalError> {
    // SAFETY: setsid has no arguments; failing (already a group leader) is
    // reported by TIOCSCTTY below.
    unsafe { libc::setsid() };
    // SAFETY: TIOCSCTTY takes an int by value.
    if unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCSCTTY, libc::c_int::from(steal)) } < 0 {
        return Err(TerminalError::Controlling(last_error()));
    }
    put_on_stdio(slave)
}

/// In the task's process, before it execs: the slave on fds 0, 1 and 2
/// (not made the controlling terminal: a moved task's restorer does that
/// in the restored process).
pub fn put_on_stdio(slave: &OwnedFd) -> Result<(), TerminalError> {
    for target in 0..3 {
        // SAFETY: dup2 onto the standard descriptors of this process, which
        // is about to exec; nothing in it holds them as owned values.
        if unsafe { libc::dup2(slave.as_raw_fd(), target) } < 0 {
            return Err(TerminalError::Controlling(last_error()));
        }
    }
    Ok(())
}

/// Send `fd` over the Unix socket `sock` (one byte of data with SCM_RIGHTS).
pub fn send_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> Result<(), TerminalError> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let raw = [fd.as_raw_fd()];
    let iov = [io::IoSlice::new(b"T")];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None).map_err(|e| TerminalError::Send(e.into()))?;
    Ok(())
}

/// Receive one descriptor sent by [`send_fd`]; `None` if the peer closed
/// the socket without sending one.
pub fn recv_fd(sock: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    loop {
        let mut iov = [io::IoSliceMut::new(&mut byte)];
        let msg = match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if msg.bytes == 0 {
            return Ok(None);
        }
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                if let Some(&fd) = fds.first() {
                    // SAFETY: the kernel just installed this descriptor for us.
                    return Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
        }
    }
}

/// The agent's end of a terminal task's setup: the socket its sandbox's
/// stdin is the other end of.
pub struct TerminalLine {
    ours: OwnedFd,
}

impl TerminalLine {
    /// A socket pair: (our end, the sandbox's stdin).
    pub fn new() -> Result<(TerminalLine, OwnedFd), TerminalError> {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (a, b) = socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| TerminalError::Line(e.into()))?;
        Ok((TerminalLine { ours: a }, b))
    }

    /// Wait for the sandbox's pty master. `None`: the sandbox ended (or
    /// failed) before it made one.
    pub fn receive_master(self) -> io::Result<Option<OwnedFd>> {
        recv_fd(self.ours.as_fd())
    }
}

/// A terminal's slave, opened through its master (non-blocking).
fn peer(master: BorrowedFd<'_>) -> Result<OwnedFd, TerminalError> {
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor.
    let s = unsafe {
        libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC)
    };
    if s < 0 {
        return Err(TerminalError::OpenSlave(last_error()));
    }
    // SAFETY: the ioctl just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(s) })
}

fn termios_of(fd: BorrowedFd<'_>) -> Result<libc::termios, TerminalError> {
    // SAFETY: termios is plain old data; all-zero is a valid value.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes into the live termios we pass.
    if unsafe { libc::tcgetattr(fd.as_raw_fd(), &raw mut t) } < 0 {
        return Err(TerminalError::Modes(last_error()));
    }
    Ok(t)
}

fn set_termios(fd: BorrowedFd<'_>, t: &libc::termios) -> Result<(), TerminalError> {
    // SAFETY: tcsetattr reads the live termios we pass.
    if unsafe { libc::tcsetattr(fd.as_raw_fd(), libc::TCSANOW, t) } < 0 {
        return Err(TerminalError::Modes(last_error()));
    }
    Ok(())
}

/// Take out what was typed that the task has not read yet (its process
/// must be stopped): the line discipline's input queue, already echoed
/// and edited, including an unfinished line in canonical mode (switching
/// the slave to non-canonical mode makes it readable). The modes are put
/// back as they were.
pub fn take_pending_input(master: BorrowedFd<'_>) -> Result<Vec<u8>, TerminalError> {
    let slave = peer(master)?;
    let saved = termios_of(slave.as_fd())?;
    let mut raw = saved;
    raw.c_lflag &= !libc::ICANON;
    raw.c_cc[libc::VMIN] = 0;
    raw.c_cc[libc::VTIME] = 0;
    set_termios(slave.as_fd(), &raw)?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: reads into our live buffer from our descriptor.
        let n = unsafe { libc::read(slave.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match usize::try_from(n) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    set_termios(slave.as_fd(), &saved)?;
    Ok(out)
}

/// Put `data` (from [`take_pending_input`]) back into a terminal's input
/// queue, as typed but not echoed again nor re-interpreted (no signals,
/// no CR/NL mapping, no flow control), then restore its modes. In canonical
/// mode its lines are lines again and an unfinished one stays editable.
pub fn give_pending_input(master: BorrowedFd<'_>, data: &[u8]) -> Result<(), TerminalError> {
    if data.is_empty() {
        return Ok(());
    }
    let slave = peer(master)?;
    let saved = termios_of(slave.as_fd())?;
    let mut quiet = saved;
    quiet.c_lflag &= !(libc::ECHO | libc::ECHONL | libc::ISIG | libc::IEXTEN);
    quiet.c_iflag &= !(libc::ICRNL | libc::INLCR | libc::IGNCR | libc::ISTRIP | libc::IXON | libc::IUCLC);
    set_termios(slave.as_fd(), &quiet)?;
    let mut rest = data;
    while !rest.is_empty() {
        // SAFETY: writes from our live slice to our descriptor.
        let n = unsafe { libc::write(master.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
        match usize::try_from(n) {
            Ok(n) if n > 0 => rest = &rest[n..],
            _ => {
                let e = last_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if e.kind() == io::ErrorKind::WouldBlock {
                    let mut fds = [libc::pollfd { fd: master.as_raw_fd(), events: libc::POLLOUT, revents: 0 }];
                    // SAFETY: polls one descriptor we hold.
                    unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
                    continue;
                }
                return Err(TerminalError::Send(e));
            }
        }
    }
    // The bytes reach the line discipline from a work queue; polling the
    // slave runs that work now (n_tty_poll flushes it), with the quiet modes.
    let mut fds = [libc::pollfd { fd: slave.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
    // SAFETY: polls one descriptor we hold, without waiting.
    unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
    set_termios(slave.as_fd(), &saved)
}
