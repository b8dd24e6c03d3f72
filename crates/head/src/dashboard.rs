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
//! and fetched pages of its clones: live, from the agents' `CloneProgress` (each running clone's
//! counters so far, every second while they change), then final from `CloneStats`. Each change of
//! a ticket's fault count is kept as a sample ([`FAULT_SAMPLES`] of them), from which the page
//! plots the fault rate per ticket over time.
//!
//! A `starling.Executor` is its ticket's group (its workers are the ticket's clone tasks) with
//! the futures' counts added: the Python client sends them (`ExecutorProgress`, on change, at most
//! four times a second). The client is the only one that knows them: calls and results go
//! straight between the parent and its workers over TCP, never through the head, so the head has
//! no traffic it could count itself.

use crate::Head;
use serde_json::{json, Value};
use starling_proto::{CloneCounters, ExecutorProgress, ExitStatus, Msg, TaskId, TaskSpec, TASK_COUNT_ENV};
use std::collections::{HashMap, VecDeque};
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
/// Fault-count samples kept per ticket (at most one per [`SAMPLE_SPACING`] seconds).
const FAULT_SAMPLES: usize = 120;
/// Samples closer together than this (seconds) are merged: the agents report every second, one
/// message per clone, and a sample per message would only add noise to the rate (two reports a
/// moment apart would make a spike of it).
const SAMPLE_SPACING: f64 = 0.5;
/// The recent fault rate is measured over at least this many seconds of samples.
const RATE_WINDOW: f64 = 1.0;

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// One group's progress.
#[derive(Debug, Clone)]
struct Group {
    /// `job`, `ticket`, `executor` (a ticket whose client said it is a `starling.Executor`) or `command`.
    kind: &'static str,
    /// The ticket of a `ticket` or `executor` group.
    ticket: Option<u64>,
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
    /// Counters of the clones that ended (`CloneStats`).
    faults: u64,
    pages_fetched: u64,
    /// Counters so far of the clones still running (`CloneProgress`), by task and clone.
    live: HashMap<(TaskId, u32), CloneCounters>,
    /// (Unix time, faults so far) at each change, oldest first.
    fault_samples: VecDeque<(f64, u64)>,
    executor: Option<ExecutorProgress>,
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
            (Some(c), _) => ("ticket", ticket_label(c.ticket)),
            (None, Some(j)) => ("job", j.clone()),
            (None, None) => ("command", command.to_string()),
        };
        let ticket = spec.clone.as_ref().map(|c| c.ticket);
        let total = spec
            .env
            .iter()
            .find(|(k, _)| k.as_slice() == TASK_COUNT_ENV.as_bytes())
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok());
        let key = (conn, label.clone());
        let g = self.group(key.clone(), kind, label, command, ticket);
        if g.command.is_empty() {
            g.command = command.to_string();
        }
        g.started += 1;
        g.running += 1;
        g.cores += u64::from(spec.cores());
        g.last_end = None;
        if total.is_some() {
            g.total = total;
        }
        self.tasks.insert(task, key);
    }

    /// The group `key`, made (as `kind`) if new.
    fn group(&mut self, key: (u64, String), kind: &'static str, label: String, command: &str, ticket: Option<u64>) -> &mut Group {
        if !self.groups.contains_key(&key) {
            self.order.push(key.clone());
            self.trim();
        }
        self.groups.entry(key).or_insert_with(|| Group {
            kind,
            ticket,
            label,
            command: command.to_string(),
            total: None,
            started: 0,
            finished: 0,
            nonzero: 0,
            failed: 0,
            lost: 0,
            cores: 0,
            clones_ended: 0,
            faults: 0,
            pages_fetched: 0,
            live: HashMap::new(),
            fault_samples: VecDeque::new(),
            executor: None,
            first_start: unix_now(),
            last_end: None,
            running: 0,
        })
    }

    /// Client connection `conn`'s `starling.Executor` on `ticket` says how its futures stand.
    pub(crate) fn executor(&mut self, conn: u64, ticket: u64, progress: ExecutorProgress) {
        let g = self.group((conn, ticket_label(ticket)), "executor", ticket_label(ticket), "", Some(ticket));
        g.kind = "executor";
        g.executor = Some(progress);
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
            Msg::CloneStats { task, clone_id, counters, .. } => {
                if let Some(g) = self.tasks.get(task).and_then(|k| self.groups.get_mut(k)) {
                    g.live.remove(&(*task, *clone_id));
                    g.clones_ended += 1;
                    g.faults += counters.faults;
                    g.pages_fetched += counters.pages_fetched;
                    g.sample_faults(unix_now());
                }
            }
            Msg::CloneProgress { task, clone_id, counters } => {
                if let Some(g) = self.tasks.get(task).and_then(|k| self.groups.get_mut(k)) {
                    g.live.insert((*task, *clone_id), *counters);
                    g.sample_faults(unix_now());
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
                // An executor whose workers are not placed yet is running already.
                let waiting_executor = g.executor.is_some_and(|e| !e.closed) && g.started == 0;
                let state = if g.running > 0 || waiting_executor {
                    "running"
                } else if g.failed + g.lost + g.nonzero > 0 {
                    "failed"
                } else {
                    "done"
                };
                let (faults, pages_fetched) = g.faults_now();
                // Running: faults per second lately; ended: per second of the ticket's life.
                let fault_rate = match g.last_end {
                    None => g.recent_fault_rate(),
                    Some(end) if g.ticket.is_some() && g.clones_ended > 0 && end > g.first_start => {
                        Some(faults as f64 / (end - g.first_start))
                    }
                    Some(_) => None,
                };
                let executor = g.executor.map(|e| {
                    json!({"workers": e.workers, "submitted": e.submitted, "done": e.done, "failed": e.failed,
                           "cancelled": e.cancelled, "closed": e.closed})
                });
                json!({
                    "client": conn, "kind": g.kind, "label": g.label, "command": g.command, "ticket": g.ticket,
                    "total": g.total.unwrap_or(g.started).max(g.started), "started": g.started,
                    "running": g.running, "done": done, "finished": g.finished, "nonzero": g.nonzero,
                    "failed": g.failed, "lost": g.lost, "cores": g.cores, "state": state,
                    "clones_ended": g.clones_ended, "clones_live": g.live.len(), "faults": faults,
                    "pages_fetched": pages_fetched, "fault_rate": fault_rate,
                    "fault_samples": g.fault_samples.iter().map(|(t, f)| json!([t, f])).collect::<Vec<_>>(),
                    "executor": executor, "started_unix": g.first_start, "ended_unix": g.last_end,
                })
            })
            .collect()
    }
}

fn ticket_label(ticket: u64) -> String {
    format!("ticket {ticket}")
}

impl Group {
    /// Faults and fetched pages of the ended clones plus the running ones' so far.
    fn faults_now(&self) -> (u64, u64) {
        self.live.values().fold((self.faults, self.pages_fetched), |(f, p), c| (f + c.faults, p + c.pages_fetched))
    }

    /// Keep (now, faults so far) if the count changed. Samples are [`SAMPLE_SPACING`] apart: a
    /// change sooner than that after the last sample updates its count (not its time).
    fn sample_faults(&mut self, now: f64) {
        let (faults, _) = self.faults_now();
        let n = self.fault_samples.len();
        if let Some(last) = self.fault_samples.back_mut() {
            if last.1 == faults {
                return;
            }
            // (The first sample, the start's zero, is never changed.)
            if n >= 2 && now - last.0 < SAMPLE_SPACING {
                last.1 = faults;
                return;
            }
        }
        if self.fault_samples.is_empty() {
            // The rate starts from the ticket's start: nothing faulted before it (its first
            // clones' first report comes a second after they start).
            self.fault_samples.push_back((self.first_start.min(now - SAMPLE_SPACING), 0));
        }
        self.fault_samples.push_back((now, faults));
        while self.fault_samples.len() > FAULT_SAMPLES {
            self.fault_samples.pop_front();
        }
    }

    /// Faults per second between the last sample and the latest one at least [`RATE_WINDOW`]
    /// before it (or the first one, at least [`SAMPLE_SPACING`] before it).
    fn recent_fault_rate(&self) -> Option<f64> {
        let &(t1, f1) = self.fault_samples.back()?;
        let &(t0, f0) = self.fault_samples.iter().rev().find(|(t, _)| t1 - t >= RATE_WINDOW).or(self.fault_samples.front())?;
        (t1 - t0 >= SAMPLE_SPACING).then(|| f1.saturating_sub(f0) as f64 / (t1 - t0))
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

    fn clone_spec(ticket: u64) -> TaskSpec {
        let clone = starling_proto::CloneSpec {
            ticket,
            clone_id: 1,
            descriptor_hash: starling_proto::Hash::default(),
            descriptor_len: 0,
            page_server: "10.0.0.1:1".into(),
            page_key: starling_proto::SecretKey([0; 32]),
            local_forks: 0,
            placed_ns: 0,
            network: None,
        };
        TaskSpec { clone: Some(clone), ..spec(None, None) }
    }

    fn counters(faults: u64) -> CloneCounters {
        CloneCounters { faults, pages_fetched: faults / 2, ..Default::default() }
    }

    #[test]
    fn running_clones_faults_show_live_and_end_as_reported() {
        let mut g = Groups::default();
        g.started(TaskId(5), 1, &clone_spec(42), "starling-clone");
        g.count(&Msg::CloneProgress { task: TaskId(5), clone_id: 1, counters: counters(10) });
        g.count(&Msg::CloneProgress { task: TaskId(5), clone_id: 2, counters: counters(4) });
        let j = &g.json()[0];
        assert_eq!((j["kind"].as_str(), j["ticket"].as_u64(), j["state"].as_str()), (Some("ticket"), Some(42), Some("running")));
        assert_eq!((j["faults"].as_u64(), j["pages_fetched"].as_u64(), j["clones_live"].as_u64()), (Some(14), Some(7), Some(2)));
        // Cumulative: a later report replaces the clone's earlier one.
        g.count(&Msg::CloneProgress { task: TaskId(5), clone_id: 1, counters: counters(30) });
        assert_eq!(g.json()[0]["faults"], 34);
        // The end's counters replace the live ones (not added to them).
        g.count(&Msg::CloneStats { task: TaskId(5), clone_id: 1, status: Some(ExitStatus::Code(0)), counters: counters(31) });
        let j = &g.json()[0];
        assert_eq!((j["faults"].as_u64(), j["clones_live"].as_u64(), j["clones_ended"].as_u64()), (Some(35), Some(1), Some(1)));
        let samples = j["fault_samples"].as_array().unwrap();
        assert_eq!(samples.first().unwrap()[1], 0, "the samples start from nothing at the ticket's start");
        assert_eq!(samples.last().unwrap()[1], 35, "the last sample is the count now");
        // Progress for a task the head does not know changes nothing.
        g.count(&Msg::CloneProgress { task: TaskId(9), clone_id: 1, counters: counters(1000) });
        assert_eq!(g.json()[0]["faults"], 35);
    }

    #[test]
    fn fault_rate_is_over_the_last_second_of_samples() {
        let mut g = Groups::default();
        g.started(TaskId(5), 1, &clone_spec(1), "c");
        let key = (1, ticket_label(1));
        let grp = g.groups.get_mut(&key).unwrap();
        // Round times, so the differences below are exact.
        grp.first_start = 1000.0;
        let t0 = grp.first_start;
        grp.live.insert((TaskId(5), 1), counters(100));
        grp.sample_faults(t0 + 1.0);
        grp.live.insert((TaskId(5), 1), counters(400));
        grp.sample_faults(t0 + 2.0);
        // 300 faults in the last second.
        assert_eq!(grp.recent_fault_rate(), Some(300.0));
        // Changes under SAMPLE_SPACING after the last sample update its count, not its time.
        grp.live.insert((TaskId(5), 1), counters(500));
        grp.sample_faults(t0 + 2.2);
        grp.live.insert((TaskId(5), 1), counters(600));
        grp.sample_faults(t0 + 2.4);
        let kept: Vec<(f64, u64)> = grp.fault_samples.iter().map(|&(t, f)| (t - t0, f)).collect();
        assert_eq!(kept, [(0.0, 0), (1.0, 100), (2.0, 600)]);
        grp.live.insert((TaskId(5), 1), counters(700));
        grp.sample_faults(t0 + 2.5);
        assert_eq!(grp.fault_samples.back(), Some(&(t0 + 2.5, 700)));
    }

    #[test]
    fn an_executor_is_its_tickets_group_with_its_futures() {
        let mut g = Groups::default();
        let p = |submitted, done, closed| ExecutorProgress { workers: 2, submitted, done, failed: 0, cancelled: 0, closed };
        // The note may come before any worker's task started: the group is running already.
        g.executor(3, 8, p(5, 0, false));
        g.started(TaskId(11), 3, &clone_spec(8), "starling-clone");
        g.started(TaskId(12), 3, &clone_spec(8), "starling-clone");
        let j = g.json();
        assert_eq!(j.len(), 1, "one group: {j:?}");
        assert_eq!((j[0]["kind"].as_str(), j[0]["started"].as_u64(), j[0]["command"].as_str()), (Some("executor"), Some(2), Some("starling-clone")));
        assert_eq!((j[0]["executor"]["submitted"].as_u64(), j[0]["executor"]["done"].as_u64()), (Some(5), Some(0)));
        g.executor(3, 8, p(5, 5, true));
        for t in [11, 12] {
            g.count(&Msg::Finished { task: TaskId(t), status: ExitStatus::Code(0), changes: vec![], accessed: vec![] });
        }
        let j = &g.json()[0];
        assert_eq!((j["state"].as_str(), j["executor"]["done"].as_u64(), j["executor"]["closed"].as_bool()), (Some("done"), Some(5), Some(true)));
        // Another client's ticket of the same number is another group.
        g.executor(4, 8, p(1, 0, false));
        assert_eq!(g.json().len(), 2);
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
