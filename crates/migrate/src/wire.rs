//! The frames between a migration's source and target, on one TCP
//! connection: `"SFMG"`, a `u32` little-endian length, a bincode body.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::io::{Read, Write};

const MAGIC: [u8; 4] = *b"SFMG";
/// Largest frame accepted (an `Image` carries the caller's payload: the
/// task's written files, among others).
pub const MAX_FRAME: u32 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a migration frame")]
    Magic,
    #[error("frame of {0} bytes")]
    TooLarge(u32),
    #[error("undecodable frame: {0}")]
    Decode(String),
}

/// Source → target.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToTarget {
    /// First: what the target's caller needs to prepare (its payload).
    Prepare { payload: Vec<u8> },
    /// Pages of process `process` (its index in the task's tree, the root
    /// 0) and their bytes (`addrs.len()` × 4096), copied while it runs or
    /// at the freeze.
    Pages { process: u32, addrs: Vec<u64>, data: Vec<u8> },
    /// The tree is frozen: its encoded descriptor (the root's, with its
    /// descendants), per process (in the tree's order) the pages sent
    /// before that it wrote since (the target fetches them instead) and
    /// the page server holding its memory, the caller's payload.
    Image { descriptor: Vec<u8>, stale: Vec<Vec<u64>>, page_servers: Vec<String>, payload: Vec<u8> },
    /// Pages of process `process` sent before that it wrote since and that
    /// will not be sent again before the freeze (pre-copy stopped: see
    /// `source::RoundEnd::StopUnsent`): the target drops them now, so the
    /// freeze's `stale` lists only what was written after this.
    Stale { process: u32, addrs: Vec<u64> },
}

/// Target → source.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToSource {
    /// The target is ready for the freeze: what the restore needs besides
    /// memory (its view, the files it maps) is in place. The source does
    /// not freeze before this.
    Prepared,
    /// The process runs on the target; where the target's part of the
    /// pause went (named steps, ms).
    Resumed { phases_ms: Vec<(String, f64)> },
    /// The source holds nothing the process needs any more.
    /// With the faults the target served meanwhile and their service time
    /// (power-of-two µs bounds, see `fault::ServiceTimes`), and the pages
    /// that arrived when they were in place already (thrown away).
    Complete { local_pages: u64, remote_pages: u64, faults: u64, fault_p50_us: Option<u64>, fault_p99_us: Option<u64>, discarded_pages: u64 },
    /// The target gave up (before `Resumed`: the source keeps the process).
    Failed { reason: String },
}

pub fn send<T: Serialize>(w: &mut impl Write, frame: &T) -> Result<(), WireError> {
    let body = bincode::serialize(frame).map_err(|e| WireError::Decode(e.to_string()))?;
    let len = u32::try_from(body.len()).ok().filter(|&l| l <= MAX_FRAME).ok_or(WireError::TooLarge(u32::MAX))?;
    let mut head = [0u8; 8];
    head[..4].copy_from_slice(&MAGIC);
    head[4..].copy_from_slice(&len.to_le_bytes());
    w.write_all(&head)?;
    w.write_all(&body)?;
    w.flush()?;
    Ok(())
}

pub fn recv<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, WireError> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head)?;
    if head[..4] != MAGIC {
        return Err(WireError::Magic);
    }
    let len = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    // Grown as bytes arrive, not allocated at the length the peer claims.
    let mut body = Vec::new();
    r.take(u64::from(len)).read_to_end(&mut body)?;
    if body.len() < len as usize {
        return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(u64::from(MAX_FRAME))
        .reject_trailing_bytes()
        .deserialize(&body)
        .map_err(|e| WireError::Decode(e.to_string()))
}
