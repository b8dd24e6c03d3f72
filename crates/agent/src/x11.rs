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

use crate::{io_step, Agent, AgentError, Result, Step};
use starling_proto::conn::Outgoing;
use starling_proto::{Msg, TaskId, X11Forward};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
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

/// What the task's X connections' writers are sent: bytes from the X server, or the end.
type StreamTx = Sender<Option<Vec<u8>>>;

/// The open connections of one task's display, by stream number.
#[derive(Default)]
struct Streams {
    next: u32,
    open: HashMap<u32, StreamTx>,
}

/// One task's display on this host. Dropping it closes every connection and removes its files.
pub(crate) struct Display {
    listener: UnixListener,
    socket: PathBuf,
    auth: PathBuf,
    /// `/tmp/.X11-unix` of the task's root, when we made it (removed again at the end).
    made_dir: Option<PathBuf>,
    streams: Arc<Mutex<Streams>>,
}

/// The task's paths (inside its root) and the display number it is given.
pub(crate) struct DisplayEnv {
    pub number: u32,
    pub auth_path: String,
}

impl DisplayEnv {
    /// Set `DISPLAY` and `XAUTHORITY` in a task's environment (replacing the client's).
    pub(crate) fn apply(&self, env: &mut Vec<(Vec<u8>, Vec<u8>)>) {
        env.retain(|(k, _)| k != b"DISPLAY" && k != b"XAUTHORITY");
        env.push((b"DISPLAY".to_vec(), format!(":{}", self.number).into_bytes()));
        env.push((b"XAUTHORITY".to_vec(), self.auth_path.clone().into_bytes()));
    }
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

/// Open the task's display in its root `root` (the overlay the sandbox will chroot to) and
/// register it with the agent; the caller puts the returned variables in the task's environment.
pub(crate) fn open(agent: &Agent, task: TaskId, x: &X11Forward, root: &Path, uid: u32, gid: u32, tx: &Outgoing) -> Result<DisplayEnv> {
    let dir = root.join("tmp/.X11-unix");
    let made_dir = match std::fs::symlink_metadata(&dir) {
        Ok(_) => None,
        Err(_) => {
            std::fs::create_dir(&dir).map_err(io_step(Step::CreateDir(dir.clone())))?;
            // As an X server leaves it: anyone may make a socket there, nobody remove another's.
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
                .map_err(io_step(Step::CreateDir(dir.clone())))?;
            Some(dir.clone())
        }
    };
    let taken = abstract_names();
    let number = (FIRST_DISPLAY..FIRST_DISPLAY + DISPLAYS_TRIED)
        .find(|n| {
            let name = format!("X{n}");
            std::fs::symlink_metadata(dir.join(&name)).is_err() && !taken.iter().any(|t| *t == format!("/tmp/.X11-unix/{name}"))
        })
        .ok_or(AgentError::X11NoDisplay)?;
    let socket = dir.join(format!("X{number}"));
    // A task's root lies deep in the state directory: bind through a descriptor of the
    // directory, since a socket's path must fit in 108 bytes.
    let dir_fd = std::fs::File::open(&dir).map_err(io_step(Step::X11))?;
    let short = format!("/proc/self/fd/{}/X{number}", dir_fd.as_raw_fd());
    let listener = UnixListener::bind(&short).map_err(io_step(Step::X11))?;
    drop(dir_fd);
    // Anyone who can reach it may connect; the stand-in cookie is what admits a connection.
    std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o666)).map_err(io_step(Step::X11))?;
    let auth_name = format!(".starling-X{number}.Xauthority");
    let auth = dir.join(&auth_name);
    let display = Display { listener, socket, auth: auth.clone(), made_dir, streams: Arc::default() };
    write_auth(&auth, number, x, uid, gid, agent.cfg.rootless)?;
    let accepting = display.listener.try_clone().map_err(io_step(Step::X11))?;
    let (streams, tx) = (display.streams.clone(), tx.clone());
    std::thread::Builder::new()
        .name(format!("x11-{task}"))
        .spawn(move || accept_loop(task, &accepting, &streams, &tx))
        .map_err(io_step(Step::X11))?;
    agent.displays.lock().unwrap().insert(task, display);
    log::info!("task {task}: X display :{number}");
    Ok(DisplayEnv { number, auth_path: format!("/tmp/.X11-unix/{auth_name}") })
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
            if let Some(w) = streams.open.get(&stream) {
                let _ = w.send(Some(bytes));
            }
        }
        None => {
            if let Some(w) = streams.open.remove(&stream) {
                let _ = w.send(None);
            }
        }
    }
}

impl Drop for Display {
    fn drop(&mut self) {
        // Wakes the accept loop (accept fails on a shut-down listener).
        // SAFETY: shutdown(2) on the listener we own.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for (_, w) in self.streams.lock().unwrap().open.drain() {
            let _ = w.send(None);
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.auth);
        if let Some(d) = &self.made_dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn accept_loop(task: TaskId, listener: &UnixListener, streams: &Arc<Mutex<Streams>>, tx: &Outgoing) {
    loop {
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // Shut down: the task ended.
            Err(_) => return,
        };
        let (w_tx, w_rx) = std::sync::mpsc::channel();
        let stream = {
            let mut s = streams.lock().unwrap();
            let id = s.next;
            s.next += 1;
            s.open.insert(id, w_tx);
            id
        };
        // The client must hear of the stream before its first bytes.
        if tx.blocking_send(Msg::X11Open { task, stream }).is_err() {
            return;
        }
        let Ok(writer) = conn.try_clone() else {
            streams.lock().unwrap().open.remove(&stream);
            let _ = tx.blocking_send(Msg::X11Close { task, stream });
            continue;
        };
        std::thread::spawn(move || write_loop(writer, &w_rx));
        let (streams, tx) = (streams.clone(), tx.clone());
        std::thread::spawn(move || read_loop(task, stream, conn, &streams, &tx));
    }
}

/// The program's requests, to the client.
fn read_loop(task: TaskId, stream: u32, mut conn: UnixStream, streams: &Mutex<Streams>, tx: &Outgoing) {
    let mut buf = vec![0u8; READ_BYTES];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if tx.blocking_send(Msg::X11Data { task, stream, data: buf[..n].to_vec() }).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    // Said once, by whichever end closed first: the server's close already removed it.
    if let Some(w) = streams.lock().unwrap().open.remove(&stream) {
        let _ = w.send(None);
        let _ = tx.blocking_send(Msg::X11Close { task, stream });
    }
}

/// The X server's replies, events and errors, to the program.
fn write_loop(mut conn: UnixStream, rx: &Receiver<Option<Vec<u8>>>) {
    while let Ok(Some(bytes)) = rx.recv() {
        if conn.write_all(&bytes).is_err() {
            break;
        }
    }
    let _ = conn.shutdown(std::net::Shutdown::Both);
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
}
