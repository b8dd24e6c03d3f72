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
use starling_proto::{ChunkData, ClusterStatus, FileReq, FileResp, Hash, HostInfo, Msg, ProtoError, Role, TaskId};
use starling_store::HostCache;
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
    /// Persistent state (the relay cache).
    pub state: std::path::PathBuf,
    /// Serve content-named requests (recipes, chunks) from a shared cache, so no
    /// unique chunk crosses the client's link twice. Off only for measurements.
    pub relay_cache: bool,
    /// Relay cache size bound.
    pub cache_bytes: u64,
}

struct Host {
    info: HostInfo,
    tx: Outgoing,
    /// Cores held by tasks the head has placed here and not yet seen
    /// finish (a task holds one, a hierarchical clone task one per clone).
    cores_busy: u32,
    conn_id: u64,
}

struct Route {
    /// `None` once the client has gone (the task is being killed).
    client: Option<Outgoing>,
    client_conn: u64,
    host: String,
    host_conn: u64,
    /// Cores the task holds on its host (`TaskSpec::cores`).
    cores: u32,
}

/// A launch waiting for a free core.
struct Queued {
    conn: u64,
    client: Outgoing,
    spec: starling_proto::TaskSpec,
    reference: u64,
    job_fresh: bool,
}

#[derive(Default)]
struct State {
    hosts: HashMap<String, Host>,
    /// Tasks placed and not yet ended; a task holds a core of its host until then.
    routes: HashMap<TaskId, Route>,
    queue: std::collections::VecDeque<Queued>,
}

/// Requests the head itself sent to a client (ids with [`HEAD_ID_BIT`] set),
/// waiting for their answers.
type HeadWaiters = Mutex<HashMap<u64, tokio::sync::oneshot::Sender<FileResp>>>;

struct JobBindings {
    bindings: HashMap<starling_proto::WirePath, starling_proto::Lookup>,
    used: std::time::Instant,
}

/// Jobs idle this long are forgotten (their next launch simply sends more).
const JOB_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);
/// Bound on one job's bindings.
const JOB_MAX_BINDINGS: usize = 100_000;

/// Ids of requests the head originates; agents number theirs from 0.
const HEAD_ID_BIT: u64 = 1 << 63;

pub struct Head {
    me: Mutex<std::sync::Weak<Head>>,
    state: Mutex<State>,
    /// The relay cache (UCop's remdis cache): immutable, hash-named content only,
    /// so it can never change what a task sees.
    cache: Option<HostCache>,
    /// Chunks being fetched from a client right now (single flight per chunk).
    inflight: Mutex<HashMap<Hash, tokio::sync::watch::Receiver<bool>>>,
    waiters: HeadWaiters,
    next_req: AtomicU64,
    /// Bindings sent for each job (`exec --job NAME`, keyed by uid and name):
    /// a launch carries only the delta, and its task gets them all.
    jobs: Mutex<HashMap<String, JobBindings>>,
    next_task: AtomicU64,
    next_conn: AtomicU64,
    listen: String,
    facts: Vec<(String, String)>,
}

/// Run the head until the process is killed.
pub async fn run(cfg: HeadConfig) -> Result<()> {
    let listener = TcpListener::bind(&cfg.listen).await.with_context(|| format!("head: cannot listen on {}", cfg.listen))?;
    let cache = if cfg.relay_cache {
        Some(HostCache::open(&cfg.state.join("cache"), cfg.cache_bytes).context("opening the relay cache")?)
    } else {
        None
    };
    let head = Arc::new(Head {
        me: Mutex::new(std::sync::Weak::new()),
        state: Mutex::new(State::default()),
        cache,
        inflight: Mutex::new(HashMap::new()),
        waiters: Mutex::new(HashMap::new()),
        next_req: AtomicU64::new(0),
        jobs: Mutex::new(HashMap::new()),
        // Task ids are unique across head restarts too (hosts keep per-task dirs).
        next_task: AtomicU64::new(now_ns() as u64 / 1000),
        next_conn: AtomicU64::new(1),
        listen: cfg.listen.clone(),
        facts: cfg.facts,
    });
    *head.me.lock().unwrap() = Arc::downgrade(&head);
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

fn libc_eio() -> i32 {
    5 // EIO
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
                    let cores_busy = st.hosts.get(&info.name).map(|h| h.cores_busy).unwrap_or(0);
                    log::debug!("host {} ({}) reports load {:.2}, {} running", info.name, info.addr, info.load, info.running);
                    st.hosts.insert(info.name.clone(), Host { info, tx: tx.clone(), cores_busy, conn_id: conn });
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::Pong { .. } => {}
                Msg::FileRequest { task, id, req: req @ (FileReq::GetRecipe { .. } | FileReq::GetChunks { .. }) }
                    if self.cache.is_some() =>
                {
                    let Some(me) = self.self_arc() else { continue };
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let resp = me.serve_content(task, req).await;
                        let _ = tx.send(Msg::FileResponse { task, id, resp }).await;
                    });
                }
                m => {
                    let Some(task) = m.task() else {
                        log::warn!("agent sent an unroutable message");
                        continue;
                    };
                    // A task ends with Finished, or with an Error when its host could not run it.
                    let ended = matches!(m, Msg::Finished { .. } | Msg::Error { .. });
                    let client = {
                        let mut st = self.state.lock().unwrap();
                        let c = st.routes.get(&task).and_then(|r| r.client.clone());
                        if ended {
                            if let Some(r) = st.routes.remove(&task) {
                                if let Some(h) = st.hosts.get_mut(&r.host) {
                                    h.cores_busy = h.cores_busy.saturating_sub(r.cores);
                                }
                            }
                        }
                        c
                    };
                    if let Some(c) = client {
                        let _ = c.send(m).await;
                    }
                    if ended {
                        self.drain_queue().await;
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
                Msg::Launch { spec, reference } => self.launch(conn, &tx, spec, reference).await,
                Msg::LaunchJob { spec, tasks, first_reference } => {
                    let n = tasks.len();
                    for (i, t) in tasks.into_iter().enumerate() {
                        let mut s = spec.clone();
                        if let Some(argv) = t.argv {
                            s.argv = argv;
                        }
                        s.env.retain(|(k, _)| k != b"STARLING_TASK" && k != b"STARLING_TASKS");
                        s.env.push((b"STARLING_TASK".to_vec(), i.to_string().into_bytes()));
                        s.env.push((b"STARLING_TASKS".to_vec(), n.to_string().into_bytes()));
                        self.launch(conn, &tx, s, first_reference + i as u64).await;
                    }
                }
                Msg::Push { recipes, chunks } => {
                    if let Some(cache) = &self.cache {
                        for r in &recipes {
                            let _ = cache.put_recipe(r);
                        }
                        for c in &chunks {
                            match c.open() {
                                Ok(bytes) => {
                                    let _ = cache.put_chunk(&c.hash, &bytes);
                                }
                                Err(e) => log::warn!("client pushed a bad chunk: {e}"),
                            }
                        }
                    }
                }
                Msg::Ping { nonce } => {
                    let _ = tx.send(Msg::Pong { nonce }).await;
                }
                Msg::TicketRequest { n, hierarchical } => {
                    let ticket = self.next_task.fetch_add(1, Ordering::Relaxed);
                    let granted = self.grant(n, hierarchical);
                    let _ = tx.send(Msg::TicketGrant { ticket, granted }).await;
                }
                Msg::FileResponse { id, resp, .. } if id & HEAD_ID_BIT != 0 => {
                    if let Some(w) = self.waiters.lock().unwrap().remove(&id) {
                        let _ = w.send(resp);
                    }
                }
                m => {
                    let Some(task) = m.task() else { continue };
                    let agent = {
                        let st = self.state.lock().unwrap();
                        st.routes.get(&task).filter(|r| r.client_conn == conn).and_then(|r| st.hosts.get(&r.host)).map(|h| h.tx.clone())
                    };
                    if let Some(a) = agent {
                        let _ = a.send(m).await;
                    }
                }
            }
        }
    }

    /// Place a task on a host with a free core and start it, or queue it
    /// until one frees up. Answers the client `Started` or `LaunchFailed`.
    async fn launch(&self, conn: u64, tx: &Outgoing, mut spec: starling_proto::TaskSpec, reference: u64) {
        let mut job_fresh = false;
        if let Some(job) = &spec.job {
            let (all, fresh) = self.job_bindings(format!("{}:{job}", spec.uid), std::mem::take(&mut spec.prethrow));
            spec.prethrow = all;
            job_fresh = fresh;
        }
        let placed = {
            let mut st = self.state.lock().unwrap();
            match Self::check_placeable(&st, spec.host.as_deref(), spec.cores()) {
                Err(message) => Err(message),
                Ok(()) => match Self::pick(&mut st, spec.host.as_deref(), spec.cores()) {
                    Some(p) => Ok(Some((spec, p))),
                    None => {
                        st.queue.push_back(Queued { conn, client: tx.clone(), spec, reference, job_fresh });
                        Ok(None)
                    }
                },
            }
        };
        match placed {
            Err(message) => {
                let _ = tx.send(Msg::LaunchFailed { reference, message }).await;
            }
            Ok(Some((spec, (host, host_tx, host_conn)))) => {
                self.start(conn, tx, spec, reference, job_fresh, host, host_tx, host_conn).await
            }
            Ok(None) => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn start(
        &self,
        conn: u64,
        tx: &Outgoing,
        spec: starling_proto::TaskSpec,
        reference: u64,
        job_fresh: bool,
        host: String,
        host_tx: Outgoing,
        host_conn: u64,
    ) {
        let task = TaskId(self.next_task.fetch_add(1, Ordering::Relaxed));
        self.state
            .lock()
            .unwrap()
            .routes
            .insert(task, Route { client: Some(tx.clone()), client_conn: conn, host: host.clone(), host_conn, cores: spec.cores() });
        let _ = tx.send(Msg::Started { task, host: host.clone(), reference, job_fresh }).await;
        if host_tx.send(Msg::RunTask { task, spec }).await.is_err() {
            self.lose_task(task, &format!("host {host} went away before the task started")).await;
        }
    }

    /// Merge a launch's (delta) bindings into its job's; returns all of them,
    /// and whether the job was unknown until now.
    fn job_bindings(
        &self,
        key: String,
        delta: Vec<(starling_proto::WirePath, starling_proto::Lookup)>,
    ) -> (Vec<(starling_proto::WirePath, starling_proto::Lookup)>, bool) {
        let mut jobs = self.jobs.lock().unwrap();
        jobs.retain(|_, j| j.used.elapsed() < JOB_IDLE);
        let fresh = !jobs.contains_key(&key);
        let j = jobs.entry(key).or_insert_with(|| JobBindings { bindings: HashMap::new(), used: std::time::Instant::now() });
        j.used = std::time::Instant::now();
        for (p, l) in delta {
            if j.bindings.len() < JOB_MAX_BINDINGS || j.bindings.contains_key(&p) {
                j.bindings.insert(p, l);
            }
        }
        (j.bindings.iter().map(|(p, l)| (p.clone(), l.clone())).collect(), fresh)
    }

    /// Start queued launches that now fit, oldest first.
    async fn drain_queue(&self) {
        let ready: Vec<(Queued, (String, Outgoing, u64))> = {
            let mut st = self.state.lock().unwrap();
            let mut out = Vec::new();
            let mut i = 0;
            while i < st.queue.len() {
                let want = st.queue[i].spec.host.clone();
                let cores = st.queue[i].spec.cores();
                match Self::pick(&mut st, want.as_deref(), cores) {
                    Some(p) => {
                        let q = st.queue.remove(i).expect("index in range");
                        out.push((q, p));
                    }
                    None => i += 1,
                }
            }
            out
        };
        for (q, (host, host_tx, host_conn)) in ready {
            self.start(q.conn, &q.client, q.spec, q.reference, q.job_fresh, host, host_tx, host_conn).await;
        }
    }

    fn self_arc(&self) -> Option<Arc<Head>> {
        self.me.lock().unwrap().upgrade()
    }

    /// Ask the client that owns `task` for content; `None` if it is gone.
    async fn ask_client(&self, task: TaskId, req: FileReq) -> Option<FileResp> {
        let client = self.state.lock().unwrap().routes.get(&task).and_then(|r| r.client.clone())?;
        let id = HEAD_ID_BIT | self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiters.lock().unwrap().insert(id, tx);
        if client.send(Msg::FileRequest { task, id, req }).await.is_err() {
            self.waiters.lock().unwrap().remove(&id);
            return None;
        }
        rx.await.ok()
    }

    /// Answer a content-named request from the relay cache, fetching what is
    /// missing from the task's client exactly once however many hosts ask.
    async fn serve_content(&self, task: TaskId, req: FileReq) -> FileResp {
        let cache = self.cache.as_ref().expect("relay cache on");
        match req {
            FileReq::GetRecipe { name } => {
                if let Ok(Some(r)) = cache.get_recipe(&name) {
                    return FileResp::Recipe(Some(r));
                }
                let resp = self.ask_client(task, FileReq::GetRecipe { name }).await.unwrap_or(FileResp::Errno(libc_eio()));
                if let FileResp::Recipe(Some(r)) = &resp {
                    if r.name() == name {
                        let _ = cache.put_recipe(r);
                    }
                }
                resp
            }
            FileReq::GetChunks { hashes } => {
                // Up to three passes: a chunk another task was fetching may
                // still be missing if that fetch failed; then fetch it ourselves.
                for _ in 0..3 {
                    let (mine, theirs, done_tx) = self.claim(cache, &hashes);
                    if let Some(done_tx) = done_tx {
                        self.fetch_into_cache(task, &mine).await;
                        let mut inflight = self.inflight.lock().unwrap();
                        for h in &mine {
                            inflight.remove(h);
                        }
                        let _ = done_tx.send(true);
                    }
                    for mut w in theirs {
                        let _ = w.wait_for(|done| *done).await;
                    }
                    if hashes.iter().all(|h| cache.has_chunk(h)) {
                        break;
                    }
                }
                let mut out = Vec::with_capacity(hashes.len());
                for h in &hashes {
                    let mut bytes = cache.get_chunk(h).ok().flatten();
                    if bytes.is_none() {
                        // Evicted (or lost) since it was checked: ask the client again.
                        self.fetch_into_cache(task, std::slice::from_ref(h)).await;
                        bytes = cache.get_chunk(h).ok().flatten();
                    }
                    match bytes {
                        // Head → host is the cluster network: no need to spend CPU compressing.
                        Some(bytes) => out.push(ChunkData::seal(&bytes, false)),
                        None => return FileResp::Errno(libc_eio()),
                    }
                }
                FileResp::Chunks(out)
            }
            _ => FileResp::Errno(libc_eio()),
        }
    }

    /// Split the missing chunks into those this request will fetch (now
    /// marked in flight) and the fetches of others to wait for.
    #[allow(clippy::type_complexity)]
    fn claim(
        &self,
        cache: &HostCache,
        hashes: &[Hash],
    ) -> (Vec<Hash>, Vec<tokio::sync::watch::Receiver<bool>>, Option<tokio::sync::watch::Sender<bool>>) {
        let mut mine = Vec::new();
        let mut theirs = Vec::new();
        let mut inflight = self.inflight.lock().unwrap();
        for h in hashes {
            if cache.has_chunk(h) || mine.contains(h) {
                continue;
            }
            match inflight.get(h) {
                Some(w) => theirs.push(w.clone()),
                None => mine.push(*h),
            }
        }
        if mine.is_empty() {
            return (mine, theirs, None);
        }
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        for h in &mine {
            inflight.insert(*h, done_rx.clone());
        }
        (mine, theirs, Some(done_tx))
    }

    async fn fetch_into_cache(&self, task: TaskId, hashes: &[Hash]) {
        let cache = self.cache.as_ref().expect("relay cache on");
        if let Some(FileResp::Chunks(got)) = self.ask_client(task, FileReq::GetChunks { hashes: hashes.to_vec() }).await {
            for c in got {
                if !hashes.contains(&c.hash) {
                    continue;
                }
                match c.open() {
                    Ok(bytes) => {
                        let _ = cache.put_chunk(&c.hash, &bytes);
                    }
                    Err(e) => log::warn!("client sent a bad chunk: {e}"),
                }
            }
        }
    }

    fn status(&self) -> ClusterStatus {
        let st = self.state.lock().unwrap();
        let mut hosts: Vec<HostInfo> =
            // The head's own count is exact; the agent's report lags by up to its heartbeat.
            st.hosts.values().map(|h| HostInfo { running: h.cores_busy, ..h.info.clone() }).collect();
        hosts.sort_by(|a, b| natural_key(&a.name).cmp(&natural_key(&b.name)));
        let mut facts = self.facts.clone();
        facts.push(("queued".into(), st.queue.len().to_string()));
        facts.push(("relay_cache".into(), if self.cache.is_some() { "on" } else { "off" }.into()));
        ClusterStatus { head: self.listen.clone(), hosts, facts }
    }

    /// Grant up to `n` clones by free cores (cores minus tasks placed there).
    /// The grant is advisory: the clones are then launched as tasks.
    fn grant(&self, n: u32, hierarchical: bool) -> Result<Vec<(String, u32)>, String> {
        let st = self.state.lock().unwrap();
        let mut free: Vec<(String, u32)> = st
            .hosts
            .values()
            .map(|h| (h.info.name.clone(), h.info.cores.saturating_sub(h.cores_busy)))
            .filter(|(_, f)| *f > 0)
            .collect();
        if free.is_empty() {
            return Err(if st.hosts.is_empty() { "the cluster has no hosts".into() } else { "no free cores in the cluster".into() });
        }
        free.sort_by(|a, b| b.1.cmp(&a.1).then(natural_key(&a.0).cmp(&natural_key(&b.0))));
        let mut out: Vec<(String, u32)> = Vec::new();
        let mut left = n;
        if hierarchical {
            // Fill each host's cores before moving on: one restore per host, then local forks.
            for (h, f) in free {
                if left == 0 {
                    break;
                }
                let k = f.min(left);
                out.push((h, k));
                left -= k;
            }
        } else {
            // Spread round-robin so clones land on as many hosts as possible.
            let mut free = free;
            while left > 0 && free.iter().any(|(_, f)| *f > 0) {
                for (h, f) in free.iter_mut() {
                    if left == 0 || *f == 0 {
                        continue;
                    }
                    *f -= 1;
                    left -= 1;
                    match out.iter_mut().find(|(o, _)| o == h) {
                        Some((_, k)) => *k += 1,
                        None => out.push((h.clone(), 1)),
                    }
                }
            }
        }
        Ok(out)
    }

    /// Can this launch (needing `cores` on one host) ever be placed?
    fn check_placeable(st: &State, want: Option<&str>, cores: u32) -> Result<(), String> {
        if st.hosts.is_empty() {
            return Err("the cluster has no hosts (are the agents running? see `starling status`)".into());
        }
        if let Some(w) = want {
            let Some(h) = st.hosts.get(w) else {
                let mut names: Vec<_> = st.hosts.keys().cloned().collect();
                names.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
                return Err(format!("no host named {w:?} (hosts: {})", names.join(", ")));
            };
            if h.info.cores.max(1) < cores {
                return Err(format!("host {w} has {} cores; the task needs {cores}", h.info.cores));
            }
        } else if st.hosts.values().all(|h| h.info.cores.max(1) < cores) {
            return Err(format!("no host has the {cores} cores the task needs"));
        }
        Ok(())
    }

    /// A host with a free core (the named one, else the least loaded), now
    /// holding one more task; `None` if every eligible host is busy.
    fn pick(st: &mut State, want: Option<&str>, cores: u32) -> Option<(String, Outgoing, u64)> {
        let free = |h: &Host| h.cores_busy + cores <= h.info.cores.max(1);
        let name = match want {
            Some(w) => st.hosts.get(w).filter(|h| free(h)).map(|h| h.info.name.clone())?,
            None => st
                .hosts
                .values()
                .filter(|h| free(h))
                .min_by(|a, b| {
                    let fa = a.cores_busy as f32 / a.info.cores.max(1) as f32;
                    let fb = b.cores_busy as f32 / b.info.cores.max(1) as f32;
                    fa.total_cmp(&fb).then(natural_key(&a.info.name).cmp(&natural_key(&b.info.name)))
                })
                .map(|h| h.info.name.clone())?,
        };
        let h = st.hosts.get_mut(&name).expect("host exists");
        h.cores_busy += cores;
        Some((name, h.tx.clone(), h.conn_id))
    }

    async fn lose_task(&self, task: TaskId, why: &str) {
        let r = {
            let mut st = self.state.lock().unwrap();
            let r = st.routes.remove(&task);
            if let Some(r) = &r {
                if let Some(h) = st.hosts.get_mut(&r.host) {
                    h.cores_busy = h.cores_busy.saturating_sub(r.cores);
                }
            }
            r
        };
        if let Some(c) = r.and_then(|r| r.client) {
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
        // Queued launches that can no longer be placed fail now.
        let failed: Vec<Queued> = {
            let mut st = self.state.lock().unwrap();
            let queue: Vec<Queued> = st.queue.drain(..).collect();
            let (bad, keep): (Vec<Queued>, Vec<Queued>) =
                queue.into_iter().partition(|q| Self::check_placeable(&st, q.spec.host.as_deref(), q.spec.cores()).is_err());
            st.queue = keep.into();
            bad
        };
        for q in failed {
            let _ = q.client.send(Msg::LaunchFailed { reference: q.reference, message: format!("host {name} was lost before the task could start") }).await;
        }
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
                    // Keep the route until the host reports the end: the core stays busy until then.
                    r.client = None;
                    (*t, st.hosts.get(&r.host).map(|h| h.tx.clone()))
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
