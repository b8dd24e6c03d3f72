//! The restore plan: the flat input of the no-libc restorer.
//!
//! The serde descriptor (`starling_image::Descriptor`) is what travels
//! between hosts. On the restoring host it is validated and lowered into this
//! plan (`starling_image::lower`), whose records are `repr(C)` so the
//! restorer reads them in place, without an allocator or a deserializer.
//! The records embed the same state types as the descriptor ([`ThreadCore`],
//! [`ProcessCore`], [`SigactionTable`], …): nothing is re-declared.
//!
//! Layout of a plan: [`PlanHeader`] | [`PlanThread`] × n | [`PlanRegion`] × n
//! | [`PlanFd`] × n | [`PlanSignal`] × n | blob. Table offsets are from the
//! start of the plan; [`BlobRef`]s from the start of the blob, which starts
//! at a multiple of [`FPU_ALIGN`] (FPU areas inside it are aligned so, for
//! `rt_sigreturn`).

use super::process::ProcessCore;
use super::regs::FPU_ALIGN;
use super::signal::{SigInfo, SigactionTable};
use super::thread::ThreadCore;

/// "STRLPLAN" little-endian.
pub const PLAN_MAGIC: u64 = u64::from_le_bytes(*b"STRLPLAN");
/// Bumped on every layout change.
pub const PLAN_VERSION: u64 = 12;
/// Largest plan the restorer accepts (its static read buffer).
pub const PLAN_MAX_BYTES: usize = 8 << 20;
/// Most threads one process can have restored (the restorer's stacks).
pub const MAX_THREADS: u64 = 512;
/// Most clones one restorer starts (`clone_count`): a host's cores, bounded.
pub const MAX_CLONES_PER_RESTORE: u64 = 256;

/// Plan flag: create a new PID namespace so the process gets its PID (and
/// its threads their TIDs).
pub const PLAN_FLAG_NEW_PIDNS: u64 = 1;
/// Plan flag: the leader resumes with its clone ID in rax, which the
/// template's resume point returns (remote fork). Without it the registers
/// are restored as captured (migration).
pub const PLAN_FLAG_CLONE_ID_IN_RAX: u64 = 2;
/// Plan flag: the process had a controlling terminal. The restorer got the
/// new pty's slave on fd 0 (no session holds it); the restored process
/// leads its own session (`ProcessCore::sid`) and takes the pty as that
/// session's controlling terminal (TIOCSCTTY) before it forks its children,
/// which makes its process group the terminal's foreground one.
pub const PLAN_FLAG_TERMINAL: u64 = 4;

/// Plan flag: the process's parent leads a session (`ProcessCore::sid`)
/// and forks it before it starts that session: it stays in the session its
/// parent was forked in (`starling_image::forked_before_parent_setsid`).
pub const PLAN_FLAG_BEFORE_PARENT_SETSID: u64 = 8;

/// Plan flag: the process leads the process group that was its terminal's
/// foreground one (the root's `ProcessCore::tpgid`: a shell put a job
/// there with `tcsetpgrp`). Once it has started its group it makes it the
/// foreground group again (TIOCSPGRP on the terminal it inherited on fd 0),
/// before any process of the tree resumes.
pub const PLAN_FLAG_TERMINAL_FOREGROUND: u64 = 16;

/// Most [`PlanHeader::join_groups`] (one per cgroup hierarchy).
pub const MAX_JOIN_GROUPS: u64 = 8;

/// Most plans (processes) in one process tree.
pub const MAX_TREE_PLANS: usize = 64;

/// [`PlanHeader::parent`] of a tree's root (and of a single process).
pub const NO_PARENT: u64 = u64::MAX;

/// Largest [`PlanHeader::auxv`]: the kernel's `saved_auxv` (AT_VECTOR_SIZE
/// = 2 × (20 + 2 + 28) words on x86-64).
pub const MAX_AUXV_BYTES: u64 = 50 * 2 * 8;

/// Most instructions of [`PlanHeader::seccomp`] (the kernel's BPF_MAXINSNS).
pub const MAX_SECCOMP_INSNS: u64 = 4096;

/// A byte range of the plan's blob.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlobRef {
    pub off: u64,
    pub len: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlanHeader {
    pub magic: u64,
    pub version: u64,
    pub total_len: u64,
    pub flags: u64,
    /// ID of the first clone this plan restores (0 for a migration).
    pub clone_id: u64,
    /// How many processes (clone IDs `clone_id ..`): the first gets the
    /// image's PID; each further one is a fork of it made at the restore
    /// point (hierarchical tickets). Needs `PLAN_FLAG_NEW_PIDNS` when > 1,
    /// and a single thread.
    pub clone_count: u64,
    /// A process tree is several plans one after the other (each starting
    /// at a multiple of [`FPU_ALIGN`], its `total_len` its own): this is
    /// the index of the plan of this process's parent, which forks it with
    /// its PID before either restores anything; [`NO_PARENT`] for the first
    /// plan (the root, forked by PID 1). A tree needs `PLAN_FLAG_NEW_PIDNS`
    /// and a `clone_count` of 1 in every plan.
    pub parent: u64,
    /// Pipes between the processes of the tree (every plan of a tree has
    /// the same count); their table ([`PlanPipe`] × `n_pipes`) is in the
    /// root's plan only (`n_pipes` 0 in the others). The root creates them
    /// before it forks anything, each end at `pipe_fd_base + 2 × index`
    /// (+ 1: the write end), above every fd of every process of the tree;
    /// each process `dup2`s the ends it holds ([`FdRestore::TreePipe`]) and
    /// closes the rest.
    pub tree_pipes: u64,
    pub pipe_fd_base: u64,
    pub n_pipes: u64,
    pub pipes_off: u64,
    pub n_threads: u64,
    pub threads_off: u64,
    pub n_regions: u64,
    pub regions_off: u64,
    pub n_fds: u64,
    pub fds_off: u64,
    pub n_signals: u64,
    pub signals_off: u64,
    pub blob_off: u64,
    pub blob_len: u64,
    pub cwd: BlobRef,
    /// Supplementary groups: `u32`s.
    pub groups: BlobRef,
    /// A seccomp BPF program (`struct sock_filter`s of 8 bytes, at most
    /// [`MAX_SECCOMP_INSNS`]) the leader installs, with `no_new_privs`, on
    /// every thread (`SECCOMP_FILTER_FLAG_TSYNC`) just before the process
    /// resumes; empty: none (a remote-fork clone; a moved `exec` task gets
    /// the sandbox's task filter back).
    pub seccomp: BlobRef,
    /// The program's executable as the process sees it (`/proc/PID/exe`):
    /// the restorer makes it the process's exe link (`PR_SET_MM_MAP`'s
    /// `exe_fd`) so `ps`, `top` and the program itself name the program,
    /// not the restorer. Empty: left as it is (a remote-fork clone).
    pub exe: BlobRef,
    /// The kernel's saved auxiliary vector (`/proc/PID/auxv`: `u64` pairs
    /// ending with AT_NULL), at most [`MAX_AUXV_BYTES`]; empty: not set.
    pub auxv: BlobRef,
    /// How many `cgroup.procs` descriptors the restorer got from
    /// `abi::restorer::JOIN_FD` on: every restored process writes itself
    /// (`0`) into each, in order, once, as the last step before it resumes
    /// (after it reported running: a frozen freezer group stops it there, a
    /// move is complete; so a freezer comes last). At most [`MAX_JOIN_GROUPS`].
    pub join_groups: u64,
    pub process: ProcessCore,
    pub sigactions: SigactionTable,
}

/// One thread; the first is the thread group leader (TID = PID).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlanThread {
    pub core: ThreadCore,
    /// FXSAVE/XSAVE area (aligned to [`FPU_ALIGN`]); an XSAVE area is
    /// followed by `FP_XSTATE_MAGIC2`.
    pub fpu: BlobRef,
}

/// How the restorer maps a region.
#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    /// The file, `MAP_PRIVATE`; no userfaultfd (MISSING mode cannot cover it).
    FilePrivate = 1,
    /// Anonymous, registered with the userfaultfd: the handler fills it.
    AnonRegister = 2,
    /// Anonymous, all pages zero: nothing to fetch.
    AnonPlain = 3,
    /// The file, `MAP_SHARED`.
    FileShared = 4,
    /// The host's `[vvar]`, moved to the image's address.
    Vvar = 5,
    VvarVclock = 6,
    Vdso = 7,
}

impl MapKind {
    pub const fn from_u64(v: u64) -> Option<MapKind> {
        Some(match v {
            1 => MapKind::FilePrivate,
            2 => MapKind::AnonRegister,
            3 => MapKind::AnonPlain,
            4 => MapKind::FileShared,
            5 => MapKind::Vvar,
            6 => MapKind::VvarVclock,
            7 => MapKind::Vdso,
            _ => return None,
        })
    }
}

/// Region flag: the stack (mapped `MAP_GROWSDOWN`).
pub const REGION_FLAG_GROWSDOWN: u64 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanRegion {
    pub start: u64,
    pub end: u64,
    /// PROT_* bits.
    pub prot: u64,
    /// A [`MapKind`].
    pub map: u64,
    pub flags: u64,
    pub file_offset: u64,
    pub path: BlobRef,
}

impl PlanRegion {
    pub const fn map_kind(&self) -> Option<MapKind> {
        MapKind::from_u64(self.map)
    }
}

/// How the restorer gives the process one of its descriptors.
#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdRestore {
    /// Keep the descriptor the restorer was started with (stdio).
    Inherit = 1,
    /// `open(path, flags)`, then `lseek(offset)`.
    Reopen = 2,
    /// Placeholder: read end of a pipe whose writer is gone (reads EOF).
    PipeReadEof = 3,
    /// Placeholder: write end of a pipe whose reader is gone (EPIPE).
    PipeWriteEpipe = 4,
    /// `dup2(offset, fd)`: a copy of the restored process's stdout or stderr
    /// (`offset` is 1 or 2), for a descriptor of the file stdout/stderr
    /// writes to.
    Dup = 5,
    /// An end of pipe `offset` of the tree (`PlanHeader::tree_pipes`): its
    /// write end if `open_flags` is `O_WRONLY`, else its read end; the
    /// descriptor gets `open_flags`' `O_NONBLOCK`.
    TreePipe = 6,
    /// A Unix stream socket connected to `path`, which is first sent
    /// `offset` as 4 bytes (little-endian); the descriptor gets
    /// `open_flags`' `O_NONBLOCK`.
    Connect = 7,
}

/// Longest socket path of an [`FdRestore::Connect`] (a `sockaddr_un`'s `sun_path`, NUL included).
pub const SOCKET_PATH_MAX: u64 = 108;

impl FdRestore {
    pub const fn from_u64(v: u64) -> Option<FdRestore> {
        Some(match v {
            1 => FdRestore::Inherit,
            2 => FdRestore::Reopen,
            3 => FdRestore::PipeReadEof,
            4 => FdRestore::PipeWriteEpipe,
            5 => FdRestore::Dup,
            6 => FdRestore::TreePipe,
            7 => FdRestore::Connect,
            _ => return None,
        })
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanFd {
    pub fd: u64,
    /// A [`FdRestore`].
    pub kind: u64,
    pub open_flags: u64,
    pub offset: u64,
    pub path: BlobRef,
}

impl PlanFd {
    pub const fn restore_kind(&self) -> Option<FdRestore> {
        FdRestore::from_u64(self.kind)
    }
}

/// A pipe between processes of a tree, as the root creates it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanPipe {
    /// Its capacity in bytes (`F_SETPIPE_SZ`).
    pub capacity: u64,
    /// What was in it, unread (written into it before anything runs).
    pub data: BlobRef,
}

/// Largest capacity of a moved pipe (the kernel's default `pipe-max-size`).
pub const MAX_PIPE_BYTES: u64 = 1 << 20;
/// Lowest fd number of a tree's pipes' ends while it restores.
pub const MIN_PIPE_FD_BASE: u64 = 10;
/// Highest fd number anything of a plan may use.
pub const MAX_PLAN_FD: u64 = 1 << 20;

/// A signal to queue again before the threads resume.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlanSignal {
    /// The thread it is queued for; 0: the process (shared queue).
    pub tid: u64,
    pub info: SigInfo,
}

pub const HEADER_SIZE: usize = core::mem::size_of::<PlanHeader>();
pub const THREAD_SIZE: usize = core::mem::size_of::<PlanThread>();
pub const REGION_SIZE: usize = core::mem::size_of::<PlanRegion>();
pub const FD_SIZE: usize = core::mem::size_of::<PlanFd>();
pub const SIGNAL_SIZE: usize = core::mem::size_of::<PlanSignal>();
pub const PIPE_SIZE: usize = core::mem::size_of::<PlanPipe>();

/// Round `n` up to the FPU alignment (blob offsets of FPU areas).
pub const fn align_fpu(n: u64) -> u64 {
    (n + FPU_ALIGN - 1) & !(FPU_ALIGN - 1)
}

/// The offsets of the plans of a process tree in `bytes` (see
/// [`PlanHeader::parent`]), each checked by [`validate`], the parents
/// before their children; at most `max` plans.
#[allow(clippy::cast_possible_truncation)] // offsets are checked against `bytes.len()` first
pub fn validate_tree(bytes: &[u8], out: &mut [u64]) -> Result<usize, PlanInvalid> {
    let mut n = 0usize;
    let mut off = 0u64;
    let len = bytes.len() as u64;
    while off < len {
        if n == out.len() {
            return Err(PlanInvalid { what: "too many plans in a tree", value: n as u64 });
        }
        let rest = &bytes[off as usize..];
        if rest.len() < HEADER_SIZE {
            return Err(PlanInvalid { what: "plan shorter than header", value: rest.len() as u64 });
        }
        let h: PlanHeader = record(rest, 0, 0);
        if h.total_len > rest.len() as u64 || h.total_len < HEADER_SIZE as u64 {
            return Err(PlanInvalid { what: "plan length in a tree", value: h.total_len });
        }
        validate(&rest[..h.total_len as usize])?;
        let root = n == 0;
        if root != (h.parent == NO_PARENT) || (!root && (h.parent >= n as u64 || h.clone_count != 1 || h.flags & PLAN_FLAG_NEW_PIDNS == 0)) {
            return Err(PlanInvalid { what: "parent of a plan in a tree", value: h.parent });
        }
        let root_pipes = if root { h.n_pipes } else { record::<PlanHeader>(bytes, 0, 0).n_pipes };
        if h.tree_pipes != root_pipes || (!root && h.n_pipes != 0) {
            return Err(PlanInvalid { what: "pipes of a plan in a tree", value: h.tree_pipes });
        }
        out[n] = off;
        n += 1;
        off = align_fpu(off + h.total_len);
    }
    if n == 0 {
        return Err(PlanInvalid { what: "empty plan", value: 0 });
    }
    // A process joining a group of the tree waits for it: its leader must
    // be there, in it, and in the same session (`check_sessions` checks the
    // rest when the descriptor is decoded).
    let header_at = |i: usize| record::<PlanHeader>(bytes, out[i], 0).process;
    for i in 0..n {
        let p = header_at(i);
        if p.pgid != 0 && p.pgid != p.pid && !(0..n).map(header_at).any(|l| l.pid == p.pgid && l.pgid == p.pgid && l.sid == p.sid) {
            return Err(PlanInvalid { what: "process group without its leader in the tree", value: p.pgid });
        }
    }
    Ok(n)
}

fn pipe_fd_base_end_bad(end: Option<u64>) -> bool {
    end.is_none_or(|e| e > MAX_PLAN_FD)
}

/// Why [`validate`] refused a plan: what was wrong and the value that was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanInvalid {
    pub what: &'static str,
    pub value: u64,
}

fn invalid(what: &'static str, value: u64) -> Result<(), PlanInvalid> {
    Err(PlanInvalid { what, value })
}

/// Record `i` of a table of `T`s at `off`, read unaligned (bounds checked by the caller, so the
/// offsets fit in usize).
#[allow(clippy::cast_possible_truncation)]
fn record<T: Copy>(plan: &[u8], off: u64, i: u64) -> T {
    let at = off as usize + i as usize * core::mem::size_of::<T>();
    let bytes = &plan[at..at + core::mem::size_of::<T>()];
    // SAFETY: `bytes` holds exactly size_of::<T>() bytes, and every plan record is made of integers
    // (u64s, u8 arrays), valid for any bit pattern; read_unaligned needs no alignment.
    unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

/// Check everything the restorer relies on before it reads a plan in place: the header's magic,
/// version and length, every table and blob reference inside the plan, counts within the
/// restorer's limits, known region and fd kinds. The one definition of a well-formed plan: the
/// restorer runs it on the bytes it read (and dies with its reason), the fuzz target on any bytes.
#[allow(clippy::cast_possible_truncation)] // offsets are checked against `plan.len()` before any narrowing use
pub fn validate(plan: &[u8]) -> Result<(), PlanInvalid> {
    let len = plan.len() as u64;
    if plan.len() < HEADER_SIZE {
        return invalid("plan shorter than header", len);
    }
    let h: PlanHeader = record(plan, 0, 0);
    if h.magic != PLAN_MAGIC || h.version != PLAN_VERSION || h.total_len != len {
        return invalid("plan magic/version/length mismatch", h.version);
    }
    let in_bounds = |off: u64, count: u64, size: usize| -> bool {
        count <= len && off.is_multiple_of(8) && off.checked_add(count.saturating_mul(size as u64)).is_some_and(|e| e <= len)
    };
    if !in_bounds(h.threads_off, h.n_threads, THREAD_SIZE)
        || !in_bounds(h.regions_off, h.n_regions, REGION_SIZE)
        || !in_bounds(h.fds_off, h.n_fds, FD_SIZE)
        || !in_bounds(h.signals_off, h.n_signals, SIGNAL_SIZE)
        || !in_bounds(h.pipes_off, h.n_pipes, PIPE_SIZE)
        || !in_bounds(h.blob_off, h.blob_len, 1)
        || !h.blob_off.is_multiple_of(64)
    {
        return invalid("plan tables out of bounds", len);
    }
    if h.n_threads == 0 || h.n_threads > MAX_THREADS {
        return invalid("thread count", h.n_threads);
    }
    let several = h.clone_count > 1;
    if h.clone_count == 0
        || h.clone_count > MAX_CLONES_PER_RESTORE
        || (several && (h.flags & PLAN_FLAG_NEW_PIDNS == 0 || h.n_threads != 1))
    {
        return invalid("clone count", h.clone_count);
    }
    // Forks of one plan share its session and group: the restorer's.
    if several && (h.process.sid != 0 || h.process.pgid != 0) {
        return invalid("session of clones", h.process.sid);
    }
    let foreground = h.flags & PLAN_FLAG_TERMINAL_FOREGROUND != 0;
    if foreground && (h.parent == NO_PARENT || h.process.pgid != h.process.pid || h.process.sid == h.process.pid) {
        return invalid("a terminal's foreground group not led by a child in its session", h.process.pgid);
    }
    if h.flags & PLAN_FLAG_TERMINAL != 0 && h.process.sid != h.process.pid {
        return invalid("a terminal's process does not lead its session", h.process.sid);
    }
    if h.join_groups > MAX_JOIN_GROUPS {
        return invalid("groups to join", h.join_groups);
    }
    let blob_ok = |r: BlobRef| r.off.checked_add(r.len).is_some_and(|e| e <= h.blob_len);
    if !blob_ok(h.seccomp) || !h.seccomp.len.is_multiple_of(8) || h.seccomp.len / 8 > MAX_SECCOMP_INSNS {
        return invalid("seccomp program", h.seccomp.len);
    }
    if !blob_ok(h.cwd) || h.cwd.len >= 4095 || !blob_ok(h.groups) || !h.groups.len.is_multiple_of(4) {
        return invalid("cwd/groups out of bounds", 0);
    }
    if !blob_ok(h.exe) || h.exe.len >= 4095 || !blob_ok(h.auxv) || !h.auxv.len.is_multiple_of(16) || h.auxv.len > MAX_AUXV_BYTES {
        return invalid("exe/auxv out of bounds", h.auxv.len);
    }
    for i in 0..h.n_threads {
        let t: PlanThread = record(plan, h.threads_off, i);
        if !blob_ok(t.fpu) || !t.fpu.off.is_multiple_of(64) || (t.fpu.len as usize) < super::regs::FXSAVE_BYTES {
            return invalid("thread FPU area", t.core.tid);
        }
        if i == 0 && t.core.tid != h.process.pid {
            return invalid("leader tid is not the pid", t.core.tid);
        }
    }
    let has_thread = |tid: u64| (0..h.n_threads).any(|i| record::<PlanThread>(plan, h.threads_off, i).core.tid == tid);
    if let Some(what) = h.process.timers.invalid(has_thread) {
        return invalid(what, h.process.timers.count);
    }
    for i in 0..h.n_regions {
        let r: PlanRegion = record(plan, h.regions_off, i);
        if !blob_ok(r.path) || r.map_kind().is_none() {
            return invalid("region", r.start);
        }
    }
    let pipe_fds_end = h.tree_pipes.checked_mul(2).and_then(|n| n.checked_add(h.pipe_fd_base));
    if h.tree_pipes > 0 && (h.pipe_fd_base < MIN_PIPE_FD_BASE || pipe_fd_base_end_bad(pipe_fds_end)) {
        return invalid("tree pipes' fd numbers", h.pipe_fd_base);
    }
    for i in 0..h.n_pipes {
        let p: PlanPipe = record(plan, h.pipes_off, i);
        if !blob_ok(p.data) || p.capacity > MAX_PIPE_BYTES || p.data.len > p.capacity {
            return invalid("pipe", i);
        }
    }
    for i in 0..h.n_fds {
        let f: PlanFd = record(plan, h.fds_off, i);
        if !blob_ok(f.path) || f.restore_kind().is_none() || f.fd >= MAX_PLAN_FD {
            return invalid("fd", f.fd);
        }
        if f.restore_kind() == Some(FdRestore::TreePipe) && (f.offset >= h.tree_pipes || f.fd >= h.pipe_fd_base) {
            return invalid("fd of a tree pipe", f.fd);
        }
        // A socket path fits a `sockaddr_un` (108 bytes, NUL included); the hello is 4 bytes.
        if f.restore_kind() == Some(FdRestore::Connect) && (f.path.len >= SOCKET_PATH_MAX || f.offset > u64::from(u32::MAX)) {
            return invalid("fd of a socket", f.fd);
        }
    }
    Ok(())
}
