//! Routing: what each connection's messages do. A client's task messages
//! go to the task's host, a host's to the task's client; content requests
//! go to the relay cache when there is one.

use crate::migration::ClientMsgRoute;
use crate::Head;
use starling_proto::conn::{Incoming, Outgoing};
use starling_proto::{FileReq, Msg, ProtoError};
use tokio::io::AsyncRead;

impl Head {
    pub(crate) async fn serve_agent<R: AsyncRead + Unpin>(
        &self,
        conn: u64,
        incoming: &mut Incoming<R>,
        tx: Outgoing,
        bound: Option<&str>,
    ) -> Result<(), ProtoError> {
        loop {
            match incoming.recv().await? {
                Msg::HostInfo(info) => {
                    if let Err(why) = self.may_register(bound, &info.name) {
                        log::warn!("refused a host: {why}");
                        let _ = tx.send(Msg::Error { task: None, message: why.clone() }).await;
                        return Err(ProtoError::Refused(why));
                    }
                    let mut st = self.state.lock().unwrap();
                    let cores_busy = st.hosts.get(&info.name).map_or(0, |h| h.cores_busy);
                    log::debug!("host {} ({}) reports load {:.2}, {} running", info.name, info.addr, info.load, info.running);
                    st.hosts.insert(info.name.clone(), crate::Host { info, tx: tx.clone(), cores_busy, conn_id: conn });
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::Pong { .. } => {}
                // For the dashboard only: the client learns a clone's counters from `CloneStats`.
                m @ Msg::CloneProgress { .. } => self.groups.lock().unwrap().count(&m),
                Msg::UsageReply { nonce, tasks } => self.usage_reply(conn, nonce, tasks),
                Msg::MigrateInReady { migration, result } => self.migrate_in_ready(migration, result).await,
                Msg::MigrateFreezing { migration, task } => self.migrate_freezing(migration, task, &tx).await,
                Msg::MigrateHandedOver { migration, task, cpu_seconds } => self.migrate_handed_over(migration, task, cpu_seconds).await,
                Msg::MigrateDone { migration, task, result } => self.migrate_done(migration, task, result).await,
                Msg::FileRequest { task, id, req: req @ (FileReq::GetRecipe { .. } | FileReq::GetChunks { .. } | FileReq::FindChunks { .. }) }
                    if self.relay.is_some() =>
                {
                    let Some(me) = self.self_arc() else { continue };
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let (client, peer, detached) = {
                            let st = me.state.lock().unwrap();
                            let peer = st.hosts.values().find(|h| h.conn_id == conn).and_then(|h| h.info.peer.clone());
                            let r = st.routes.get(&task);
                            (r.and_then(|r| r.client.clone()), peer, r.is_some_and(|r| r.outlive.is_some() && r.client.is_none()))
                        };
                        if detached {
                            // No client to fetch a miss from: the request waits for one (`starling attach`), which answers it.
                            me.route_from_host(Msg::FileRequest { task, id, req }).await;
                            return;
                        }
                        let relay = me.relay.as_ref().expect("relay cache on");
                        let resp = relay.serve(client, task, req, peer).await;
                        let _ = tx.send(Msg::FileResponse { task, id, resp }).await;
                    });
                }
                m => {
                    if let Some(m) = self.hold_from_target(conn, m) {
                        if let Some(m) = self.rerun_filter(m).await {
                            self.route_from_host(m).await;
                        }
                    }
                }
            }
        }
    }

    /// A host's task message: to the task's client. A task ends with
    /// `Finished`, or with an `Error` when its host could not run it.
    pub(crate) async fn route_from_host(&self, m: Msg) {
        let Some(task) = m.task() else {
            log::warn!("agent sent an unroutable message");
            return;
        };
        let ended = matches!(m, Msg::Finished { .. } | Msg::Error { .. });
        self.count(&m);
        if m.is_stream() {
            if let Some(r) = self.state.lock().unwrap().routes.get_mut(&task) {
                r.relayed += 1;
            }
        }
        let Err(m) = self.keep_for_client(task, m).await else {
            if ended {
                self.drain_queue().await;
            }
            return;
        };
        let (client, moving) = {
            let mut st = self.state.lock().unwrap();
            let c = st.routes.get(&task).and_then(|r| r.client.clone());
            let moving = if ended { st.end_route(task).and_then(|mut r| r.moving.take()) } else { None };
            (c, moving)
        };
        self.move_outlived(task, moving).await;
        if let Some(c) = client {
            let _ = c.send(m).await;
        }
        if ended {
            self.drain_queue().await;
        }
    }

    pub(crate) async fn serve_client<R: AsyncRead + Unpin>(
        &self,
        conn: u64,
        incoming: &mut Incoming<R>,
        tx: Outgoing,
        who: crate::ClientIdentity,
    ) -> Result<(), ProtoError> {
        loop {
            match incoming.recv().await? {
                Msg::StatusRequest => {
                    let _ = tx.send(Msg::StatusReply(self.status())).await;
                }
                Msg::Launch { spec, reference } => match self.admit(&who, spec) {
                    Ok(spec) => self.launch(conn, &tx, spec, reference).await,
                    Err(message) => {
                        let _ = tx.send(Msg::LaunchFailed { reference, message }).await;
                    }
                },
                Msg::LaunchJob { spec, tasks, first_reference } => {
                    let n = tasks.len();
                    let spec = match self.admit(&who, spec) {
                        Ok(spec) => spec,
                        Err(message) => {
                            for reference in (first_reference..).take(n) {
                                let _ = tx.send(Msg::LaunchFailed { reference, message: message.clone() }).await;
                            }
                            continue;
                        }
                    };
                    for (i, (t, reference)) in tasks.into_iter().zip(first_reference..).enumerate() {
                        let mut s = spec.clone();
                        if let Some(argv) = t.argv {
                            s.argv = argv;
                        }
                        s.set_task_index(i, n);
                        self.launch(conn, &tx, s, reference).await;
                    }
                }
                Msg::Push { recipes, chunks } => {
                    if let Some(relay) = &self.relay {
                        relay.take_push(&recipes, &chunks);
                    }
                }
                Msg::HoldsQuery { nonce, names } => {
                    let held = match &self.relay {
                        Some(relay) => relay.holds(&names),
                        None => Vec::new(),
                    };
                    let _ = tx.send(Msg::HoldsReply { nonce, held }).await;
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::PsRequest => {
                    let Some(me) = self.self_arc() else { continue };
                    let tx = tx.clone();
                    let viewer = who.as_ref().map(|c| c.uid).filter(|&uid| uid != 0);
                    tokio::spawn(async move {
                        let rows = me.ps(viewer).await;
                        let _ = tx.send(Msg::PsReply(rows)).await;
                    });
                }
                Msg::Migrate { task, to, stop_and_copy } => {
                    // `starling migrate` runs beside the task's own client: a
                    // local user may move their own tasks (root, any task).
                    let owner = self.state.lock().unwrap().routes.get(&task).map(|r| r.uid);
                    if let (Some(c), Some(owner)) = (&who, owner) {
                        if c.uid != 0 && c.uid != owner {
                            let result = Err(format!("task {task} runs as uid {owner}: only that user or root may move it"));
                            let _ = tx.send(Msg::MigrateReply { task, result }).await;
                            continue;
                        }
                    }
                    if let Err(message) = self.migrate(task, to, stop_and_copy, Some(tx.clone())).await {
                        let _ = tx.send(Msg::MigrateReply { task, result: Err(message) }).await;
                    }
                }
                Msg::TicketRequest { n, hierarchical, isolation } => {
                    let ticket = self.next_task.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let (granted, unisolated) = {
                        let mut st = self.state.lock().unwrap();
                        match crate::placement::grant_isolated(&st.hosts, n, hierarchical, isolation) {
                            Ok((g, unisolated)) => {
                                st.grants.insert((conn, ticket), g.iter().map(|(host, _)| host.clone()).collect());
                                (Ok(g), unisolated)
                            }
                            Err(e) => (Err(e.to_string()), Vec::new()),
                        }
                    };
                    for u in &unisolated {
                        log::info!("ticket {ticket}: its clones on {} run with the host's network ({})", u.host, u.why);
                    }
                    let _ = tx.send(Msg::TicketGrant { ticket, granted, unisolated }).await;
                }
                Msg::RoamNote { task, decision } => self.roam_note(conn, task, decision),
                Msg::Attach { task, reference, force } => self.attach(conn, &tx, &who, task, reference, force).await,
                m @ Msg::OutputAck { .. } => self.client_has(conn, &m),
                Msg::ExecutorProgress { ticket, progress } => self.groups.lock().unwrap().executor(conn, ticket, progress),
                Msg::FileResponse { id, resp, .. } if self.relay.as_ref().is_some_and(|r| r.is_ours(id)) => {
                    if let Some(relay) = &self.relay {
                        relay.answered(id, resp);
                    }
                }
                m => self.route_from_client(conn, m).await,
            }
        }
    }

    /// A client's task message: to the task's host (only from the task's own client).
    async fn route_from_client(&self, conn: u64, m: Msg) {
        if matches!(m, Msg::FileResponse { .. }) {
            self.client_has(conn, &m);
        }
        let m = match self.route_client_msg(m) {
            ClientMsgRoute::Pass(m) => m,
            ClientMsgRoute::ToTarget(target, m) => {
                let _ = target.send(m).await;
                return;
            }
            ClientMsgRoute::Consumed => return,
        };
        let Some(task) = m.task() else { return };
        self.record_stdin(&m);
        if m.is_stream() {
            if let Some(r) = self.state.lock().unwrap().routes.get_mut(&task) {
                r.relayed += 1;
            }
        }
        let agent = {
            let st = self.state.lock().unwrap();
            st.routes.get(&task).filter(|r| r.client_conn == conn).and_then(|r| st.hosts.get(&r.host)).map(|h| h.tx.clone())
        };
        if let Some(a) = agent {
            let _ = a.send(m).await;
        }
    }
}
