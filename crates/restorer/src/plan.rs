//! The restore plan: the flat, fixed-layout input of the no-libc restorer.
//!
//! The serde/bincode *descriptor* (in `starling-fork`) is what travels between
//! hosts. On the clone host it is validated and lowered into this plan, whose
//! layout is plain `#[repr(C)]` little-endian records so that the restorer can
//! read it without an allocator or a deserializer. This file is shared
//! verbatim by the restorer binary (`#[path]` include, `no_std`) and by the
//! library (`starling_restorer::plan`), so both sides agree by construction.
//!
//! Layout of a plan blob:
//! `PlanHeader` | `PlanRegion` × n_regions | `PlanFd` × n_fds | string bytes.
//! All offsets are byte offsets from the start of the blob.

/// "STRLPLAN" little-endian.
pub const PLAN_MAGIC: u64 = u64::from_le_bytes(*b"STRLPLAN");
/// Bumped on every layout change.
pub const PLAN_VERSION: u64 = 2;
/// Largest plan the restorer accepts (its static read buffer).
pub const PLAN_MAX_BYTES: usize = 8 << 20;

/// Plan flag: create a new PID namespace and give the clone the template's PID.
pub const PLAN_FLAG_NEW_PIDNS: u64 = 1;

/// Most clones one restorer starts (`clone_count`): a host's cores, bounded.
pub const MAX_CLONES_PER_RESTORE: u64 = 256;

/// Records the restorer sends over the handler socket (fd 4, SOCK_SEQPACKET):
/// `[tag, clone id, value]` as three little-endian u64s.
pub const RECORD_SIZE: usize = 24;
/// A clone's userfaultfd (attached with SCM_RIGHTS); value unused.
pub const RECORD_UFFD: u64 = 1;
/// A clone ended; value = its raw wait status (as from wait4).
pub const RECORD_EXIT: u64 = 2;

/// Region kinds.
pub const REGION_FILE_PRIVATE: u64 = 1; // mmap the file MAP_PRIVATE, no userfaultfd
pub const REGION_ANON_REGISTER: u64 = 2; // anonymous, registered with userfaultfd
pub const REGION_ANON_PLAIN: u64 = 3; // anonymous, all pages zero: nothing to fetch
pub const REGION_FILE_SHARED: u64 = 4; // mmap the file MAP_SHARED
pub const REGION_VVAR: u64 = 5;
pub const REGION_VVAR_VCLOCK: u64 = 6;
pub const REGION_VDSO: u64 = 7;

/// Region flag: the stack (mapped MAP_GROWSDOWN).
pub const REGION_FLAG_GROWSDOWN: u64 = 1;

/// Fd kinds.
pub const FD_INHERIT: u64 = 1; // keep the fd the restorer was started with (stdio)
pub const FD_REOPEN: u64 = 2; // open(path, flags) then lseek(offset)
pub const FD_PIPE_READ_EOF: u64 = 3; // placeholder: read end of a pipe whose writer is closed
pub const FD_PIPE_WRITE_EPIPE: u64 = 4; // placeholder: write end of a pipe whose reader is closed

/// Restorer exit codes for failures before the jump (the clone never ran).
pub const EXIT_BAD_PLAN: i32 = 240;
pub const EXIT_PIDNS: i32 = 241;
pub const EXIT_COLLISION: i32 = 242;
pub const EXIT_MAP: i32 = 243;
pub const EXIT_UFFD: i32 = 244;
pub const EXIT_VDSO: i32 = 245;
pub const EXIT_FD: i32 = 246;
pub const EXIT_THREAD_STATE: i32 = 247;

/// The registers a resume point needs: the x86-64 SysV callee-saved set,
/// the stack pointer after return, the return address, and the FPU control
/// state that the ABI also requires callee-saved (MXCSR control bits, x87 CW).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResumeContext {
    pub rbx: u64,
    pub rbp: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rsp: u64,
    pub rip: u64,
    /// low 32 bits: MXCSR; bits 32..48: x87 control word.
    pub mxcsr_fcw: u64,
}

/// The kernel's `struct sigaction` for `rt_sigaction` on x86-64.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelSigaction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// Fields of `struct prctl_mm_map` we know (auxv and exe_fd are not set).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MmLayout {
    pub start_code: u64,
    pub end_code: u64,
    pub start_data: u64,
    pub end_data: u64,
    pub start_brk: u64,
    pub brk: u64,
    pub start_stack: u64,
    pub arg_start: u64,
    pub arg_end: u64,
    pub env_start: u64,
    pub env_end: u64,
}

/// Number of rlimit slots carried (RLIMIT_CPU..RLIMIT_RTTIME).
pub const N_RLIMITS: usize = 16;
/// Signals 1..=64 (index = signo - 1).
pub const N_SIGNALS: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlanHeader {
    pub magic: u64,
    pub version: u64,
    pub total_len: u64,
    pub flags: u64,
    /// ID of the first clone this plan restores.
    pub clone_id: u64,
    /// How many clones (IDs `clone_id ..`): the first gets the template's
    /// PID; each further one is a fork of it made at the restore point, so a
    /// host restores once per ticket (hierarchical tickets). Needs
    /// `PLAN_FLAG_NEW_PIDNS` when > 1.
    pub clone_count: u64,
    pub template_pid: u64,
    pub n_regions: u64,
    pub regions_off: u64,
    pub n_fds: u64,
    pub fds_off: u64,
    pub strings_off: u64,
    pub strings_len: u64,
    pub resume: ResumeContext,
    pub fs_base: u64,
    pub tid_address: u64,
    pub robust_head: u64,
    pub robust_len: u64,
    pub rseq_addr: u64,
    pub rseq_len: u64,
    pub rseq_sig: u64,
    pub sigmask: u64,
    pub altstack_sp: u64,
    pub altstack_flags: u64,
    pub altstack_size: u64,
    pub sigactions: [KernelSigaction; N_SIGNALS],
    pub cwd_off: u64,
    pub cwd_len: u64,
    pub umask: u64,
    /// [soft, hard] per resource; u64::MAX = infinity. `rlimit_valid` bit i says slot i is set.
    pub rlimits: [[u64; 2]; N_RLIMITS],
    pub rlimit_valid: u64,
    pub uid: u64,
    pub gid: u64,
    pub mm: MmLayout,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanRegion {
    pub start: u64,
    pub end: u64,
    /// PROT_* bits.
    pub prot: u64,
    pub kind: u64,
    pub flags: u64,
    pub file_offset: u64,
    pub path_off: u64,
    pub path_len: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanFd {
    pub fd: u64,
    pub kind: u64,
    pub open_flags: u64,
    pub offset: u64,
    pub path_off: u64,
    pub path_len: u64,
}

/// Size of a header / record in bytes (used by both writer and reader).
pub const HEADER_SIZE: usize = core::mem::size_of::<PlanHeader>();
pub const REGION_SIZE: usize = core::mem::size_of::<PlanRegion>();
pub const FD_SIZE: usize = core::mem::size_of::<PlanFd>();
