//! Two paths for one task's stream: through the head, or straight between the task's client and
//! the home site (the client's own machine) over the home agent's Unix socket.
//!
//! A task at home would otherwise pay the link to the head for every keystroke and echo. Its
//! stream ([`Msg::is_stream`]: terminal, pipes, X) goes direct while it runs at home; every
//! other message (file requests, changes, its end) still goes through the head, which keeps the
//! task's route, moves and replay. The stream switches paths when the client opens the direct
//! path, when the task leaves home (a move's freeze) or ends, and when either end goes away.
//!
//! Each sender switches at one point of its own message order and says so on the path it
//! leaves: a [`Msg::PathSwitch`] is the last of the stream on that path. Each receiver reads the
//! stream from one path at a time ([`PathMerge`]): what comes early on the other is held until
//! the switch arrives, so no byte is lost, repeated or reordered across a switch, whatever the
//! two paths' delays. Both ends run the same two pieces: [`spawn_sender`] and [`PathMerge`].
//!
//! A terminal task's output must survive its client going away (`starling attach`): the head
//! keeps what it relays until the client acknowledges writing it ([`Msg::OutputAck`]); the home
//! agent's sender keeps what it sends directly ([`KeptOutput`]). The client acknowledges each
//! output on the path it came by ([`PathMerge::arrived`] says which), so each keeper counts only
//! its own. When the sender leaves a direct connection it waits until its client acknowledged all
//! it sent there, or the connection ended: what is left then (the client went away unwritten) goes
//! to the head in its place in the order, before anything else the sender has, and the head
//! replays it with the rest.
//!
//! ```text
//! opening (client asks):  client ─DirectOpen─▶ home (direct)   home ─DirectOpen─▶ client (direct: agreed)
//!                         home ─PathSwitch─▶ head ─▶ client     then the task's output direct
//!                         client ─PathSwitch─▶ head ─▶ home     then the client's input direct
//! closing (home decides): home ─PathSwitch─▶ client (direct)    then output through the head
//!                         client ─PathSwitch─▶ home (direct)    then input through the head
//! ```

use crate::conn::Outgoing;
use crate::unacked::UnackedOutput;
use crate::{Msg, TaskId};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// A direct connection waiting to be taken by a task's sender (see [`Msg::DirectOpen`]).
pub type DirectSlot = Arc<Mutex<Option<Direct>>>;

/// A direct connection, for a task's sender.
pub struct Direct {
    pub tx: Outgoing,
    /// Where the sender keeps the output it sends here until its client acknowledges it (a home
    /// agent's terminal task); `None`: nothing is kept.
    pub kept: Option<Arc<KeptOutput>>,
}

/// Longest a sender leaving a direct connection waits for its client to acknowledge the output
/// it sent there (a client that stopped writing, e.g. a suspended `starling exec`): past it, that
/// output is not kept for an attach.
pub const ACK_WAIT: Duration = Duration::from_secs(30);

/// The output a task's sender sent on one direct connection and its client has not acknowledged
/// writing; acknowledgements come from that connection's reader, which says when it ended.
#[derive(Debug, Default)]
pub struct KeptOutput {
    state: Mutex<Kept>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct Kept {
    unacked: UnackedOutput,
    ended: bool,
}

impl KeptOutput {
    /// The client wrote `bytes` more of the output sent on this connection.
    pub fn ack(&self, bytes: u64) {
        self.state.lock().unwrap().unacked.ack(bytes);
        self.changed.notify_one();
    }

    /// The connection ended: no acknowledgement follows.
    pub fn ended(&self) {
        self.state.lock().unwrap().ended = true;
        self.changed.notify_one();
    }

    fn push(&self, m: Msg) {
        self.state.lock().unwrap().unacked.push(m);
    }

    /// Once the client acknowledged all of it or the connection ended (at most `wait`): the
    /// output its client never acknowledged.
    async fn settled(&self, task: TaskId, wait: Duration) -> Vec<Msg> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            {
                let mut k = self.state.lock().unwrap();
                if k.unacked.is_empty() {
                    return Vec::new();
                }
                if k.ended {
                    return k.unacked.take();
                }
            }
            // (`notify_one` keeps a permit: a change between the check and here is not missed.)
            if tokio::time::timeout_at(deadline, self.changed.notified()).await.is_err() {
                log::warn!("task {task}: its client did not acknowledge its direct output in {wait:?}; that output is not kept for `starling attach`");
                return Vec::new();
            }
        }
    }
}

/// Leave direct connection `d` (its switch sent already): once its output is settled, what its
/// client never acknowledged goes to `head`, in its place in the order.
async fn leave(task: TaskId, d: Direct, head: &Outgoing) -> Result<(), mpsc::error::SendError<Msg>> {
    drop(d.tx);
    let Some(kept) = d.kept else { return Ok(()) };
    for m in kept.settled(task, ACK_WAIT).await {
        head.send(m).await?;
    }
    Ok(())
}

/// Whether a message's place in the task's stream order matters to its receiver: the stream,
/// the switches, and the task's end (which must follow all of its output). File requests and
/// output chunks do not wait for a switch.
fn ordered(m: &Msg) -> bool {
    m.is_stream() || matches!(m, Msg::PathSwitch { .. } | Msg::Finished { .. } | Msg::Error { task: Some(_), .. })
}

/// The receiving end of one task's two paths: which one the stream is read from now, and what
/// came early on the other.
#[derive(Debug, Default)]
pub struct PathMerge {
    /// The stream is read from the direct path now (else the head's).
    direct: bool,
    /// Ordered messages that came on the path not read now, in order.
    held: VecDeque<Msg>,
    /// The direct connection is gone: a switch to it, when it comes, ends at once.
    gone: bool,
    /// The stream left the direct path (its sender's switch, or the connection lost) since
    /// [`PathMerge::opened`].
    left_direct: bool,
}

impl PathMerge {
    /// A direct connection was agreed on: the stream comes there after the head's path says so.
    pub fn opened(&mut self) {
        self.gone = false;
        self.left_direct = false;
    }

    /// Whether the stream is read from the direct path now.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether the stream left the direct path since it was opened (the peer's switch read, or
    /// the connection lost): nothing more comes on it.
    pub fn left_direct(&self) -> bool {
        self.left_direct
    }

    /// `m` came on the direct path (`via_direct`) or the head's: what to act on now, in order,
    /// each with the path it came by (true: direct). A switch is consumed here.
    pub fn arrived(&mut self, via_direct: bool, m: Msg) -> Vec<(bool, Msg)> {
        let mut out = Vec::new();
        self.take(via_direct, m, &mut out);
        out
    }

    fn take(&mut self, via_direct: bool, m: Msg, out: &mut Vec<(bool, Msg)>) {
        if !ordered(&m) {
            out.push((via_direct, m));
        } else if via_direct != self.direct {
            self.held.push_back(m);
        } else if matches!(m, Msg::PathSwitch { .. }) {
            self.switch(out);
        } else {
            out.push((via_direct, m));
        }
    }

    /// The path read now ended: read the other, starting with what it already sent.
    fn switch(&mut self, out: &mut Vec<(bool, Msg)>) {
        self.direct = !self.direct;
        if !self.direct {
            self.left_direct = true;
        }
        let via = self.direct;
        for m in std::mem::take(&mut self.held) {
            // (After a switch among them, the rest are held again.)
            self.take(via, m, out);
        }
        if self.direct && self.gone {
            // The direct connection went away: what it sent is out, the head's path is next.
            self.direct = false;
            self.left_direct = true;
        }
    }

    /// The direct connection ended without a switch (its peer went away): what it sent is all
    /// it will send; the stream goes on through the head.
    pub fn lost_direct(&mut self) -> Vec<(bool, Msg)> {
        self.gone = true;
        let mut out = Vec::new();
        if self.direct {
            self.switch(&mut out);
        }
        out
    }
}

/// Start the sender of one task's messages: producers send into the returned channel; its
/// stream goes to the direct connection while there is one, everything else (and the stream
/// otherwise) to `head`, in the order sent. Control, in the same channel (so a switch falls at
/// an exact point of the order): [`Msg::DirectOpen`] takes the connection in `slot` and switches
/// to it, [`Msg::PathSwitch`] switches back to the head. The task's end (`Finished`, or its
/// `Error`) switches back first. `on_direct` says which path the stream takes now. Leaving a
/// direct connection whose output is kept waits until that output is settled ([`leave`]).
pub fn spawn_sender(task: TaskId, head: Outgoing, slot: DirectSlot, on_direct: Arc<std::sync::atomic::AtomicBool>) -> Outgoing {
    use std::sync::atomic::Ordering;
    let (tx, mut rx) = mpsc::channel::<Msg>(crate::conn::QUEUE);
    tokio::spawn(async move {
        let mut direct: Option<Direct> = None;
        while let Some(m) = rx.recv().await {
            let to_head = match m {
                Msg::DirectOpen { .. } => {
                    let Some(d) = slot.lock().unwrap().take() else { continue };
                    if direct.is_none() && head.send(Msg::PathSwitch { task }).await.is_err() {
                        break;
                    }
                    direct = Some(d);
                    on_direct.store(true, Ordering::SeqCst);
                    continue;
                }
                Msg::PathSwitch { .. } => {
                    on_direct.store(false, Ordering::SeqCst);
                    if let Some(d) = direct.take() {
                        let _ = d.tx.send(Msg::PathSwitch { task }).await;
                        if leave(task, d, &head).await.is_err() {
                            break;
                        }
                    }
                    continue;
                }
                m if m.is_stream() => match &direct {
                    Some(d) => {
                        let kept = matches!(m, Msg::Output { .. }).then_some(d.kept.as_ref()).flatten();
                        if let Some(k) = kept {
                            k.push(m.clone());
                        }
                        let kept = kept.is_some();
                        match d.tx.send(m).await {
                            Ok(()) => continue,
                            // Gone: its receiver's end learns so from the connection.
                            Err(mpsc::error::SendError(m)) => {
                                on_direct.store(false, Ordering::SeqCst);
                                if let Some(d) = direct.take() {
                                    if leave(task, d, &head).await.is_err() {
                                        break;
                                    }
                                }
                                if kept {
                                    // (Handed over with the rest of the kept output.)
                                    continue;
                                }
                                m
                            }
                        }
                    }
                    None => m,
                },
                m => {
                    if matches!(m, Msg::Finished { .. } | Msg::Error { task: Some(_), .. }) {
                        on_direct.store(false, Ordering::SeqCst);
                        if let Some(d) = direct.take() {
                            let _ = d.tx.send(Msg::PathSwitch { task }).await;
                            if leave(task, d, &head).await.is_err() {
                                break;
                            }
                        }
                    }
                    m
                }
            };
            if head.send(to_head).await.is_err() {
                break;
            }
        }
    });
    tx
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: TaskId = TaskId(1);

    fn out(s: &str) -> Msg {
        crate::test_support::output(s.as_bytes())
    }

    fn text(ms: &[(bool, Msg)]) -> String {
        ms.iter()
            .map(|(_, m)| match m {
                Msg::Output { data, .. } => String::from_utf8_lossy(data).into_owned(),
                Msg::Finished { .. } => "<end>".into(),
                Msg::FileRequest { .. } => "<file>".into(),
                _ => "<?>".into(),
            })
            .collect()
    }

    fn switch() -> Msg {
        Msg::PathSwitch { task: T }
    }

    #[test]
    fn direct_output_waits_for_the_heads_switch_and_the_heads_for_the_direct_ones() {
        let mut m = PathMerge::default();
        m.opened();
        let mut seen = Vec::new();
        seen.extend(m.arrived(true, out("c"))); // early on the direct path
        seen.extend(m.arrived(false, out("a")));
        seen.extend(m.arrived(false, out("b")));
        assert_eq!(text(&seen), "ab");
        seen.extend(m.arrived(false, switch()));
        assert_eq!(text(&seen), "abc");
        assert!(m.is_direct());
        // Leaving: the head's output (and the end) wait for the direct path's switch.
        seen.extend(m.arrived(false, out("e")));
        seen.extend(m.arrived(false, Msg::Finished { task: T, status: crate::ExitStatus::Code(0), changes: vec![], accessed: vec![] }));
        seen.extend(m.arrived(true, out("d")));
        assert_eq!(text(&seen), "abcd");
        seen.extend(m.arrived(true, switch()));
        assert_eq!(text(&seen), "abcde<end>");
        assert!(m.left_direct() && !m.is_direct());
    }

    #[test]
    fn file_requests_never_wait_for_a_switch() {
        let mut m = PathMerge::default();
        m.opened();
        assert_eq!(text(&m.arrived(false, switch())), "");
        let req = Msg::FileRequest { task: T, id: 1, req: crate::FileReq::GetChunks { hashes: vec![] } };
        assert_eq!(text(&m.arrived(false, req)), "<file>");
    }

    #[test]
    fn a_lost_direct_path_gives_what_it_sent_then_the_heads() {
        let mut m = PathMerge::default();
        m.opened();
        m.arrived(false, switch());
        let mut seen = m.arrived(false, out("y")); // the head's, after the loss
        seen.extend(m.arrived(true, out("x")));
        seen.extend(m.lost_direct());
        assert_eq!(text(&seen), "xy");
        assert!(!m.is_direct() && m.left_direct());
        // Lost before the head's switch came: what it sent comes at that switch, then the head's.
        let mut m = PathMerge::default();
        m.opened();
        let mut seen = m.arrived(true, out("p"));
        seen.extend(m.lost_direct());
        seen.extend(m.arrived(false, out("o")));
        seen.extend(m.arrived(false, switch()));
        seen.extend(m.arrived(false, out("q")));
        assert_eq!(text(&seen), "opq");
        assert!(!m.is_direct());
    }

    /// A sender with a direct connection whose output is kept: its head channel, its direct
    /// channel, the kept output, and its input.
    async fn sender_on_direct() -> (mpsc::Receiver<Msg>, mpsc::Receiver<Msg>, Arc<KeptOutput>, Outgoing) {
        let (head_tx, head_rx) = mpsc::channel(64);
        let (direct_tx, direct_rx) = mpsc::channel(64);
        let kept = Arc::new(KeptOutput::default());
        let slot: DirectSlot = Arc::new(Mutex::new(Some(Direct { tx: direct_tx, kept: Some(kept.clone()) })));
        let tx = spawn_sender(T, head_tx, slot, Arc::default());
        tx.send(Msg::DirectOpen { task: T }).await.unwrap();
        (head_rx, direct_rx, kept, tx)
    }

    async fn next(rx: &mut mpsc::Receiver<Msg>) -> String {
        let m = rx.recv().await.expect("a message");
        if matches!(m, Msg::PathSwitch { .. }) { "<switch>".into() } else { text(&[(false, m)]) }
    }

    #[tokio::test]
    async fn leaving_a_direct_path_hands_the_unacknowledged_output_to_the_head_before_what_follows() {
        let (mut head, mut direct, kept, tx) = sender_on_direct().await;
        assert_eq!(next(&mut head).await, "<switch>", "the head's path ends where the direct one starts");
        tx.send(out("ab")).await.unwrap();
        tx.send(out("cd")).await.unwrap();
        assert_eq!(next(&mut direct).await, "ab");
        assert_eq!(next(&mut direct).await, "cd");
        kept.ack(3); // the client wrote "abc"
        tx.send(switch()).await.unwrap();
        tx.send(out("ef")).await.unwrap();
        assert_eq!(next(&mut direct).await, "<switch>");
        // The client never writes "d": its connection ends. "d" goes to the head, then "ef".
        kept.ended();
        assert_eq!(next(&mut head).await, "d");
        assert_eq!(next(&mut head).await, "ef");
    }

    #[tokio::test]
    async fn output_the_client_acknowledged_is_not_handed_over() {
        let (mut head, mut direct, kept, tx) = sender_on_direct().await;
        assert_eq!(next(&mut head).await, "<switch>");
        tx.send(out("xyz")).await.unwrap();
        assert_eq!(next(&mut direct).await, "xyz");
        tx.send(switch()).await.unwrap();
        tx.send(out("after")).await.unwrap();
        assert_eq!(next(&mut direct).await, "<switch>");
        kept.ack(3); // all of it written: nothing to hand over
        assert_eq!(next(&mut head).await, "after");
        drop(tx);
        assert!(head.recv().await.is_none(), "nothing else went to the head");
    }
}
