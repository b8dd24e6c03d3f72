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

/// A `struct timespec`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct TimeSpec {
    pub sec: u64,
    pub nsec: u64,
}

impl TimeSpec {
    pub const fn is_zero(&self) -> bool {
        self.sec == 0 && self.nsec == 0
    }
}

/// `sigev_notify` values a POSIX timer may carry (`SIGEV_THREAD` is the
/// kernel's plain signal; glibc's threads use `SIGEV_THREAD_ID`).
pub const SIGEV_SIGNAL: u64 = 0;
pub const SIGEV_NONE: u64 = 1;
pub const SIGEV_THREAD: u64 = 2;
pub const SIGEV_THREAD_ID: u64 = 4;

/// Clocks a moved timer may run on: CLOCK_REALTIME, CLOCK_MONOTONIC,
/// CLOCK_PROCESS_CPUTIME_ID, CLOCK_BOOTTIME, CLOCK_TAI, and the process's
/// own CPU clocks as glibc names them (`MAKE_PROCESS_CPUCLOCK(0, PROF |
/// VIRT | SCHED)`: -8, -7, -6), all stored as two's-complement `u64`s. Not
/// thread CPU clocks (the restorer's leader would own them) nor other
/// processes' clocks nor the alarm clocks (CAP_WAKE_ALARM).
pub const POSIX_TIMER_CLOCKS: [u64; 8] = [0, 1, 2, 7, 11, (-8i64).cast_unsigned(), (-7i64).cast_unsigned(), (-6i64).cast_unsigned()];

/// A POSIX timer (`timer_create`): its ID (which the program holds), how it
/// notifies, and when it fires next. The overrun count is not carried.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct PosixTimer {
    /// The kernel's timer ID (a non-negative `int`).
    pub id: u64,
    /// The clock ID it was created on (one of [`POSIX_TIMER_CLOCKS`]).
    pub clock: u64,
    /// `sigev_notify`: [`SIGEV_SIGNAL`], [`SIGEV_NONE`], [`SIGEV_THREAD`] or
    /// `SIGEV_SIGNAL | SIGEV_THREAD_ID`.
    pub notify: u64,
    /// `sigev_signo` (unused with [`SIGEV_NONE`]).
    pub signo: u64,
    /// `sigev_value`, as the program gave it.
    pub sigval: u64,
    /// The thread it signals (`SIGEV_THREAD_ID`), as the process sees it.
    pub tid: u64,
    pub interval: TimeSpec,
    /// Time left until it fires next; zero: disarmed.
    pub remaining: TimeSpec,
}

impl PosixTimer {
    /// Why this timer cannot be restored, if it cannot (the plan's and the
    /// descriptor's check; `tid` membership is checked by the caller).
    pub fn invalid(&self) -> Option<&'static str> {
        let mut known_clock = false;
        let mut i = 0;
        while i < POSIX_TIMER_CLOCKS.len() {
            known_clock |= POSIX_TIMER_CLOCKS[i] == self.clock;
            i += 1;
        }
        if self.id > i32::MAX as u64 {
            return Some("POSIX timer id");
        }
        if !known_clock {
            return Some("POSIX timer clock");
        }
        if !matches!(self.notify, SIGEV_SIGNAL | SIGEV_NONE | SIGEV_THREAD | SIGEV_THREAD_ID) {
            return Some("POSIX timer notification");
        }
        if self.notify != SIGEV_NONE && (self.signo == 0 || self.signo > 64) {
            return Some("POSIX timer signal");
        }
        if (self.notify == SIGEV_THREAD_ID) != (self.tid != 0) || self.tid > i32::MAX as u64 {
            return Some("POSIX timer thread");
        }
        if self.interval.nsec >= 1_000_000_000 || self.remaining.nsec >= 1_000_000_000 {
            return Some("POSIX timer time");
        }
        None
    }
}

/// Most POSIX timers a process can have moved.
pub const MAX_POSIX_TIMERS: usize = 32;

/// A process's POSIX timers: the first `count` of `table`, in ascending ID
/// order (the restorer's fallback creates them in that order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct PosixTimers {
    pub count: u64,
    pub table: [PosixTimer; MAX_POSIX_TIMERS],
}

impl PosixTimers {
    /// The timers in use (empty if `count` is out of range).
    pub fn used(&self) -> &[PosixTimer] {
        match usize::try_from(self.count) {
            Ok(n) if n <= MAX_POSIX_TIMERS => &self.table[..n],
            _ => &[],
        }
    }

    /// Why the table cannot be restored, if it cannot; `has_thread` says
    /// whether the process has a thread of a given ID.
    pub fn invalid(&self, has_thread: impl Fn(u64) -> bool) -> Option<&'static str> {
        if self.count > MAX_POSIX_TIMERS as u64 {
            return Some("POSIX timer count");
        }
        let mut prev: Option<u64> = None;
        for t in self.used() {
            if let Some(why) = t.invalid() {
                return Some(why);
            }
            if prev.is_some_and(|p| p >= t.id) {
                return Some("POSIX timer ids not ascending");
            }
            if t.notify == SIGEV_THREAD_ID && !has_thread(t.tid) {
                return Some("POSIX timer thread is not one of the process's");
            }
            prev = Some(t.id);
        }
        None
    }
}

/// Everything fixed-size about a process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct ProcessCore {
    /// The process ID as it sees itself (innermost PID namespace).
    pub pid: u64,
    /// The session it is in: the PID (as the tree's processes see it) of
    /// the process of its tree that leads it; 0: the session the restorer
    /// runs in, which no process of the tree leads (the sandbox's).
    pub sid: u64,
    /// Its process group, named the same way (0: the restorer's group).
    pub pgid: u64,
    /// The foreground process group of the terminal it controls (a
    /// process leading a session with a terminal), named the same way; 0:
    /// its own group, which taking the terminal makes the foreground one.
    pub tpgid: u64,
    pub umask: u64,
    pub creds: Creds,
    pub rlimits: [Rlimit; N_RLIMITS],
    pub itimers: [ITimer; N_ITIMERS],
    pub timers: PosixTimers,
    pub mm: MmLayout,
}
