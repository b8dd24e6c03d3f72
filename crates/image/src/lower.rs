//! Lowering a [`Descriptor`] into the restorer's flat plan (restoring host).
//!
//! Per region, how the restorer maps it ([`map_kind`]):
//! * vDSO/vvar → the host's special mappings, moved;
//! * shared file mapping → the file, `MAP_SHARED`;
//! * private file mapping whose pages all still come from the file → the
//!   file, `MAP_PRIVATE` (no userfaultfd: MISSING mode cannot cover it);
//! * anything else with a page to fetch or read → anonymous, registered with
//!   the userfaultfd (file pages of such regions are read by the handler);
//! * all-zero anonymous → plain anonymous, never registered.
//!
//! Per fd: a pipe between processes of a tree gets its end of the pipe the
//! tree's root made again; other stdio is inherited from the restorer's
//! caller, regular files and directories are reopened at their offset,
//! other pipes get EOF/EPIPE placeholders, the rest is closed.

use crate::abi::plan::*;
use crate::descriptor::{Descriptor, FdKind, PageClass, Region, RegionKind};
use std::vec::Vec;

/// Options of a restore that are not part of the process's state.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions<'a> {
    /// ID of the first clone (0: a migration, not a clone).
    pub clone_id: u32,
    /// Processes this restore starts (see `PlanHeader::clone_count`).
    pub clone_count: u32,
    /// Create a PID namespace so the process keeps its PID and TIDs.
    pub new_pid_namespace: bool,
    /// The leader resumes with the clone ID in rax: it returns it from the
    /// template's resume point (remote fork). A migration resumes with the
    /// registers as they were.
    pub clone_id_in_rax: bool,
    /// A seccomp BPF program (raw `struct sock_filter`s) the process gets
    /// with `no_new_privs` as it resumes; empty: none.
    pub seccomp: &'a [u8],
    /// The process gets the terminal on its fd 0 back as its controlling
    /// terminal (`PLAN_FLAG_TERMINAL`: a moved terminal task).
    pub terminal: bool,
    /// `cgroup.procs` descriptors the restorer gets at `abi::restorer::JOIN_FD ..`,
    /// joined by every restored process as its last step (`PlanHeader::join_groups`).
    pub join_groups: u32,
}

/// How the restorer must map a region.
pub fn map_kind(r: &Region) -> MapKind {
    match &r.kind {
        RegionKind::Vvar => MapKind::Vvar,
        RegionKind::VvarVclock => MapKind::VvarVclock,
        RegionKind::Vdso => MapKind::Vdso,
        RegionKind::File { .. } if r.shared => MapKind::FileShared,
        RegionKind::File { .. } if r.pages.count(PageClass::Fetch) == 0 => MapKind::FilePrivate,
        _ if r.pages.count(PageClass::Zero) == r.pages.pages() => MapKind::AnonPlain,
        _ => MapKind::AnonRegister,
    }
}

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is one of the plan's repr(C) records, made only of u64
    // fields (no padding, no pointers), so every byte is initialized.
    unsafe { core::slice::from_raw_parts((v as *const T).cast::<u8>(), core::mem::size_of::<T>()) }
}

/// The plan's blob: strings, group lists and FPU areas.
#[derive(Default)]
struct Blob(Vec<u8>);

impl Blob {
    fn add(&mut self, bytes: &[u8]) -> BlobRef {
        let off = self.0.len() as u64;
        self.0.extend_from_slice(bytes);
        BlobRef { off, len: bytes.len() as u64 }
    }
    fn add_aligned(&mut self, bytes: &[u8]) -> BlobRef {
        let aligned = align_fpu(self.0.len() as u64);
        self.0.resize(usize::try_from(aligned).expect("plan fits memory"), 0);
        self.add(bytes)
    }
}

/// Build the plan for one restore: one plan per process of the tree `d`
/// is the root of, one after the other (`PlanHeader::parent`), each
/// process's clone ID `opts.clone_id` + its index.
pub fn lower(d: &Descriptor, opts: PlanOptions) -> Vec<u8> {
    let processes = d.processes();
    // The tree's pipes' ends wait above every fd of every process.
    let max_fd = processes.iter().flat_map(|(_, p)| p.fds.iter().map(|f| u64::try_from(f.fd).unwrap_or(0))).max().unwrap_or(0);
    let foreground = if opts.terminal { d.process.core.tpgid } else { 0 };
    let tree = Tree { pipes: d.pipes.len() as u64, pipe_fd_base: (max_fd + 1).max(MIN_PIPE_FD_BASE), foreground };
    // Validated descriptors always have an order; a tree that has none keeps the default one.
    let early = crate::descriptor::forked_before_parent_setsid(&d.session_ids()).unwrap_or_else(|_| std::vec![false; processes.len()]);
    let mut out = Vec::new();
    for (i, (parent, p)) in processes.into_iter().enumerate() {
        out.resize(usize::try_from(align_fpu(out.len() as u64)).expect("plan fits memory"), 0);
        let index = u32::try_from(i).expect("a tree has few processes");
        let own = PlanOptions { clone_id: opts.clone_id + index, ..opts };
        out.extend_from_slice(&lower_process(p, own, parent.map_or(NO_PARENT, |p| p as u64), early[i], tree));
    }
    out
}

/// What every plan of a tree says about the tree.
#[derive(Clone, Copy)]
struct Tree {
    pipes: u64,
    pipe_fd_base: u64,
    /// The terminal's foreground group (a moved terminal task's), 0: the root's own.
    foreground: u64,
}

/// The plan of one process (`parent`: its parent's plan index).
fn lower_process(d: &Descriptor, opts: PlanOptions, parent: u64, before_parent_setsid: bool, tree: Tree) -> Vec<u8> {
    let mut blob = Blob::default();
    // FPU areas first: their alignment then costs no padding between strings.
    let threads: Vec<PlanThread> =
        d.threads.iter().map(|t| PlanThread { core: t.core, fpu: blob.add_aligned(&t.fpu) }).collect();
    let regions: Vec<PlanRegion> = d
        .regions
        .iter()
        .map(|r| {
            let map = map_kind(r);
            let (file_offset, path) = match &r.kind {
                RegionKind::File { path, offset, .. } if matches!(map, MapKind::FilePrivate | MapKind::FileShared) => {
                    (*offset, blob.add(path.as_bytes()))
                }
                _ => (0, BlobRef::default()),
            };
            PlanRegion {
                start: r.start,
                end: r.end,
                prot: u64::from(r.prot),
                map: map as u64,
                flags: if r.growsdown { REGION_FLAG_GROWSDOWN } else { 0 },
                file_offset,
                path,
            }
        })
        .collect();
    let fds: Vec<PlanFd> = d
        .fds
        .iter()
        .filter_map(|f| {
            let fd = u64::try_from(f.fd).ok()?;
            let mut e = PlanFd { fd, ..Default::default() };
            match &f.kind {
                FdKind::TreePipe { pipe, write, flags } => {
                    e.kind = FdRestore::TreePipe as u64;
                    e.offset = u64::from(*pipe);
                    e.open_flags = u64::from(*flags & libc_o_nonblock()) | u64::from(*write);
                }
                FdKind::Reconnect { path, hello, flags } => {
                    e.kind = FdRestore::Connect as u64;
                    e.offset = u64::from(*hello);
                    e.open_flags = u64::from(*flags & libc_o_nonblock());
                    e.path = blob.add(path.as_bytes());
                }
                _ if f.fd <= 2 => e.kind = FdRestore::Inherit as u64,
                FdKind::Reopen { path, flags, offset } => {
                    e.kind = FdRestore::Reopen as u64;
                    e.open_flags = u64::from(*flags);
                    e.offset = *offset;
                    e.path = blob.add(path.as_bytes());
                }
                FdKind::PipeRead => e.kind = FdRestore::PipeReadEof as u64,
                FdKind::PipeWrite => e.kind = FdRestore::PipeWriteEpipe as u64,
                FdKind::Stream { of } => {
                    e.kind = FdRestore::Dup as u64;
                    e.offset = u64::try_from(*of).ok()?;
                }
                FdKind::Socket | FdKind::Other { .. } => return None,
            }
            Some(e)
        })
        .collect();
    let signals: Vec<PlanSignal> = d
        .threads
        .iter()
        .flat_map(|t| t.pending.iter().map(|info| PlanSignal { tid: t.core.tid, info: *info }))
        .chain(d.process.pending.iter().map(|info| PlanSignal { tid: 0, info: *info }))
        .collect();
    let pipes: Vec<PlanPipe> =
        d.pipes.iter().map(|p| PlanPipe { capacity: u64::from(p.capacity), data: blob.add(&p.data) }).collect();
    let cwd = blob.add(d.process.cwd.as_bytes());
    let group_bytes: Vec<u8> = d.process.groups.iter().flat_map(|g| g.to_le_bytes()).collect();
    let groups = blob.add(&group_bytes);
    let seccomp = blob.add(opts.seccomp);
    let exe = blob.add(d.process.exe.as_bytes());
    let auxv_bytes: Vec<u8> = d.process.auxv.iter().flat_map(|w| w.to_le_bytes()).collect();
    let auxv = blob.add_aligned(&auxv_bytes);

    let threads_off = HEADER_SIZE as u64;
    let regions_off = threads_off + (threads.len() * THREAD_SIZE) as u64;
    let fds_off = regions_off + (regions.len() * REGION_SIZE) as u64;
    let signals_off = fds_off + (fds.len() * FD_SIZE) as u64;
    let pipes_off = signals_off + (signals.len() * SIGNAL_SIZE) as u64;
    let blob_off = align_fpu(pipes_off + (pipes.len() * PIPE_SIZE) as u64);
    let mut flags = 0;
    if opts.new_pid_namespace {
        flags |= PLAN_FLAG_NEW_PIDNS;
    }
    if opts.clone_id_in_rax {
        flags |= PLAN_FLAG_CLONE_ID_IN_RAX;
    }
    if opts.terminal && parent == NO_PARENT {
        flags |= PLAN_FLAG_TERMINAL;
    }
    if before_parent_setsid {
        flags |= PLAN_FLAG_BEFORE_PARENT_SETSID;
    }
    if tree.foreground != 0 && parent != NO_PARENT && d.process.core.pid == tree.foreground {
        flags |= PLAN_FLAG_TERMINAL_FOREGROUND;
    }
    let header = PlanHeader {
        magic: PLAN_MAGIC,
        version: PLAN_VERSION,
        total_len: blob_off + blob.0.len() as u64,
        flags,
        clone_id: u64::from(opts.clone_id),
        clone_count: u64::from(opts.clone_count.max(1)),
        parent,
        tree_pipes: tree.pipes,
        pipe_fd_base: tree.pipe_fd_base,
        n_pipes: pipes.len() as u64,
        pipes_off,
        n_threads: threads.len() as u64,
        threads_off,
        n_regions: regions.len() as u64,
        regions_off,
        n_fds: fds.len() as u64,
        fds_off,
        n_signals: signals.len() as u64,
        signals_off,
        blob_off,
        blob_len: blob.0.len() as u64,
        cwd,
        groups,
        seccomp,
        exe,
        auxv,
        join_groups: u64::from(opts.join_groups),
        process: d.process.core,
        sigactions: d.sigactions,
    };
    let total = usize::try_from(header.total_len).expect("plan fits memory");
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(as_bytes(&header));
    threads.iter().for_each(|t| out.extend_from_slice(as_bytes(t)));
    regions.iter().for_each(|r| out.extend_from_slice(as_bytes(r)));
    fds.iter().for_each(|f| out.extend_from_slice(as_bytes(f)));
    signals.iter().for_each(|s| out.extend_from_slice(as_bytes(s)));
    pipes.iter().for_each(|p| out.extend_from_slice(as_bytes(p)));
    out.resize(usize::try_from(blob_off).expect("plan fits memory"), 0);
    out.extend_from_slice(&blob.0);
    debug_assert_eq!(out.len(), total);
    out
}

/// `O_NONBLOCK` (x86-64 Linux; this crate builds without libc).
const fn libc_o_nonblock() -> u32 {
    0o4000
}
