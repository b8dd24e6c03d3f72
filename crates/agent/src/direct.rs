//! The home site's direct path (`agent --home`): a task running on the client's own machine
//! exchanges its stream with its client over this agent's Unix socket instead of through the
//! head, which sits across the link (`starling_proto::path` has the protocol).
//!
//! Each task here sends everything through its path sender ([`task_sender`]); it first tells
//! its client, through the head, where to open the direct path ([`Msg::AtHome`]). A client that
//! connects and sends [`Msg::DirectOpen`] (as the task's user, or root: `SO_PEERCRED`) gets the
//! stream from then on. The path closes when the task freezes to leave home
//! ([`close_for_move`]: the freeze waits until the client's last direct input is in), when the
//! task ends, or when the client goes away (then the task's stream goes through the head again,
//! which keeps it for `starling attach`, and the next client is told [`Msg::AtHome`] again).
//!
//! A terminal task's output sent directly is kept until its client acknowledges writing it
//! (`OutputAck` on the direct path, [`KeptOutput`]); what a client that went away had not
//! written goes to the head in its place in the order, so `starling attach` gets it as it gets
//! what the head relayed (`starling_proto::path` has how).

use crate::Agent;
use starling_proto::conn::{establish, Outgoing};
use starling_proto::path::{Direct, DirectSlot, KeptOutput, PathMerge};
use starling_proto::{Msg, ProtoError, Role, TaskId, TaskSpec};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::net::UnixListener;

/// The socket's name in the agent's state directory.
const SOCKET: &str = "direct.sock";

/// The two paths of one task here.
pub(crate) struct TaskPath {
    /// The task's path sender (weak: the sender ends when the task's last producer is gone).
    sender: tokio::sync::mpsc::WeakSender<Msg>,
    slot: DirectSlot,
    /// The task's stream goes to its client directly now.
    on_direct: Arc<AtomicBool>,
    /// The user the task runs as (only they, or root, may open its direct path).
    uid: u32,
    /// A terminal task: its output outlives its client, so what goes directly is kept until
    /// the client acknowledges it.
    keeps_output: bool,
    state: Mutex<PathState>,
    changed: Condvar,
}

#[derive(Default)]
struct PathState {
    /// The client's input: which path it is read from.
    merge: PathMerge,
    /// A client's direct connection is open and its input may still come on it.
    open: bool,
    /// The task is frozen to leave home: no direct path opens.
    leaving: bool,
    /// Which direct connection is the task's (an earlier one may still be closing).
    conn: u64,
}

/// The Unix socket a home agent serves direct paths on.
pub(crate) fn socket_path(state: &Path) -> PathBuf {
    state.join(SOCKET)
}

/// The sender task `task`'s messages go through on this agent: on a home agent its path
/// sender (whose first message tells the client where to open the direct path), elsewhere
/// the head connection itself.
pub(crate) fn task_sender(agent: &Arc<Agent>, task: TaskId, spec: &TaskSpec, head: &Outgoing) -> Outgoing {
    if !agent.cfg.home {
        return head.clone();
    }
    let slot = DirectSlot::default();
    let on_direct = Arc::new(AtomicBool::new(false));
    let sender = starling_proto::path::spawn_sender(task, head.clone(), slot.clone(), on_direct.clone());
    let path = TaskPath {
        sender: sender.downgrade(),
        slot,
        on_direct,
        uid: spec.uid,
        keeps_output: spec.terminal.is_some(),
        state: Mutex::new(PathState::default()),
        changed: Condvar::new(),
    };
    agent.paths.lock().unwrap().insert(task, Arc::new(path));
    let _ = sender.try_send(at_home(agent, task));
    sender
}

fn at_home(agent: &Agent, task: TaskId) -> Msg {
    Msg::AtHome { task, socket: socket_path(&agent.cfg.settings.state).display().to_string() }
}

/// The task's path sender is done with (its runner ended here): forget its paths, unless a
/// later one of the task's (it came back) took their place.
pub(crate) fn forget(agent: &Agent, task: TaskId, sender: &Outgoing) {
    let mut paths = agent.paths.lock().unwrap();
    let mine = paths.get(&task).is_some_and(|p| p.sender.upgrade().is_none_or(|s| s.same_channel(sender)));
    if mine {
        paths.remove(&task);
    }
}

fn path_of(agent: &Agent, task: TaskId) -> Option<Arc<TaskPath>> {
    agent.paths.lock().unwrap().get(&task).cloned()
}

/// Task `task`'s path sender here, if it has one (a home agent's task).
pub(crate) fn sender_of(agent: &Agent, task: TaskId) -> Option<Outgoing> {
    path_of(agent, task).and_then(|p| p.sender.upgrade())
}

/// Whether task `task`'s stream goes straight to its client now (for `starling ps`).
/// Both ways: its output goes direct, and its client's input is read from there.
pub(crate) fn is_direct(agent: &Agent, task: TaskId) -> bool {
    path_of(agent, task).is_some_and(|p| p.on_direct.load(Ordering::SeqCst) && p.state.lock().unwrap().merge.is_direct())
}

/// A message of the client for a task here, from the head (`via_direct` false) or the direct
/// path: delivered in the order its client sent it.
pub(crate) fn input(agent: &Arc<Agent>, via_direct: bool, m: Msg) {
    let Some(path) = m.task().and_then(|t| path_of(agent, t)) else {
        if !matches!(m, Msg::PathSwitch { .. }) {
            agent.deliver_input(m);
        }
        return;
    };
    let mut st = path.state.lock().unwrap();
    // Delivered under the lock: the two paths' readers never interleave a switch's release.
    for (_, m) in st.merge.arrived(via_direct, m) {
        agent.deliver_input(m);
    }
    if st.open && st.merge.left_direct() {
        st.open = false;
        path.changed.notify_all();
    }
}

/// The task is frozen to leave home: its stream goes through the head from here, and this
/// waits (at most `wait`) until the client's input on the direct path is all in, so the move
/// hands over every byte typed. Nothing opens a direct path again unless [`stay_home`].
pub(crate) fn close_for_move(agent: &Agent, task: TaskId, wait: Duration) {
    let Some(path) = path_of(agent, task) else { return };
    path.state.lock().unwrap().leaving = true;
    if let Some(sender) = path.sender.upgrade() {
        let _ = sender.blocking_send(Msg::PathSwitch { task });
    }
    let st = path.state.lock().unwrap();
    let (st, timeout) = path.changed.wait_timeout_while(st, wait, |st| st.open).unwrap();
    if timeout.timed_out() && st.open {
        log::warn!("task {task}: its client did not close the direct path in {wait:?}; its late input is lost");
    }
}

/// The move failed: the task goes on here, and its client may open the direct path again.
pub(crate) fn stay_home(agent: &Agent, task: TaskId) {
    let Some(path) = path_of(agent, task) else { return };
    path.state.lock().unwrap().leaving = false;
    if let Some(sender) = path.sender.upgrade() {
        let _ = sender.blocking_send(at_home(agent, task));
    }
}

/// Serve direct paths on the agent's socket (home agents only).
pub(crate) async fn serve(agent: Arc<Agent>) {
    let path = socket_path(&agent.cfg.settings.state);
    let _ = std::fs::remove_file(&path);
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => return log::warn!("home site: cannot serve direct paths on {}: {e}; tasks here talk through the head", path.display()),
    };
    // Any local user may connect; each connection is checked against its task's user.
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)) {
        log::warn!("home site: {}: {e}", path.display());
    }
    log::info!("home site: direct paths on {}", path.display());
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                log::warn!("{}: accepting: {e}", path.display());
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = direct_connection(&agent, sock).await {
                log::info!("home site: a direct path ended: {e}");
            }
        });
    }
}

/// Why a client may not open a task's direct path.
fn refusal(agent: &Agent, task: TaskId, uid: u32) -> Result<Arc<TaskPath>, String> {
    let path = path_of(agent, task).ok_or_else(|| format!("no task {task} runs on the home site"))?;
    if uid != 0 && uid != path.uid {
        return Err(format!("task {task} runs as uid {}: uid {uid} may not open its stream", path.uid));
    }
    let st = path.state.lock().unwrap();
    if st.leaving {
        return Err(format!("task {task} is leaving the home site"));
    }
    if st.open {
        return Err(format!("task {task} has a direct path open already"));
    }
    drop(st);
    Ok(path)
}

async fn direct_connection(agent: &Arc<Agent>, sock: tokio::net::UnixStream) -> Result<(), ProtoError> {
    let cred = starling_auth::unix_peer(&sock)?;
    let (r, w) = tokio::io::split(sock);
    let (peer, mut incoming, tx) = establish(r, w, Role::Agent, &agent.cfg.name).await?;
    if peer.role != Role::Client {
        return Err(ProtoError::UnexpectedPeer { expected: Role::Client, got: peer.role });
    }
    let task = match incoming.recv().await? {
        Msg::DirectOpen { task } => task,
        other => return Err(ProtoError::Refused(format!("expected DirectOpen, got {:?}", std::mem::discriminant(&other)))),
    };
    let path = match refusal(agent, task, cred.uid) {
        Ok(p) => p,
        Err(message) => {
            let _ = tx.send(Msg::Error { task: Some(task), message: message.clone() }).await;
            return Err(ProtoError::Refused(message));
        }
    };
    let Some(sender) = path.sender.upgrade() else { return Ok(()) };
    let conn = {
        let mut st = path.state.lock().unwrap();
        if st.leaving || st.open {
            return Ok(());
        }
        st.open = true;
        st.merge = PathMerge::default();
        st.merge.opened();
        st.conn += 1;
        st.conn
    };
    // Agreed: the echo goes first on the connection, then (from the sender) the stream.
    let _ = tx.send(Msg::DirectOpen { task }).await;
    let kept = path.keeps_output.then(|| Arc::new(KeptOutput::default()));
    *path.slot.lock().unwrap() = Some(Direct { tx, kept: kept.clone() });
    let _ = sender.send(Msg::DirectOpen { task }).await;
    drop(sender);
    log::info!("task {task}: its stream goes straight to its client (uid {})", cred.uid);
    let end = loop {
        match incoming.recv().await {
            // (Of the output that came this way; it may come after the switch.)
            Ok(Msg::OutputAck { task: t, bytes }) if t == task => {
                if let Some(k) = &kept {
                    k.ack(bytes);
                }
            }
            Ok(m) if m.task() == Some(task) && (m.is_stream() || matches!(m, Msg::PathSwitch { .. })) => input(agent, true, m),
            Ok(other) => log::warn!("task {task}: unexpected message on its direct path: {:?}", std::mem::discriminant(&other)),
            Err(e) => break e,
        }
    };
    if let Some(k) = &kept {
        k.ended();
    }
    // Gone without its switch: the client went away (its task outlives it, as over the head).
    let lost = {
        let mut st = path.state.lock().unwrap();
        if st.conn != conn {
            // A later connection is the task's now; this one had switched away before it opened.
            return Ok(());
        }
        let lost = !st.merge.left_direct();
        for (_, m) in st.merge.lost_direct() {
            agent.deliver_input(m);
        }
        st.open = false;
        path.changed.notify_all();
        lost && !st.leaving
    };
    if let Some(sender) = path.sender.upgrade() {
        let _ = sender.send(Msg::PathSwitch { task }).await;
        if lost {
            log::info!("task {task}: its client's direct path is gone; its stream goes through the head");
            let _ = sender.send(at_home(agent, task)).await;
        }
    }
    match end {
        ProtoError::Closed => Ok(()),
        e => Err(e),
    }
}
