//! Chunks that live only inside assembled files. A file fetched for a task
//! is written chunk by chunk straight into its assembled file (never stored
//! chunk by chunk as well), so to serve those chunks to other hosts this
//! remembers where each one was written: an open descriptor of the file
//! (valid while it is still being written, and after it is renamed into
//! place or evicted) and the chunk's offset. What is read back here is not
//! trusted: the host it is served to verifies it against its name.

use starling_proto::Hash;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// Files whose chunks are remembered: the most recently assembled ones. An
/// evicted file's blocks stay allocated while its descriptor is held here.
const FILES: usize = 16;

#[derive(Default)]
pub(crate) struct Located {
    files: VecDeque<Arc<File>>,
    chunks: HashMap<Hash, (Arc<File>, u64, u32)>,
}

impl Located {
    /// Start remembering chunks of `file`, forgetting the oldest file's.
    pub(crate) fn add_file(&mut self, file: Arc<File>) {
        self.files.push_back(file);
        if self.files.len() > FILES {
            if let Some(old) = self.files.pop_front() {
                self.chunks.retain(|_, (f, ..)| !Arc::ptr_eq(f, &old));
            }
        }
    }

    /// Chunk `hash` is the `len` bytes at `offset` of `file` (already written).
    pub(crate) fn add_chunk(&mut self, hash: Hash, file: &Arc<File>, offset: u64, len: u32) {
        self.chunks.insert(hash, (file.clone(), offset, len));
    }

    pub(crate) fn find(&self, hash: &Hash) -> Option<(Arc<File>, u64, u32)> {
        self.chunks.get(hash).cloned()
    }
}

/// The bytes at `offset`, `len` long, of `file`.
pub(crate) fn read_at(file: &File, offset: u64, len: u32) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}
