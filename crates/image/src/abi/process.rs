//! Process-wide state.

/// Fields of the kernel's `struct prctl_mm_map` that describe the memory
/// layout (`PR_SET_MM_MAP`; auxv and exe_fd are not carried).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
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

/// One resource limit; `u64::MAX` is infinity.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct Rlimit {
    pub soft: u64,
    pub hard: u64,
}

impl Default for Rlimit {
    fn default() -> Self {
        Rlimit { soft: u64::MAX, hard: u64::MAX }
    }
}

/// Resource limits carried: RLIMIT_CPU (0) ..= RLIMIT_RTTIME (15).
pub const N_RLIMITS: usize = 16;

/// The real, effective and saved user and group IDs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct Creds {
    pub ruid: u64,
    pub euid: u64,
    pub suid: u64,
    pub rgid: u64,
    pub egid: u64,
    pub sgid: u64,
}

impl Creds {
    pub const fn is_root(&self) -> bool {
        self.ruid == 0 && self.euid == 0 && self.suid == 0 && self.rgid == 0 && self.egid == 0 && self.sgid == 0
    }
}

/// A `struct timeval`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct TimeVal {
    pub sec: u64,
    pub usec: u64,
}

/// A `struct itimerval`: an interval timer (value zero: disarmed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct ITimer {
    pub interval: TimeVal,
    pub value: TimeVal,
}

impl ITimer {
    pub const fn armed(&self) -> bool {
        self.value.sec != 0 || self.value.usec != 0
    }
}

/// ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF.
pub const N_ITIMERS: usize = 3;

/// Everything fixed-size about a process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct ProcessCore {
    /// The process ID as it sees itself (innermost PID namespace).
    pub pid: u64,
    pub umask: u64,
    pub creds: Creds,
    pub rlimits: [Rlimit; N_RLIMITS],
    pub itimers: [ITimer; N_ITIMERS],
    pub mm: MmLayout,
}
