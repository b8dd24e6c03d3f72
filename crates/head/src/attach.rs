//! Tasks that outlive their client (`starling attach`, issue 11 part 6).
//!
//! A task on a terminal is a session the user may leave and come back to, as
//! with tmux or mosh: when its client goes away (killed, or its link lost)
//! the task keeps running where it is, and `starling attach TASK` makes
//! another client its own. For that the head keeps, per such task, the output
//! its client has not acknowledged writing (`OutputAck`; bounded by
//! [`starling_proto::unacked::MAX_UNACKED`], oldest dropped first; a task at home: what went to its client
//! directly, which the home agent hands over when that client goes away, `agent::direct`) and, while no client is attached,
//! every other message for the client (file requests, which the task waits
//! for; its changes and its end). An attach replays exactly that, so the new
//! client prints from the first byte the last one had not, and commits the
//! task's changes when it ends. A task that ends while detached is kept (at
//! most [`MAX_ENDED`]) so an attach still gets its output and status.
//! The X connections of a detached task end: they were the old client's.

use crate::{ClientIdentity, Head, State};
use starling_proto::conn::Outgoing;
use starling_proto::unacked::UnackedOutput;
use starling_proto::{Msg, TaskId};
use std::collections::{BTreeMap, VecDeque};

/// Most tasks kept after ending with no client attached.
pub(crate) const MAX_ENDED: usize = 64;

/// What a task's client has not seen yet.
#[derive(Default)]
pub(crate) struct Replay {
    /// `Output` not acknowledged yet (bounded by [`starling_proto::unacked::MAX_UNACKED`]).
    output: UnackedOutput,
    /// How many of `output` went to the attached client.
    sent: usize,
    /// Other messages not sent to a client yet, in order.
    held: VecDeque<Msg>,
    /// File requests sent to a client and not answered: sent again to the next one.
    asked: BTreeMap<u64, Msg>,
    /// A flush is under way: it sends what is added meanwhile.
    flushing: bool,
}

impl Replay {
    /// A message from the task's host for its client.
    fn push(&mut self, m: Msg, attached: bool) {
        match m {
            Msg::Output { .. } => {
                let gone = self.output.push(m);
                self.sent = self.sent.saturating_sub(gone);
            }
            // The X server's end of these connections was the client's, which is gone.
            Msg::X11Open { .. } | Msg::X11Data { .. } | Msg::X11Close { .. } if !attached => {}
            m => self.held.push_back(m),
        }
    }

    /// The client wrote `bytes` more of the output (that came through the head).
    pub(crate) fn ack(&mut self, bytes: u64) {
        let done = self.output.ack(bytes);
        self.sent = self.sent.saturating_sub(done);
    }

    /// A client answered file request `id`.
    pub(crate) fn answered(&mut self, id: u64) {
        self.asked.remove(&id);
    }

    /// The client is gone: the next gets again what this one did not acknowledge or answer.
    fn detach(&mut self) {
        self.sent = 0;
        let asked = std::mem::take(&mut self.asked);
        for (i, m) in asked.into_values().enumerate() {
            self.held.insert(i, m);
        }
    }

    /// What the attached client has not been sent, marked sent.
    fn unsent(&mut self) -> Vec<Msg> {
        let mut out = self.output.from(self.sent);
        self.sent = self.output.len();
        for m in self.held.drain(..) {
            if let Msg::FileRequest { id, .. } = &m {
                self.asked.insert(*id, m.clone());
            }
            out.push(m);
        }
        out
    }
}

/// A task that ended with no client attached, kept for an attach.
pub(crate) struct Ended {
    pub(crate) replay: Replay,
    pub(crate) client: Option<Outgoing>,
    pub(crate) client_conn: u64,
    pub(crate) uid: u32,
    pub(crate) host: String,
}

impl State {
    /// The replay of a task that may outlive its client, running or ended, and its client.
    fn replay_of(&mut self, task: TaskId) -> Option<(&mut Replay, Option<Outgoing>)> {
        if let Some(r) = self.routes.get_mut(&task) {
            let c = r.client.clone();
            return r.outlive.as_mut().map(|o| (o, c));
        }
        self.ended.get_mut(&task).map(|e| (&mut e.replay, e.client.clone()))
    }

    /// The client of connection `conn` is gone: its tasks that outlive it are detached.
    /// Returns the tasks it had that do not (to be ended).
    pub(crate) fn detach_client(&mut self, conn: u64) -> Vec<TaskId> {
        let mut end = Vec::new();
        for (task, r) in self.routes.iter_mut().filter(|(_, r)| r.client_conn == conn) {
            r.client = None;
            match r.outlive.as_mut() {
                Some(o) => {
                    o.detach();
                    log::info!("task {task}: its client went away; it keeps running on {} (starling attach {task})", r.host);
                }
                None => end.push(*task),
            }
        }
        for e in self.ended.values_mut().filter(|e| e.client_conn == conn) {
            e.client = None;
            e.replay.detach();
        }
        end
    }
}

impl Head {
    /// A host's message for a task that may outlive its client: kept until its client has it.
    /// `Err(m)`: not such a task (route it as usual).
    pub(crate) async fn keep_for_client(&self, task: TaskId, m: Msg) -> Result<(), Msg> {
        let ended = matches!(m, Msg::Finished { .. } | Msg::Error { .. });
        let moving = {
            let mut st = self.state.lock().unwrap();
            let Some(r) = st.routes.get_mut(&task) else { return Err(m) };
            let attached = r.client.is_some();
            let Some(o) = r.outlive.as_mut() else { return Err(m) };
            o.push(m, attached);
            if ended {
                let mut r = st.end_route(task).expect("the route is there");
                let moving = r.moving.take();
                let replay = r.outlive.take().unwrap_or_default();
                if r.client.is_none() {
                    log::info!("task {task} ended with no client attached: kept for `starling attach {task}`");
                }
                while st.ended.len() >= MAX_ENDED {
                    let Some(oldest) = st.ended.keys().min().copied() else { break };
                    st.ended.remove(&oldest);
                }
                st.ended.insert(task, Ended { replay, client: r.client, client_conn: r.client_conn, uid: r.uid, host: r.host });
                moving
            } else {
                None
            }
        };
        self.move_outlived(task, moving).await;
        self.flush(task).await;
        Ok(())
    }

    /// Send the attached client what it has not been sent (one flush per task at a time).
    async fn flush(&self, task: TaskId) {
        let mut first = true;
        loop {
            let (client, batch) = {
                let mut st = self.state.lock().unwrap();
                let Some((replay, client)) = st.replay_of(task) else { return };
                let Some(client) = client else {
                    replay.flushing &= !first;
                    return;
                };
                if first && replay.flushing {
                    return;
                }
                first = false;
                replay.flushing = true;
                let batch = replay.unsent();
                if batch.is_empty() {
                    replay.flushing = false;
                    // An ended task whose end reached its client is done with.
                    if st.ended.get(&task).is_some_and(|e| e.replay.held.is_empty() && e.replay.asked.is_empty()) {
                        st.ended.remove(&task);
                    }
                    return;
                }
                (client, batch)
            };
            for m in batch {
                if client.send(m).await.is_err() {
                    break;
                }
            }
        }
    }

    /// `OutputAck` or a `FileResponse` from a task's client: what it no longer needs kept.
    pub(crate) fn client_has(&self, conn: u64, m: &Msg) {
        let Some(task) = m.task() else { return };
        let mut st = self.state.lock().unwrap();
        let mine = st.routes.get(&task).map(|r| r.client_conn).or_else(|| st.ended.get(&task).map(|e| e.client_conn)) == Some(conn);
        let Some((replay, _)) = st.replay_of(task).filter(|_| mine) else { return };
        match m {
            Msg::OutputAck { bytes, .. } => replay.ack(*bytes),
            Msg::FileResponse { id, .. } => replay.answered(*id),
            _ => {}
        }
    }

    /// `starling attach TASK`: make connection `conn` the task's client.
    pub(crate) async fn attach(&self, conn: u64, tx: &Outgoing, who: &ClientIdentity, task: TaskId, reference: u64, force: bool) {
        let taken = {
            let mut st = self.state.lock().unwrap();
            let st = &mut *st;
            let found = match (st.routes.get_mut(&task), st.ended.get_mut(&task)) {
                (Some(r), _) => match r.outlive.as_mut() {
                    Some(o) => Ok((&mut r.client, &mut r.client_conn, o, r.uid, r.host.clone())),
                    None => Err(format!("task {task} is not on a terminal: only a terminal task outlives its client, so there is nothing to attach to")),
                },
                (None, Some(e)) => Ok((&mut e.client, &mut e.client_conn, &mut e.replay, e.uid, format!("{} (ended)", e.host))),
                (None, None) => Err(format!("no task {task}: it has ended, or never ran (`starling ps` lists the running tasks)")),
            };
            found.and_then(|(client, client_conn, replay, uid, host)| {
                if let Some(c) = who.as_ref().filter(|c| c.uid != 0 && c.uid != uid) {
                    return Err(format!("task {task} runs as uid {uid}: uid {} may not attach to it", c.uid));
                }
                if client.is_some() && !force {
                    return Err(format!(
                        "task {task} has a client attached already (its own `starling exec`, or an attach); `starling attach --force {task}` takes it over"
                    ));
                }
                let old = client.take();
                if old.is_some() {
                    replay.detach();
                }
                *client_conn = conn;
                Ok((old, host, std::mem::take(&mut replay.output.dropped)))
            })
        };
        let (old, host, dropped) = match taken {
            Ok(t) => t,
            Err(message) => {
                let _ = tx.send(Msg::LaunchFailed { reference, message }).await;
                return;
            }
        };
        if let Some(old) = old {
            let message = "another client took this task over (`starling attach --force`); it goes on there".to_string();
            let _ = old.send(Msg::Error { task: Some(task), message }).await;
        }
        if dropped > 0 {
            log::warn!("task {task}: {dropped} bytes of its output were dropped unseen while it had no client");
        }
        log::info!("task {task} on {host}: a client attached");
        let _ = tx.send(Msg::Started { task, host, reference, job_fresh: false }).await;
        // Only now (after `Started`) may the replay reach the client.
        {
            let mut st = self.state.lock().unwrap();
            if let Some(r) = st.routes.get_mut(&task).filter(|r| r.client_conn == conn) {
                r.client = Some(tx.clone());
            } else if let Some(e) = st.ended.get_mut(&task).filter(|e| e.client_conn == conn) {
                e.client = Some(tx.clone());
            }
        }
        self.flush(task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::test_support::{output as out, output_bytes as bytes};

    #[test]
    fn a_new_client_gets_exactly_what_the_last_one_did_not_acknowledge() {
        let mut r = Replay::default();
        r.push(out(b"abc"), true);
        r.push(out(b"defg"), true);
        assert_eq!(bytes(&r.unsent()), b"abcdefg");
        assert!(r.unsent().is_empty(), "sent once");
        r.ack(5); // "abcde" written
        r.detach();
        r.push(out(b"hi"), false);
        assert_eq!(bytes(&r.unsent()), b"fghi");
    }

    #[test]
    fn unanswered_file_requests_go_to_the_next_client_and_x11_of_a_detached_task_is_dropped() {
        let mut r = Replay::default();
        let req = |id| Msg::FileRequest { task: TaskId(1), id, req: starling_proto::FileReq::GetChunks { hashes: Vec::new() } };
        r.push(req(7), true);
        r.push(req(8), true);
        assert_eq!(r.unsent().len(), 2);
        r.answered(7);
        r.detach();
        r.push(Msg::X11Close { task: TaskId(1), stream: 0 }, false);
        let again = r.unsent();
        assert!(matches!(again.as_slice(), [Msg::FileRequest { id: 8, .. }]), "{again:?}");
    }
}
