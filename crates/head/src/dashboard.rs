//! The live dashboard, on the head's metrics listener (`metrics::serve`).
//!
//! * `GET /` — one self-contained HTML page (`dashboard.html`: inline CSS and JS, plots on
//!   `<canvas>`, nothing fetched from elsewhere);
//! * `GET /api/state` — what the head knows now, as JSON ([`state_json`]);
//! * `GET /api/events` — server-sent events: the same JSON as one `data:` event whenever it changes
//!   (checked every [`EVENT_TICK`]), a comment line every [`KEEPALIVE`] otherwise.
//!
//! Progress is kept per *group* of tasks ([`Groups`]): the tasks of one job (`exec --job NAME`,
//! `run -n N`, whose tasks say their count in `STARLING_TASKS`), the clone tasks of one remote-fork
//! ticket (an `sf_clone`, a `starling.Executor` pool), or the tasks of one command line of a client.
//! A group counts its tasks started, finished, failed and lost, and for a ticket the page faults
//! and fetched pages its clones reported (clones report them when they end, so a ticket's fault
//! rate is known once its clones have ended).

use crate::Head;
use serde_json::{json, Value};
use starling_proto::{ExitStatus, Msg, TaskId, TaskSpec, TASK_COUNT_ENV};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The page.
pub(crate) const PAGE: &str = include_str!("dashboard.html");
/// How often `/api/events` looks for a change.
const EVENT_TICK: Duration = Duration::from_millis(250);
/// How long `/api/events` stays silent at most (a comment line keeps proxies from closing it).
const KEEPALIVE: Duration = Duration::from_secs(15);
/// Ended groups kept for the page, newest last.
const ENDED_KEPT: usize = 50;

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// One group's progress.
#[derive(Debug, Clone)]
struct Group {
    /// `job`, `ticket` or `command`.
    kind: &'static str,
    label: String,
    command: String,
    /// Tasks the group will have, when its tasks say (`STARLING_TASKS`).
    total: Option<u64>,
    started: u64,
    finished: u64,
    /// Finished with a non-zero status.
    nonzero: u64,
    failed: u64,
    lost: u64,
    /// Cores its tasks held (a hierarchical clone task holds one per clone).
    cores: u64,
    clones_ended: u64,
    faults: u64,
    pages_fetched: u64,
    first_start: f64,
    last_end: Option<f64>,
    running: u64,
}

/// Progress of every group, and which group each live task is in.
#[derive(Default)]
pub(crate) struct Groups {
    groups: HashMap<(u64, String), Group>,
    /// Keys in the order groups were made (ended ones are dropped oldest first).
    order: Vec<(u64, String)>,
    tasks: HashMap<TaskId, (u64, String)>,
}

impl Groups {
    /// A task placed for client connection `conn`.
    pub(crate) fn started(&mut self, task: TaskId, conn: u64, spec: &TaskSpec, command: &str) {
        let (kind, label) = match (&spec.clone, &spec.job) {
            (Some(c), _) => ("ticket", format!("ticket {}", c.ticket)),
            (None, Some(j)) => ("job", j.clone()),
            (None, None) => ("command", command.to_string()),
        };
        let total = spec
            .env
            .iter()
            .find(|(k, _)| k.as_slice() == TASK_COUNT_ENV.as_bytes())
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok());
        let key = (conn, label.clone());
        if !self.groups.contains_key(&key) {
            self.order.push(key.clone());
            self.trim();
        }
        let g = self.groups.entry(key.clone()).or_insert_with(|| Group {
            kind,
            label,
            command: command.to_string(),
            total,
            started: 0,
            finished: 0,
            nonzero: 0,
            failed: 0,
            lost: 0,
            cores: 0,
            clones_ended: 0,
            faults: 0,
            pages_fetched: 0,
            first_start: unix_now(),
            last_end: None,
            running: 0,
        });
        g.started += 1;
        g.running += 1;
        g.cores += u64::from(spec.cores());
        g.last_end = None;
        if total.is_some() {
            g.total = total;
        }
        self.tasks.insert(task, key);
    }

    /// Forget the oldest groups that have no running task, beyond [`ENDED_KEPT`].
    fn trim(&mut self) {
        while self.order.len() > ENDED_KEPT {
            let Some(i) = self.order.iter().position(|k| self.groups.get(k).is_none_or(|g| g.running == 0)) else { return };
            let k = self.order.remove(i);
            self.groups.remove(&k);
        }
    }

    fn ended(&mut self, task: TaskId, f: impl FnOnce(&mut Group)) {
        let Some(key) = self.tasks.remove(&task) else { return };
        if let Some(g) = self.groups.get_mut(&key) {
            f(g);
            g.running = g.running.saturating_sub(1);
            if g.running == 0 {
                g.last_end = Some(unix_now());
            }
        }
    }

    /// What a host's task message says (as [`Head::count`] sees it).
    pub(crate) fn count(&mut self, m: &Msg) {
        match m {
            Msg::Finished { task, status, .. } => {
                let bad = *status != ExitStatus::Code(0);
                self.ended(*task, |g| {
                    g.finished += 1;
                    g.nonzero += u64::from(bad);
                });
            }
            Msg::Error { task: Some(task), .. } => self.ended(*task, |g| g.failed += 1),
            Msg::CloneStats { task, counters, .. } => {
                if let Some(g) = self.tasks.get(task).and_then(|k| self.groups.get_mut(k)) {
                    g.clones_ended += 1;
                    g.faults += counters.faults;
                    g.pages_fetched += counters.pages_fetched;
                }
            }
            _ => {}
        }
    }

    /// A task lost with its host or client.
    pub(crate) fn lost(&mut self, task: TaskId) {
        self.ended(task, |g| g.lost += 1);
    }

    fn json(&self) -> Vec<Value> {
        self.order
            .iter()
            .filter_map(|k| self.groups.get(k).map(|g| (k.0, g)))
            .map(|(conn, g)| {
                let done = g.finished + g.failed + g.lost;
                let state = if g.running > 0 {
                    "running"
                } else if g.failed + g.lost + g.nonzero > 0 {
                    "failed"
                } else {
                    "done"
                };
                // Faults per second of the ticket's life, once its clones have reported.
                let fault_rate = match (g.kind, g.last_end) {
                    ("ticket", Some(end)) if g.clones_ended > 0 && end > g.first_start => {
                        Some(g.faults as f64 / (end - g.first_start))
                    }
                    _ => None,
                };
                json!({
                    "client": conn, "kind": g.kind, "label": g.label, "command": g.command,
                    "total": g.total.unwrap_or(g.started).max(g.started), "started": g.started,
                    "running": g.running, "done": done, "finished": g.finished, "nonzero": g.nonzero,
                    "failed": g.failed, "lost": g.lost, "cores": g.cores, "state": state,
                    "clones_ended": g.clones_ended, "faults": g.faults, "pages_fetched": g.pages_fetched,
                    "fault_rate": fault_rate, "started_unix": g.first_start, "ended_unix": g.last_end,
                })
            })
            .collect()
    }
}

/// `/`: the page, with the state of this moment in it (shown before the events start; `</` is
/// escaped so the JSON cannot end the script).
pub(crate) fn page(head: &Head) -> String {
    PAGE.replacen("/*STATE*/null", &state_json(head).replace("</", "<\\/"), 1)
}

/// `/api/state`: hosts, tasks, groups (jobs and tickets), counters. Times are absolute (Unix
/// seconds), so the text changes only when the state does.
pub(crate) fn state_json(head: &Head) -> String {
    let snap = head.snapshot();
    let c = &head.counters;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let now_i = Instant::now();
    let now_u = unix_now();
    let tasks: Vec<Value> = {
        let st = head.state.lock().unwrap();
        let mut t: Vec<(&TaskId, &crate::Route)> = st.routes.iter().collect();
        t.sort_by_key(|(id, _)| id.0);
        t.iter()
            .map(|(id, r)| {
                json!({
                    "id": id.0, "host": r.host, "cores": r.cores, "command": r.command, "job": r.job,
                    "clone": r.clone_task, "moving_to": r.moving.as_ref().map(|m| m.to.clone()),
                    "started_unix": now_u - now_i.duration_since(r.started).as_secs_f64(),
                })
            })
            .collect()
    };
    let lingering = head.lingering.lock().unwrap();
    let hosts: Vec<Value> = snap
        .hosts
        .iter()
        .map(|h| {
            json!({
                "name": h.name, "addr": h.addr, "cores": h.cores, "running": h.running, "load": h.load,
                "mem_bytes": h.mem_bytes, "page_distribution": h.page_distribution,
                "owner": h.owner.as_ref().map(|o| json!({"state": o.state, "doing": lingering.doing.get(&h.name).or(Some(&o.doing))})),
            })
        })
        .collect();
    drop(lingering);
    let groups = head.groups.lock().unwrap().json();
    let (hits, misses) = (get(&c.relay_recipe_hits) + get(&c.relay_chunk_hits), get(&c.relay_recipe_misses) + get(&c.relay_chunk_misses));
    json!({
        "head": snap.listen,
        "hosts": hosts,
        "tasks": tasks,
        "queued": snap.queued,
        "jobs": groups,
        "relay_cache": snap.relay_cache,
        "counters": {
            "tasks_started": get(&c.tasks_started), "tasks_finished": get(&c.tasks_finished),
            "tasks_failed": get(&c.tasks_failed), "tasks_lost": get(&c.tasks_lost),
            "clones": get(&c.clones), "clone_faults": get(&c.clone_faults),
            "clone_pages_fetched": get(&c.clone_pages_fetched),
            "cache_hits": hits, "cache_misses": misses,
            "bytes_from_clients": get(&c.relay_bytes_from_clients), "bytes_to_hosts": get(&c.relay_bytes_to_hosts),
        },
    })
    .to_string()
}

/// `/api/events`: the state as an event now and on every change, until the peer goes.
pub(crate) async fn events(head: &Head, sock: &mut TcpStream) -> std::io::Result<()> {
    sock.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: keep-alive\r\nAccess-Control-Allow-Origin: *\r\n\r\nretry: 1000\n\n",
    )
    .await?;
    let mut last = String::new();
    let mut quiet = Instant::now();
    loop {
        let now = state_json(head);
        if now != last {
            sock.write_all(format!("event: state\ndata: {now}\n\n").as_bytes()).await?;
            last = now;
            quiet = Instant::now();
        } else if quiet.elapsed() >= KEEPALIVE {
            sock.write_all(b": keepalive\n\n").await?;
            quiet = Instant::now();
        }
        tokio::time::sleep(EVENT_TICK).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::WirePath;

    fn spec(job: Option<&str>, count: Option<u32>) -> TaskSpec {
        let mut s = TaskSpec { job: job.map(str::to_string), ..TaskSpec::new(vec![b"true".to_vec()], WirePath::root()) };
        if let Some(n) = count {
            s.set_task_index(0, usize::try_from(n).unwrap());
        }
        s
    }

    #[test]
    fn a_job_counts_its_tasks_to_done() {
        let mut g = Groups::default();
        for t in 1..=3 {
            g.started(TaskId(t), 7, &spec(Some("sweep"), Some(4)), "sim");
        }
        let fin = |t, code| Msg::Finished { task: TaskId(t), status: ExitStatus::Code(code), changes: vec![], accessed: vec![] };
        g.count(&fin(1, 0));
        let j = &g.json()[0];
        assert_eq!((j["label"].as_str(), j["total"].as_u64(), j["done"].as_u64(), j["running"].as_u64()), (Some("sweep"), Some(4), Some(1), Some(2)));
        assert_eq!(j["state"], "running");
        g.count(&fin(2, 0));
        g.count(&fin(3, 0));
        assert_eq!(g.json()[0]["state"], "done");
        // A task of a group that is not known (or counted twice) changes nothing.
        g.count(&fin(3, 1));
        assert_eq!(g.json()[0]["finished"], 3);
    }

    #[test]
    fn a_failed_or_lost_task_marks_its_group_failed() {
        let mut g = Groups::default();
        g.started(TaskId(1), 1, &spec(None, None), "a");
        g.started(TaskId(2), 2, &spec(None, None), "a");
        g.count(&Msg::Finished { task: TaskId(1), status: ExitStatus::Code(3), changes: vec![], accessed: vec![] });
        g.lost(TaskId(2));
        let j = g.json();
        assert_eq!(j.len(), 2, "one group per client connection");
        assert_eq!((j[0]["state"].as_str(), j[0]["nonzero"].as_u64()), (Some("failed"), Some(1)));
        assert_eq!((j[1]["state"].as_str(), j[1]["lost"].as_u64()), (Some("failed"), Some(1)));
    }
}
