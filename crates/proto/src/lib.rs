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
pub mod path;
pub mod unacked;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;

pub use frame::{read_frame, write_frame, FrameReader, FrameWriter};
pub use msg::*;
pub use types::*;
/// A clone's fault-handler counters, as `CloneStats` carries them (defined with the process image).
pub use starling_image::abi::counters::{realtime_ns, CloneCounters};

/// Frame magic: identifies a starling peer.
pub const MAGIC: [u8; 4] = *b"STRL";
/// Protocol version spoken by this build. Peers of another version are refused.
/// Bump it with every change to the encoding of any message (bincode encodes
/// enum variants by index: even adding a variant in the middle changes it).
pub const PROTOCOL_VERSION: u16 = 30;
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
    #[error("cannot encode a message: {0}")]
    Encode(#[source] bincode::Error),
    #[error("malformed message: {0}")]
    Decode(#[source] bincode::Error),
    #[error("bad compressed frame: {0}")]
    Decompress(#[source] std::io::Error),
    #[error("unknown frame flags {0:#x}")]
    FrameFlags(u16),
    #[error("invalid message: {0}")]
    Invalid(#[from] Invalid),
    /// The peer's first message was an `Error` (its reason).
    #[error("peer refused us: {0}")]
    Refused(String),
    #[error("expected Hello, got another message")]
    NoHello,
    #[error("expected a {expected:?} peer, got a {got:?}")]
    UnexpectedPeer { expected: Role, got: Role },
}

/// What made a message invalid (checked on receipt, before anything acts on it).
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    #[error("path {0:?} is not absolute")]
    PathNotAbsolute(String),
    #[error("path longer than PATH_MAX")]
    PathTooLong,
    #[error("path contains NUL")]
    PathNul,
    #[error("path {0:?} is not normalised")]
    PathNotNormalised(String),
    #[error("name contains '/'")]
    NameHasSlash,
    #[error("a name of {0} bytes is longer than NAME_MAX (255)")]
    NameTooLong(usize),
    #[error("chunk length {0} out of range")]
    ChunkLength(u32),
    #[error("recipe chunks sum to {total} bytes but size is {size}")]
    RecipeSize { total: u64, size: u64 },
    #[error("chunk {hash:?}: bad zstd data: {source}")]
    ChunkZstd { hash: Hash, #[source] source: std::io::Error },
    #[error("chunk {0:?}: content does not match its name")]
    ChunkMismatch(Hash),
    #[error("empty argv")]
    EmptyArgv,
    #[error("argv contains NUL")]
    ArgvNul,
    #[error("malformed environment entry")]
    BadEnv,
    #[error("clone descriptor empty or too large")]
    CloneDescriptor,
    #[error("bad clone spec")]
    CloneSpec,
    #[error("umask out of range")]
    Umask,
    #[error("terminal modes with more than 32 control characters")]
    TerminalModes,
    #[error("bad name in a prethrown listing")]
    ListingName,
    #[error("bad symlink target")]
    SymlinkTarget,
    #[error("a task cannot replace /")]
    ReplaceRoot,
    #[error("{what} of {len} bytes exceeds {max}")]
    TooLarge { what: &'static str, len: usize, max: usize },
    #[error("host load is not a finite non-negative number")]
    HostLoad,
    #[error("signal {0} out of range")]
    Signal(i32),
    #[error("bad directory entry name")]
    DirEntryName,
    #[error("job references overflow")]
    JobReferences,
    #[error("job of {0} tasks")]
    JobSize(usize),
    #[error("bad argv in job task")]
    JobArgv,
    #[error("ticket for {0} clones")]
    TicketSize(u32),
    #[error("executor progress counts more ended futures than submitted ones")]
    ExecutorCounts,
}
