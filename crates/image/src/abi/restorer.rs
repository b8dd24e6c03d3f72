//! The contract between the restorer and whoever starts it (the local
//! backend, an agent's clone or migration task): which descriptors it gets,
//! what it reports, how it fails.

/// The plan, read to EOF.
pub const PLAN_FD: i32 = 3;
/// A `SOCK_SEQPACKET` socket to the fault handler: the restorer sends one
/// [`Record`] per message (a userfaultfd attached with `SCM_RIGHTS`).
pub const HANDLER_FD: i32 = 4;
/// The first of the plan's `join_groups` descriptors (`JOIN_FD ..`): open
/// `cgroup.procs` files the restored process writes itself into as its last
/// step before it resumes. Until then it stays where its starter put it: a
/// moved guest's restore runs outside the guest's `cpu.idle` and freezer
/// groups (under a busy owner it would otherwise barely run, or be frozen
/// halfway), and the program itself never runs outside them.
pub const JOIN_FD: i32 = 5;

/// One message from the restorer to its handler.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// A [`RecordTag`].
    pub tag: u64,
    /// The clone (0 for a migration) the record is about.
    pub clone_id: u64,
    /// [`RecordTag::Exited`]: the raw wait status.
    pub value: u64,
}

pub const RECORD_SIZE: usize = core::mem::size_of::<Record>();

#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordTag {
    /// The process registered its memory: serve this userfaultfd (attached).
    Userfaultfd = 1,
    /// The process ended (reported by the restorer's PID 1).
    Exited = 2,
    /// Every thread is restored and about to resume (sent by the process
    /// itself, right before it closes the socket and resumes).
    Running = 3,
}

impl RecordTag {
    pub const fn from_u64(v: u64) -> Option<RecordTag> {
        match v {
            1 => Some(RecordTag::Userfaultfd),
            2 => Some(RecordTag::Exited),
            3 => Some(RecordTag::Running),
            _ => None,
        }
    }
}

/// Exit codes of a restorer that failed before the process resumed (it
/// never ran): 240..=249.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestorerExit {
    BadPlan = 240,
    PidNamespace = 241,
    Collision = 242,
    Map = 243,
    Userfaultfd = 244,
    Vdso = 245,
    Fd = 246,
    ThreadState = 247,
    Threads = 248,
    Join = 249,
}

impl RestorerExit {
    pub const fn from_code(code: i32) -> Option<RestorerExit> {
        Some(match code {
            240 => RestorerExit::BadPlan,
            241 => RestorerExit::PidNamespace,
            242 => RestorerExit::Collision,
            243 => RestorerExit::Map,
            244 => RestorerExit::Userfaultfd,
            245 => RestorerExit::Vdso,
            246 => RestorerExit::Fd,
            247 => RestorerExit::ThreadState,
            248 => RestorerExit::Threads,
            249 => RestorerExit::Join,
            _ => return None,
        })
    }

    /// What failed, for messages.
    pub const fn what(self) -> &'static str {
        match self {
            RestorerExit::BadPlan => "the restore plan was malformed",
            RestorerExit::PidNamespace => "the PID namespace or the process ID could not be set up",
            RestorerExit::Collision => "a memory region collides with the restorer's image",
            RestorerExit::Map => "a memory region could not be mapped",
            RestorerExit::Userfaultfd => "the userfaultfd could not be set up",
            RestorerExit::Vdso => "the vDSO differs from the image's (another kernel?)",
            RestorerExit::Fd => "a file descriptor could not be restored",
            RestorerExit::ThreadState => "per-thread or process state could not be restored",
            RestorerExit::Threads => "a thread could not be created with its ID",
            RestorerExit::Join => "the process could not join its cgroups",
        }
    }
}
