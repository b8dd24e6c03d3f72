//! Tests of the caches and of `read_chunks` (the chunker tests live in `chunker`).

use crate::chunker::Chunking;
use super::*;
use crate::chunker::tests::random_bytes;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::thread::sleep;
use std::time::Duration;

fn chunk_path(dir: &Path, h: &Hash) -> PathBuf {
    let hex = h.to_hex();
    dir.join("chunks").join(&hex[..2]).join(hex)
}

/// Distinct chunks of exactly `len` bytes each.
fn chunks(n: usize, len: usize) -> Vec<(Hash, Vec<u8>)> {
    (0..n).map(|i| random_bytes(100 + i as u64, len)).map(|b| (Hash::of(&b), b)).collect()
}

/// Put every chunk of `data` and its recipe into `cache`.
fn fill(cache: &HostCache, data: &[u8], mtime_ns: i64) -> Recipe {
    let mut recipe = Recipe { size: data.len() as u64, mode: 0o100644, uid: 0, gid: 0, mtime_ns, chunks: vec![] };
    for (r, range) in chunker::chunk_bytes(data) {
        cache.put_chunk(&r.hash, &data[range]).unwrap();
        recipe.chunks.push(r);
    }
    recipe
}

#[test]
fn lru_eviction_keeps_the_bound_and_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cs = chunks(8, 10_000);
    let exists = |i: usize| chunk_path(dir.path(), &cs[i].0).exists();
    // mtime is the persisted recency: keep operations a few clock ticks apart.
    let tick = || sleep(Duration::from_millis(20));
    {
        let cache = HostCache::open(dir.path(), 50_000).unwrap();
        for (h, b) in &cs[..5] {
            cache.put_chunk(h, b).unwrap();
            tick();
        }
        assert_eq!(cache.stats().bytes, 50_000);
        assert_eq!(cache.stats().evictions, 0);
        // Using chunk 0 makes chunk 1 the least recently used.
        assert_eq!(cache.get_chunk(&cs[0].0).unwrap().as_deref(), Some(&cs[0].1[..]));
        tick();
        cache.put_chunk(&cs[5].0, &cs[5].1).unwrap();
        tick();
        assert!(exists(0) && !exists(1) && exists(2), "chunk 1 (LRU) should be the one evicted");
        cache.put_chunk(&cs[6].0, &cs[6].1).unwrap();
        assert!(exists(0) && !exists(2) && exists(3));
        let s = cache.stats();
        assert_eq!((s.bytes, s.chunks, s.evictions), (50_000, 5, 2));
        assert!(!cache.has_chunk(&cs[1].0));
        assert_eq!(cache.get_chunk(&cs[1].0).unwrap(), None);
    }
    // After a restart the order on disk is 3, 4, 0, 5, 6 (oldest first).
    let cache = HostCache::open(dir.path(), 50_000).unwrap();
    assert_eq!(cache.stats().chunks, 5);
    assert_eq!(cache.stats().bytes, 50_000);
    cache.put_chunk(&cs[7].0, &cs[7].1).unwrap();
    assert!(!exists(3) && exists(4) && exists(0) && exists(7));
    assert!(cache.stats().bytes <= 50_000);
}

#[test]
fn reopening_with_a_smaller_bound_evicts_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let cs = chunks(4, 10_000);
    {
        let cache = HostCache::open(dir.path(), 1 << 20).unwrap();
        for (h, b) in &cs {
            cache.put_chunk(h, b).unwrap();
            sleep(Duration::from_millis(20));
        }
    }
    let cache = HostCache::open(dir.path(), 20_000).unwrap();
    assert_eq!(cache.stats().bytes, 20_000);
    assert!(!chunk_path(dir.path(), &cs[0].0).exists());
    assert!(!chunk_path(dir.path(), &cs[1].0).exists());
    assert!(cache.has_chunk(&cs[2].0) && cache.has_chunk(&cs[3].0));
}

#[test]
fn corrupted_entries_are_detected_and_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let cache = HostCache::open(dir.path(), 1 << 20).unwrap();
    let (h, bytes) = chunks(1, 5000).pop().unwrap();
    cache.put_chunk(&h, &bytes).unwrap();
    let mut bad = bytes.clone();
    bad[1234] ^= 1;
    fs::write(chunk_path(dir.path(), &h), &bad).unwrap();
    assert_eq!(cache.get_chunk(&h).unwrap(), None, "corrupt bytes must not be handed out");
    assert!(!chunk_path(dir.path(), &h).exists(), "corrupt entry deleted");
    assert!(!cache.has_chunk(&h));
    assert_eq!(cache.stats().chunks, 0);

    let recipe = Recipe { size: 5000, mode: 0o100600, uid: 1, gid: 2, mtime_ns: 3, chunks: vec![ChunkRef { hash: h, len: 5000 }] };
    let name = cache.put_recipe(&recipe).unwrap();
    assert_eq!(name, recipe.name());
    assert_eq!(cache.get_recipe(&name).unwrap(), Some(recipe.clone()));
    let hex = name.to_hex();
    let rpath = dir.path().join("recipes").join(&hex[..2]).join(&hex);
    let mut other = recipe.clone();
    other.uid = 99;
    fs::write(&rpath, bincode::serialize(&other).unwrap()).unwrap();
    assert_eq!(cache.get_recipe(&name).unwrap(), None, "a recipe stored under the wrong name is rejected");
    fs::write(&rpath, b"garbage").unwrap();
    assert_eq!(cache.get_recipe(&name).unwrap(), None);
    assert!(!rpath.exists());
}

#[test]
fn assemble_rebuilds_a_multi_megabyte_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = HostCache::open(dir.path(), 64 << 20).unwrap();
    // Repeated content: the second copy resynchronises and shares chunks.
    let half = random_bytes(7, 3 << 20);
    let data = [&half[..], &half[..]].concat();
    let recipe = Recipe { size: data.len() as u64, mode: 0o100755, uid: 0, gid: 0, mtime_ns: 1, chunks: chunker::chunk_bytes(&data).into_iter().map(|(r, _)| r).collect() };
    let missing = cache.missing(&recipe);
    let distinct: std::collections::HashSet<_> = recipe.chunks.iter().map(|c| c.hash).collect();
    assert_eq!(missing.len(), distinct.len(), "missing lists each chunk once");
    assert!(distinct.len() < recipe.chunks.len(), "the repeated half should share chunks");
    assert_eq!(missing[0], recipe.chunks[0].hash, "first-use order");
    assert_eq!(cache.assemble(&recipe).unwrap_err().kind(), io::ErrorKind::NotFound);

    let filled = fill(&cache, &data, 1);
    assert_eq!(filled.chunks, recipe.chunks);
    assert!(cache.missing(&recipe).is_empty());
    let path = cache.assemble(&recipe).unwrap();
    assert!(fs::read(&path).unwrap() == data, "assembled bytes differ from the original");
    let chunk_bytes_total = cache.stats().bytes;
    assert!(chunk_bytes_total >= data.len() as u64, "the assembled file counts toward the bound");

    // Same content, different metadata: same assembled file, no new bytes.
    let mut later = recipe.clone();
    later.mtime_ns = 2;
    assert_ne!(later.name(), recipe.name());
    assert_eq!(cache.assemble(&later).unwrap(), path);
    assert_eq!(cache.stats().bytes, chunk_bytes_total);
    assert_eq!(cache.stats().files, 1);

    // Empty file.
    let empty = Recipe { size: 0, mode: 0o100644, uid: 0, gid: 0, mtime_ns: 0, chunks: vec![] };
    assert_eq!(fs::metadata(cache.assemble(&empty).unwrap()).unwrap().len(), 0);
    // A recipe whose sizes do not add up is refused, not assembled.
    let mut lying = recipe.clone();
    lying.size += 1;
    assert_eq!(cache.assemble(&lying).unwrap_err().kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn assembled_files_are_evicted_too() {
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(8, 400_000);
    let cache = HostCache::open(dir.path(), 1_000_000).unwrap();
    let recipe = fill(&cache, &data, 0);
    let path = cache.assemble(&recipe).unwrap();
    assert_eq!(cache.stats().bytes, 800_000);
    // Fill with unrelated chunks: the oldest entries (the chunks) go first, then the file.
    for (h, b) in chunks(3, 100_000) {
        cache.put_chunk(&h, &b).unwrap();
    }
    assert!(cache.stats().bytes <= 1_000_000);
    assert!(path.exists(), "the assembled file was used more recently than its chunks");
    assert!(recipe.chunks.iter().any(|c| !chunk_path(dir.path(), &c.hash).exists()));
    for (h, b) in chunks(9, 100_000).into_iter().skip(3) {
        cache.put_chunk(&h, &b).unwrap();
    }
    assert!(!path.exists(), "the assembled file is evicted once it is the oldest");
    assert!(cache.stats().bytes <= 1_000_000);
    assert_eq!(cache.stats().files, 0);
}

#[test]
fn concurrent_users_keep_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let a = HostCache::open(dir.path(), 300_000).unwrap();
    let b = HostCache::open(dir.path(), 300_000).unwrap(); // a second "process"
    let cs = chunks(40, 10_000);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (a, cs) = (&a, &cs);
            s.spawn(move || {
                for i in 0..cs.len() {
                    let (h, bytes) = &cs[(i * 7 + t * 13) % cs.len()];
                    a.put_chunk(h, bytes).unwrap();
                    if let Some(got) = a.get_chunk(h).unwrap() {
                        assert_eq!(&got, bytes);
                    }
                }
            });
        }
    });
    assert!(a.stats().bytes <= 300_000);
    // b learns of a's chunks from disk, and drops what a evicted.
    for (h, bytes) in &cs {
        let on_disk = chunk_path(dir.path(), h).exists();
        assert_eq!(b.has_chunk(h), on_disk);
        assert_eq!(b.get_chunk(h).unwrap().is_some(), on_disk);
        if on_disk {
            assert_eq!(b.get_chunk(h).unwrap().unwrap(), *bytes);
        }
    }
    assert!(fs::read_dir(dir.path().join("tmp")).unwrap().next().is_none(), "no temporary files left");
}

fn write(path: &Path, data: &[u8]) {
    fs::File::create(path).unwrap().write_all(data).unwrap();
}

#[test]
fn recipe_cache_rehashes_only_on_change() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().join("recipes");
    let file = dir.path().join("input.dat");
    write(&file, &random_bytes(9, 300_000));
    // Let the file's ctime age past the racy window, so its recipe is kept.
    sleep(Duration::from_millis(2 * (RACY_WINDOW_NS / 1_000_000) as u64));
    let meta = fs::symlink_metadata(&file).unwrap();

    let cache = RecipeCache::open(&cache_dir, Chunking::ContentDefined).unwrap();
    let (r1, hashed) = cache.recipe(&file, &meta).unwrap();
    assert!(hashed);
    assert_eq!(r1.size, 300_000);
    let (again, hashed) = cache.recipe(&file, &meta).unwrap();
    assert!(!hashed, "unchanged file must not be re-hashed");
    assert_eq!(again, r1);
    assert_eq!(cache.lookup_name(&r1.name()), Some((file.clone(), r1.clone())));
    // Persisted: a new process reuses it.
    let cache2 = RecipeCache::open(&cache_dir, Chunking::ContentDefined).unwrap();
    assert_eq!(cache2.lookup_name(&r1.name()), None, "lookup_name only knows recipes this process served");
    assert_eq!(cache2.recipe(&file, &meta).unwrap(), (r1.clone(), false));

    // Same size, same mtime (set back), different bytes: only ctime tells.
    let mut changed = random_bytes(9, 300_000);
    changed[150_000] ^= 0xff;
    write(&file, &changed);
    fs::File::options().write(true).open(&file).unwrap().set_modified(meta.modified().unwrap()).unwrap();
    let meta2 = fs::symlink_metadata(&file).unwrap();
    assert_eq!((meta2.len(), meta2.mtime(), meta2.mtime_nsec()), (meta.len(), meta.mtime(), meta.mtime_nsec()));
    assert_ne!((meta2.ctime(), meta2.ctime_nsec()), (meta.ctime(), meta.ctime_nsec()));
    let (r2, hashed) = cache2.recipe(&file, &meta2).unwrap();
    assert!(hashed, "modification hidden by resetting mtime must be noticed");
    assert_ne!(r2.content_id(), r1.content_id());
    assert_eq!(r2.mtime_ns, r1.mtime_ns);

    // A corrupt record is a miss, not an error.
    sleep(Duration::from_millis(2 * (RACY_WINDOW_NS / 1_000_000) as u64));
    let (_, hashed) = cache2.recipe(&file, &meta2).unwrap();
    assert!(hashed, "too fresh to have been remembered");
    let (_, hashed) = cache2.recipe(&file, &meta2).unwrap();
    assert!(!hashed);
    let shard = cache_dir.join(format!("{:02x}", meta2.ino() & 0xff));
    for rec in fs::read_dir(&shard).unwrap() {
        let p = rec.unwrap().path();
        let mut bytes = fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&p, bytes).unwrap();
    }
    let cache3 = RecipeCache::open(&cache_dir, Chunking::ContentDefined).unwrap();
    let (r3, hashed) = cache3.recipe(&file, &meta2).unwrap();
    assert!(hashed);
    assert_eq!(r3, r2);
}

#[test]
fn read_chunks_serves_verified_chunks_and_detects_changes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    let data = random_bytes(10, 1 << 20);
    write(&file, &data);
    let meta = fs::metadata(&file).unwrap();
    let recipe = chunker::chunk_file(&file, &meta, Chunking::ContentDefined, |_, _| {}).unwrap();
    assert!(recipe.chunks.len() >= 3);
    let wanted: Vec<Hash> = vec![recipe.chunks[2].hash, recipe.chunks[0].hash];
    let got = read_chunks(&file, &recipe, &wanted).unwrap();
    let ranges = chunker::chunk_bytes(&data);
    assert_eq!(got, vec![(wanted[0], data[ranges[2].1.clone()].to_vec()), (wanted[1], data[ranges[0].1.clone()].to_vec())]);

    let unknown = read_chunks(&file, &recipe, &[Hash::of(b"not in it")]).unwrap_err();
    assert_eq!(unknown.kind(), io::ErrorKind::InvalidInput);

    // Change one byte inside chunk 2.
    let mut changed = data.clone();
    changed[ranges[2].1.start + 10] ^= 1;
    write(&file, &changed);
    assert!(read_chunks(&file, &recipe, &[recipe.chunks[0].hash]).is_ok());
    let err = read_chunks(&file, &recipe, &[recipe.chunks[2].hash]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    assert!(err.to_string().contains(&file.display().to_string()), "error names the file: {err}");
    // Truncated.
    write(&file, &data[..1000]);
    let last = recipe.chunks.last().unwrap().hash;
    assert_eq!(read_chunks(&file, &recipe, &[last]).unwrap_err().kind(), io::ErrorKind::InvalidData);
}

#[test]
fn caches_are_shareable_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<HostCache>();
    shareable::<RecipeCache>();
}

#[test]
fn assemble_fetching_writes_fetched_chunks_straight_into_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = HostCache::open(dir.path(), 64 << 20).unwrap();
    // Repeated content (shared chunks) and one chunk already cached.
    let half = random_bytes(9, 2 << 20);
    let data = [&half[..], &half[..], &random_bytes(10, 1 << 20)[..]].concat();
    let pieces = chunker::chunk_bytes(&data);
    let recipe = Recipe { size: data.len() as u64, mode: 0o100644, uid: 0, gid: 0, mtime_ns: 1, chunks: pieces.iter().map(|(r, _)| *r).collect() };
    let (first, range) = &pieces[0];
    cache.put_chunk(&first.hash, &data[range.clone()]).unwrap();
    let missing = cache.missing(&recipe);
    assert!(!missing.contains(&first.hash));
    let by_hash: std::collections::HashMap<Hash, Vec<u8>> = pieces.iter().map(|(r, g)| (r.hash, data[g.clone()].to_vec())).collect();
    let mut asked = Vec::new();
    let path = cache
        .assemble_fetching(&recipe, &missing, &mut |h| {
            asked.push(*h);
            Ok(by_hash[h].clone())
        })
        .unwrap();
    assert_eq!(asked, missing, "each missing chunk fetched once, in the order listed");
    assert!(fs::read(&path).unwrap() == data, "assembled bytes differ from the original");
    // Only the chunks the file repeats were kept as chunk entries.
    let repeated: std::collections::HashSet<Hash> =
        recipe.chunks.iter().map(|c| c.hash).filter(|h| recipe.chunks.iter().filter(|c| c.hash == *h).count() > 1).collect();
    for h in &missing {
        assert_eq!(chunk_path(dir.path(), h).exists(), repeated.contains(h), "chunk {h}");
    }
    // A fetch that fails leaves no file behind.
    let other = random_bytes(11, 1 << 20);
    let r2 = Recipe { size: other.len() as u64, mode: 0o100644, uid: 0, gid: 0, mtime_ns: 1, chunks: chunker::chunk_bytes(&other).into_iter().map(|(r, _)| r).collect() };
    let m2 = cache.missing(&r2);
    let err = cache.assemble_fetching(&r2, &m2, &mut |_| Err(io::Error::other("gone"))).unwrap_err();
    assert_eq!(err.to_string(), "gone");
    assert_eq!(cache.assemble(&r2).unwrap_err().kind(), io::ErrorKind::NotFound);
}

#[test]
fn chunks_written_into_an_assembled_file_are_served_to_peers_while_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let cache = HostCache::open(dir.path(), 64 << 20).unwrap();
    let data = random_bytes(12, 3 << 20);
    let pieces = chunker::chunk_bytes(&data);
    assert!(pieces.len() > 2, "the test needs several chunks");
    let recipe = Recipe { size: data.len() as u64, mode: 0o100644, uid: 0, gid: 0, mtime_ns: 1, chunks: pieces.iter().map(|(r, _)| *r).collect() };
    let bytes_of = |i: usize| data[pieces[i].1.clone()].to_vec();
    assert!(cache.chunk_for_peer(&pieces[0].0.hash).unwrap().is_none(), "nothing is held before the fetch");
    let missing = cache.missing(&recipe);
    let mut next = 0;
    cache
        .assemble_fetching(&recipe, &missing, &mut |h| {
            // Every chunk fetched before this one is already readable; this one is not yet.
            for (i, (r, _)) in pieces.iter().enumerate().take(next) {
                assert!(cache.chunk_for_peer(&r.hash).unwrap() == Some(bytes_of(i)), "chunk {i} while writing");
            }
            assert!(cache.chunk_for_peer(h).unwrap().is_none());
            next += 1;
            Ok(bytes_of(next - 1))
        })
        .unwrap();
    for (i, (r, _)) in pieces.iter().enumerate() {
        assert!(cache.chunk_for_peer(&r.hash).unwrap() == Some(bytes_of(i)), "chunk {i} after assembly");
    }
}
