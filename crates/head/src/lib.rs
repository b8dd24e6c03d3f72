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
//!
//! By concern: [`routing`] (who talks to whom), [`queue`] (launches waiting
//! for cores), [`placement`] (which host, and fork tickets' grants),
//! [`relay`] (the shared content cache), [`jobs`] (job bindings). What the
//! head knows is read through [`Head::snapshot`].

mod dashboard;
mod jobs;
mod linger;
mod migration;
mod placement;
mod ps;
mod queue;
mod metrics;
mod relay;
mod routing;

use starling_config::HeadSettings;
use starling_proto::conn::{establish, Outgoing};
use starling_proto::{ClusterStatus, HostInfo, Msg, ProtoError, Role, TaskId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error("head: cannot listen on {addr}: {source}")]
    Listen { addr: String, #[source] source: std::io::Error },
    #[error("opening the relay cache {}: {source}", path.display())]
    RelayCache { path: std::path::PathBuf, #[source] source: std::io::Error },
    #[error("head: accepting connections: {0}")]
    Accept(#[source] std::io::Error),
    #[error("head: cannot serve /metrics on {addr}: {source}")]
    Metrics { addr: String, #[source] source: std::io::Error },
}

/// A connected host.
pub(crate) struct Host {
    pub(crate) info: HostInfo,
    pub(crate) tx: Outgoing,
    /// Cores held by tasks the head has placed here and not yet seen
    /// finish (a task holds one, a hierarchical clone task one per clone).
    pub(crate) cores_busy: u32,
    pub(crate) conn_id: u64,
}

/// A placed task: where its messages go.
pub(crate) struct Route {
    /// `None` once the client has gone (the task is being killed).
    pub(crate) client: Option<Outgoing>,
    pub(crate) client_conn: u64,
    pub(crate) host: String,
    pub(crate) host_conn: u64,
    /// Cores the task holds on its host (`TaskSpec::cores`).
    pub(crate) cores: u32,
    /// For `starling ps`: the command line (shortened), job, start time.
    pub(crate) command: String,
    pub(crate) job: Option<String>,
    pub(crate) started: std::time::Instant,
    /// A remote-fork clone task (clones cannot move yet).
    pub(crate) clone_task: bool,
    /// On its way to another host.
    pub(crate) moving: Option<migration::Moving>,
    /// File requests a move's target sent before the switch (marked id → host).
    pub(crate) target_file_ids: HashMap<u64, String>,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) hosts: HashMap<String, Host>,
    /// Tasks placed and not yet ended; a task holds its cores until then.
    pub(crate) routes: HashMap<TaskId, Route>,
    pub(crate) queue: std::collections::VecDeque<queue::Queued>,
    /// Latest migrations' reports, oldest first.
    pub(crate) recent_migrations: std::collections::VecDeque<starling_proto::MigrationReport>,
    /// `starling ps` requests waiting for the agents' usage replies.
    pub(crate) usage_waiters: HashMap<u64, tokio::sync::mpsc::UnboundedSender<Vec<starling_proto::TaskUsage>>>,
}

impl State {
    /// Retire a task's route and give back its cores.
    /// A move still under way gives back the target's cores too: the
    /// caller ends it with [`Head::move_outlived`].
    pub(crate) fn end_route(&mut self, task: TaskId) -> Option<Route> {
        let r = self.routes.remove(&task)?;
        if let Some(h) = self.hosts.get_mut(&r.host) {
            h.cores_busy = h.cores_busy.saturating_sub(r.cores);
        }
        if let Some(m) = r.moving.as_ref().filter(|m| !m.switched) {
            if let Some(h) = self.hosts.get_mut(&m.to) {
                h.cores_busy = h.cores_busy.saturating_sub(r.cores);
            }
        }
        Some(r)
    }
}

pub struct Head {
    me: Mutex<std::sync::Weak<Head>>,
    pub(crate) state: Mutex<State>,
    /// `None` when the relay cache is off (measurements).
    pub(crate) relay: Option<relay::Relay>,
    pub(crate) jobs: Mutex<jobs::Jobs>,
    pub(crate) next_task: AtomicU64,
    /// What `/metrics` counts (`metrics` module).
    pub(crate) counters: Arc<metrics::Counters>,
    /// Progress of jobs and tickets, for the dashboard.
    pub(crate) groups: Mutex<dashboard::Groups>,
    next_conn: AtomicU64,
    listen: String,
    facts: Vec<(String, String)>,
    /// The LL policy's episodes and what it is doing per host.
    pub(crate) lingering: Mutex<linger::Lingering>,
}

/// What the head knows, at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub listen: String,
    /// Each host as it reported itself, with `running` = cores the head has
    /// placed there (exact; the agent's own count lags by a heartbeat).
    pub hosts: Vec<HostInfo>,
    /// Placed tasks: (task, host, cores held).
    pub tasks: Vec<(TaskId, String, u32)>,
    /// Launches waiting for cores.
    pub queued: usize,
    /// Jobs whose bindings the head holds.
    pub jobs: usize,
    pub relay_cache: bool,
    pub facts: Vec<(String, String)>,
}

/// Run the head until the process is killed.
pub async fn run(settings: HeadSettings) -> Result<(), HeadError> {
    let listener = TcpListener::bind(&settings.listen)
        .await
        .map_err(|source| HeadError::Listen { addr: settings.listen.clone(), source })?;
    let counters = Arc::new(metrics::Counters::default());
    let metrics_listener = match &settings.metrics {
        Some(addr) => {
            Some(TcpListener::bind(addr).await.map_err(|source| HeadError::Metrics { addr: addr.clone(), source })?)
        }
        None => None,
    };
    let mut facts = settings.facts;
    if let Some(l) = &metrics_listener {
        if let Ok(a) = l.local_addr() {
            facts.push(("metrics".into(), format!("http://{a}/metrics")));
        }
    }
    let relay = if settings.relay_cache {
        let dir = settings.state.join("cache");
        Some(
            relay::Relay::open(&dir, settings.cache_mib << 20, counters.clone())
                .map_err(|source| HeadError::RelayCache { path: dir, source })?,
        )
    } else {
        None
    };
    let head = Arc::new(Head {
        me: Mutex::new(std::sync::Weak::new()),
        state: Mutex::new(State::default()),
        relay,
        jobs: Mutex::new(jobs::Jobs::default()),
        // Task ids are unique across head restarts too (hosts keep per-task dirs).
        next_task: AtomicU64::new(now_us()),
        counters,
        groups: Mutex::new(dashboard::Groups::default()),
        next_conn: AtomicU64::new(1),
        listen: settings.listen.clone(),
        facts,
        lingering: Mutex::new(linger::Lingering::default()),
    });
    *head.me.lock().unwrap() = Arc::downgrade(&head);
    if let Some(l) = metrics_listener {
        tokio::spawn(metrics::serve(head.clone(), l));
    }
    {
        let head = head.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(linger::TICK).await;
                head.linger_tick().await;
            }
        });
    }
    log::info!("head listening on {}", settings.listen);
    for addr in settings.agents {
        tokio::spawn(head.clone().dial_agent(addr));
    }
    loop {
        let (sock, peer) = listener.accept().await.map_err(HeadError::Accept)?;
        let _ = sock.set_nodelay(true);
        let head = head.clone();
        tokio::spawn(async move {
            if let Err(e) = head.serve(sock).await {
                log::info!("connection from {peer}: {e}");
            }
        });
    }
}

/// Microseconds since the epoch.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl Head {
    /// Keep a connection to an agent started with `starling agent --listen`.
    async fn dial_agent(self: Arc<Self>, addr: String) {
        loop {
            match TcpStream::connect(&addr).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    if let Err(e) = self.clone().serve(s).await {
                        log::warn!("agent {addr}: {e}");
                    }
                }
                Err(e) => log::debug!("dial {addr}: {e}"),
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }

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
                Err(ProtoError::UnexpectedPeer { expected: Role::Agent, got: Role::Head })
            }
        }
    }

    pub(crate) fn self_arc(&self) -> Option<Arc<Head>> {
        self.me.lock().unwrap().upgrade()
    }

    /// What the head knows now (for `starling status` and dashboards).
    pub fn snapshot(&self) -> Snapshot {
        let st = self.state.lock().unwrap();
        let mut hosts: Vec<HostInfo> = st.hosts.values().map(|h| HostInfo { running: h.cores_busy, ..h.info.clone() }).collect();
        hosts.sort_by_key(|h| placement::natural_key(&h.name));
        let tasks = st.routes.iter().map(|(t, r)| (*t, r.host.clone(), r.cores)).collect();
        Snapshot {
            listen: self.listen.clone(),
            hosts,
            tasks,
            queued: st.queue.len(),
            jobs: self.jobs.lock().unwrap().len(),
            relay_cache: self.relay.is_some(),
            facts: self.facts.clone(),
        }
    }

    fn status(&self) -> ClusterStatus {
        let snap = self.snapshot();
        let mut facts = snap.facts;
        facts.push(("queued".into(), snap.queued.to_string()));
        facts.push(("relay_cache".into(), if snap.relay_cache { "on" } else { "off" }.into()));
        let mut hosts = snap.hosts;
        let lg = self.lingering.lock().unwrap();
        for h in &mut hosts {
            if let (Some(o), Some(d)) = (h.owner.as_mut(), lg.doing.get(&h.name)) {
                o.doing.clone_from(d);
            }
        }
        ClusterStatus { head: snap.listen, hosts, facts }
    }

    /// Tell a task's client it was lost, and give back its cores.
    pub(crate) async fn lose_task(&self, task: TaskId, why: &str) {
        let Some(mut r) = self.state.lock().unwrap().end_route(task) else { return };
        metrics::add(&self.counters.tasks_lost, 1);
        self.groups.lock().unwrap().lost(task);
        self.move_outlived(task, r.moving.take()).await;
        if let Some(c) = r.client {
            let _ = c.send(Msg::Error { task: Some(task), message: why.to_string() }).await;
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
        self.fail_unplaceable(&name).await;
    }

    async fn client_gone(&self, conn: u64) {
        let orphans: Vec<(TaskId, Option<Outgoing>)> = {
            let mut st = self.state.lock().unwrap();
            st.queue.retain(|q| q.conn != conn);
            let st = &mut *st;
            st.routes
                .iter_mut()
                .filter(|(_, r)| r.client_conn == conn)
                .map(|(t, r)| {
                    // Keep the route until the host reports the end: the cores stay busy until then.
                    r.client = None;
                    (*t, st.hosts.get(&r.host).map(|h| h.tx.clone()))
                })
                .collect()
        };
        for (task, agent) in orphans {
            if let Some(a) = agent {
                // The client is gone: nobody can receive the results, so end the task.
                let _ = a.send(Msg::Signal { task, signo: libc::SIGKILL }).await;
            }
        }
    }
}
