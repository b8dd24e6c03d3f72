//! IE (Immediate Eviction, the seed's baseline policy, Condor's classic
//! behaviour): when a host's owner becomes active, its IE guests are killed
//! at once and rerun from the start on a host whose owner is idle.
//!
//! What makes a rerun invisible to the task's client, kept per task in
//! [`Rerun`]: the launch spec (the rerun is the same launch under the same
//! task id); the stdin the client sent (replayed to the new run); and how
//! many bytes of stdout and stderr the client has been shown, so the new
//! run's first bytes — the same ones, for a deterministic program — are not
//! shown twice. The killed run's file changes are never committed (the
//! client commits only at `Finished`, which the head holds back), so
//! nothing it wrote survives. A task that consumed more stdin than
//! [`MAX_STDIN`] cannot be rerun and lingers instead (status says so).
//! Reruns wait in the launch queue for a free core on any host whose owner
//! is idle (a `--host` pin names where the first run starts); a lost host's
//! IE tasks are rerun the same way.

use crate::queue::Queued;
use crate::Head;
use starling_proto::{GuestPolicy, Msg, Stream, TaskId, TaskSpec};

/// Stdin kept for a replay; a task that reads more cannot be rerun.
pub(crate) const MAX_STDIN: usize = 8 << 20;

/// Host name of a route whose task waits in the queue for its rerun.
pub(crate) const QUEUED_FOR_RERUN: &str = "(queued: rerun)";

/// Everything needed to run a task again from the start (IE).
pub(crate) struct Rerun {
    pub(crate) spec: TaskSpec,
    pub(crate) reference: u64,
    /// Bytes of stdout, stderr the client has been sent, over all runs.
    sent: [u64; 2],
    /// Bytes of the current run's stdout, stderr still to drop (an earlier run sent them).
    skip: [u64; 2],
    stdin: Vec<u8>,
    stdin_eof: bool,
    /// More stdin than [`MAX_STDIN`] went to the task: it can no longer be rerun.
    pub(crate) stdin_overflow: bool,
    /// The host the task is being evicted from (its kill is under way).
    pub(crate) evicting: Option<String>,
    /// Runs started so far (1 = the first).
    pub(crate) runs: u32,
}

impl Rerun {
    pub(crate) fn new(spec: TaskSpec, reference: u64) -> Rerun {
        Rerun {
            spec,
            reference,
            sent: [0; 2],
            skip: [0; 2],
            stdin: Vec::new(),
            stdin_eof: false,
            stdin_overflow: false,
            evicting: None,
            runs: 1,
        }
    }

    /// The part of a run's output the client has not seen yet (`None`: nothing).
    fn unseen(&mut self, stream: Stream, mut data: Vec<u8>) -> Option<Vec<u8>> {
        let i = match stream {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        };
        let n = u64::try_from(data.len()).unwrap_or(u64::MAX);
        let drop = self.skip[i].min(n);
        self.skip[i] -= drop;
        data.drain(..usize::try_from(drop).unwrap_or(data.len()));
        self.sent[i] += n - drop;
        (!data.is_empty()).then_some(data)
    }

    fn record_stdin(&mut self, data: &[u8]) {
        if self.stdin_overflow {
            return;
        }
        if self.stdin.len() + data.len() > MAX_STDIN {
            self.stdin_overflow = true;
            self.stdin = Vec::new();
        } else {
            self.stdin.extend_from_slice(data);
        }
    }

    /// A new run starts: its output repeats what was sent.
    fn restart(&mut self) {
        self.skip = self.sent;
        self.evicting = None;
        self.runs += 1;
    }
}

/// Is a task of policy `own`, on a host of policy `host`, an IE guest?
pub(crate) fn is_ie(own: Option<GuestPolicy>, host: Option<GuestPolicy>) -> bool {
    own.or(host) == Some(GuestPolicy::ImmediateEviction)
}

impl Head {
    /// A host's IE guests, now that its owner is active: kill each (its
    /// `Finished` then requeues it, [`Head::rerun_ended`]).
    pub(crate) async fn evict(&self, host: &str) -> Vec<TaskId> {
        let (agent, tasks) = {
            let mut st = self.state.lock().unwrap();
            let host_policy = st.hosts.get(host).and_then(|h| h.info.owner.as_ref()).and_then(|o| GuestPolicy::parse(&o.policy).ok());
            let agent = st.hosts.get(host).map(|h| h.tx.clone());
            let mut tasks = Vec::new();
            for (t, r) in st.routes.iter_mut() {
                if r.host != host || r.moving.is_some() || !is_ie(r.policy, host_policy) {
                    continue;
                }
                if let Some(re) = r.rerun.as_mut().filter(|re| re.evicting.is_none() && !re.stdin_overflow) {
                    re.evicting = Some(host.to_string());
                    tasks.push(*t);
                }
            }
            (agent, tasks)
        };
        if let Some(a) = agent {
            for &task in &tasks {
                log::info!("IE: evicting task {task} from {host}: its owner is active");
                let _ = a.send(Msg::Signal { task, signo: libc::SIGKILL }).await;
            }
        }
        tasks
    }

    /// A message from a task's host, seen by the eviction policy first:
    /// output the client already saw is dropped, an evicted run's end
    /// requeues the task. `None`: consumed.
    pub(crate) async fn rerun_filter(&self, m: Msg) -> Option<Msg> {
        let Some(task) = m.task() else { return Some(m) };
        let ended = {
            let mut st = self.state.lock().unwrap();
            let Some(re) = st.routes.get_mut(&task).and_then(|r| r.rerun.as_mut()) else { return Some(m) };
            match m {
                Msg::Output { task, stream, data } => {
                    return re.unseen(stream, data).map(|data| Msg::Output { task, stream, data });
                }
                Msg::ChangeChunks { .. } if re.evicting.is_some() => return None,
                Msg::Finished { .. } | Msg::Error { .. } if re.evicting.is_some() => true,
                m => return Some(m),
            }
        };
        if ended {
            self.requeue(task, "evicted").await;
        }
        None
    }

    /// Stdin on its way to a rerunnable task: kept for a replay.
    pub(crate) fn record_stdin(&self, m: &Msg) {
        let mut st = self.state.lock().unwrap();
        match m {
            Msg::Stdin { task, data } => {
                if let Some(re) = st.routes.get_mut(task).and_then(|r| r.rerun.as_mut()) {
                    re.record_stdin(data);
                }
            }
            Msg::StdinEof { task } => {
                if let Some(re) = st.routes.get_mut(task).and_then(|r| r.rerun.as_mut()) {
                    re.stdin_eof = true;
                }
            }
            _ => {}
        }
    }

    /// Put a task whose run ended without finishing (evicted, or its host
    /// lost) back in the queue, for a host whose owner is idle. `false`:
    /// it cannot be rerun.
    pub(crate) async fn requeue(&self, task: TaskId, why: &str) -> bool {
        let queued = {
            let mut st = self.state.lock().unwrap();
            let st = &mut *st;
            let Some(r) = st.routes.get_mut(&task) else { return false };
            let Some(client) = r.client.clone() else { return false };
            let Some(re) = r.rerun.as_mut().filter(|re| !re.stdin_overflow) else { return false };
            re.restart();
            let mut spec = re.spec.clone();
            // `--host` says where to start; a rerun goes wherever an owner is idle.
            spec.host = None;
            let reference = re.reference;
            if let Some(h) = st.hosts.get_mut(&r.host) {
                h.cores_busy = h.cores_busy.saturating_sub(r.cores);
            }
            log::info!("task {task} {why} on {}: rerun {} queued for a host whose owner is idle", r.host, re.runs);
            r.host = QUEUED_FOR_RERUN.to_string();
            r.host_conn = 0;
            st.queue.push_back(Queued { conn: r.client_conn, client, spec, reference, job_fresh: false, rerun: Some(task) });
            crate::metrics::add(&self.counters.tasks_rerun, 1);
            true
        };
        if queued {
            self.drain_queue().await;
        }
        queued
    }

    /// A rerun is placed: point its route at the new host and replay its stdin there.
    pub(crate) async fn rerun_started(&self, task: TaskId, host: String, host_conn: u64, host_tx: &starling_proto::conn::Outgoing) {
        let replay = {
            let mut st = self.state.lock().unwrap();
            let Some(r) = st.routes.get_mut(&task) else { return };
            r.host = host;
            r.host_conn = host_conn;
            r.rerun.as_ref().map(|re| (re.stdin.clone(), re.stdin_eof))
        };
        if let Some((stdin, eof)) = replay {
            if !stdin.is_empty() {
                let _ = host_tx.send(Msg::Stdin { task, data: stdin }).await;
            }
            if eof {
                let _ = host_tx.send(Msg::StdinEof { task }).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TaskSpec {
        TaskSpec {
            policy: Some(GuestPolicy::ImmediateEviction),
            ..TaskSpec::new(vec![b"true".to_vec()], starling_proto::WirePath::root())
        }
    }

    #[test]
    fn a_rerun_shows_only_output_the_client_has_not_seen() {
        let mut re = Rerun::new(spec(), 1);
        assert_eq!(re.unseen(Stream::Stdout, b"line 1\nli".to_vec()), Some(b"line 1\nli".to_vec()));
        assert_eq!(re.unseen(Stream::Stderr, b"warn\n".to_vec()), Some(b"warn\n".to_vec()));
        re.restart();
        // The second run repeats the first's output, in other pieces, then goes on.
        assert_eq!(re.unseen(Stream::Stdout, b"line".to_vec()), None);
        assert_eq!(re.unseen(Stream::Stdout, b" 1\nline 2\n".to_vec()), Some(b"ne 2\n".to_vec()));
        assert_eq!(re.unseen(Stream::Stderr, b"warn\nmore\n".to_vec()), Some(b"more\n".to_vec()));
        re.restart();
        assert_eq!(re.unseen(Stream::Stdout, b"line 1\nline 2\nline 3\n".to_vec()), Some(b"line 3\n".to_vec()));
        assert_eq!(re.runs, 3);
    }

    #[test]
    fn stdin_beyond_the_limit_makes_a_task_not_rerunnable() {
        let mut re = Rerun::new(spec(), 1);
        re.record_stdin(&vec![0; MAX_STDIN]);
        assert!(!re.stdin_overflow);
        re.record_stdin(b"x");
        assert!(re.stdin_overflow);
        assert!(re.stdin.is_empty());
    }

    #[test]
    fn a_task_policy_wins_over_its_host() {
        assert!(is_ie(Some(GuestPolicy::ImmediateEviction), Some(GuestPolicy::LingerForever)));
        assert!(is_ie(None, Some(GuestPolicy::ImmediateEviction)));
        assert!(!is_ie(Some(GuestPolicy::LingerLonger), Some(GuestPolicy::ImmediateEviction)));
        assert!(!is_ie(None, None));
    }
}
