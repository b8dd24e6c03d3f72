//! Per-thread kernel state that is not in the registers.

use super::regs::GpRegs;

/// `set_robust_list` registration (`head` 0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct RobustList {
    pub head: u64,
    pub len: u64,
}

/// `rseq` registration (`addr` 0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct Rseq {
    pub addr: u64,
    pub len: u64,
    pub sig: u64,
}

/// The alternate signal stack (`sp` 0: none); the kernel's `stack_t` with
/// its `int` flags widened.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct AltStack {
    pub sp: u64,
    pub flags: u64,
    pub size: u64,
}

/// Everything fixed-size about one thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct ThreadCore {
    /// The thread's ID as the process sees it (innermost PID namespace).
    pub tid: u64,
    pub regs: GpRegs,
    /// `set_tid_address` (clear-child-tid; 0: none).
    pub tid_address: u64,
    pub robust: RobustList,
    pub rseq: Rseq,
    /// Blocked signals (bit `n-1` = signal `n`).
    pub sigmask: u64,
    pub altstack: AltStack,
    /// The thread's name (`/proc/PID/task/TID/comm`, `PR_SET_NAME`), NUL-padded;
    /// all zero: keep whatever name the restored thread has. Without it a
    /// restored thread shows the restorer's name in `ps`, `top` and debuggers.
    pub comm: [u8; 16],
}
