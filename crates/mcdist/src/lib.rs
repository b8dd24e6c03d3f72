//! mcdist: multicast page distribution for the clones of one fork ticket
//! (SnowFlock's mcdist, `/work/shared/papers/snowflock.md` §4 and §6).
//!
//! Clones of one ticket run the same code and fault on the same pages. With
//! unicast the parent's host sends every page once per clone; with mcdist
//! every page goes once to the ticket's multicast group and every clone
//! installs it, whether it asked or not.
//!
//! * [`Sender`] runs next to the page server on the parent's host. It joins
//!   nothing; it reads unicast [`wire::Request`]s (page addresses plus the
//!   receiver's measured receive rate and request→arrival time) and
//!   multicasts the pages to the group, paced by a token bucket.
//!   - *Lockstep suppression*: a request for a page sent less than the
//!     lockstep window ago (2 × the receivers' reported request→arrival
//!     time, clamped to 2–100 ms) or still queued is not answered again —
//!     the clones simply run in lockstep.
//!   - *Flow control*: the rate limit rises linearly, by
//!     `link_rate / 100` every 10 ms (line rate one second after a cut,
//!     whatever the link: the paper's fixed +10 KB/s per 10 ms would need
//!     20 minutes to reach 10 GbE); a request for a page that was sent
//!     longer ago than the window is an *implicit loss* and cuts the limit
//!     to 3/4 of the mean rate the receivers reported (never below
//!     `min_rate`). Every change is recorded in a rate trace.
//!   - *Push* (optional): each requested page also queues the next
//!     `push_pages` not-yet-sent pages of its region at low priority.
//! * [`Receiver`] runs once per clone host and ticket, shared by the fault
//!   handlers of that host's clones of the ticket. It joins the group; a
//!   background thread reassembles and verifies pages (BLAKE3 of the page in
//!   every fragment) and hands them over in batches: to the faulting threads
//!   waiting for exactly that page, otherwise to a [`PageSink`] that installs
//!   it into each of the host's clones that has not got it. Waiting threads
//!   re-request after a timeout (exponential backoff, bounded).
//! * Detection: a receiver sends HELLO to the sender, which answers with a
//!   multicast PROBE. A receiver that hears none within `probe_timeout`
//!   refuses to start ([`McdistError::NoMulticast`]); callers then fall
//!   back to unicast and report [`Mode::UnicastFallback`].
//!
//! Packets are split to fit the link MTU (see [`wire`] for the reasons).

pub mod receiver;
pub mod sender;
pub mod seal;
pub mod wire;

pub use receiver::{Fetched, PageSink, Receiver, ReceiverConfig, ReceiverStats};
pub use sender::{PageSource, RateSample, Sender, SenderConfig, SenderStats, SourcePage};

use std::net::{Ipv4Addr, SocketAddrV4};

pub const PAGE_SIZE: u64 = wire::PAGE as u64;

/// How a clone gets its pages (shown by `starling status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Not decided yet.
    Unknown = 0,
    /// Multicast (on demand).
    Multicast = 1,
    /// Multicast with push of neighbouring pages.
    MulticastPush = 2,
    /// Unicast because multicast was switched off.
    Unicast = 3,
    /// Unicast because multicast did not work here (detected).
    UnicastFallback = 4,
}

impl Mode {
    pub fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::Multicast,
            2 => Mode::MulticastPush,
            3 => Mode::Unicast,
            4 => Mode::UnicastFallback,
            _ => Mode::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Unknown => "unknown",
            Mode::Multicast => "multicast",
            Mode::MulticastPush => "multicast+push",
            Mode::Unicast => "unicast",
            Mode::UnicastFallback => "unicast (multicast unavailable)",
        }
    }
}

/// Whether pages go by multicast: off, on, or on with push (the setting
/// `fork.mcdist`, resolved by the caller's edge; see `starling-config`).
pub use starling_config::Multicast as Switch;

/// A rate in bytes/s (a non-negative float from the flow control) as the
/// counters store it: saturating, NaN as 0.
pub(crate) fn rate_to_u64(rate: f64) -> u64 {
    // `as` from f64 saturates at the bounds and maps NaN to 0, which is the meaning wanted here.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let r = rate.max(0.0) as u64;
    r
}

/// The multicast group of a ticket: 239.231.x.y (administratively scoped),
/// port 17000 + (ticket mod 10000), so concurrent tickets do not share a group.
pub fn group_for_ticket(ticket: u64) -> SocketAddrV4 {
    let g = (ticket % 65_000) as u16 + 1;
    let [hi, lo] = g.to_be_bytes();
    SocketAddrV4::new(Ipv4Addr::new(239, 231, hi, lo), 17_000 + u16::try_from(ticket % 10_000).expect("below 10000"))
}

#[derive(Debug, thiserror::Error)]
pub enum McdistError {
    #[error("{what}: {source}")]
    Io { what: String, #[source] source: std::io::Error },
    #[error("no multicast from the sender within {0:?}")]
    NoMulticast(std::time::Duration),
    #[error("page {addr:#x} did not arrive within {waited:?}")]
    Timeout { addr: u64, waited: std::time::Duration },
    #[error("receiver stopped")]
    Stopped,
}

impl McdistError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        McdistError::Io { what: what.into(), source }
    }
}

pub type Result<T> = std::result::Result<T, McdistError>;
