//! Live migration as the head sees it: choosing the target, pairing the
//! two agents, and switching the task's route without losing, repeating or
//! reordering anything between the task and its client.
//!
//! ```text
//! requester ─Migrate─▶ head ─MigrateIn──────▶ target   (listens)
//!                           ◀─MigrateInReady─
//!                           ─MigrateOut─────▶ source   (pre-copy to the target directly)
//!                           ◀─MigrateFreezing─          the task is frozen: client → task
//!                           ─MigrateHeld────▶           messages are held from here
//!                           ◀─MigrateHandedOver─        its output here was all sent before
//!                                                      this; the route switches to the
//!                                                      target, held input goes there, the
//!                                                      target's held output to the client
//!            ◀─MigrateReply─◀─MigrateDone──────         (the source holds nothing)
//! ```
//!
//! Until the switch the target's task messages are held (its output must
//! not overtake the source's last), except file requests: the target's view
//! may need files before the task resumes, so they go to the client at once
//! with a marked id, and their answers come back to the target.

use crate::placement::{members_changed, natural_key, ticket_hosts};
use crate::{Head, Host};
use starling_proto::conn::Outgoing;
use starling_proto::{MigrationReport, Msg, NetworkIsolation, SecretKey, TaskId};
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

/// File-request ids of a target's requests before the switch carry this bit
/// (the relay cache's own requests carry `relay::HEAD_ID_BIT`, the top one).
const TARGET_FILE_ID: u64 = 1 << 62;
const _: () = assert!(TARGET_FILE_ID != crate::relay::HEAD_ID_BIT);

/// A task on its way to another host.
pub(crate) struct Moving {
    pub(crate) id: u64,
    pub(crate) from: String,
    pub(crate) to: String,
    /// The move's secret (`MigrateIn`, `MigrateOut`).
    key: SecretKey,
    /// Who asked (a client's connection), told the outcome.
    requester: Option<Outgoing>,
    stop_and_copy: bool,
    /// The source said the task is frozen: client → task messages wait.
    holding: bool,
    held_input: Vec<Msg>,
    /// The target's task messages before the switch.
    held_output: Vec<Msg>,
    /// The route points at the target now.
    pub(crate) switched: bool,
    started: Instant,
    /// Why the target cannot enforce the moving clone's ticket network (`None`: it can, or the
    /// task has none): the clone runs there with the host's whole network, and the report says so.
    unisolated: Option<String>,
}

/// Where [`Head::route_client_msg`] sends a client's task message.
pub(crate) enum ClientMsgRoute {
    /// On to the task's host, as usual.
    Pass(Msg),
    /// To a move's target (an answer to a file request the target made before the switch).
    ToTarget(Outgoing, Msg),
    /// Kept by the move (input held while the task is frozen) or no longer wanted.
    Consumed,
}

/// Recent migrations' reports, for policies that weigh a move's cost.
pub(crate) const RECENT_MIGRATIONS: usize = 64;

impl Head {
    /// Move `task` to host `to` (None: the least loaded other host with
    /// room). Returns the migration's id; the outcome goes to `requester`
    /// when there is one (policies pass none and read
    /// [`Head::recent_migrations`]).
    pub async fn migrate(&self, task: TaskId, to: Option<String>, stop_and_copy: bool, requester: Option<Outgoing>) -> Result<u64, String> {
        let id = self.next_task.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = SecretKey::random();
        let (target_tx, from, network, pushes) = {
            let mut st = self.state.lock().unwrap();
            let st = &mut *st;
            let route = st.routes.get(&task).ok_or_else(|| format!("no running task {task} (see `starling ps`)"))?;
            if route.moving.is_some() {
                return Err(format!("task {task} is already moving"));
            }
            if route.clone_task && route.cores > 1 {
                return Err(format!(
                    "task {task} holds {} clones of a hierarchical ticket: they move only together, which is not supported",
                    route.cores
                ));
            }
            let (from, cores, isolation, conn) = (route.host.clone(), route.cores, route.isolation(), route.client_conn);
            // A clone of an isolated ticket goes only where its network can be enforced, unless
            // the caller names a host that cannot and the ticket does not require it.
            let enforces = |h: &Host| isolation == NetworkIsolation::Off || h.info.cannot_isolate.is_none();
            let target = match &to {
                Some(name) if *name == from => return Err(format!("task {task} already runs on {name}")),
                Some(name) => {
                    let h = st.hosts.get(name).ok_or_else(|| {
                        let mut known: Vec<_> = st.hosts.keys().cloned().collect();
                        known.sort_by_key(|a| natural_key(a));
                        format!("no host named {name:?} (hosts: {})", known.join(", "))
                    })?;
                    if let (NetworkIsolation::Required, Some(why)) = (isolation, &h.info.cannot_isolate) {
                        return Err(format!(
                            "task {task} is a clone of a ticket that requires its own network (fork.isolate_network = required), \
                             and host {name} cannot enforce one ({why})"
                        ));
                    }
                    if h.cores_busy + cores > h.info.cores.max(1) {
                        return Err(format!("host {name} has no free core for task {task}"));
                    }
                    name.clone()
                }
                None => least_loaded_other(&st.hosts, &from, cores, enforces).ok_or_else(|| match isolation {
                    NetworkIsolation::Off => format!("no other host has a free core for task {task}"),
                    NetworkIsolation::On => format!(
                        "no other host that can enforce its ticket's own network has a free core for task {task} \
                         (name a host with --to to move it there with that host's whole network)"
                    ),
                    NetworkIsolation::Required => format!(
                        "no other host that can enforce its ticket's own network has a free core for task {task} \
                         (its ticket requires one: fork.isolate_network = required)"
                    ),
                })?,
            };
            // Told to whoever asked, with the report: the clone loses its ticket's network there.
            let unisolated = (isolation != NetworkIsolation::Off).then(|| st.hosts.get(&target)?.info.cannot_isolate.clone()).flatten();
            // Its ticket's network there, as for a clone launched there (whatever its source ran
            // it with: a source that could not enforce it ran it with none).
            let ticket = route.ticket_net.as_ref().map(|t| t.ticket);
            let network = route
                .ticket_net
                .as_ref()
                .filter(|t| unisolated.is_none() || t.asked.required)
                .map(|t| crate::placement::ticket_network(st, conn, t.ticket, &target, &self.control_ports, &t.asked));
            let before = ticket.map(|t| owned(ticket_hosts(st, conn, t)));
            let h = st.hosts.get_mut(&target).expect("chosen above");
            // The target holds the task's cores from now on (no launch may take them).
            h.cores_busy += cores;
            let target_tx = h.tx.clone();
            let route = st.routes.get_mut(&task).expect("checked above");
            route.moving = Some(Moving {
                key,
                id,
                from: from.clone(),
                to: target.clone(),
                requester,
                stop_and_copy,
                holding: false,
                held_input: Vec::new(),
                held_output: Vec::new(),
                switched: false,
                started: Instant::now(),
                unisolated,
            });
            // The ticket's other clones learn the target (once its `moving` counts it).
            let pushes = ticket.zip(before).map(|(t, before)| members_changed(st, conn, t, &before)).unwrap_or_default();
            (target_tx, from, network, pushes)
        };
        log::info!("migration {id}: task {task} from {from}");
        send_all(pushes).await;
        if target_tx.send(Msg::MigrateIn { migration: id, task, from, key, network }).await.is_err() {
            self.migration_failed(task, id, "the target host went away").await;
        }
        Ok(id)
    }

    /// Reports of the latest migrations (oldest first).
    pub fn recent_migrations(&self) -> Vec<MigrationReport> {
        self.state.lock().unwrap().recent_migrations.iter().cloned().collect()
    }

    fn find_moving(&self, migration: u64) -> Option<TaskId> {
        let st = self.state.lock().unwrap();
        st.routes.iter().find(|(_, r)| r.moving.as_ref().is_some_and(|m| m.id == migration)).map(|(t, _)| *t)
    }

    /// The target listens (or cannot): tell the source to start.
    pub(crate) async fn migrate_in_ready(&self, migration: u64, result: Result<String, String>) {
        let Some(task) = self.find_moving(migration) else { return };
        let addr = match result {
            Ok(a) => a,
            Err(why) => return self.migration_failed(task, migration, &format!("the target cannot take it: {why}")).await,
        };
        let (source_tx, to, stop_and_copy, key) = {
            let st = self.state.lock().unwrap();
            let Some(r) = st.routes.get(&task) else { return };
            let to = r.moving.as_ref().map(|m| m.to.clone()).unwrap_or_default();
            let stop_and_copy = r.moving.as_ref().is_some_and(|m| m.stop_and_copy);
            let Some(key) = r.moving.as_ref().map(|m| m.key) else { return };
            (st.hosts.get(&r.host).map(|h| h.tx.clone()), to, stop_and_copy, key)
        };
        let sent = match source_tx {
            Some(tx) => tx.send(Msg::MigrateOut { migration, task, to_host: to, to_addr: addr, stop_and_copy, key }).await.is_ok(),
            None => false,
        };
        if !sent {
            self.migration_failed(task, migration, "the source host went away").await;
        }
    }

    /// The task is frozen: hold its input, then let the source go on.
    pub(crate) async fn migrate_freezing(&self, migration: u64, task: TaskId, source: &Outgoing) {
        if let Some(m) = self.state.lock().unwrap().routes.get_mut(&task).and_then(|r| r.moving.as_mut()) {
            if m.id == migration {
                m.holding = true;
            }
        }
        let _ = source.send(Msg::MigrateHeld { migration }).await;
    }

    /// The task runs on the target: switch its route, and release what was held.
    pub(crate) async fn migrate_handed_over(&self, migration: u64, task: TaskId, cpu_seconds: f64) {
        let (target, input, output) = {
            let mut st = self.state.lock().unwrap();
            let st = &mut *st;
            let Some(r) = st.routes.get_mut(&task) else { return };
            let Some(m) = r.moving.as_mut().filter(|m| m.id == migration) else { return };
            m.switched = true;
            m.holding = false;
            r.cpu_before += cpu_seconds;
            let (input, output) = (std::mem::take(&mut m.held_input), std::mem::take(&mut m.held_output));
            let to = m.to.clone();
            if let Some(h) = st.hosts.get_mut(&r.host) {
                h.cores_busy = h.cores_busy.saturating_sub(r.cores);
            }
            let target = st.hosts.get(&to).map(|h| (h.tx.clone(), h.conn_id));
            if let Some((_, conn)) = &target {
                r.host = to;
                r.host_conn = *conn;
            }
            (target.map(|t| t.0), input, output)
        };
        log::info!("migration {migration}: task {task} switched");
        // The target's output goes the way of any host's now. It may hold
        // the task's end: a task that read its last input before the freeze
        // can end on the target before the source says it handed over (two
        // connections, no order between them). Sent straight to the client,
        // that end left the route behind and the target's cores busy for
        // good; routed, it ends the route and tells whoever asked.
        for m in output {
            if let Some(m) = self.rerun_filter(m).await {
                self.route_from_host(m).await;
            }
        }
        if let Some(t) = target {
            for m in input {
                let _ = t.send(m).await;
            }
        }
    }

    /// The source's last word.
    pub(crate) async fn migrate_done(&self, migration: u64, task: TaskId, result: Result<MigrationReport, String>) {
        match result {
            Ok(mut report) => {
                let (requester, pushes) = {
                    let mut st = self.state.lock().unwrap();
                    let before = ticket_hosts_of(&st, task);
                    let m = st.routes.get_mut(&task).and_then(|r| r.moving.take_if(|m| m.id == migration));
                    if let Some(r) = st.routes.get_mut(&task) {
                        crate::roam::moved(r, &report);
                    }
                    report.total_ms = m.as_ref().map_or(report.total_ms, |m| m.started.elapsed().as_secs_f64() * 1e3);
                    report.unisolated = m.as_ref().and_then(|m| m.unisolated.clone());
                    st.recent_migrations.push_back(report.clone());
                    if st.recent_migrations.len() > RECENT_MIGRATIONS {
                        st.recent_migrations.pop_front();
                    }
                    // The host it left, unless the grant or another clone keeps it in the ticket.
                    let pushes = members_after(&st, task, before);
                    (m.and_then(|m| m.requester), pushes)
                };
                send_all(pushes).await;
                self.moved_away(task);
                log::info!("migration {migration}: task {task} moved {} -> {} (pause {:.1} ms)", report.from, report.to, report.pause_ms);
                if let Some(r) = requester {
                    let _ = r.send(Msg::MigrateReply { task, result: Ok(report) }).await;
                }
            }
            Err(why) => self.migration_failed(task, migration, &why).await,
        }
    }

    /// End a migration that failed. Before the switch the task stays where
    /// it ran: held input goes there, the target forgets it. After, the
    /// task is the target's (if the target lost it, its end says so).
    pub(crate) async fn migration_failed(&self, task: TaskId, migration: u64, why: &str) {
        let (moving, source_tx, target_tx, pushes) = {
            let mut st = self.state.lock().unwrap();
            let st = &mut *st;
            let before = ticket_hosts_of(st, task);
            let Some(r) = st.routes.get_mut(&task) else { return };
            let Some(m) = r.moving.take_if(|m| m.id == migration) else { return };
            let source_tx = st.hosts.get(&r.host).map(|h| h.tx.clone());
            let target_tx = if m.switched {
                None
            } else {
                st.hosts.get_mut(&m.to).map(|h| {
                    h.cores_busy = h.cores_busy.saturating_sub(r.cores);
                    h.tx.clone()
                })
            };
            // The target it did not reach (or the source it left), unless kept in the ticket.
            let pushes = members_after(st, task, before);
            (m, source_tx, target_tx, pushes)
        };
        send_all(pushes).await;
        log::warn!("migration {migration}: task {task} {} -> {}: {why}", moving.from, moving.to);
        if let Some(t) = target_tx {
            let _ = t.send(Msg::MigrateAbort { migration }).await;
        }
        if !moving.switched {
            if let Some(s) = source_tx {
                for m in moving.held_input {
                    let _ = s.send(m).await;
                }
            }
        }
        if let Some(r) = moving.requester {
            let message = if moving.switched {
                format!("task {task} moved to {} but the move did not complete: {why}", moving.to)
            } else {
                format!("task {task} was not moved and runs on {}: {why}", moving.from)
            };
            let _ = r.send(Msg::MigrateReply { task, result: Err(message) }).await;
        }
    }

    /// The task ended while it was moving (before the source's last word):
    /// the target forgets it and whoever asked for the move is told.
    pub(crate) async fn move_outlived(&self, task: TaskId, moving: Option<Moving>) {
        let Some(m) = moving else { return };
        log::info!("migration {}: task {task} ended during its move {} -> {}", m.id, m.from, m.to);
        if !m.switched {
            let target = self.state.lock().unwrap().hosts.get(&m.to).map(|h| h.tx.clone());
            if let Some(t) = target {
                let _ = t.send(Msg::MigrateAbort { migration: m.id }).await;
            }
        }
        if let Some(r) = m.requester {
            let why = if m.switched {
                format!("task {task} moved to {} and ended there before the move completed", m.to)
            } else {
                format!("task {task} ended on {} before it could move", m.from)
            };
            let _ = r.send(Msg::MigrateReply { task, result: Err(why) }).await;
        }
    }

    /// Where a client's message for a task that may be frozen for a move
    /// goes. File answers for the target's early requests come back here
    /// and go to the target, whatever the task's route says.
    pub(crate) fn route_client_msg(&self, m: Msg) -> ClientMsgRoute {
        let Some(task) = m.task() else { return ClientMsgRoute::Pass(m) };
        let mut st = self.state.lock().unwrap();
        let st = &mut *st;
        let Some(r) = st.routes.get_mut(&task) else { return ClientMsgRoute::Pass(m) };
        match m {
            Msg::FileResponse { task, id, resp } if id & TARGET_FILE_ID != 0 => {
                let target = r.target_file_ids.remove(&id).and_then(|h| st.hosts.get(&h)).map(|h| h.tx.clone());
                match target {
                    Some(tx) => ClientMsgRoute::ToTarget(tx, Msg::FileResponse { task, id: id & !TARGET_FILE_ID, resp }),
                    // The move ended and its target with it: nobody waits for this answer.
                    None => ClientMsgRoute::Consumed,
                }
            }
            // (A switch of its path goes where its input goes.)
            m if m.is_stream() || matches!(m, Msg::PathSwitch { .. }) => match r.moving.as_mut() {
                Some(mv) if mv.holding => {
                    mv.held_input.push(m);
                    ClientMsgRoute::Consumed
                }
                _ => ClientMsgRoute::Pass(m),
            },
            m => ClientMsgRoute::Pass(m),
        }
    }

    /// A host's task message: from a move's target before the switch it is
    /// held (None), or, a file request, sent on now with a marked id.
    pub(crate) fn hold_from_target(&self, conn: u64, m: Msg) -> Option<Msg> {
        let Some(task) = m.task() else { return Some(m) };
        let mut st = self.state.lock().unwrap();
        let st = &mut *st;
        let Some(r) = st.routes.get_mut(&task) else { return Some(m) };
        let Some(mv) = r.moving.as_mut().filter(|mv| !mv.switched) else { return Some(m) };
        let from_target = st.hosts.get(&mv.to).is_some_and(|h| h.conn_id == conn);
        if !from_target {
            return Some(m);
        }
        match m {
            Msg::FileRequest { task, id, req } => {
                let marked = id | TARGET_FILE_ID;
                r.target_file_ids.insert(marked, mv.to.clone());
                Some(Msg::FileRequest { task, id: marked, req })
            }
            m => {
                mv.held_output.push(m);
                None
            }
        }
    }
}

fn owned(hosts: BTreeSet<&str>) -> BTreeSet<String> {
    hosts.into_iter().map(str::to_owned).collect()
}

async fn send_all(msgs: Vec<(Outgoing, Msg)>) {
    for (tx, m) in msgs {
        let _ = tx.send(m).await;
    }
}

/// The hosts of `task`'s ticket network, if it is a clone of an isolated ticket.
fn ticket_hosts_of(st: &crate::State, task: TaskId) -> Option<BTreeSet<String>> {
    let r = st.routes.get(&task)?;
    Some(owned(ticket_hosts(st, r.client_conn, r.ticket_net.as_ref()?.ticket)))
}

/// What tells `task`'s ticket's hosts their members, if they changed from `before`.
fn members_after(st: &crate::State, task: TaskId, before: Option<BTreeSet<String>>) -> Vec<(Outgoing, Msg)> {
    let (Some(r), Some(before)) = (st.routes.get(&task), before) else { return Vec::new() };
    let Some(t) = &r.ticket_net else { return Vec::new() };
    members_changed(st, r.client_conn, t.ticket, &before)
}

/// The least loaded host other than `from` with `cores` free that `eligible` keeps (never the
/// home site: a task goes home only when asked to).
fn least_loaded_other(hosts: &HashMap<String, Host>, from: &str, cores: u32, eligible: impl Fn(&Host) -> bool) -> Option<String> {
    hosts
        .values()
        .filter(|h| h.info.name != from && !h.info.home && h.cores_busy + cores <= h.info.cores.max(1) && eligible(h))
        .min_by(|a, b| {
            let load = |h: &Host| f64::from(h.cores_busy) / f64::from(h.info.cores.max(1));
            load(a).total_cmp(&load(b)).then(natural_key(&a.info.name).cmp(&natural_key(&b.info.name)))
        })
        .map(|h| h.info.name.clone())
}
