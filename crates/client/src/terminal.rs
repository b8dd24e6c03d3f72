//! `starling exec` on a terminal: whether the task gets a pty, the local
//! terminal in raw mode while it runs, and window-size changes passed on.
//!
//! As `ssh -t`: the task's host makes a pty with this terminal's modes and
//! size; what is typed here goes to it byte for byte (this terminal is in
//! raw mode, so Ctrl-C, Ctrl-Z and line editing are the remote line
//! discipline's), its output comes back as one stream.

use starling_proto::{TerminalModes, TerminalSize};
use std::os::fd::RawFd;

/// Whether `starling exec` runs its task on a terminal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TerminalMode {
    /// When our stdin is a terminal and we are its foreground job (so a
    /// background job, a step of `make -j CC='starling exec ...'` or of a
    /// script never gets one), and never for `--job` tasks.
    #[default]
    Auto,
    /// Always (`-t`), even when stdin is not a terminal.
    Always,
    /// Never (`-T`): plain pipes, stdout and stderr apart.
    Never,
}

/// Rows and columns when no terminal says (the classic VT100's).
const DEFAULT_SIZE: (u16, u16) = (24, 80);

fn is_tty(fd: RawFd) -> bool {
    // SAFETY: isatty only inspects the descriptor number.
    unsafe { libc::isatty(fd) == 1 }
}

/// Whether we are a job of our own in the foreground of `fd`'s terminal:
/// our process group is the terminal's foreground group and we lead it (a
/// job-control shell starts each command so). A compile step run by `make`
/// in the foreground is in make's group, not its leader: it gets pipes, so
/// parallel steps never fight over the terminal.
fn own_foreground_job(fd: RawFd) -> bool {
    // SAFETY: tcgetpgrp, getpgrp and getpid take no pointers.
    unsafe {
        let pgrp = libc::getpgrp();
        libc::tcgetpgrp(fd) == pgrp && pgrp == libc::getpid()
    }
}

/// The window size of the terminal on `fd`, if it is one and says.
pub fn window_size(fd: RawFd) -> Option<(u16, u16)> {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes a winsize through the pointer, which is live.
    if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &raw mut ws) } < 0 || ws.ws_row == 0 || ws.ws_col == 0 {
        return None;
    }
    Some((ws.ws_row, ws.ws_col))
}

fn termios(fd: RawFd) -> Option<libc::termios> {
    // SAFETY: termios is plain old data; all-zero is a valid value.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes into the live termios we pass.
    (unsafe { libc::tcgetattr(fd, &raw mut t) } == 0).then_some(t)
}

/// The terminal the task should get, or `None` for pipes. `job`: the task
/// belongs to a `--job` (a build's compile step, never interactive).
pub fn decide(mode: TerminalMode, job: bool) -> Option<TerminalSize> {
    let stdin_tty = is_tty(0);
    let wanted = match mode {
        TerminalMode::Never => false,
        TerminalMode::Always => true,
        TerminalMode::Auto => stdin_tty && own_foreground_job(0) && !job,
    };
    if !wanted {
        return None;
    }
    let (rows, cols) = window_size(0).or_else(|| window_size(1)).unwrap_or(DEFAULT_SIZE);
    let modes = stdin_tty.then(|| termios(0)).flatten().map(|t| TerminalModes::from_termios(&t));
    Some(TerminalSize { rows, cols, modes })
}

/// The local terminal (our stdin) in raw mode while this lives; its modes
/// are put back when it is dropped (normal end, error, or a signal that
/// `starling exec` turned into an ordinary return).
pub struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    /// Put stdin's terminal in raw mode; `None` if stdin is no terminal.
    pub fn enter() -> Option<RawMode> {
        if !is_tty(0) {
            return None;
        }
        let saved = termios(0)?;
        let mut raw = saved;
        // SAFETY: cfmakeraw edits the live termios we pass.
        unsafe { libc::cfmakeraw(&raw mut raw) };
        // SAFETY: tcsetattr reads the live termios we pass.
        if unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &raw const raw) } != 0 {
            return None;
        }
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: tcsetattr reads the live termios we saved.
        unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &raw const self.saved) };
    }
}
