//! starling's content-addressed store.
//!
//! A task on a cluster host reads the client's files without the client
//! shipping them whole: each file is described by a [`Recipe`] — its
//! metadata plus the list of content-defined chunks that rebuild its bytes —
//! and named by the hash of that recipe (its RecipeName). A host that already
//! knows a RecipeName needs nothing; otherwise it fetches the recipe, then
//! only the chunks it lacks. This crate holds the pieces on both ends
//! (UCop §4, improved as in §9):
//!
//! * [`chunker`] — FastCDC (16/64/256 KiB) boundaries that survive
//!   insertions, BLAKE3 chunk names; streaming, so huge files are cheap.
//! * [`RecipeCache`] — client side: a file is re-hashed only when its
//!   `(dev, inode, size, mtime_ns, ctime_ns)` changed, persisted across runs
//!   and shared by concurrent client processes.
//! * [`read_chunks`] — client side: serve chunks straight from the file,
//!   re-verified, so a file changed after hashing is reported, never
//!   silently sent under an old name.
//! * [`HostCache`] — host side: chunks, recipes and assembled files (the
//!   backing files for FUSE passthrough) in one size-bounded LRU directory,
//!   shared by all tasks on a host and by the head's relay cache.
//!
//! Trust: bytes are only ever handed out under a name they match. Peers'
//! chunks are verified on receipt (`ChunkData::into_verified`), once per hop:
//! the host cache re-verifies every chunk and recipe it reads back from disk
//! for its own use (`get_chunk`, `get_recipe`), but bytes it only passes on to
//! a peer that verifies them anyway are not hashed again
//! (`get_chunk_unverified`, the relay cache serving hosts). Every write goes
//! through a temporary file and an atomic rename, so neither a crash nor a
//! concurrent reader sees a partial entry.

pub mod chunker;
mod host_cache;
mod located;
mod recipe_cache;

pub use host_cache::{CacheStats, HostCache};
pub use recipe_cache::{RecipeCache, RACY_WINDOW_NS};
pub use starling_proto::{ChunkRef, Hash, Recipe};

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Read the chunks `wanted` of the file at `path`, which `recipe` describes
/// (the client answering a host's GetChunks). Each chunk is re-hashed: if the
/// file changed since its recipe was made, the result is an
/// `InvalidData` error naming the path. Asking for a chunk that is not in the
/// recipe is an `InvalidInput` error.
pub fn read_chunks(path: &Path, recipe: &Recipe, wanted: &[Hash]) -> io::Result<Vec<(Hash, Vec<u8>)>> {
    // Where each chunk starts (its first occurrence: all are identical).
    let mut offsets: HashMap<Hash, (u64, u32)> = HashMap::with_capacity(recipe.chunks.len());
    let mut offset = 0u64;
    for c in &recipe.chunks {
        offsets.entry(c.hash).or_insert((offset, c.len));
        offset += u64::from(c.len);
    }
    let file = File::options().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    let changed = |h: &Hash, at: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: file changed since it was hashed (chunk {h} at offset {at} no longer matches)", path.display()),
        )
    };
    let mut out = Vec::with_capacity(wanted.len());
    for h in wanted {
        let &(at, len) = offsets.get(h).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{}: chunk {h} is not part of its recipe", path.display()))
        })?;
        let mut bytes = vec![0u8; len as usize];
        match file.read_exact_at(&mut bytes, at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(changed(h, at)),
            Err(e) => return Err(e),
        }
        if Hash::of(&bytes) != *h {
            return Err(changed(h, at));
        }
        out.push((*h, bytes));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
