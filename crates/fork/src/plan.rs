//! Lowering a [`Descriptor`] into the restorer's flat plan (clone host side).
//!
//! Decides, per region, how the restorer maps it:
//! * vDSO/vvar → moved host special mappings;
//! * shared file mapping → the file, `MAP_SHARED`;
//! * private file mapping whose pages all still come from the file → the
//!   file, `MAP_PRIVATE` (no userfaultfd: MISSING mode cannot cover it);
//! * anything else with a page to fetch or read → anonymous, registered with
//!   the userfaultfd (file pages of such regions are read by the handler);
//! * all-zero anonymous → plain anonymous, never registered.
//!
//! And per fd: stdio is inherited from the restorer's caller, regular files
//! and directories are reopened at their offset, pipes get EOF/EPIPE
//! placeholders, the rest is closed.

use crate::descriptor::{Descriptor, FdKind, PageClass, Region, RegionKind};
use starling_restorer::plan::*;

/// Options of a restore that are not part of the template's state.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    pub clone_id: u32,
    /// Clones this restore starts (IDs `clone_id ..`, see `PlanHeader::clone_count`).
    pub clone_count: u32,
    /// Create a PID namespace and give the clone the template's PID.
    pub new_pid_namespace: bool,
}

/// How the restorer must map a region.
pub fn region_plan_kind(r: &Region) -> u64 {
    match &r.kind {
        RegionKind::Vvar => REGION_VVAR,
        RegionKind::VvarVclock => REGION_VVAR_VCLOCK,
        RegionKind::Vdso => REGION_VDSO,
        RegionKind::File { .. } if r.shared => REGION_FILE_SHARED,
        RegionKind::File { .. } if r.pages.count(PageClass::Fetch) == 0 => REGION_FILE_PRIVATE,
        _ if r.pages.count(PageClass::Zero) == r.pages.pages() => REGION_ANON_PLAIN,
        _ => REGION_ANON_REGISTER,
    }
}

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is one of the plan's repr(C) records made only of u64 fields
    // (no padding, no pointers), so every byte is initialized.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

/// Build the plan blob for one clone.
pub fn build_plan(d: &Descriptor, opts: PlanOptions) -> Vec<u8> {
    let mut strings: Vec<u8> = Vec::new();
    let mut add_str = |s: &str| -> (u64, u64) {
        let off = strings.len() as u64;
        strings.extend_from_slice(s.as_bytes());
        (off, s.len() as u64)
    };
    let regions: Vec<PlanRegion> = d
        .regions
        .iter()
        .map(|r| {
            let kind = region_plan_kind(r);
            let (file_offset, (path_off, path_len)) = match &r.kind {
                RegionKind::File { path, offset, .. } if kind == REGION_FILE_PRIVATE || kind == REGION_FILE_SHARED => {
                    (*offset, add_str(path))
                }
                _ => (0, (0, 0)),
            };
            PlanRegion {
                start: r.start, end: r.end, prot: r.prot as u64, kind,
                flags: if r.growsdown { REGION_FLAG_GROWSDOWN } else { 0 },
                file_offset, path_off, path_len,
            }
        })
        .collect();
    let fds: Vec<PlanFd> = d
        .fds
        .iter()
        .filter_map(|f| {
            let mut e = PlanFd { fd: f.fd as u64, ..Default::default() };
            match &f.kind {
                _ if f.fd <= 2 => e.kind = FD_INHERIT,
                FdKind::Reopen { path, flags, offset } => {
                    e.kind = FD_REOPEN;
                    e.open_flags = *flags as u64;
                    e.offset = *offset;
                    (e.path_off, e.path_len) = add_str(path);
                }
                FdKind::PipeRead => e.kind = FD_PIPE_READ_EOF,
                FdKind::PipeWrite => e.kind = FD_PIPE_WRITE_EPIPE,
                FdKind::Socket | FdKind::Other { .. } => return None,
            }
            Some(e)
        })
        .collect();
    let (cwd_off, cwd_len) = add_str(&d.process.cwd);

    let t = &d.thread;
    let mut sigactions = [KernelSigaction::default(); N_SIGNALS];
    for (dst, a) in sigactions.iter_mut().zip(&d.signals.actions) {
        *dst = KernelSigaction { handler: a[0], flags: a[1], restorer: a[2], mask: a[3] };
    }
    let mut rlimits = [[0u64; 2]; N_RLIMITS];
    let mut rlimit_valid = 0u64;
    for &(res, soft, hard) in &d.process.rlimits {
        if (res as usize) < N_RLIMITS {
            rlimits[res as usize] = [soft, hard];
            rlimit_valid |= 1 << res;
        }
    }
    let m = &d.process.mm;
    let regions_off = HEADER_SIZE as u64;
    let fds_off = regions_off + (regions.len() * REGION_SIZE) as u64;
    let strings_off = fds_off + (fds.len() * FD_SIZE) as u64;
    let header = PlanHeader {
        magic: PLAN_MAGIC,
        version: PLAN_VERSION,
        total_len: strings_off + strings.len() as u64,
        flags: if opts.new_pid_namespace { PLAN_FLAG_NEW_PIDNS } else { 0 },
        clone_id: opts.clone_id as u64,
        clone_count: opts.clone_count.max(1) as u64,
        template_pid: d.template_pid as u64,
        n_regions: regions.len() as u64,
        regions_off,
        n_fds: fds.len() as u64,
        fds_off,
        strings_off,
        strings_len: strings.len() as u64,
        resume: ResumeContext {
            rbx: t.resume[0], rbp: t.resume[1], r12: t.resume[2], r13: t.resume[3], r14: t.resume[4],
            r15: t.resume[5], rsp: t.resume[6], rip: t.resume[7], mxcsr_fcw: t.resume[8],
        },
        fs_base: t.fs_base,
        tid_address: t.tid_address,
        robust_head: t.robust_head,
        robust_len: t.robust_len,
        rseq_addr: t.rseq_addr,
        rseq_len: t.rseq_len,
        rseq_sig: t.rseq_sig,
        sigmask: d.signals.mask,
        altstack_sp: d.signals.altstack[0],
        altstack_flags: d.signals.altstack[1],
        altstack_size: d.signals.altstack[2],
        sigactions,
        cwd_off,
        cwd_len,
        umask: d.process.umask as u64,
        rlimits,
        rlimit_valid,
        uid: d.process.uid as u64,
        gid: d.process.gid as u64,
        mm: MmLayout {
            start_code: m.start_code, end_code: m.end_code, start_data: m.start_data, end_data: m.end_data,
            start_brk: m.start_brk, brk: m.brk, start_stack: m.start_stack, arg_start: m.arg_start,
            arg_end: m.arg_end, env_start: m.env_start, env_end: m.env_end,
        },
    };
    let mut out = Vec::with_capacity(header.total_len as usize);
    out.extend_from_slice(as_bytes(&header));
    regions.iter().for_each(|r| out.extend_from_slice(as_bytes(r)));
    fds.iter().for_each(|f| out.extend_from_slice(as_bytes(f)));
    out.extend_from_slice(&strings);
    debug_assert_eq!(out.len() as u64, header.total_len);
    out
}
