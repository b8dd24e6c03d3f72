//! starling's process image: one definition of each kind of process state.
//!
//! CRIU keeps one schema per kind of state (`images/*.proto`) and both its
//! dump and its restore pipelines use it; this crate is that schema for
//! starling. Two layers:
//!
//! * [`abi`]: `repr(C)` records (registers, per-thread state, signals,
//!   process-wide state, the flat restore plan, the restorer's fd and record
//!   contract, the named per-clone counters). The no-libc restorer compiles
//!   this directory as part of itself, so both sides agree by construction.
//! * the descriptor ([`Descriptor`], serde/bincode, feature `std`): what
//!   travels between hosts — the `abi` records plus what varies in size
//!   (regions with their page classes, fds, FPU areas, queued signals,
//!   cwd, groups) — and [`lower()`], which turns it into the plan.
//!
//! Who fills it: `starling-fork`'s template + dump (a process that asked to
//! be copied: one thread, frozen in `fork()`), and `starling-migrate`'s
//! capture (any process, from outside with ptrace: every thread). Who reads
//! it: the fault handler (page classes), [`lower()`] and the restorer.

#![no_std]

#[cfg(feature = "std")]
extern crate std;

pub mod abi;

#[cfg(feature = "std")]
mod descriptor;
#[cfg(feature = "std")]
mod lower;

#[cfg(feature = "std")]
pub use descriptor::*;
#[cfg(feature = "std")]
pub use lower::{lower, map_kind, PlanOptions};
pub use abi::{PAGE_BYTES, PAGE_SIZE};

#[cfg(any(test, feature = "sample"))]
pub mod sample;
#[cfg(test)]
mod tests;
