//! A task's standard streams on this host: stdin from the client (via the
//! head) into a pipe, stdout and stderr from pipes to the client. Both can
//! be stopped with nothing lost and handed over: live migration takes them
//! to another host at the freeze, or starts them again here if the move
//! fails.

use starling_proto::conn::Outgoing;
use starling_proto::{Msg, Stream, TaskId};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{Receiver, Sender};
use std::thread::JoinHandle;

/// What reaches a task's stdin pump.
pub(crate) enum StdinMsg {
    Data(Vec<u8>),
    /// The client closed its stdin.
    Eof,
    /// The client's terminal has a new size (terminal tasks; else ignored).
    Resize(u16, u16),
    /// Stop and give back the pipe's write end and the queue (live migration).
    Handover(Sender<StdinHandover>),
}

/// A stopped stdin pump's state.
pub(crate) struct StdinHandover {
    /// The pipe's write end; None once the client closed stdin (or the task
    /// closed its end).
    pub writer: Option<File>,
    /// Messages queued after the handover request.
    pub rx: Receiver<StdinMsg>,
}

/// Feed `writer` from `rx` until EOF or a handover. `prefill` goes first
/// (stdin a moved task had not read yet).
pub(crate) fn start_stdin(writer: Option<File>, rx: Receiver<StdinMsg>, prefill: Vec<u8>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut writer = writer;
        let write = |w: &mut Option<File>, data: &[u8]| {
            if let Some(f) = w.as_mut() {
                if write_all_waiting(f, data).is_err() {
                    // The task closed its stdin: take the rest silently.
                    *w = None;
                }
            }
        };
        // A terminal task's stdin is its pty's master (shared with its
        // output pump, hence non-blocking).
        let terminal = writer.as_ref().is_some_and(|f| {
            // SAFETY: isatty only inspects the descriptor we hold.
            unsafe { libc::isatty(f.as_raw_fd()) == 1 }
        });
        write(&mut writer, &prefill);
        loop {
            match rx.recv() {
                Ok(StdinMsg::Data(d)) => write(&mut writer, &d),
                Ok(StdinMsg::Eof) if terminal => {
                    // The master stays open (its output goes on): the end of
                    // input is the terminal's EOF character, as a user types it.
                    let eof = writer
                        .as_ref()
                        .and_then(|f| starling_sandbox::terminal::get_modes(f.as_fd()).ok())
                        .and_then(|m| m.cc.get(libc::VEOF).copied())
                        .unwrap_or(4);
                    write(&mut writer, &[eof]);
                }
                Ok(StdinMsg::Eof) => writer = None,
                Ok(StdinMsg::Resize(rows, cols)) => {
                    if let Some(f) = writer.as_ref().filter(|_| terminal) {
                        let _ = starling_sandbox::terminal::set_size(f.as_fd(), rows, cols);
                    }
                }
                Ok(StdinMsg::Handover(reply)) => {
                    let _ = reply.send(StdinHandover { writer, rx });
                    return;
                }
                Err(_) => return,
            }
        }
    })
}

/// `write_all` that also works on a non-blocking descriptor: on EAGAIN it
/// waits until the descriptor is writable again.
pub(crate) fn write_all_waiting(f: &mut File, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        match f.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fds = [libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLOUT, revents: 0 }];
                // SAFETY: polls one descriptor we hold.
                unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A pump from one of the task's output pipes to the client.
pub(crate) struct OutputPump {
    stop: OwnedFd,
    thread: JoinHandle<OwnedFd>,
}

impl OutputPump {
    pub(crate) fn start(task: TaskId, stream: Stream, fd: OwnedFd, tx: Outgoing) -> std::io::Result<OutputPump> {
        // SAFETY: eventfd with flags only; the result is a fresh fd we own.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor owned by nobody else.
        let stop = unsafe { OwnedFd::from_raw_fd(efd) };
        let wake = stop.try_clone()?;
        set_nonblocking(&fd)?;
        let thread = std::thread::Builder::new().name(format!("out-{task}")).spawn(move || pump(task, stream, fd, &wake, &tx))?;
        Ok(OutputPump { stop, thread })
    }

    /// Stop: everything in the pipe now is sent first. Returns the pipe's
    /// read end (to start a pump on it again).
    pub(crate) fn stop(self) -> Option<OwnedFd> {
        // SAFETY: writes 8 bytes to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), 1u64.to_ne_bytes().as_ptr().cast(), 8) };
        self.thread.join().ok()
    }

    /// Wait until the task's end of the pipe closed and all was sent.
    pub(crate) fn join(self) {
        let _ = self.thread.join();
    }
}

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on our own descriptor.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn pump(task: TaskId, stream: Stream, fd: OwnedFd, stop: &OwnedFd, tx: &Outgoing) -> OwnedFd {
    let mut f = File::from(fd);
    let mut buf = vec![0u8; 64 << 10];
    let mut stopping = false;
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if tx.blocking_send(Msg::Output { task, stream, data: buf[..n].to_vec() }).is_err() {
                    break;
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if stopping {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        let mut fds = [
            libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: polls two descriptors we hold.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        // Asked to stop: drain what is in the pipe, then leave.
        stopping |= fds[1].revents != 0;
    }
    OwnedFd::from(f)
}
