//! Launches: placed on a host with free cores at once, or queued until
//! cores free up, oldest first.

use crate::placement::{check_placeable, pick};
use crate::{Head, Route};
use starling_proto::conn::Outgoing;
use starling_proto::{Msg, TaskId, TaskSpec};
use std::sync::atomic::Ordering;

/// A launch waiting for free cores.
pub(crate) struct Queued {
    pub(crate) conn: u64,
    pub(crate) client: Outgoing,
    pub(crate) spec: TaskSpec,
    pub(crate) reference: u64,
    pub(crate) job_fresh: bool,
    /// IE: the task this launch runs again from the start (same id, no `Started`),
    /// only on a host whose owner is idle.
    pub(crate) rerun: Option<TaskId>,
}

/// Where a placed launch goes: the host's name, connection and id.
type Placed = (String, Outgoing, u64);

impl Head {
    /// Place a task on a host with free cores and start it, or queue it
    /// until some free up. Answers the client `Started` or `LaunchFailed`.
    pub(crate) async fn launch(&self, conn: u64, tx: &Outgoing, mut spec: TaskSpec, reference: u64) {
        let mut job_fresh = false;
        if let Some(job) = &spec.job {
            let key = format!("{}:{job}", spec.uid);
            let (all, fresh) = self.jobs.lock().unwrap().merge(key, std::mem::take(&mut spec.prethrow));
            spec.prethrow = all;
            job_fresh = fresh;
        }
        let q = Queued { conn, client: tx.clone(), spec, reference, job_fresh, rerun: None };
        let placed: Result<Option<(Queued, Placed)>, crate::placement::Unplaceable> = {
            let mut st = self.state.lock().unwrap();
            let (want, cores) = (q.spec.host.clone(), q.spec.cores());
            check_placeable(&st.hosts, want.as_deref(), cores).map(|()| {
                match pick(&mut st.hosts, want.as_deref(), cores, false).map(|h| (h.info.name.clone(), h.tx.clone(), h.conn_id)) {
                    Some(host) => Some((q, host)),
                    None => {
                        st.queue.push_back(q);
                        None
                    }
                }
            })
        };
        match placed {
            Err(why) => {
                let _ = tx.send(Msg::LaunchFailed { reference, message: why.to_string() }).await;
            }
            Ok(Some((q, host))) => self.start(q, host).await,
            Ok(None) => {}
        }
    }

    /// Start a placed launch: route it, tell the client, hand it to the host.
    async fn start(&self, mut q: Queued, (host, host_tx, host_conn): Placed) {
        let ticket_net = q.spec.clone.as_ref().and_then(|c| Some(crate::TicketAsk { ticket: c.ticket, asked: c.network.clone()? }));
        if let Some(c) = q.spec.clone.as_mut() {
            c.placed_ns = starling_proto::realtime_ns();
            if let Some(asked) = c.network.take() {
                let st = self.state.lock().unwrap();
                // A host that cannot enforce it runs the clone with its own network (the grant
                // told the client so), unless the job requires it: then the host fails the clone.
                let can = st.hosts.get(&host).is_some_and(|h| h.info.cannot_isolate.is_none());
                if can || asked.required {
                    c.network = Some(crate::placement::ticket_network(&st, q.conn, c.ticket, &host, &self.control_ports, &asked));
                }
            }
        }
        if let Some(task) = q.rerun {
            self.rerun_started(task, host.clone(), host_conn, &host_tx).await;
            if host_tx.send(Msg::RunTask { task, spec: q.spec }).await.is_err() {
                self.lose_task(task, &format!("host {host} went away before the task's rerun started")).await;
            }
            return;
        }
        let task = TaskId(self.next_task.fetch_add(1, Ordering::Relaxed));
        let host_policy = {
            let st = self.state.lock().unwrap();
            st.hosts.get(&host).and_then(|h| h.info.owner.as_ref()).and_then(|o| starling_proto::GuestPolicy::parse(&o.policy).ok())
        };
        let rerun = (q.spec.clone.is_none() && crate::eviction::is_ie(q.spec.policy, host_policy))
            .then(|| Box::new(crate::eviction::Rerun::new(q.spec.clone(), q.reference)));
        let route = Route {
            client: Some(q.client.clone()),
            client_conn: q.conn,
            host: host.clone(),
            host_conn,
            cores: q.spec.cores(),
            uid: q.spec.uid,
            command: crate::ps::command_line(&q.spec.argv),
            job: q.spec.job.clone(),
            started: std::time::Instant::now(),
            clone_task: q.spec.clone.is_some(),
            ticket_net,
            policy: q.spec.policy,
            rerun,
            moving: None,
            cpu_before: 0.0,
            target_file_ids: Default::default(),
            roam: None,
            outlive: q.spec.terminal.is_some().then(crate::attach::Replay::default),
            relayed: 0,
        };
        self.groups.lock().unwrap().started(task, q.conn, &q.spec, &route.command);
        self.state.lock().unwrap().routes.insert(task, route);
        crate::metrics::add(&self.counters.tasks_started, 1);
        let _ = q.client.send(Msg::Started { task, host: host.clone(), reference: q.reference, job_fresh: q.job_fresh }).await;
        if host_tx.send(Msg::RunTask { task, spec: q.spec }).await.is_err() {
            self.lose_task(task, &format!("host {host} went away before the task started")).await;
        }
    }

    /// Start queued launches that now fit, oldest first.
    pub(crate) async fn drain_queue(&self) {
        let ready: Vec<(Queued, Placed)> = {
            let mut st = self.state.lock().unwrap();
            let mut out = Vec::new();
            let mut i = 0;
            while i < st.queue.len() {
                let want = st.queue[i].spec.host.clone();
                let cores = st.queue[i].spec.cores();
                let idle_owner = st.queue[i].rerun.is_some();
                match pick(&mut st.hosts, want.as_deref(), cores, idle_owner).map(|h| (h.info.name.clone(), h.tx.clone(), h.conn_id)) {
                    Some(p) => {
                        let q = st.queue.remove(i).expect("index in range");
                        out.push((q, p));
                    }
                    None => i += 1,
                }
            }
            out
        };
        for (q, placed) in ready {
            self.start(q, placed).await;
        }
    }

    /// After host `lost` went away: queued launches that can no longer be placed fail now.
    pub(crate) async fn fail_unplaceable(&self, lost: &str) {
        let failed: Vec<Queued> = {
            let mut st = self.state.lock().unwrap();
            let queue: Vec<Queued> = st.queue.drain(..).collect();
            let (bad, keep): (Vec<Queued>, Vec<Queued>) =
                queue.into_iter().partition(|q| check_placeable(&st.hosts, q.spec.host.as_deref(), q.spec.cores()).is_err());
            st.queue = keep.into();
            bad
        };
        for q in failed {
            let message = format!("host {lost} was lost before the task could start");
            let _ = q.client.send(Msg::LaunchFailed { reference: q.reference, message }).await;
        }
    }
}
