//! The `repr(C)` layer of the process image: plain records of `u64`s that
//! mean the same in the library (serde descriptor, plan builder, capture) and
//! in the no-libc restorer, which includes this directory verbatim
//! (`#[path]`, `no_std`, no allocator). Nothing here allocates or panics on
//! malformed input: kinds read from bytes are `u64`s with checked
//! conversions to typed enums.
//!
//! | module | state |
//! |---|---|
//! | [`regs`] | a thread's registers: general purpose (`user_regs_struct` order) and the FPU save area |
//! | [`thread`] | per-thread kernel state: TID, clear-tid address, robust list, rseq, signal mask, altstack |
//! | [`signal`] | dispositions (`Sigaction` × 64) and queued signals (`SigInfo`) |
//! | [`process`] | process-wide state: memory layout (`MmLayout`), umask, credentials, rlimits, interval timers, POSIX timers (`PosixTimers`, at most `MAX_POSIX_TIMERS`) |
//! | [`plan`] | the flat restore plan the restorer reads on [`restorer::PLAN_FD`] |
//! | [`restorer`] | the restorer's fd contract, its records on [`restorer::HANDLER_FD`] and its exit codes |
//! | [`counters`] | the named per-clone fault-handler counters |
//! | [`uffd`] | the userfaultfd kernel ABI the restorer, fault handler and dirty tracker share |

pub mod counters;
pub mod plan;
pub mod process;
pub mod regs;
pub mod restorer;
pub mod signal;
pub mod thread;
pub mod uffd;

/// Page size assumed throughout (x86-64).
pub const PAGE_SIZE: u64 = 4096;
/// [`PAGE_SIZE`] as a buffer length.
pub const PAGE_BYTES: usize = 4096;

/// The restorer's own image is linked at this address; the window from here
/// of [`RESTORER_WINDOW`] bytes is reserved for it. A restored process keeps
/// the restorer's pages mapped there (nothing can unmap the code it runs), so
/// a capture leaves regions inside the window out of the image: they are the
/// previous restorer's, not the program's.
pub const RESTORER_BASE: u64 = 0x3f00_0000_0000;
/// Size of the reserved window at [`RESTORER_BASE`].
pub const RESTORER_WINDOW: u64 = 1 << 30;

/// Whether `[start, end)` lies inside the restorer's reserved window.
pub const fn in_restorer_window(start: u64, end: u64) -> bool {
    start >= RESTORER_BASE && end <= RESTORER_BASE + RESTORER_WINDOW
}
