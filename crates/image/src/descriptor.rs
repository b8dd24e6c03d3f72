//! The descriptor: a process's state, serde/bincode, as it travels between
//! hosts. Page contents are not in it: each page is classified ([`PageClass`])
//! and comes from the page server, the host's copy of a file, or zero.

use crate::abi::process::ProcessCore;
use crate::abi::regs::{FP_XSTATE_MAGIC1, FPX_SW_BYTES_OFFSET, FXSAVE_BYTES};
use crate::abi::signal::{SigInfo, SigactionTable};
use crate::abi::thread::ThreadCore;
use crate::abi::plan::{MAX_AUXV_BYTES, MAX_THREADS};
use crate::PAGE_SIZE;
use serde::{Deserialize, Serialize};
use std::string::{String, ToString};
use std::vec::Vec;
use std::format;

/// 7: sessions and process groups (`ProcessCore::sid`/`pgid`); 8: `FdKind::Reconnect` (X display connections).
pub const DESCRIPTOR_VERSION: u32 = 9;
/// Most processes one descriptor carries (a process and its descendants).
pub const MAX_TREE_PROCESSES: usize = crate::abi::plan::MAX_TREE_PLANS;
/// Upper bound accepted by [`Descriptor::decode`].
pub const MAX_DESCRIPTOR_BYTES: u64 = 64 << 20;
/// Largest FPU area accepted (XSAVE with AMX is ~11 KiB).
pub const MAX_FPU_BYTES: usize = 64 << 10;

/// Why a descriptor was refused.
#[derive(Debug, thiserror::Error)]
pub enum DescriptorError {
    #[error("descriptor of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("undecodable descriptor: {0}")]
    Decode(String),
    #[error("descriptor version {0}, expected {DESCRIPTOR_VERSION}")]
    Version(u32),
    #[error("malformed descriptor: {0}")]
    Invalid(String),
    #[error("the tree's sessions and process groups: {0}")]
    Sessions(#[from] SessionError),
}

/// Why a tree's sessions and process groups cannot be made again by the
/// restorer (see [`check_sessions`]). PIDs are as the task sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("process {pid} is in session {sid}, which no process of the task leads")]
    NoSessionLeader { pid: u64, sid: u64 },
    #[error("process {pid} is in session {sid}, which it did not get from its parent")]
    SessionNotInherited { pid: u64, sid: u64 },
    #[error("process {pid} leads its session but is in process group {pgid}")]
    SessionLeaderInOtherGroup { pid: u64, pgid: u64 },
    #[error("process {pid} is in process group {pgid}, which no process of the task leads (its leader has ended or left it)")]
    NoGroupLeader { pid: u64, pgid: u64 },
    #[error("process {pid} is in process group {pgid}, which is another session's")]
    GroupOfAnotherSession { pid: u64, pgid: u64 },
    #[error("process {pid} is in the sandbox's process group but in session {sid}")]
    SandboxGroupOtherSession { pid: u64, sid: u64 },
}

/// A process of a tree as sessions and process groups go: its parent's
/// index (None: the root) and its PID, session and group
/// ([`ProcessCore::sid`], [`ProcessCore::pgid`]: 0 is the restorer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionIds {
    pub parent: Option<usize>,
    pub pid: u64,
    pub sid: u64,
    pub pgid: u64,
}

/// Whether the restorer makes a tree's sessions and groups again, the
/// parents before their children (`tree` in that order). Each restored
/// process first forks its children that must stay in the session it was
/// forked in ([`forked_before_parent_setsid`]), then starts its session if
/// it leads one (`setsid`), then forks the rest; only then does it start
/// the group it leads (`setpgid(0, 0)`) or join the group another process
/// of the tree leads (waiting for that group to exist). The restorer's
/// group cannot be named from inside the PID namespace (its leader is
/// outside) and is only inherited, which being in the restorer's session
/// guarantees; any other group needs its leader in the tree, in it, in the
/// same session. Every state a real tree reaches passes but a group whose
/// leader has ended or left it (no process may take its ID).
pub fn check_sessions(tree: &[SessionIds]) -> Result<(), SessionError> {
    let by_pid = |pid: u64| tree.iter().find(|p| p.pid == pid);
    for p in tree {
        let (pid, sid, pgid) = (p.pid, p.sid, p.pgid);
        if sid != 0 && by_pid(sid).is_none_or(|l| l.sid != sid) {
            return Err(SessionError::NoSessionLeader { pid, sid });
        }
        if sid == pid && pgid != pid {
            return Err(SessionError::SessionLeaderInOtherGroup { pid, pgid });
        }
        if pgid == 0 && sid != 0 {
            return Err(SessionError::SandboxGroupOtherSession { pid, sid });
        }
        if pgid != 0 && pgid != pid {
            let leader = by_pid(pgid).filter(|l| l.pgid == pgid).ok_or(SessionError::NoGroupLeader { pid, pgid })?;
            if leader.sid != sid {
                return Err(SessionError::GroupOfAnotherSession { pid, pgid });
            }
        }
    }
    forked_before_parent_setsid(tree).map(|_| ())
}

/// For each process of a tree (as [`check_sessions`] takes it): whether its
/// parent, which leads a session, forks it before starting that session, so
/// that it stays in the session its parent was forked in. A session is only
/// inherited at a fork: a process not leading one must be forked in it, and
/// one that leads a session must be forked in the session its own early
/// children are in. A tree where that cannot be is refused.
pub fn forked_before_parent_setsid(tree: &[SessionIds]) -> Result<Vec<bool>, SessionError> {
    let n = tree.len();
    // The session each process must be forked in, where anything says
    // (children after their parents: computed from the last up).
    let mut needs: Vec<Option<u64>> = std::vec![None; n];
    for i in (0..n).rev() {
        let p = tree[i];
        if p.sid != p.pid {
            needs[i] = Some(p.sid);
            continue;
        }
        for (j, c) in tree.iter().enumerate().filter(|(_, c)| c.parent == Some(i)) {
            if let Some(s) = needs[j].filter(|&s| s != p.pid) {
                if needs[i].is_some_and(|t| t != s) {
                    return Err(SessionError::SessionNotInherited { pid: c.pid, sid: s });
                }
                needs[i] = Some(s);
            }
        }
    }
    let mut forked_in = std::vec![0u64; n];
    let mut early = std::vec![false; n];
    for (i, p) in tree.iter().enumerate() {
        if let Some(parent) = p.parent.filter(|&j| j < i) {
            let leads = tree[parent].sid == tree[parent].pid;
            early[i] = leads && needs[i].is_some_and(|s| s != tree[parent].pid);
            forked_in[i] = if leads && !early[i] { tree[parent].pid } else { forked_in[parent] };
        }
        if let Some(sid) = needs[i].filter(|&s| s != forked_in[i]) {
            return Err(SessionError::SessionNotInherited { pid: p.pid, sid });
        }
    }
    Ok(early)
}

/// How a restored process obtains one page.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageClass {
    /// Never touched (or below a stack pointer): zero-fill locally.
    Zero,
    /// Unmodified page of a private file mapping: read from the host's copy.
    File,
    /// Anonymous or copy-on-written: from the page server.
    Fetch,
}

/// Run-length encoded page classes of one region.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct PageRuns(pub Vec<(PageClass, u32)>);

impl PageRuns {
    pub fn push(&mut self, class: PageClass) {
        match self.0.last_mut() {
            Some((c, n)) if *c == class && *n < u32::MAX => *n += 1,
            _ => self.0.push((class, 1)),
        }
    }
    /// `n` pages of one class.
    pub fn uniform(class: PageClass, n: u64) -> PageRuns {
        let mut r = PageRuns::default();
        let mut left = n;
        while left > 0 {
            let k = left.min(u64::from(u32::MAX));
            r.0.push((class, u32::try_from(k).unwrap_or(u32::MAX)));
            left -= k;
        }
        r
    }
    pub fn pages(&self) -> u64 {
        self.0.iter().map(|&(_, n)| u64::from(n)).sum()
    }
    pub fn count(&self, class: PageClass) -> u64 {
        self.0.iter().filter(|(c, _)| *c == class).map(|&(_, n)| u64::from(n)).sum()
    }
    /// One class per page.
    pub fn expand(&self) -> Vec<PageClass> {
        let mut v = Vec::with_capacity(usize::try_from(self.pages()).unwrap_or(0));
        for &(c, n) in &self.0 {
            v.extend(core::iter::repeat_n(c, n as usize));
        }
        v
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum RegionKind {
    /// Private anonymous memory (including `[heap]`, `[stack]`, `[anon:…]`).
    Anonymous { name: String },
    /// Shared anonymous memory: the restored process gets a private copy of
    /// its content at capture time.
    SharedAnonymous { name: String },
    File { path: String, offset: u64, inode: u64 },
    Vvar,
    VvarVclock,
    Vdso,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    /// PROT_READ=1 | PROT_WRITE=2 | PROT_EXEC=4.
    pub prot: u8,
    pub shared: bool,
    pub growsdown: bool,
    pub kind: RegionKind,
    pub pages: PageRuns,
}

impl Region {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
    pub fn describe(&self) -> String {
        let name = match &self.kind {
            RegionKind::Anonymous { name } | RegionKind::SharedAnonymous { name } => name.as_str(),
            RegionKind::File { path, .. } => path.as_str(),
            RegionKind::Vvar => "[vvar]",
            RegionKind::VvarVclock => "[vvar_vclock]",
            RegionKind::Vdso => "[vdso]",
        };
        format!("{:x}-{:x} {}", self.start, self.end, name)
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum FdKind {
    /// Regular file or directory: reopened by path with its flags and offset.
    Reopen { path: String, flags: u32, offset: u64 },
    PipeRead,
    PipeWrite,
    /// A regular file open for writing that is the process's stdout or
    /// stderr (fd 1 or 2 itself, or another descriptor of the same file, as
    /// `prog > log` or pytest's saved copy of fd 1 give). A clone writes it
    /// as a stream: the descriptor becomes a copy of the clone's own fd `of`
    /// (1 or 2), which the agent relays to the client, who appends it to its
    /// own fd — the file is never reopened, so never committed as a whole.
    Stream { of: i32 },
    /// An end of a pipe between processes of the tree (`Descriptor::pipes`
    /// of the tree's root, by index), with the descriptor's flags.
    TreePipe { pipe: u32, write: bool, flags: u32 },
    /// A Unix stream socket connected to a proxy of the task's host that
    /// serves it again on the target (the task's X display, `exec --x11`):
    /// reconnected to the socket at `path` (inside the task's root), which
    /// is first told `hello` (4 bytes, little-endian: which of the proxy's
    /// connections this one is); the descriptor gets `flags`' `O_NONBLOCK`.
    Reconnect { path: String, hello: u32, flags: u32 },
    Socket,
    /// Character/block device, anon inode (eventfd, epoll…), deleted file.
    Other { target: String },
}

/// A pipe between processes of a tree.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct PipeImage {
    /// Its capacity (`F_GETPIPE_SZ`): writers block where they did.
    pub capacity: u32,
    /// What was in it, unread.
    pub data: Vec<u8>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct FdEntry {
    pub fd: i32,
    pub kind: FdKind,
}

/// One thread: its fixed-size state, its FPU area and its own queue.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ThreadState {
    pub core: ThreadCore,
    /// A 512-byte FXSAVE area, or an XSAVE area as `PTRACE_GETREGSET
    /// NT_X86_XSTATE` returns it followed by `FP_XSTATE_MAGIC2`.
    pub fpu: Vec<u8>,
    /// Signals queued for this thread.
    pub pending: Vec<SigInfo>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    pub core: ProcessCore,
    /// Working directory, as the process sees it.
    pub cwd: String,
    pub groups: Vec<u32>,
    /// Signals queued for the process (shared queue).
    pub pending: Vec<SigInfo>,
    /// Its executable as it sees it (`/proc/PID/exe`); empty: the
    /// restorer's stays (a remote-fork clone, which the plan names nothing for).
    pub exe: String,
    /// The kernel's saved auxiliary vector (`/proc/PID/auxv`, as `u64`s);
    /// empty: the restorer's stays.
    pub auxv: Vec<u64>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub version: u32,
    pub regions: Vec<Region>,
    pub fds: Vec<FdEntry>,
    /// The thread group leader first (its TID is the PID).
    pub threads: Vec<ThreadState>,
    pub sigactions: SigactionTable,
    pub process: ProcessState,
    /// The processes descending from it, moving with it (a process tree),
    /// parents before their children: each with the index of its parent
    /// (0: this process, i: `descendants[i - 1]`). Each is restored as a
    /// fork of its restored parent with its own PID, so the parent's `wait`
    /// still reaps it. Flat (a descendant has none of its own): decoding
    /// never recurses deeper than one level.
    pub descendants: Vec<(u32, Descriptor)>,
    /// The pipes between processes of the tree (the root's only): each is
    /// made again on the target with its unread bytes in it, and every
    /// process gets its ends at the same fd numbers (`FdKind::TreePipe`).
    pub pipes: Vec<PipeImage>,
}

impl Descriptor {
    /// The process ID it had (and gets again where a PID namespace allows).
    pub fn pid(&self) -> i32 {
        i32::try_from(self.process.core.pid).unwrap_or(0)
    }

    pub fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("descriptor types always serialize")
    }

    /// Decode and validate a descriptor from a peer.
    pub fn decode(bytes: &[u8]) -> Result<Self, DescriptorError> {
        use bincode::Options;
        if bytes.len() as u64 > MAX_DESCRIPTOR_BYTES {
            return Err(DescriptorError::TooLarge(bytes.len()));
        }
        let d: Descriptor = bincode::DefaultOptions::new()
            .with_fixint_encoding()
            .with_limit(MAX_DESCRIPTOR_BYTES)
            .reject_trailing_bytes()
            .deserialize(bytes)
            .map_err(|e| DescriptorError::Decode(e.to_string()))?;
        d.validate()?;
        Ok(d)
    }

    /// The processes of the tree it is the root of, parents before their
    /// children, each with its parent's index (None: the root). The index is
    /// the process's clone ID in the restore.
    pub fn processes(&self) -> Vec<(Option<usize>, &Descriptor)> {
        core::iter::once((None, self)).chain(self.descendants.iter().map(|(p, d)| (Some(*p as usize), d))).collect()
    }

    /// The tree's processes as sessions and process groups go.
    pub fn session_ids(&self) -> Vec<SessionIds> {
        self.processes()
            .iter()
            .map(|(parent, d)| SessionIds { parent: *parent, pid: d.process.core.pid, sid: d.process.core.sid, pgid: d.process.core.pgid })
            .collect()
    }

    /// Structural checks the plan and the restorer rely on, for the whole
    /// tree: every process's own, at most [`MAX_TREE_PROCESSES`], no PID twice.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        let bad = |detail: String| Err(DescriptorError::Invalid(detail));
        let procs = self.processes();
        if procs.len() > MAX_TREE_PROCESSES {
            return bad(format!("{} processes in one tree", procs.len()));
        }
        for (i, (parent, d)) in procs.iter().enumerate().skip(1) {
            if parent.is_none_or(|p| p >= i) || !d.descendants.is_empty() {
                return bad(format!("process {i} of the tree: parent not before it, or descendants of its own"));
            }
        }
        for (i, (_, d)) in procs.iter().enumerate() {
            if i > 0 && !d.pipes.is_empty() {
                return bad(format!("process {i} of the tree has pipes of its own"));
            }
            for f in &d.fds {
                if let FdKind::TreePipe { pipe, .. } = f.kind {
                    if pipe as usize >= self.pipes.len() {
                        return bad(format!("fd {} is pipe {pipe} of {}", f.fd, self.pipes.len()));
                    }
                }
            }
        }
        if self.pipes.iter().any(|p| u64::from(p.capacity) > crate::abi::plan::MAX_PIPE_BYTES || p.data.len() > p.capacity as usize) {
            return bad("a pipe's capacity or content".to_string());
        }
        let mut ids: Vec<u64> = procs.iter().flat_map(|(_, d)| d.threads.iter().map(|t| t.core.tid)).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return bad("duplicate thread or process ids in the tree".to_string());
        }
        check_sessions(&self.session_ids())?;
        let root = &self.process.core;
        let tpgid = root.tpgid;
        if tpgid != 0 && !procs.iter().skip(1).any(|(_, d)| d.process.core.pid == tpgid && d.process.core.pgid == tpgid && d.process.core.sid == root.pid) {
            return bad(format!("the terminal's foreground group {tpgid} is not led by a process of the root's session"));
        }
        if procs.iter().skip(1).any(|(_, d)| d.process.core.tpgid != 0) {
            return bad("a terminal's foreground group named by a process other than the root".to_string());
        }
        procs.iter().try_for_each(|(_, d)| d.validate_process())
    }

    /// The checks of one process (not its children).
    fn validate_process(&self) -> Result<(), DescriptorError> {
        let bad = |detail: String| Err(DescriptorError::Invalid(detail));
        if self.version != DESCRIPTOR_VERSION {
            return Err(DescriptorError::Version(self.version));
        }
        let pid = self.process.core.pid;
        if pid <= 1 || pid > 1 << 22 {
            return bad(format!("pid {pid}"));
        }
        let mut prev_end = 0;
        for r in &self.regions {
            if r.start % PAGE_SIZE != 0 || r.end % PAGE_SIZE != 0 || r.end <= r.start || r.start < prev_end {
                return bad(format!("region {} unaligned, empty or out of order", r.describe()));
            }
            if r.pages.pages() != r.len() / PAGE_SIZE {
                return bad(format!("region {} page classes do not cover it", r.describe()));
            }
            if let RegionKind::File { path, .. } = &r.kind {
                if !path.starts_with('/') || path.contains('\0') || path.len() >= 4096 {
                    return bad(format!("region {} path", r.describe()));
                }
            }
            prev_end = r.end;
        }
        let exe = &self.process.exe;
        if !exe.is_empty() && (!exe.starts_with('/') || exe.contains('\0') || exe.len() >= 4095) {
            return bad(format!("executable path {exe:?}"));
        }
        if !self.process.auxv.len().is_multiple_of(2) || self.process.auxv.len() as u64 * 8 > MAX_AUXV_BYTES {
            return bad(format!("auxv of {} words", self.process.auxv.len()));
        }
        if self.threads.is_empty() || self.threads.len() as u64 > MAX_THREADS {
            return bad(format!("{} threads", self.threads.len()));
        }
        if self.threads[0].core.tid != pid {
            return bad(format!("leader tid {} is not the pid {pid}", self.threads[0].core.tid));
        }
        for t in &self.threads {
            if t.core.tid == 0 || t.core.tid > 1 << 22 {
                return bad(format!("thread id {}", t.core.tid));
            }
            if t.fpu.len() < FXSAVE_BYTES || t.fpu.len() > MAX_FPU_BYTES {
                return bad(format!("thread {}: FPU area of {} bytes", t.core.tid, t.fpu.len()));
            }
            if t.fpu.len() > FXSAVE_BYTES {
                let magic = u32::from_le_bytes(t.fpu[FPX_SW_BYTES_OFFSET..FPX_SW_BYTES_OFFSET + 4].try_into().unwrap_or([0; 4]));
                if magic != FP_XSTATE_MAGIC1 {
                    return bad(format!("thread {}: XSAVE area without its magic", t.core.tid));
                }
            }
        }
        let mut tids: Vec<u64> = self.threads.iter().map(|t| t.core.tid).collect();
        tids.sort_unstable();
        if tids.windows(2).any(|w| w[0] == w[1]) {
            return bad("duplicate thread ids".to_string());
        }
        if let Some(why) = self.process.core.timers.invalid(|tid| self.threads.iter().any(|t| t.core.tid == tid)) {
            return bad(why.to_string());
        }
        if self.process.cwd.contains('\0') || self.process.cwd.len() >= 4096 {
            return bad("cwd".to_string());
        }
        if self.process.groups.len() > 65536 {
            return bad("groups".to_string());
        }
        let mut prev_fd = -1;
        for f in &self.fds {
            if f.fd <= prev_fd || f.fd >= 1 << 20 {
                return bad(format!("fd {} out of order/range", f.fd));
            }
            if let FdKind::Reopen { path, .. } | FdKind::Reconnect { path, .. } = &f.kind {
                if path.contains('\0') || path.len() >= 4096 {
                    return bad(format!("fd {} path", f.fd));
                }
            }
            if let FdKind::Reconnect { path, .. } = &f.kind {
                // It must fit a `sockaddr_un` (108 bytes, NUL included).
                if path.len() >= 108 || !path.starts_with('/') {
                    return bad(format!("fd {} socket path", f.fd));
                }
            }
            if let FdKind::Stream { of } = f.kind {
                if of != 1 && of != 2 {
                    return bad(format!("fd {} streams to fd {of}", f.fd));
                }
            }
            prev_fd = f.fd;
        }
        Ok(())
    }

    /// Number of pages of each class over all regions: (zero, file, fetch).
    pub fn page_totals(&self) -> (u64, u64, u64) {
        let mut t = (0, 0, 0);
        for r in &self.regions {
            t.0 += r.pages.count(PageClass::Zero);
            t.1 += r.pages.count(PageClass::File);
            t.2 += r.pages.count(PageClass::Fetch);
        }
        t
    }

    pub fn region_at(&self, addr: u64) -> Option<&Region> {
        let i = self.regions.partition_point(|r| r.end <= addr);
        self.regions.get(i).filter(|r| r.start <= addr)
    }
}
