//! starling's wire protocol.
//!
//! Every connection (client ↔ head, head ↔ agent) carries a sequence of
//! *frames*. A frame is a fixed 12-byte header followed by a bincode body:
//!
//! ```text
//! +--------+---------+----------+-----------+----------------------+
//! | "STRL" | version | reserved | body len  | body (bincode `Msg`) |
//! | 4 B    | u16 LE  | u16 = 0  | u32 LE    | ≤ MAX_FRAME bytes    |
//! +--------+---------+----------+-----------+----------------------+
//! ```
//!
//! A reader checks the magic, the version and the length *before* it
//! allocates anything, decodes the body with a size limit, rejects trailing
//! bytes, and then validates the message's contents ([`Msg::validate`]).
//! Anything wrong is a [`ProtoError`]: the caller reports it and closes the
//! connection. Nothing here panics on peer input.

pub mod types;
pub mod msg;
pub mod frame;
pub mod conn;

pub use frame::{read_frame, write_frame, FrameReader, FrameWriter};
pub use msg::*;
pub use types::*;
/// A clone's fault-handler counters, as `CloneStats` carries them (defined with the process image).
pub use starling_image::abi::counters::CloneCounters;

/// Frame magic: identifies a starling peer.
pub const MAGIC: [u8; 4] = *b"STRL";
/// Protocol version spoken by this build. Peers of another version are refused.
/// Bump it with every change to the encoding of any message (bincode encodes
/// enum variants by index: even adding a variant in the middle changes it).
pub const PROTOCOL_VERSION: u16 = 4;
/// Largest frame body accepted (32 MiB). Chunk batches are sized to fit.
pub const MAX_FRAME: u32 = 32 << 20;
/// Largest path accepted on the wire (Linux PATH_MAX).
pub const MAX_PATH: usize = 4096;

/// Why a frame or message was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("connection closed by peer")]
    Closed,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a starling peer (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("peer speaks starling protocol v{peer}, this build speaks v{ours}; upgrade one side")]
    Version { peer: u16, ours: u16 },
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(u64),
    #[error("truncated frame: expected {expected} bytes, got {got}")]
    Truncated { expected: usize, got: usize },
    #[error("malformed message: {0}")]
    Decode(String),
    #[error("invalid message: {0}")]
    Invalid(String),
}

impl ProtoError {
    pub fn invalid(s: impl Into<String>) -> Self {
        ProtoError::Invalid(s.into())
    }
}
