//! The messages. One enum for every link; each side accepts only the
//! variants that make sense for its role and answers others with `Error`.

use crate::types::*;
use crate::{CloneCounters, Invalid, ProtoError, MAX_PATH};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Client,
    Agent,
    Head,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A file-view request from a host, answered by the client (or by the head's
/// cache, for content-named requests).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileReq {
    Lookup { path: WirePath },
    ReadDir { path: WirePath },
    GetRecipe { name: Hash },
    GetChunks { hashes: Vec<Hash> },
    /// Like `GetChunks`, from a host that can fetch from its peers: the head
    /// may answer, per chunk, with a peer that has (or is fetching) it
    /// instead of the bytes ([`FileResp::ChunkSources`]).
    FindChunks { hashes: Vec<Hash> },
}

/// Where a host gets one chunk of a [`FileReq::FindChunks`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChunkSource {
    /// The bytes, as `GetChunks` would have sent them.
    Data(ChunkData),
    /// Ask this peer (its [`HostInfo::peer`] address); on any failure, the
    /// head with `GetChunks`.
    Peer { hash: Hash, addr: String },
}

impl ChunkSource {
    pub fn hash(&self) -> &Hash {
        match self {
            ChunkSource::Data(c) => &c.hash,
            ChunkSource::Peer { hash, .. } => hash,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileResp {
    Lookup(Lookup),
    /// Entries, or an errno (ENOENT, ENOTDIR, EACCES...).
    ReadDir(Result<Vec<DirEntry>, i32>),
    Recipe(Option<Recipe>),
    Chunks(Vec<ChunkData>),
    /// The answer to `FindChunks`: one source per chunk, in the order asked.
    ChunkSources(Vec<ChunkSource>),
    /// The request failed with this errno.
    Errno(i32),
}

/// One task of a [`Msg::LaunchJob`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobTask {
    /// This task's argv, or `None` for the job spec's.
    pub argv: Option<Vec<Vec<u8>>>,
}

/// Most tasks in one job launch.
pub const MAX_JOB_TASKS: usize = 100_000;

/// One row of `starling status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub head: String,
    pub hosts: Vec<HostInfo>,
    /// Free-form facts about the cluster (bridge, subnet, link profile, ...).
    pub facts: Vec<(String, String)>,
}

/// Largest number of hashes in one GetChunks request.
pub const MAX_BATCH: usize = 4096;

/// Largest number of names in one `HoldsQuery` (or its reply).
pub const MAX_HOLDS_QUERY: usize = 1 << 16;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// First frame in each direction on every connection. `compress`: the
    /// sender would like frames to it zstd-compressed (a slow link).
    Hello { role: Role, name: String, compress: bool },
    /// Something went wrong; `task` names the task it concerns, if any.
    Error { task: Option<TaskId>, message: String },

    // ---- agent ↔ head
    /// Agent → head: who I am and how loaded (sent at start and periodically).
    HostInfo(HostInfo),
    /// Head → agent: start a task.
    RunTask { task: TaskId, spec: TaskSpec },

    // ---- client ↔ head
    /// Client → head: run this. `reference` is the client's name for the
    /// launch; the head answers `Started` (once a host has a free core: the
    /// head queues tasks rather than oversubscribe hosts) or `LaunchFailed`.
    Launch { spec: TaskSpec, reference: u64 },
    /// `job_fresh`: the launch named a job the head held no bindings for
    /// (new, expired, or the head restarted): a client that sent only a delta
    /// must send everything next time.
    Started { task: TaskId, host: String, reference: u64, job_fresh: bool },
    LaunchFailed { reference: u64, message: String },
    StatusRequest,
    StatusReply(ClusterStatus),

    // ---- task traffic (routed by the head between client and agent)
    Stdin {
        task: TaskId,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    StdinEof { task: TaskId },
    Output {
        task: TaskId,
        stream: Stream,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    Signal { task: TaskId, signo: i32 },
    FileRequest { task: TaskId, id: u64, req: FileReq },
    FileResponse { task: TaskId, id: u64, resp: FileResp },
    /// Agent → client: content of files the task wrote, ahead of `Finished`.
    ChangeChunks { task: TaskId, chunks: Vec<ChunkData> },
    /// Agent → client: the task ended; these are its file-system changes,
    /// and the paths it looked at (for the client's prethrow profile).
    Finished { task: TaskId, status: ExitStatus, changes: Vec<Change>, accessed: Vec<WirePath> },
    /// Agent → client: one clone of a clone task ended: its exit status when
    /// the restorer reported one (a hierarchical task holds several clones;
    /// `Finished` carries only the first one's), and its fault-handler
    /// counters. Sent once per clone after the task's processes ended,
    /// before `Finished`.
    CloneStats { task: TaskId, clone_id: u32, status: Option<ExitStatus>, counters: CloneCounters },
    /// Client → agent: changes committed (paths that conflicted were saved beside).
    Committed { task: TaskId, conflicts: Vec<WirePath> },

    Ping { nonce: u64 },
    Pong { nonce: u64 },

    /// Client → head, ahead of a launch in the same flight: content the
    /// client's shadow index says the head lacks (UCop's proposed push).
    Push { recipes: Vec<Recipe>, chunks: Vec<ChunkData> },
    /// Client → head, before a large push: which of these recipe and chunk
    /// names does the relay cache hold already? (A client whose shadow index
    /// is cold — a fresh client cache against a warm cluster — would
    /// otherwise push content the head has.)
    HoldsQuery { nonce: u64, names: Vec<Hash> },
    /// Head → client: the queried names the relay cache holds (none without one).
    HoldsReply { nonce: u64, held: Vec<Hash> },
    /// Client → head: start several tasks sharing one spec, one prethrow and
    /// one consistency point (a job). Task i gets `STARLING_TASK=i`,
    /// `STARLING_TASKS=n` and, if given, its own argv. Answered by one
    /// `Started` (or `LaunchFailed`) per task; task i has reference
    /// `first_reference + i`.
    LaunchJob { spec: TaskSpec, tasks: Vec<JobTask>, first_reference: u64 },

    // ---- fork API
    /// Client → head: reserve up to `n` clones.
    TicketRequest { n: u32, hierarchical: bool, isolation: NetworkIsolation },
    /// Head → client: the grant — (host, clones on that host) — or why not.
    /// Non-hierarchical: one clone per granted core. Hierarchical: the first
    /// clone on each host is restored there; the rest are local forks of it.
    /// `unisolated`: granted hosts that cannot enforce the ticket's own
    /// network (isolation `On`): their clones run with the host's network.
    TicketGrant { ticket: u64, granted: Result<Vec<(String, u32)>, String>, unisolated: Vec<Unisolated> },

    // ---- tasks of the whole cluster, and moving them (live migration)
    /// Client → head: every running task.
    PsRequest,
    PsReply(Vec<TaskRow>),
    /// Head → agent: what do your tasks use now (`nonce` pairs the reply).
    UsageRequest { nonce: u64 },
    UsageReply { nonce: u64, tasks: Vec<TaskUsage> },
    /// Client → head: move a running task to host `to` (None: the head
    /// picks). `stop_and_copy`: no pre- or post-copy, every page sent while
    /// it is frozen (the baseline the benchmark compares against).
    Migrate { task: TaskId, to: Option<String>, stop_and_copy: bool },
    /// Head → client: how the move went.
    MigrateReply { task: TaskId, result: Result<MigrationReport, String> },
    /// Head → target agent: `task` will move here from `from`; listen for it,
    /// and take the stream only from a peer that proves `key` (the move's
    /// secret, made by the head; the source gets it in `MigrateOut`).
    /// `network`: a moving clone's ticket network here, as the head makes it
    /// for a clone launched here (the ticket's members, this host among them;
    /// `None`: the whole network, whatever the clone had on its source).
    MigrateIn { migration: u64, task: TaskId, from: String, key: SecretKey, network: Option<TicketNetwork> },
    /// Target agent → head: listening at this address (or why not).
    MigrateInReady { migration: u64, result: Result<String, String> },
    /// Head → target agent: forget the migration (it failed before the switch).
    MigrateAbort { migration: u64 },
    /// Head → agent: the hosts of ticket `ticket` are now `members` (a clone of
    /// it moved): the rules of its clones here let exactly these (and the
    /// parent's machine) through. Ignored where no clone of it runs.
    TicketMembers { ticket: u64, members: Vec<std::net::IpAddr> },
    /// Head → source agent: move `task` to `to_host`, whose agent listens at `to_addr`.
    /// `key`: the move's secret, proved to the target's listener, and the
    /// key of the page server the target fetches the rest of memory from.
    MigrateOut { migration: u64, task: TaskId, to_host: String, to_addr: String, stop_and_copy: bool, key: SecretKey },
    /// Source agent → head: the task is frozen; hold what the client sends
    /// it (stdin, signals) until the switch.
    MigrateFreezing { migration: u64, task: TaskId },
    /// Head → source agent: the task's input is held.
    MigrateHeld { migration: u64 },
    /// Source agent → head: the task runs on the target now, and everything
    /// it printed here was sent before this message.
    MigrateHandedOver {
        migration: u64,
        task: TaskId,
        /// CPU time the task used on the source (its processes' utime + stime): `starling ps`
        /// adds it to what the target measures, whose counters restart at zero.
        cpu_seconds: f64,
    },
    /// Source agent → head: the migration ended (the source holds nothing
    /// of the task any more, or it failed and the task runs where it ran).
    MigrateDone { migration: u64, task: TaskId, result: Result<MigrationReport, String> },
    /// Link relay → head, before the client's bytes: the credentials the
    /// kernel gave for the local user the relay accepted (`SO_PEERCRED`). The
    /// head believes it only on a connection whose certificate is the relay's.
    OnBehalfOf { uid: u32, gid: u32, groups: Vec<u32> },

    // ---- terminal tasks (appended: variants are encoded by index)
    /// Client → head → agent: the client's terminal changed size; the task's
    /// pty gets it (TIOCSWINSZ: its foreground process group gets SIGWINCH).
    /// Ignored for a task without a terminal.
    Resize { task: TaskId, rows: u16, cols: u16 },

    // ---- live progress for the head's dashboard (appended: variants are encoded by index)
    /// Agent → head: a running clone's fault-handler counters so far (cumulative), sent
    /// periodically while they change (`CloneStats` still carries the final ones). The head
    /// keeps them for the dashboard; they go no further.
    CloneProgress { task: TaskId, clone_id: u32, counters: CloneCounters },
    /// Client → head: a `starling.Executor`'s futures on ticket `ticket` (its workers are that
    /// ticket's clones), sent when the counts change (throttled by the client) and once at
    /// shutdown with `closed`. For the dashboard only.
    ExecutorProgress { ticket: u64, progress: ExecutorProgress },

    // ---- roaming tasks (appended: variants are encoded by index)
    /// Client → head, on the task's own connection: its migration manager decided this (moves
    /// included, before it asks for them). The head keeps the latest [`MAX_ROAM_DECISIONS`] for
    /// `starling ps --why`; the first note makes the task a roaming one in `ps`.
    RoamNote { task: TaskId, decision: RoamDecision },

    // ---- CA rotation (appended: variants are encoded by index)
    /// Head → agent, over their mutual-TLS connection, after `starling ca rotate`: the CAs to
    /// trust from now on (PEM bundle, current first) and, unless `None`, a certificate of the
    /// current CA for the agent's own key (same role and names). The agent installs them for
    /// its next connections; this one goes on (`starling_auth::rotate`).
    Credentials { certificate: Option<String>, ca: String },

    // ---- revocation reaches the hosts (appended: variants are encoded by index)
    /// Head → agent, over their mutual-TLS connection, when the agent registers and whenever the
    /// revocation list changes: the serials of every revoked certificate. Hosts also serve each
    /// other (chunk sharing), so each must refuse, and drop, a host whose certificate was revoked.
    Revoked { serials: Vec<String> },

    // ---- X11 forwarding (`exec --x11`; appended: variants are encoded by index)
    /// Agent → client: the task opened X connection `stream` on the display its host serves it;
    /// the client connects to its own X server for it.
    X11Open { task: TaskId, stream: u32 },
    /// Either way: bytes of X connection `stream`, in order.
    X11Data {
        task: TaskId,
        stream: u32,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Either way: the sender's end of X connection `stream` closed (the program's, or the X
    /// server's); the receiver closes its end.
    X11Close { task: TaskId, stream: u32 },

    // ---- re-attaching a task that outlived its client (appended: variants are encoded by index)
    /// Client → head: `starling attach TASK`: be this task's client from now on. The head
    /// answers `Started` with `reference` (then the output the last client had not acknowledged,
    /// and whatever the task sent meanwhile) or `LaunchFailed` with why not (unknown or ended
    /// task, another user's, or another client attached and `force` not set; with `force` that
    /// client is told `Error` and let go).
    Attach { task: TaskId, reference: u64, force: bool },
    /// Client → head: `bytes` more of the task's output (`Output`, every stream, in order) were
    /// written to the user. The head keeps a task's unacknowledged output (bounded) while it
    /// may outlive its client, so an `Attach` replays exactly what the user has not seen.
    OutputAck { task: TaskId, bytes: u64 },

    // ---- a task at home talks to its client directly (appended: variants are encoded by index)
    /// Home agent → head → client: the task runs on the home site, the client's own machine;
    /// its stream ([`Msg::is_stream`]) may go straight between the two over the home agent's
    /// Unix socket `socket` (`crate::path`), never across the link to the head.
    AtHome { task: TaskId, socket: String },
    /// Client → home agent, first on a connection to its socket: carry this task's stream here.
    /// Echoed back first when the agent agrees (else it says `Error` and closes).
    DirectOpen { task: TaskId },
    /// Either way, on either path (the head's or the direct one): none of the task's stream
    /// follows on this path; it goes on on the other (`crate::path::PathMerge`).
    PathSwitch { task: TaskId },
}

fn check_bytes(what: &'static str, len: usize, max: usize) -> Result<(), ProtoError> {
    if len > max {
        return Err(Invalid::TooLarge { what, len, max }.into());
    }
    Ok(())
}

impl Msg {
    /// Whether compressing the whole frame is worth trying: not for
    /// messages whose bulk is chunk data (compressed, or found
    /// incompressible, chunk by chunk already).
    pub fn worth_compressing(&self) -> bool {
        !matches!(
            self,
            Msg::ChangeChunks { .. } | Msg::Push { .. } | Msg::FileResponse { resp: FileResp::Chunks(_), .. } | Msg::Stdin { .. }
        )
    }

    /// A task's stream: what its terminal, pipes and X connections carry between it and its
    /// client, either way. Only these take the direct path of a task at home (`crate::path`);
    /// the head holds the client's while the task is frozen for a move.
    pub fn is_stream(&self) -> bool {
        matches!(
            self,
            Msg::Output { .. }
                | Msg::Stdin { .. }
                | Msg::StdinEof { .. }
                | Msg::Signal { .. }
                | Msg::Resize { .. }
                | Msg::OutputAck { .. }
                | Msg::X11Open { .. }
                | Msg::X11Data { .. }
                | Msg::X11Close { .. }
        )
    }

    /// The task a message concerns (for routing), if any.
    pub fn task(&self) -> Option<TaskId> {
        match self {
            Msg::Error { task, .. } => *task,
            Msg::RunTask { task, .. }
            | Msg::Started { task, .. }
            | Msg::Stdin { task, .. }
            | Msg::StdinEof { task }
            | Msg::Output { task, .. }
            | Msg::Signal { task, .. }
            | Msg::Resize { task, .. }
            | Msg::FileRequest { task, .. }
            | Msg::FileResponse { task, .. }
            | Msg::ChangeChunks { task, .. }
            | Msg::Finished { task, .. }
            | Msg::CloneStats { task, .. }
            | Msg::CloneProgress { task, .. }
            | Msg::Committed { task, .. }
            | Msg::X11Open { task, .. }
            | Msg::X11Data { task, .. }
            | Msg::X11Close { task, .. }
            | Msg::Attach { task, .. }
            | Msg::OutputAck { task, .. }
            | Msg::AtHome { task, .. }
            | Msg::DirectOpen { task }
            | Msg::PathSwitch { task } => Some(*task),
            _ => None,
        }
    }

    /// Check everything a decoder cannot: paths, ranges, sizes, consistency.
    pub fn validate(&self) -> Result<(), ProtoError> {
        match self {
            Msg::Hello { name, .. } => check_bytes("peer name", name.len(), 256),
            Msg::Error { message, .. } => check_bytes("error message", message.len(), 64 << 10),
            Msg::HostInfo(h) => {
                check_bytes("host name", h.name.len(), 256)?;
                check_bytes("peer address", h.peer.as_ref().map_or(0, String::len), 256)?;
                check_bytes("why a host cannot isolate", h.cannot_isolate.as_ref().map_or(0, String::len), 4096)?;
                if !h.load.is_finite() || h.load < 0.0 {
                    return Err(Invalid::HostLoad.into());
                }
                Ok(())
            }
            Msg::RunTask { spec, .. } | Msg::Launch { spec, .. } => spec.validate(),
            Msg::LaunchFailed { message, .. } => check_bytes("error message", message.len(), 64 << 10),
            Msg::AtHome { socket, .. } => check_bytes("home socket path", socket.len(), 108),
            Msg::Signal { signo, .. } => {
                if !(1..=64).contains(signo) {
                    return Err(Invalid::Signal(*signo).into());
                }
                Ok(())
            }
            Msg::FileRequest { req, .. } => match req {
                FileReq::Lookup { path } | FileReq::ReadDir { path } => path.validate(),
                FileReq::GetRecipe { .. } => Ok(()),
                FileReq::GetChunks { hashes } | FileReq::FindChunks { hashes } => check_bytes("chunk batch", hashes.len(), MAX_BATCH),
            },
            Msg::FileResponse { resp, .. } => match resp {
                FileResp::Lookup(Lookup::Symlink(_, t)) => check_bytes("symlink target", t.len(), MAX_PATH),
                FileResp::ReadDir(Ok(entries)) => {
                    for e in entries {
                        if e.name.is_empty() || e.name.contains(&b'/') || e.name.contains(&0) || e.name.len() > 255 {
                            return Err(Invalid::DirEntryName.into());
                        }
                    }
                    Ok(())
                }
                FileResp::Recipe(Some(r)) => r.validate(),
                FileResp::ChunkSources(sources) => {
                    check_bytes("chunk batch", sources.len(), MAX_BATCH)?;
                    sources.iter().try_for_each(|s| match s {
                        ChunkSource::Peer { addr, .. } => check_bytes("peer address", addr.len(), 256),
                        ChunkSource::Data(_) => Ok(()),
                    })
                }
                _ => Ok(()),
            },
            Msg::Finished { changes, accessed, .. } => {
                changes.iter().try_for_each(|c| c.validate())?;
                accessed.iter().try_for_each(|p| p.validate())
            }
            Msg::HoldsQuery { names, .. } => check_bytes("queried names", names.len(), MAX_HOLDS_QUERY),
            Msg::HoldsReply { held, .. } => check_bytes("held names", held.len(), MAX_HOLDS_QUERY),
            Msg::Push { recipes, chunks } => {
                check_bytes("pushed chunks", chunks.len(), MAX_BATCH)?;
                recipes.iter().try_for_each(|r| r.validate())
            }
            Msg::LaunchJob { spec, tasks, first_reference } => {
                if first_reference.checked_add(tasks.len() as u64).is_none() {
                    return Err(Invalid::JobReferences.into());
                }
                spec.validate()?;
                if tasks.is_empty() || tasks.len() > MAX_JOB_TASKS {
                    return Err(Invalid::JobSize(tasks.len()).into());
                }
                for t in tasks {
                    if let Some(a) = &t.argv {
                        if a.is_empty() || a.iter().any(|x| x.contains(&0)) {
                            return Err(Invalid::JobArgv.into());
                        }
                    }
                }
                Ok(())
            }
            Msg::Committed { conflicts, .. } => conflicts.iter().try_for_each(|p| p.validate()),
            Msg::TicketRequest { n, .. } => {
                if *n == 0 || *n > 4096 {
                    return Err(Invalid::TicketSize(*n).into());
                }
                Ok(())
            }
            Msg::TicketGrant { granted, unisolated, .. } => {
                check_bytes("error message", granted.as_ref().err().map_or(0, String::len), 64 << 10)?;
                check_bytes("unisolated hosts", unisolated.len(), 4096)?;
                unisolated.iter().try_for_each(|u| {
                    check_bytes("host name", u.host.len(), 256)?;
                    check_bytes("why a host cannot isolate", u.why.len(), 4096)
                })
            }
            Msg::ExecutorProgress { progress: p, .. } => {
                let ended = p.done.checked_add(p.failed).and_then(|n| n.checked_add(p.cancelled));
                if ended.is_none_or(|n| n > p.submitted) {
                    return Err(Invalid::ExecutorCounts.into());
                }
                Ok(())
            }
            Msg::PsReply(rows) => check_bytes("task rows", rows.len(), 1 << 20),
            Msg::RoamNote { decision: d, .. } => {
                for (what, s) in [("state", &d.from_state), ("state", &d.to_state), ("site", &d.from_site), ("site", &d.to_site), ("action", &d.action)] {
                    check_bytes(what, s.len(), 256)?;
                }
                check_bytes("decision reason", d.reason.len(), 4096)?;
                check_bytes("sensors", d.sensors.len(), 64)?;
                d.sensors.iter().try_for_each(|(n, _)| check_bytes("sensor name", n.len(), 64))
            }
            Msg::UsageReply { tasks, .. } => check_bytes("task usage rows", tasks.len(), 1 << 20),
            Msg::Migrate { to: Some(h), .. } => check_bytes("host name", h.len(), 256),
            Msg::MigrateIn { from, network, .. } => {
                check_bytes("host name", from.len(), 256)?;
                network.as_ref().map_or(Ok(()), TicketNetwork::validate)
            }
            Msg::TicketMembers { members, .. } => check_bytes("a ticket network's members", members.len(), MAX_TICKET_NETWORK),
            Msg::OnBehalfOf { groups, .. } => check_bytes("groups", groups.len(), 65536),
            Msg::Credentials { certificate, ca } => {
                check_bytes("certificate", certificate.as_ref().map_or(0, String::len), 64 << 10)?;
                check_bytes("CA bundle", ca.len(), 64 << 10)
            }
            Msg::Revoked { serials } => {
                check_bytes("revoked serials", serials.len(), 1 << 16)?;
                serials.iter().try_for_each(|s| check_bytes("serial", s.len(), 128))
            }
            Msg::MigrateOut { to_host, to_addr, .. } => {
                check_bytes("host name", to_host.len(), 256)?;
                check_bytes("address", to_addr.len(), 256)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executor_progress_cannot_end_more_futures_than_were_submitted() {
        let note = |submitted, done, failed, cancelled| Msg::ExecutorProgress {
            ticket: 1,
            progress: ExecutorProgress { workers: 2, submitted, done, failed, cancelled, closed: false },
        };
        assert!(note(5, 2, 2, 1).validate().is_ok());
        assert!(matches!(note(5, 3, 2, 1).validate(), Err(ProtoError::Invalid(Invalid::ExecutorCounts))));
        assert!(matches!(note(u64::MAX, u64::MAX, 1, 0).validate(), Err(ProtoError::Invalid(Invalid::ExecutorCounts))));
    }
}
