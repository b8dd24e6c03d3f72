//! Linger-Longer (Ryu 2001; `../shared/papers/linger-longer.md`) on starling hosts.
//!
//! A starling host may belong to someone (its *owner*). Everything starling
//! runs there — exec tasks, clones, tasks moved in — is a *guest* and lives
//! in one cgroup per agent, in every v1 hierarchy the guest needs:
//!
//! ```text
//! /sys/fs/cgroup/<controller>/starling/<name>/guest   cpu.idle=1, memory band, freezer
//! /sys/fs/cgroup/<controller>/starling/<name>/owner   emulated hosts: `starling owner HOST -- CMD`
//! ```
//!
//! `<name>` is the agent's `--cgroup` (the embedded cluster passes the host's
//! network namespace name, e.g. `starling6-h1`, so clusters of one machine
//! never collide; a real host defaults to its agent name).
//!
//! * [`cgroup`]: the v1 hierarchies, creating, emptying and removing groups.
//! * [`guest`]: the guest group: starvation CPU priority (`cpu.idle = 1`, else
//!   `SCHED_IDLE` per task), the LowWater/HighWater memory band, freezing.
//! * [`owner`]: the owner monitor: owner CPU, free memory, disk and network
//!   I/O ([`netio`]: nftables counters), keyboard; the owner state (idle /
//!   active-light / active-busy).
//! * [`policy`]: T_lingr (eq. 3.4) for the head's LL policy.
//! * [`window`]: the guests' disk and network rate windows (blkio
//!   throttles; nftables `socket cgroupv2` + an htb class), applied while
//!   the owner does disk or network I/O.

pub mod cgroup;
pub mod guest;
pub mod netio;
pub mod nft;
pub mod owner;
pub mod policy;
pub mod window;

pub use cgroup::{CgroupError, Hierarchies};
pub use guest::{Guest, GuestError, MemoryBand};
pub use owner::{Keyboard, OwnerSample, OwnerState};
pub use window::{DiskWindow, Hysteresis, NetWindow, WindowError};
