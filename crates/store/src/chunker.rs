//! Content-defined chunking (FastCDC 2020) and recipe construction.
//!
//! Boundaries depend only on nearby bytes, so an insertion or deletion moves
//! the boundaries next to the edit and leaves the rest of the file's chunks —
//! and their names — unchanged. That is what lets a slowly changing input
//! travel as a few new chunks.

use fastcdc::v2020::{FastCDC, StreamCDC};
pub use starling_config::Chunking;
use starling_proto::{ChunkRef, Hash, Recipe};
use std::fs::{File, Metadata};
use std::io::{self, BufReader};
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// No chunk is shorter than this (except a file's last one).
pub const MIN_CHUNK: u32 = 16 * 1024;
/// The chunker aims at this average size.
pub const AVG_CHUNK: u32 = 64 * 1024;
/// Cut unconditionally at this size; the streaming chunker's buffer is this big.
pub const MAX_CHUNK: u32 = 256 * 1024;

// The wire protocol refuses chunks above its own limit; ours must fit.
const _: () = assert!(MAX_CHUNK <= starling_proto::MAX_CHUNK);

/// Modification time of `meta` in nanoseconds since the epoch.
pub fn mtime_ns(meta: &Metadata) -> i64 {
    meta.mtime().saturating_mul(1_000_000_000).saturating_add(meta.mtime_nsec())
}

/// Change time of `meta` in nanoseconds since the epoch.
pub fn ctime_ns(meta: &Metadata) -> i64 {
    meta.ctime().saturating_mul(1_000_000_000).saturating_add(meta.ctime_nsec())
}

/// A recipe with `meta`'s metadata and no chunks yet.
fn empty_recipe(meta: &Metadata) -> Recipe {
    Recipe {
        size: 0,
        mode: meta.mode(),
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ns: mtime_ns(meta),
        chunks: Vec::new(),
    }
}

/// Chunk the file at `path`, streaming (memory use is bounded by
/// [`MAX_CHUNK`], whatever the file's size). `f` sees every chunk in file
/// order. The recipe's metadata comes from `meta`; its size is the number of
/// bytes actually read (callers that care whether the file changed while
/// being read compare it with `meta.len()`).
pub fn chunk_file(path: &Path, meta: &Metadata, chunking: Chunking, f: impl FnMut(ChunkRef, &[u8])) -> io::Result<Recipe> {
    let file = File::open(path)?;
    chunk_reader(&file, meta, chunking, f)
}


/// A chunk's length as recipes record it (chunks are at most `MAX_CHUNK`).
fn chunk_len(n: usize) -> u32 {
    u32::try_from(n).expect("a chunk is at most MAX_CHUNK bytes")
}

fn chunk_fixed(file: &File, meta: &Metadata, mut f: impl FnMut(ChunkRef, &[u8])) -> io::Result<Recipe> {
    use std::io::Read;
    let mut recipe = empty_recipe(meta);
    let mut reader = BufReader::new(file);
    let mut buf = vec![0u8; starling_proto::MAX_CHUNK as usize];
    loop {
        let mut got = 0;
        while got < buf.len() {
            let n = reader.read(&mut buf[got..])?;
            if n == 0 {
                break;
            }
            got += n;
        }
        if got == 0 {
            return Ok(recipe);
        }
        let r = ChunkRef { hash: Hash::of(&buf[..got]), len: chunk_len(got) };
        f(r, &buf[..got]);
        recipe.size += got as u64;
        recipe.chunks.push(r);
    }
}

/// [`chunk_file`] on an already open file (read from its current position).
/// Content-defined chunking can be switched off ([`Chunking::Fixed`]) to
/// measure what it saves: files are then cut into fixed blocks of the
/// largest chunk size, so an edit resends its whole block (or file).
pub fn chunk_reader(file: &File, meta: &Metadata, chunking: Chunking, mut f: impl FnMut(ChunkRef, &[u8])) -> io::Result<Recipe> {
    if chunking == Chunking::Fixed {
        return chunk_fixed(file, meta, f);
    }
    let mut recipe = empty_recipe(meta);
    // StreamCDC fills its own MAX_CHUNK buffer with large reads; the
    // BufReader only smooths out the short reads some file systems return.
    let reader = BufReader::with_capacity(MAX_CHUNK as usize, file);
    for chunk in StreamCDC::new(reader, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK) {
        let chunk = chunk.map_err(io::Error::from)?;
        let r = ChunkRef { hash: Hash::of(&chunk.data), len: chunk_len(chunk.length) };
        f(r, &chunk.data);
        recipe.size += chunk.length as u64;
        recipe.chunks.push(r);
    }
    Ok(recipe)
}

/// Chunk an in-memory buffer: each chunk's reference and its range in `data`.
/// Gives the same boundaries as [`chunk_file`] on a file holding `data`.
pub fn chunk_bytes(data: &[u8]) -> Vec<(ChunkRef, Range<usize>)> {
    FastCDC::new(data, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
        .map(|c| {
            let range = c.offset..c.offset + c.length;
            (ChunkRef { hash: Hash::of(&data[range.clone()]), len: chunk_len(c.length) }, range)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::io::Write;

    /// Deterministic incompressible test data (BLAKE3 in XOF mode).
    pub(crate) fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        blake3::Hasher::new().update(&seed.to_le_bytes()).finalize_xof().fill(&mut out);
        out
    }

    fn write_file(dir: &Path, name: &str, data: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        File::create(&p).unwrap().write_all(data).unwrap();
        p
    }

    #[test]
    fn file_and_bytes_chunkers_agree_and_respect_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let data = random_bytes(1, 3 << 20);
        let p = write_file(dir.path(), "f", &data);
        let meta = std::fs::metadata(&p).unwrap();
        let mut seen = Vec::new();
        let recipe = chunk_file(&p, &meta, Chunking::ContentDefined, |r, bytes| {
            assert_eq!(Hash::of(bytes), r.hash);
            assert_eq!(bytes.len(), r.len as usize);
            seen.extend_from_slice(bytes);
        })
        .unwrap();
        assert_eq!(seen, data, "callback sees the whole file in order");
        assert_eq!(recipe.size, data.len() as u64);
        assert_eq!(recipe.mode, meta.mode());
        assert_eq!(recipe.mtime_ns, mtime_ns(&meta));
        recipe.validate().unwrap();
        let mem: Vec<ChunkRef> = chunk_bytes(&data).into_iter().map(|(r, _)| r).collect();
        assert_eq!(recipe.chunks, mem);
        assert!(recipe.chunks.len() > 10, "3 MiB at 64 KiB average: {} chunks", recipe.chunks.len());
        let (last, body) = recipe.chunks.split_last().unwrap();
        assert!(body.iter().all(|c| (MIN_CHUNK..=MAX_CHUNK).contains(&c.len)));
        assert!(last.len <= MAX_CHUNK);
    }

    #[test]
    fn empty_file_has_no_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "empty", b"");
        let meta = std::fs::metadata(&p).unwrap();
        let r = chunk_file(&p, &meta, Chunking::ContentDefined, |_, _| panic!("no chunk expected")).unwrap();
        assert_eq!((r.size, r.chunks.len()), (0, 0));
        assert!(chunk_bytes(b"").is_empty());
    }

    #[test]
    fn boundaries_survive_an_insertion_at_the_start() {
        let data = random_bytes(2, 4 << 20);
        let mut shifted = random_bytes(3, 100);
        shifted.extend_from_slice(&data);
        let a: Vec<Hash> = chunk_bytes(&data).into_iter().map(|(r, _)| r.hash).collect();
        let b: HashSet<Hash> = chunk_bytes(&shifted).into_iter().map(|(r, _)| r.hash).collect();
        let shared = a.iter().filter(|h| b.contains(h)).count();
        // Only the chunk(s) touching the insertion may differ.
        assert!(shared + 2 >= a.len(), "only {shared} of {} chunks shared", a.len());
        assert!(a.len() > 20);
    }

    #[test]
    fn recipe_name_tracks_metadata_but_content_id_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "f", &random_bytes(4, 200_000));
        let meta1 = std::fs::metadata(&p).unwrap();
        let r1 = chunk_file(&p, &meta1, Chunking::ContentDefined, |_, _| {}).unwrap();
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(12345))
            .unwrap();
        let meta2 = std::fs::metadata(&p).unwrap();
        let r2 = chunk_file(&p, &meta2, Chunking::ContentDefined, |_, _| {}).unwrap();
        assert_ne!(r1.mtime_ns, r2.mtime_ns);
        assert_ne!(r1.name(), r2.name());
        assert_eq!(r1.content_id(), r2.content_id());
    }
}
