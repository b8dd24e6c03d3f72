//! The cluster backend: clones restored on other hosts of a starling cluster.
//!
//! The parent keeps one [`Session`] to the head for the whole process (one
//! connection, however many tickets and clones), driven by a small tokio
//! runtime of its own. A ticket is the head's grant (`TicketRequest` →
//! `TicketGrant`: hosts and clones per host, by free cores). `sf_clone`
//! then freezes the template, dumps the descriptor, starts the page server
//! on the address the hosts reach this machine at, and launches every clone
//! as a task whose `TaskSpec::clone` is set: the agent runs the restorer in
//! the same sandbox over the same file view as `starling exec` tasks, so a
//! clone sees this machine's files and its output files come home at exit
//! (the session commits them, as for any task).
//!
//! Per clone, a tokio task consumes the task's events: output goes straight
//! to this process's fd 1/2; the end (`Finished` or `Lost`) sets the clone's
//! [`CloneState`]. [`ClusterClones::wait_all`] blocks on those states, so
//! `sf_join` never hangs: a lost host or head ends every affected clone as
//! `Lost`.
//!
//! Hierarchical tickets: the head fills each host's cores before moving on,
//! and each host gets ONE clone task holding all its k clones
//! (`local_forks` = k - 1): one file view, one sandbox, one restorer, whose
//! PID 1 forks the k clones at the restore point — before any memory is
//! registered or fetched, so each clone still gets its own userfaultfd and
//! fetches lazily (a fork of an already-running lazy clone would see zeros
//! for pages not yet fetched: `UFFD_FEATURE_EVENT_FORK` does not survive
//! handing the uffd to the agent). The first clone has the template's PID;
//! the others, like fork() children, their own. Without `hierarchical`,
//! every clone is its own task (spread over hosts).
//!
//! Each clone's exit status and fault-handler counters come back in a
//! `CloneStats` message when its task ended.

use crate::{Descriptor, ForkError, Result};
use starling_config::Config;
use starling_image::abi::counters::CloneCounters;
use starling_image::{FdKind, RegionKind};
use starling_proto::conn::Outgoing;
use starling_proto::{CloneSpec, ExitStatus, Msg, NetworkIsolation, Stream, TaskId, TaskSpec, WirePath};
use starling_session::discover::Target;
use starling_session::{prethrow, Session, SessionError, SessionOptions, TaskEvent, TaskHandle};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use tokio::sync::mpsc::UnboundedReceiver;

/// The variable a clone (and its task on the host) finds the parent's host in.
pub const PARENT_HOST_ENV: &str = "STARLING_PARENT_HOST";

/// Where a clone is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloneState {
    /// Launched, not ended yet.
    Running,
    Exited(i32),
    Killed(i32),
    /// Gone without a result (host or head lost, restore could not start).
    Lost(String),
}

impl From<ExitStatus> for CloneState {
    fn from(s: ExitStatus) -> Self {
        match s {
            ExitStatus::Code(c) => CloneState::Exited(c),
            ExitStatus::Signal(s) => CloneState::Killed(s),
        }
    }
}

impl CloneState {
    pub fn is_final(&self) -> bool {
        !matches!(self, CloneState::Running)
    }
    /// The classic status int: exit code, or 128+signal; -1 otherwise.
    pub fn status_code(&self) -> Option<i32> {
        match self {
            CloneState::Exited(c) => Some(*c),
            CloneState::Killed(s) => Some(128 + s),
            _ => None,
        }
    }
}

/// The process's link to the cluster: one runtime, one session.
pub struct ClusterLink {
    rt: tokio::runtime::Runtime,
    session: Session,
    /// This machine's address as the hosts reach it (the page server binds here).
    pub parent_ip: IpAddr,
    /// What its clones ask for with `fork.isolate_network` on: their ticket's own network, its
    /// members filled in by the head; refused besides the head's and hosts' ports, the port this
    /// process reaches the cluster at (the link relay's, when it goes through one). `None`: the
    /// hosts' whole network.
    network: Option<starling_proto::TicketNetwork>,
    /// What its tickets ask of the grant (`fork.isolate_network`).
    isolation: NetworkIsolation,
}

static LINK: OnceLock<Mutex<Option<Arc<ClusterLink>>>> = OnceLock::new();
/// The parent's address, readable in clones (it is in the memory they inherit).
static PARENT_HOST: OnceLock<std::ffi::CString> = OnceLock::new();

/// `IP` of the parent's host as clones reach it, in the parent and in its clones.
pub fn parent_host() -> Option<&'static std::ffi::CStr> {
    PARENT_HOST.get().map(|c| c.as_c_str())
}

/// The local address this machine uses to reach `head` (a connected UDP
/// socket sends nothing; `getsockname` tells the route's source address).
/// For the embedded cluster that is the bridge address hosts reach us at.
fn local_ip_towards(head: &str) -> Result<IpAddr> {
    let unresolved = |source| ForkError::HeadAddress { addr: head.to_string(), source };
    let target: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(head)
        .map_err(unresolved)?
        .next()
        .ok_or_else(|| unresolved(std::io::ErrorKind::NotFound.into()))?;
    let bind: SocketAddr = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("literal");
    let s = UdpSocket::bind(bind).map_err(|e| ForkError::io("udp socket", e))?;
    s.connect(target).map_err(|e| ForkError::io(format!("route to the cluster head {target}"), e))?;
    let ip = s.local_addr().map_err(|e| ForkError::io("getsockname", e))?.ip();
    // A head on loopback: hosts of a real cluster could not reach us there,
    // but an embedded cluster's head never listens on loopback.
    Ok(ip)
}

impl ClusterLink {
    /// The process-wide link, connecting on first use (to the head `config` finds).
    pub fn get(config: &Config) -> Result<Arc<ClusterLink>> {
        let cell = LINK.get_or_init(|| Mutex::new(None));
        let mut g = cell.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = g.as_ref() {
            return Ok(l.clone());
        }
        let target = Target::resolve(&config.client, &config.dirs())?;
        let parent_ip = local_ip_towards(&target.head_addr)?;
        let _ = PARENT_HOST.set(std::ffi::CString::new(parent_ip.to_string()).expect("an IP has no NUL"));
        // Clones inherit the parent's memory, environ included: set it here
        // (before this library starts any thread) so `getenv` in a clone
        // finds it. The task spec's env carries it too, for the host's logs.
        std::env::set_var(PARENT_HOST_ENV, parent_ip.to_string());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("starling-fork")
            .enable_all()
            .build()
            .map_err(|e| ForkError::io("tokio runtime", e))?;
        // Uncompressed: the embedded cluster's bridge is faster than zstd.
        let opts =
            SessionOptions { compress: false, cache_dir: config.client.cache_dir.clone(), chunking: config.client.chunking };
        let session = rt.block_on(Session::connect(&target, opts))?;
        let isolation = config.fork.isolate_network;
        let network = (isolation != NetworkIsolation::Off).then(|| starling_proto::TicketNetwork {
            members: Vec::new(),
            refused_ports: target.head_addr.parse::<SocketAddr>().map(|a| a.port()).into_iter().collect(),
            required: isolation == NetworkIsolation::Required,
        });
        let link = Arc::new(ClusterLink { rt, session, parent_ip, isolation, network });
        *g = Some(link.clone());
        Ok(link)
    }

    /// Ask the head for up to `n` clones.
    pub fn request(&self, n: u32, hierarchical: bool) -> Result<starling_session::Grant> {
        Ok(self.rt.block_on(self.session.request_ticket(n, hierarchical, self.isolation))?)
    }

    /// Tell the head how a `starling.Executor` on `ticket` stands (for its dashboard).
    pub fn executor_progress(&self, ticket: u64, progress: starling_proto::ExecutorProgress) -> Result<()> {
        Ok(self.rt.block_on(self.session.executor_progress(ticket, progress))?)
    }
}

struct CloneSlot {
    id: u32,
    host: String,
    task: Option<TaskId>,
    state: CloneState,
    /// The status the clone's restorer reported at its exit. It becomes the
    /// slot's state only when the clone's task has ended, because the task's
    /// files are committed home at its end: `sf_join` must not return before.
    reported: Option<CloneState>,
    stats: Option<CloneCounters>,
}

#[derive(Default)]
struct Shared {
    slots: Mutex<Vec<CloneSlot>>,
    changed: Condvar,
}

/// The clones of one ticket, launched on the cluster.
pub struct ClusterClones {
    link: Arc<ClusterLink>,
    shared: Arc<Shared>,
    tx: Option<Outgoing>,
}

/// The paths a restore looks up, with every ancestor (the file view resolves
/// one component at a time): the root, the sandbox's /proc and /dev mount
/// points, the cwd, every mapped file and every file reopened by path.
fn restore_paths(desc: &Descriptor) -> Vec<WirePath> {
    let mut paths = vec![desc.process.cwd.as_str(), "/proc", "/dev"];
    paths.extend(desc.regions.iter().filter_map(|r| match &r.kind {
        RegionKind::File { path, .. } => Some(path.as_str()),
        _ => None,
    }));
    paths.extend(desc.fds.iter().filter_map(|f| match &f.kind {
        FdKind::Reopen { path, .. } => Some(path.as_str()),
        _ => None,
    }));
    let mut out = vec![WirePath::root()];
    for p in paths {
        let Some(w) = prethrow::normalise(std::path::Path::new(p)) else { continue };
        out.extend(w.as_path().ancestors().filter_map(prethrow::normalise));
    }
    out.sort();
    out.dedup();
    out
}

/// Write all of `data` to raw fd `fd` (the parent's own stdout/stderr).
fn write_fd(fd: i32, mut data: &[u8]) {
    while !data.is_empty() {
        // SAFETY: writes from a live slice to a descriptor number; a closed
        // fd just returns EBADF.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        data = &data[usize::try_from(n).expect("n >= 0, checked above")..];
    }
}

/// One task of a ticket: its clones' ids, its host, its spec.
struct CloneTask {
    ids: Range<u32>,
    host: String,
    spec: TaskSpec,
}

impl CloneTask {
    /// `clone 3` or `clones 3..6`, for messages.
    fn names(&self) -> String {
        if self.ids.len() == 1 {
            format!("clone {}", self.ids.start)
        } else {
            format!("clones {}..{}", self.ids.start, self.ids.end - 1)
        }
    }
}

/// Everything a ticket's clone tasks share.
struct TicketPlan<'a> {
    ticket: u64,
    hierarchical: bool,
    parent_ip: IpAddr,
    network: Option<starling_proto::TicketNetwork>,
    descriptor_hash: starling_proto::Hash,
    descriptor_len: u32,
    page_server: SocketAddr,
    page_key: starling_proto::SecretKey,
    placement: &'a [(String, u32)],
}

impl TicketPlan<'_> {
    /// A task per clone, or per host's clones when hierarchical, numbered 1.. in placement order.
    fn tasks(&self, base: &TaskSpec) -> Vec<CloneTask> {
        let mut out = Vec::new();
        let mut next = 1u32;
        for (host, k) in self.placement {
            let groups: Vec<u32> = if self.hierarchical { vec![*k] } else { vec![1; *k as usize] };
            for count in groups {
                let id = next;
                next += count;
                let ticket = self.ticket;
                let mut spec = base.clone();
                spec.argv = vec![b"starling-clone".to_vec(), format!("ticket={ticket}").into_bytes(), format!("clone={id}").into_bytes()];
                spec.env.retain(|(k, _)| k != PARENT_HOST_ENV.as_bytes());
                spec.env.push((PARENT_HOST_ENV.as_bytes().to_vec(), self.parent_ip.to_string().into_bytes()));
                spec.host = Some(host.clone());
                spec.job = Some(format!("fork-ticket-{ticket}"));
                spec.clone = Some(CloneSpec {
                    ticket,
                    clone_id: id,
                    descriptor_hash: self.descriptor_hash,
                    descriptor_len: self.descriptor_len,
                    page_server: self.page_server.to_string(),
                    page_key: self.page_key,
                    local_forks: count - 1,
                    placed_ns: 0,
                    network: self.network.clone(),
                });
                out.push(CloneTask { ids: id..id + count, host: host.clone(), spec });
            }
        }
        out
    }
}

/// Follow one clone task's events until it ends: output to our fd 1/2,
/// per-clone statuses and counters into the slots, and the end state.
async fn follow(mut events: UnboundedReceiver<TaskEvent>, ids: Range<u32>, names: String, shared: Arc<Shared>) {
    let mut end = CloneState::Lost("the session ended without news of the clone".into());
    while let Some(ev) = events.recv().await {
        match ev {
            TaskEvent::Output(stream, data) => write_fd(if stream == Stream::Stdout { 1 } else { 2 }, &data),
            TaskEvent::CloneStats { clone_id, status, counters } => {
                let mut slots = shared.slots.lock().unwrap();
                if let Some(s) = slots.iter_mut().find(|s| s.id == clone_id && ids.contains(&s.id)) {
                    s.stats = Some(counters);
                    if let Some(status) = status {
                        s.reported = Some(CloneState::from(status));
                    }
                }
            }
            TaskEvent::Finished { status, commit, .. } => {
                if let Err(e) = commit {
                    write_fd(2, format!("starling: {names}: files were not committed: {e}\n").as_bytes());
                }
                // The first clone's status, for clones whose restorer reported none.
                end = CloneState::from(status);
                break;
            }
            TaskEvent::Lost(why) | TaskEvent::Refused(why) => {
                end = CloneState::Lost(why);
                break;
            }
            TaskEvent::Started { .. } | TaskEvent::X11(_) => {}
        }
    }
    let mut slots = shared.slots.lock().unwrap();
    for s in slots.iter_mut().filter(|s| ids.contains(&s.id) && !s.state.is_final()) {
        // A lost task's files never came home, whatever its clones reported.
        s.state = match (&end, s.reported.take()) {
            (CloneState::Lost(_), _) | (_, None) => end.clone(),
            (_, Some(reported)) => reported,
        };
    }
    shared.changed.notify_all();
}

/// Launch every task at once: the head starts each as soon as its host has
/// the cores, so clone time does not grow with the number of clones.
fn launch_all(link: &ClusterLink, tasks: Vec<CloneTask>) -> Vec<(CloneTask, std::result::Result<TaskHandle, SessionError>)> {
    link.rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for task in tasks {
            let session = link.session.clone();
            set.spawn(async move {
                let launched = session.launch(task.spec.clone()).await;
                (task, launched)
            });
        }
        let mut out = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(x) = r {
                out.push(x);
            }
        }
        out
    })
}

/// What a ticket's clones are made from: the parent's frozen template (its
/// descriptor and that descriptor's encoding, which hosts fetch and check),
/// and the page server holding its memory with the ticket's key to it.
#[derive(Clone, Copy)]
pub struct Template<'a> {
    pub descriptor: &'a Descriptor,
    pub encoded: &'a [u8],
    pub page_server: SocketAddr,
    pub page_key: starling_proto::SecretKey,
}

impl ClusterClones {
    /// Launch one clone per (host, clone id) over the link's session. On the
    /// first failure, kills what was launched and returns the error.
    pub fn launch(
        link: Arc<ClusterLink>,
        ticket: u64,
        placement: &[(String, u32)],
        hierarchical: bool,
        template: &Template<'_>,
    ) -> Result<ClusterClones> {
        let Template { descriptor: desc, encoded, page_server, page_key } = *template;
        let mut base = starling_session::spec::capture(vec!["starling-clone".into()])?;
        // Every path the restorer opens, bound now: no clone asks back for them.
        base.prethrow = prethrow::bind(link.session.files(), &restore_paths(desc));
        let plan = TicketPlan {
            ticket,
            hierarchical,
            parent_ip: link.parent_ip,
            network: link.network.clone(),
            descriptor_hash: starling_proto::Hash::of(encoded),
            descriptor_len: u32::try_from(encoded.len()).map_err(|_| ForkError::DescriptorTooLarge(encoded.len()))?,
            page_server,
            page_key,
            placement,
        };
        let tasks = plan.tasks(&base);
        let shared = Arc::new(Shared::default());
        shared.slots.lock().unwrap().extend(tasks.iter().flat_map(|t| {
            t.ids.clone().map(|id| CloneSlot { id, host: t.host.clone(), task: None, state: CloneState::Running, reported: None, stats: None })
        }));
        let mut clones = ClusterClones { link: link.clone(), shared: shared.clone(), tx: None };
        let mut failure = None;
        for (task, launched) in launch_all(&link, tasks) {
            let handle = match launched {
                Ok(h) => h,
                Err(source) => {
                    shared.slots.lock().unwrap().retain(|s| !task.ids.contains(&s.id));
                    failure.get_or_insert(ForkError::Launch { clones: task.names(), host: task.host, source });
                    continue;
                }
            };
            clones.tx.get_or_insert_with(|| handle.sender());
            for s in shared.slots.lock().unwrap().iter_mut().filter(|s| task.ids.contains(&s.id)) {
                s.task = Some(handle.task);
            }
            link.rt.spawn(follow(handle.events, task.ids.clone(), task.names(), shared.clone()));
        }
        if let Some(e) = failure {
            clones.kill();
            clones.wait_all();
            return Err(e);
        }
        Ok(clones)
    }

    /// Block until every clone has ended (exited, killed or lost).
    pub fn wait_all(&self) {
        let mut slots = self.shared.slots.lock().unwrap();
        while slots.iter().any(|s| !s.state.is_final()) {
            slots = self.shared.changed.wait(slots).unwrap();
        }
    }

    /// SIGKILL every clone that is still running (the agent kills its sandbox).
    /// A task whose clones have all exited is left to commit their files.
    pub fn kill(&self) {
        let Some(tx) = &self.tx else { return };
        let mut tasks: Vec<TaskId> = self
            .shared
            .slots
            .lock()
            .unwrap()
            .iter()
            .filter(|s| !s.state.is_final() && s.reported.is_none())
            .filter_map(|s| s.task)
            .collect();
        tasks.sort_by_key(|t| t.0);
        tasks.dedup();
        for task in tasks {
            let _ = self.link.rt.block_on(tx.send(Msg::Signal { task, signo: libc::SIGKILL }));
        }
    }

    pub fn state(&self, id: u32) -> Option<CloneState> {
        self.shared.slots.lock().unwrap().iter().find(|s| s.id == id).map(|s| s.state.clone())
    }

    pub fn stats(&self, id: u32) -> Option<CloneCounters> {
        self.shared.slots.lock().unwrap().iter().find(|s| s.id == id).and_then(|s| s.stats)
    }

    pub fn host(&self, id: u32) -> Option<String> {
        self.shared.slots.lock().unwrap().iter().find(|s| s.id == id).map(|s| s.host.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_session::commit::CommitReport;

    fn slot(id: u32) -> CloneSlot {
        CloneSlot { id, host: "h1".into(), task: None, state: CloneState::Running, reported: None, stats: None }
    }

    fn stats(clone_id: u32, code: i32) -> TaskEvent {
        TaskEvent::CloneStats { clone_id, status: Some(ExitStatus::Code(code)), counters: CloneCounters::default() }
    }

    /// The regression behind test_fork's lost files: a clone's restorer reports
    /// its exit before the task's files are committed; `sf_join` waits on the
    /// slots, so a slot must not end before the task does.
    #[tokio::test]
    async fn a_clone_ends_when_its_task_has_committed_not_when_it_exits() {
        let shared = Arc::new(Shared::default());
        shared.slots.lock().unwrap().extend([slot(1), slot(2)]);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let follower = tokio::spawn(follow(rx, 1..3, "clones 1..2".into(), shared.clone()));
        tx.send(stats(1, 0)).unwrap();
        tx.send(stats(2, 7)).unwrap();
        // Wait until the follower has taken both reports.
        while shared.slots.lock().unwrap().iter().any(|s| s.reported.is_none()) {
            tokio::task::yield_now().await;
        }
        assert!(shared.slots.lock().unwrap().iter().all(|s| s.state == CloneState::Running));
        tx.send(TaskEvent::Finished { status: ExitStatus::Code(0), commit: Ok(CommitReport::default()), accessed: Vec::new() }).unwrap();
        follower.await.unwrap();
        let states: Vec<CloneState> = shared.slots.lock().unwrap().iter().map(|s| s.state.clone()).collect();
        assert_eq!(states, vec![CloneState::Exited(0), CloneState::Exited(7)]);
    }

    /// A task lost after its clones reported (host gone before the commit):
    /// their files never came home, so the clones are lost, not exited.
    #[tokio::test]
    async fn a_task_lost_after_its_clones_exited_loses_them() {
        let shared = Arc::new(Shared::default());
        shared.slots.lock().unwrap().push(slot(1));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(stats(1, 0)).unwrap();
        tx.send(TaskEvent::Lost("host h1 lost".into())).unwrap();
        follow(rx, 1..2, "clone 1".into(), shared.clone()).await;
        assert_eq!(shared.slots.lock().unwrap()[0].state, CloneState::Lost("host h1 lost".into()));
    }
}
