//! The head: the single endpoint a client talks to (UCop's `remdis`).
//!
//! To the client it looks like one fast worker; to the agents it looks like
//! the client. It picks a host for each launch, assigns the task id, and
//! routes every task message between the client's connection and the
//! agent's. It notices a lost host (its connection drops) and tells the
//! client, and kills the tasks of a client that went away.
//!
//! ```text
//! client ──Launch──▶ head ──RunTask──▶ agent
//!        ◀─Started──      ◀─FileRequest── (file view faults)
//!        ──FileResponse─▶ ──────────────▶
//!        ◀─Output / ChangeChunks / Finished ─
//! ```

use anyhow::{Context, Result};
use starling_proto::conn::{establish, Outgoing};
use starling_proto::{ClusterStatus, HostInfo, Msg, ProtoError, Role, TaskId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};

pub struct HeadConfig {
    pub listen: String,
    /// Agents to dial (for agents started with `starling agent --listen`).
    pub dial_agents: Vec<String>,
    /// Facts shown by `starling status` (bridge, subnet, link profile...).
    pub facts: Vec<(String, String)>,
}

struct Host {
    info: HostInfo,
    tx: Outgoing,
    /// Tasks the head has placed here and not yet seen finish.
    tasks: u32,
    conn_id: u64,
}

struct Route {
    client: Outgoing,
    client_conn: u64,
    host: String,
    host_conn: u64,
}

#[derive(Default)]
struct State {
    hosts: HashMap<String, Host>,
    routes: HashMap<TaskId, Route>,
}

pub struct Head {
    state: Mutex<State>,
    next_task: AtomicU64,
    next_conn: AtomicU64,
    listen: String,
    facts: Vec<(String, String)>,
}

/// Run the head until the process is killed.
pub async fn run(cfg: HeadConfig) -> Result<()> {
    let listener = TcpListener::bind(&cfg.listen).await.with_context(|| format!("head: cannot listen on {}", cfg.listen))?;
    let head = Arc::new(Head {
        state: Mutex::new(State::default()),
        // Task ids are unique across head restarts too (hosts keep per-task dirs).
        next_task: AtomicU64::new(now_ns() as u64 / 1000),
        next_conn: AtomicU64::new(1),
        listen: cfg.listen.clone(),
        facts: cfg.facts,
    });
    log::info!("head listening on {}", cfg.listen);
    for addr in cfg.dial_agents {
        let head = head.clone();
        tokio::spawn(async move {
            loop {
                match TcpStream::connect(&addr).await {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        if let Err(e) = head.clone().serve(s).await {
                            log::warn!("agent {addr}: {e}");
                        }
                    }
                    Err(e) => log::debug!("dial {addr}: {e}"),
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
    }
    loop {
        let (sock, peer) = listener.accept().await?;
        let _ = sock.set_nodelay(true);
        let head = head.clone();
        tokio::spawn(async move {
            if let Err(e) = head.serve(sock).await {
                log::info!("connection from {peer}: {e}");
            }
        });
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as i64).unwrap_or(0)
}

impl Head {
    async fn serve(self: Arc<Self>, sock: TcpStream) -> Result<(), ProtoError> {
        let (r, w) = sock.into_split();
        let (peer, mut incoming, tx) = establish(r, w, Role::Head, "head").await?;
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        match peer.role {
            Role::Agent => {
                let res = self.serve_agent(conn, &mut incoming, tx).await;
                self.agent_gone(conn, &res).await;
                res
            }
            Role::Client => {
                let res = self.serve_client(conn, &mut incoming, tx).await;
                self.client_gone(conn).await;
                res
            }
            Role::Head => {
                let _ = tx.send(Msg::Error { task: None, message: "a head cannot connect to a head".into() }).await;
                Err(ProtoError::invalid("peer claims to be a head"))
            }
        }
    }

    async fn serve_agent<R: tokio::io::AsyncRead + Unpin>(
        &self,
        conn: u64,
        incoming: &mut starling_proto::conn::Incoming<R>,
        tx: Outgoing,
    ) -> Result<(), ProtoError> {
        loop {
            let msg = incoming.recv().await?;
            match msg {
                Msg::HostInfo(info) => {
                    let mut st = self.state.lock().unwrap();
                    let tasks = st.hosts.get(&info.name).map(|h| h.tasks).unwrap_or(0);
                    log::info!("host {} ({}) reports load {:.2}, {} running", info.name, info.addr, info.load, info.running);
                    st.hosts.insert(info.name.clone(), Host { info, tx: tx.clone(), tasks, conn_id: conn });
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::Pong { .. } => {}
                m => {
                    let Some(task) = m.task() else {
                        log::warn!("agent sent an unroutable message");
                        continue;
                    };
                    let finished = matches!(m, Msg::Finished { .. });
                    let client = {
                        let mut st = self.state.lock().unwrap();
                        let c = st.routes.get(&task).map(|r| r.client.clone());
                        if finished {
                            if let Some(r) = st.routes.get(&task) {
                                let host = r.host.clone();
                                if let Some(h) = st.hosts.get_mut(&host) {
                                    h.tasks = h.tasks.saturating_sub(1);
                                }
                            }
                        }
                        c
                    };
                    if let Some(c) = client {
                        let _ = c.send(m).await;
                    }
                }
            }
        }
    }

    async fn serve_client<R: tokio::io::AsyncRead + Unpin>(
        &self,
        conn: u64,
        incoming: &mut starling_proto::conn::Incoming<R>,
        tx: Outgoing,
    ) -> Result<(), ProtoError> {
        loop {
            let msg = incoming.recv().await?;
            match msg {
                Msg::StatusRequest => {
                    let reply = Msg::StatusReply(self.status());
                    let _ = tx.send(reply).await;
                }
                Msg::Launch { spec } => {
                    let placed = self.place(spec.host.as_deref());
                    match placed {
                        Err(message) => {
                            let _ = tx.send(Msg::Error { task: None, message }).await;
                        }
                        Ok((host, host_tx, host_conn)) => {
                            let task = TaskId(self.next_task.fetch_add(1, Ordering::Relaxed));
                            self.state.lock().unwrap().routes.insert(
                                task,
                                Route { client: tx.clone(), client_conn: conn, host: host.clone(), host_conn },
                            );
                            let _ = tx.send(Msg::Started { task, host: host.clone() }).await;
                            if host_tx.send(Msg::RunTask { task, spec }).await.is_err() {
                                self.lose_task(task, &format!("host {host} went away before the task started")).await;
                            }
                        }
                    }
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                m => {
                    let Some(task) = m.task() else { continue };
                    let agent = {
                        let st = self.state.lock().unwrap();
                        st.routes.get(&task).filter(|r| r.client_conn == conn).and_then(|r| st.hosts.get(&r.host)).map(|h| h.tx.clone())
                    };
                    let done = matches!(m, Msg::Committed { .. });
                    if let Some(a) = agent {
                        let _ = a.send(m).await;
                    }
                    if done {
                        self.state.lock().unwrap().routes.remove(&task);
                    }
                }
            }
        }
    }

    fn status(&self) -> ClusterStatus {
        let st = self.state.lock().unwrap();
        let mut hosts: Vec<HostInfo> =
            st.hosts.values().map(|h| HostInfo { running: h.info.running.max(h.tasks), ..h.info.clone() }).collect();
        hosts.sort_by(|a, b| natural_key(&a.name).cmp(&natural_key(&b.name)));
        ClusterStatus { head: self.listen.clone(), hosts, facts: self.facts.clone() }
    }

    /// Choose a host: the named one, else the one with the most free cores.
    fn place(&self, want: Option<&str>) -> Result<(String, Outgoing, u64), String> {
        let mut st = self.state.lock().unwrap();
        if st.hosts.is_empty() {
            return Err("the cluster has no hosts (are the agents running? see `starling status`)".into());
        }
        let name = match want {
            Some(w) => {
                if !st.hosts.contains_key(w) {
                    let mut names: Vec<_> = st.hosts.keys().cloned().collect();
                    names.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
                    return Err(format!("no host named {w:?} (hosts: {})", names.join(", ")));
                }
                w.to_string()
            }
            None => st
                .hosts
                .values()
                .min_by(|a, b| {
                    let fa = a.tasks as f32 / a.info.cores.max(1) as f32;
                    let fb = b.tasks as f32 / b.info.cores.max(1) as f32;
                    fa.partial_cmp(&fb).unwrap().then(natural_key(&a.info.name).cmp(&natural_key(&b.info.name)))
                })
                .map(|h| h.info.name.clone())
                .expect("hosts is not empty"),
        };
        let h = st.hosts.get_mut(&name).expect("host exists");
        h.tasks += 1;
        Ok((name, h.tx.clone(), h.conn_id))
    }

    async fn lose_task(&self, task: TaskId, why: &str) {
        let r = self.state.lock().unwrap().routes.remove(&task);
        if let Some(r) = r {
            let _ = r.client.send(Msg::Error { task: Some(task), message: why.to_string() }).await;
        }
    }

    async fn agent_gone(&self, conn: u64, why: &Result<(), ProtoError>) {
        let (name, lost): (Option<String>, Vec<TaskId>) = {
            let mut st = self.state.lock().unwrap();
            let name = st.hosts.iter().find(|(_, h)| h.conn_id == conn).map(|(n, _)| n.clone());
            if let Some(n) = &name {
                st.hosts.remove(n);
            }
            let lost = st.routes.iter().filter(|(_, r)| r.host_conn == conn).map(|(t, _)| *t).collect();
            (name, lost)
        };
        let Some(name) = name else { return };
        let reason = match why {
            Err(ProtoError::Closed) | Ok(()) => "connection closed".to_string(),
            Err(e) => e.to_string(),
        };
        log::warn!("host {name} lost ({reason}); {} task(s) affected", lost.len());
        for t in lost {
            self.lose_task(t, &format!("host {name} was lost while running the task ({reason}); no changes were committed")).await;
        }
    }

    async fn client_gone(&self, conn: u64) {
        let orphans: Vec<(TaskId, Option<Outgoing>)> = {
            let mut st = self.state.lock().unwrap();
            let ids: Vec<TaskId> = st.routes.iter().filter(|(_, r)| r.client_conn == conn).map(|(t, _)| *t).collect();
            ids.into_iter()
                .map(|t| {
                    let r = st.routes.remove(&t).expect("route exists");
                    (t, st.hosts.get(&r.host).map(|h| h.tx.clone()))
                })
                .collect()
        };
        for (task, agent) in orphans {
            if let Some(a) = agent {
                // The client is gone: nobody can receive the results, so end the task.
                let _ = a.send(Msg::Signal { task, signo: 9 }).await;
            }
        }
    }
}

/// Sort "h2" before "h10".
fn natural_key(s: &str) -> (String, u64) {
    let digits: String = s.chars().rev().take_while(|c| c.is_ascii_digit()).collect::<Vec<_>>().into_iter().rev().collect();
    let prefix = s[..s.len() - digits.len()].to_string();
    (prefix, digits.parse().unwrap_or(0))
}
