//! The host cache: chunks, recipes and assembled files on local disk, bounded
//! in size with least-recently-used eviction.
//!
//! Layout under the cache directory (`ab` = first two hex digits of the name):
//!
//! ```text
//! chunks/ab/<hash>       chunk bytes, named by their BLAKE3 hash
//! recipes/ab/<name>      bincode-encoded recipes, named by RecipeName
//! files/ab/<content_id>  whole files assembled from chunks (FUSE passthrough backing files)
//! tmp/                   files being written; renamed into place when complete
//! ```
//!
//! Everything is written to `tmp/` and renamed into place, so a reader (in
//! this or another process) never sees a partial entry, and nothing being
//! written can be evicted: only renamed entries are in the index.
//!
//! The in-memory index knows every entry's size and recency. Recency survives
//! restarts through file mtimes, which are touched whenever an entry is
//! actually read (`get_chunk`, `get_recipe`, `assemble`); on `open` the index
//! is rebuilt from a directory scan ordered by mtime. Two processes sharing a
//! directory each enforce the bound over the entries they know of; an entry
//! the other process evicted is noticed when opening it fails, and dropped.

use starling_proto::{Hash, Recipe};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

/// Temporary files older than this at `open` were left by a crashed writer.
const STALE_TMP: Duration = Duration::from_secs(3600);
/// Refuse to read a recipe file larger than this (a 1 TiB file at 64 KiB
/// chunks has a ~600 MiB recipe; anything near this bound is corrupt).
const MAX_RECIPE_FILE: u64 = 256 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Kind {
    Chunk,
    Recipe,
    File,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Chunk, Kind::Recipe, Kind::File];
    fn dir(self) -> &'static str {
        match self {
            Kind::Chunk => "chunks",
            Kind::Recipe => "recipes",
            Kind::File => "files",
        }
    }
    fn slot(self) -> usize {
        self as usize
    }
}

type Key = (Kind, Hash);

/// Counters describing a [`HostCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes of all entries (chunks, recipes, assembled files) this process knows of.
    pub bytes: u64,
    pub chunks: u64,
    pub recipes: u64,
    pub files: u64,
    /// Lookups answered from the cache (`has_chunk`, `missing`, `get_chunk`,
    /// `get_recipe`, and `assemble` when the file already existed).
    pub hits: u64,
    /// Lookups that were not.
    pub misses: u64,
    pub evictions: u64,
}

struct Entry {
    size: u64,
    /// Position in `Index::lru`; larger = used more recently.
    tick: u64,
}

#[derive(Default)]
struct Index {
    entries: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    next_tick: u64,
    /// Entries in use by an `assemble` in progress: never evicted.
    pins: HashMap<Key, u32>,
    bytes: u64,
    counts: [u64; 3],
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Index {
    /// Record `key` (of `size` bytes) as the most recently used entry.
    fn use_entry(&mut self, key: Key, size: u64) {
        let tick = self.next_tick;
        self.next_tick += 1;
        match self.entries.get_mut(&key) {
            Some(e) => {
                self.lru.remove(&e.tick);
                self.bytes = self.bytes - e.size + size;
                e.size = size;
                e.tick = tick;
            }
            None => {
                self.entries.insert(key, Entry { size, tick });
                self.bytes += size;
                self.counts[key.0.slot()] += 1;
            }
        }
        self.lru.insert(tick, key);
    }

    /// Touch `key` if known; false if not.
    fn touch(&mut self, key: Key) -> bool {
        match self.entries.get(&key) {
            Some(e) => {
                let size = e.size;
                self.use_entry(key, size);
                true
            }
            None => false,
        }
    }

    fn forget(&mut self, key: Key) {
        if let Some(e) = self.entries.remove(&key) {
            self.lru.remove(&e.tick);
            self.bytes -= e.size;
            self.counts[key.0.slot()] -= 1;
        }
    }

    fn count(&mut self, hit: bool) {
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }
}

/// A host's on-disk cache of chunks, recipes and assembled files, shared by
/// every task on the host. Thread-safe; several processes may share one
/// directory.
pub struct HostCache {
    root: PathBuf,
    max_bytes: u64,
    index: Mutex<Index>,
    /// Files being assembled by [`HostCache::assemble_fetching`], by content
    /// id: a second task opening the same new file waits for the first
    /// rather than fetching it again.
    assembling: Mutex<HashMap<Hash, std::sync::Arc<Mutex<()>>>>,
    /// Where chunks written only into assembled files are (for peers).
    located: Mutex<crate::located::Located>,
}

impl HostCache {
    /// Open (creating if needed) the cache at `dir`, bounded to `max_bytes`.
    /// Rebuilds the index from disk, oldest-used first, and evicts down to
    /// the bound.
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<HostCache> {
        for sub in Kind::ALL.iter().map(|k| k.dir()).chain(["tmp"]) {
            fs::create_dir_all(dir.join(sub))?;
        }
        remove_stale_tmp(&dir.join("tmp"));
        let mut found: Vec<(SystemTime, Key, u64)> = Vec::new();
        for kind in Kind::ALL {
            for shard in fs::read_dir(dir.join(kind.dir()))? {
                let shard = shard?;
                if !shard.file_type()?.is_dir() {
                    continue;
                }
                for f in fs::read_dir(shard.path())? {
                    let f = f?;
                    let Some(hash) = f.file_name().to_str().and_then(Hash::from_hex) else { continue };
                    if shard.file_name().to_str() != Some(&hash.to_hex()[..2]) {
                        continue;
                    }
                    // Racing with another process's eviction is fine: skip.
                    let Ok(meta) = f.metadata() else { continue };
                    if meta.is_file() {
                        found.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), (kind, hash), meta.len()));
                    }
                }
            }
        }
        found.sort_by_key(|(mtime, ..)| *mtime);
        let mut index = Index::default();
        for (_, key, size) in found {
            index.use_entry(key, size);
        }
        let cache = HostCache { root: dir.to_path_buf(), max_bytes, index: Mutex::new(index), assembling: Mutex::default(), located: Mutex::default() };
        cache.evict(&mut cache.lock(), None);
        Ok(cache)
    }

    /// Is chunk `h` cached? (Counts as a use for eviction order.)
    pub fn has_chunk(&self, h: &Hash) -> bool {
        let key = (Kind::Chunk, *h);
        let mut index = self.lock();
        let found = index.touch(key) || {
            // Another process sharing the directory may have stored it.
            // (Checked under the lock so our own eviction cannot interleave.)
            match fs::metadata(self.path(key)) {
                Ok(m) if m.is_file() => {
                    index.use_entry(key, m.len());
                    true
                }
                _ => false,
            }
        };
        index.count(found);
        found
    }

    /// Store chunk bytes the caller has already verified against `h`.
    pub fn put_chunk(&self, h: &Hash, bytes: &[u8]) -> io::Result<()> {
        debug_assert_eq!(Hash::of(bytes), *h, "put_chunk given bytes that do not match their name");
        let key = (Kind::Chunk, *h);
        if self.lock().touch(key) {
            return Ok(());
        }
        self.store(key, |f| f.write_all(bytes))
    }

    /// The bytes of chunk `h`, verified against `h`. A corrupt entry is
    /// deleted and reported as absent.
    pub fn get_chunk(&self, h: &Hash) -> io::Result<Option<Vec<u8>>> {
        let key = (Kind::Chunk, *h);
        let bytes = match self.read_entry(key, u64::from(starling_proto::MAX_CHUNK))? {
            Some(b) => b,
            None => return Ok(None),
        };
        if Hash::of(&bytes) != *h {
            log::warn!("host cache: chunk {h} is corrupt on disk; dropping it");
            self.drop_entry(key);
            return Ok(None);
        }
        self.note_read(key, bytes.len() as u64);
        Ok(Some(bytes))
    }

    /// The bytes of chunk `h` as stored, without re-hashing them: for
    /// serving to a peer that verifies them on receipt anyway (the relay
    /// cache answering hosts), where hashing here would be a second hash of
    /// the same bytes on the same hop. An oversized entry is dropped.
    pub fn get_chunk_unverified(&self, h: &Hash) -> io::Result<Option<Vec<u8>>> {
        let key = (Kind::Chunk, *h);
        let Some(bytes) = self.read_entry(key, u64::from(starling_proto::MAX_CHUNK))? else { return Ok(None) };
        self.note_read(key, bytes.len() as u64);
        Ok(Some(bytes))
    }

    /// The bytes of chunk `h` for another host, which verifies them: from
    /// the chunk store, or from where it was written into an assembled file
    /// (complete or still being written). `None` if this host has no copy.
    pub fn chunk_for_peer(&self, h: &Hash) -> io::Result<Option<Vec<u8>>> {
        if self.lock().touch((Kind::Chunk, *h)) {
            if let Some(bytes) = self.get_chunk_unverified(h)? {
                return Ok(Some(bytes));
            }
        }
        let found = self.located.lock().unwrap_or_else(|e| e.into_inner()).find(h);
        match found {
            Some((file, offset, len)) => crate::located::read_at(&file, offset, len).map(Some),
            None => Ok(None),
        }
    }

    /// Store a recipe; returns its name.
    pub fn put_recipe(&self, r: &Recipe) -> io::Result<Hash> {
        let encoded = bincode::serialize(r).map_err(io::Error::other)?;
        // Recipe::name is the hash of exactly this encoding.
        let name = Hash::of(&encoded);
        let key = (Kind::Recipe, name);
        if !self.lock().touch(key) {
            self.store(key, |f| f.write_all(&encoded))?;
        }
        Ok(name)
    }

    /// The recipe named `name`, verified (its name matches and it is
    /// self-consistent). A corrupt entry is deleted and reported as absent.
    pub fn get_recipe(&self, name: &Hash) -> io::Result<Option<Recipe>> {
        let key = (Kind::Recipe, *name);
        let bytes = match self.read_entry(key, MAX_RECIPE_FILE)? {
            Some(b) => b,
            None => return Ok(None),
        };
        let recipe = bincode::deserialize::<Recipe>(&bytes)
            .ok()
            .filter(|r| Hash::of(&bytes) == *name && r.name() == *name && r.validate().is_ok());
        match recipe {
            Some(r) => {
                self.note_read(key, bytes.len() as u64);
                Ok(Some(r))
            }
            None => {
                log::warn!("host cache: recipe {name} is corrupt on disk; dropping it");
                self.drop_entry(key);
                Ok(None)
            }
        }
    }

    /// Chunks of `r` not in the cache, each once, in order of first use.
    /// Re-check on disk that `r`'s chunks are really there (someone may have
    /// removed cache files behind the index's back) and forget those that are
    /// not, so [`HostCache::missing`] reports them.
    pub fn recheck(&self, r: &Recipe) {
        let gone: Vec<Key> = r
            .chunks
            .iter()
            .map(|c| (Kind::Chunk, c.hash))
            .filter(|k| fs::metadata(self.path(*k)).is_err())
            .collect();
        if !gone.is_empty() {
            let mut index = self.lock();
            for k in gone {
                index.forget(k);
            }
        }
    }

    pub fn missing(&self, r: &Recipe) -> Vec<Hash> {
        let mut seen = HashSet::new();
        r.chunks.iter().map(|c| c.hash).filter(|h| seen.insert(*h) && !self.has_chunk(h)).collect()
    }

    /// A local file holding exactly `r`'s bytes, assembled from cached
    /// chunks and shared by all recipes with the same content. Fails with
    /// `NotFound` if chunks are missing. The file is read-only. It may be
    /// evicted (unlinked) later, which does not disturb anyone who has it
    /// open; open it promptly, and if that fails with `NotFound` (evicted in
    /// between by heavy churn), call `assemble` again.
    pub fn assemble(&self, r: &Recipe) -> io::Result<PathBuf> {
        r.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let key = (Kind::File, r.content_id());
        let path = self.path(key);
        {
            let mut index = self.lock();
            match fs::metadata(&path) {
                Ok(m) if m.is_file() && m.len() == r.size => {
                    let _ = touch_mtime(&path);
                    index.count(true);
                    index.use_entry(key, m.len());
                    return Ok(path);
                }
                Ok(_) => {
                    // Wrong size: damaged.
                    let _ = fs::remove_file(&path);
                    index.forget(key);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => index.forget(key),
                Err(e) => return Err(e),
            }
            index.count(false);
        }
        // Keep the chunks from being evicted (by our own writes, say) while we copy them.
        let _pin = Pin::new(self, r.chunks.iter().map(|c| (Kind::Chunk, c.hash)).collect());
        let missing = self.missing(r);
        if !missing.is_empty() {
            return Err(not_found_chunks(&missing));
        }
        self.store(key, |f| {
            let mut out = io::BufWriter::with_capacity(1 << 20, &mut *f);
            for c in &r.chunks {
                let bytes = self.get_chunk(&c.hash)?.ok_or_else(|| not_found_chunks(&[c.hash]))?;
                if bytes.len() != c.len as usize {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("recipe says chunk {} is {} bytes but it is {}", c.hash, c.len, bytes.len()),
                    ));
                }
                out.write_all(&bytes)?;
            }
            out.flush()?;
            drop(out);
            // Tasks read this file directly (passthrough): keep it immutable,
            // and durable before it gets its final name, because assembled
            // files are not re-verified when reused.
            f.set_permissions(fs::Permissions::from_mode(0o444))?;
            f.sync_all()
        })?;
        Ok(path)
    }

    /// Like [`HostCache::assemble`], but the chunks not in the cache come
    /// from `fetch`, written straight into the file as they arrive (one
    /// copy on this hop: no chunk entries are written for them, except for
    /// a chunk the file uses more than once). `fetch` is called once per
    /// chunk of `missing` — the chunks of `r` this cache lacked, each once,
    /// in order of first use, as [`HostCache::missing`] lists them — in that
    /// order, and must return bytes it has verified against the name.
    /// Fails with `NotFound` if a chunk that was cached vanished meanwhile
    /// (call again: it is then among the missing). Callers assembling the
    /// same content at once take turns: the later ones find the file made
    /// and fetch nothing.
    pub fn assemble_fetching(
        &self,
        r: &Recipe,
        missing: &[Hash],
        fetch: &mut dyn FnMut(&Hash) -> io::Result<Vec<u8>>,
    ) -> io::Result<PathBuf> {
        r.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let key = (Kind::File, r.content_id());
        let path = self.path(key);
        let slot = self.assembling.lock().unwrap_or_else(|e| e.into_inner()).entry(key.1).or_default().clone();
        let result = {
            let _one_at_a_time = slot.lock().unwrap_or_else(|e| e.into_inner());
            match fs::metadata(&path) {
                // Assembled meanwhile (by another task): nothing to fetch.
                Ok(m) if m.is_file() && m.len() == r.size => self.assemble(r),
                _ => self.assemble_fetching_now(r, key, missing, fetch),
            }
        };
        let mut assembling = self.assembling.lock().unwrap_or_else(|e| e.into_inner());
        if std::sync::Arc::strong_count(&slot) == 2 {
            assembling.remove(&key.1);
        }
        result
    }

    fn assemble_fetching_now(
        &self,
        r: &Recipe,
        key: Key,
        missing: &[Hash],
        fetch: &mut dyn FnMut(&Hash) -> io::Result<Vec<u8>>,
    ) -> io::Result<PathBuf> {
        let path = self.path(key);
        let _pin = Pin::new(self, r.chunks.iter().map(|c| (Kind::Chunk, c.hash)).collect());
        let missing: HashSet<&Hash> = missing.iter().collect();
        let mut uses: HashMap<Hash, u32> = HashMap::new();
        for c in &r.chunks {
            *uses.entry(c.hash).or_insert(0) += 1;
        }
        let mut fetched: HashSet<Hash> = HashSet::new();
        self.store(key, |f| {
            // Each chunk written is remembered for peers as soon as it is in the file.
            let file = std::sync::Arc::new(f.try_clone()?);
            self.located.lock().unwrap_or_else(|e| e.into_inner()).add_file(file.clone());
            let mut offset = 0u64;
            for c in &r.chunks {
                let bytes = if missing.contains(&c.hash) && fetched.insert(c.hash) {
                    let bytes = fetch(&c.hash)?;
                    if uses[&c.hash] > 1 {
                        // Used again later in this file: keep it where the second use finds it.
                        self.put_chunk(&c.hash, &bytes)?;
                    }
                    bytes
                } else {
                    self.get_chunk(&c.hash)?.ok_or_else(|| not_found_chunks(&[c.hash]))?
                };
                if bytes.len() != c.len as usize {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("recipe says chunk {} is {} bytes but it is {}", c.hash, c.len, bytes.len()),
                    ));
                }
                f.write_all(&bytes)?;
                self.located.lock().unwrap_or_else(|e| e.into_inner()).add_chunk(c.hash, &file, offset, c.len);
                offset += u64::from(c.len);
            }
            f.set_permissions(fs::Permissions::from_mode(0o444))?;
            f.sync_all()
        })?;
        Ok(path)
    }

    /// Current counters.
    pub fn stats(&self) -> CacheStats {
        let index = self.lock();
        CacheStats {
            bytes: index.bytes,
            chunks: index.counts[Kind::Chunk.slot()],
            recipes: index.counts[Kind::Recipe.slot()],
            files: index.counts[Kind::File.slot()],
            hits: index.hits,
            misses: index.misses,
            evictions: index.evictions,
        }
    }

    /// The configured size bound.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // The index stays consistent even if a holder panicked mid-way
        // (every mutation is a few infallible steps), so poison is ignored.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, (kind, h): Key) -> PathBuf {
        let hex = h.to_hex();
        self.root.join(kind.dir()).join(&hex[..2]).join(hex)
    }

    /// Write a new entry through a temporary file, then (under the lock, so
    /// eviction cannot interleave) rename it into place, index it and evict
    /// down to the bound.
    fn store(&self, key: Key, write: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
        let mut tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))?;
        write(tmp.as_file_mut())?;
        let size = tmp.as_file().metadata()?.len();
        let dest = self.path(key);
        let mut index = self.lock();
        let tmp = match tmp.persist(&dest) {
            Ok(_) => None,
            Err(e) if e.error.kind() == io::ErrorKind::NotFound => Some(e.file),
            Err(e) => return Err(e.error),
        };
        if let Some(tmp) = tmp {
            // First entry in this shard.
            fs::create_dir_all(dest.parent().expect("entry paths have a shard directory"))?;
            tmp.persist(&dest).map_err(|e| e.error)?;
        }
        index.use_entry(key, size);
        self.evict(&mut index, Some(key));
        Ok(())
    }

    /// Read an entry's file (at most `limit` bytes; larger is corrupt).
    /// A vanished file (evicted by another process) is forgotten: `None`.
    fn read_entry(&self, key: Key, limit: u64) -> io::Result<Option<Vec<u8>>> {
        let file = match File::open(self.path(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let mut index = self.lock();
                index.forget(key);
                index.count(false);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let mut bytes = Vec::new();
        file.take(limit + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > limit {
            log::warn!("host cache: {:?} {} is oversized; dropping it", key.0, key.1);
            self.drop_entry(key);
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    /// A verified read of `key`: count a hit, and refresh its recency both
    /// in memory and on disk (so it survives a restart).
    fn note_read(&self, key: Key, size: u64) {
        let mut index = self.lock();
        index.count(true);
        // Under the lock: if a concurrent eviction unlinked the file after
        // we read it, the touch fails and the entry is not resurrected.
        // (Other failures, e.g. a read-only file system, only cost recency.)
        match touch_mtime(&self.path(key)) {
            Err(nix::errno::Errno::ENOENT) => index.forget(key),
            _ => index.use_entry(key, size),
        }
    }

    /// Delete a damaged entry and count the lookup as a miss.
    fn drop_entry(&self, key: Key) {
        let mut index = self.lock();
        let _ = fs::remove_file(self.path(key));
        index.forget(key);
        index.count(false);
    }

    /// Evict least recently used entries until within the bound, skipping
    /// pinned entries and `keep` (the entry just stored: an entry larger
    /// than the whole bound stays until something newer displaces it).
    fn evict(&self, index: &mut Index, keep: Option<Key>) {
        while index.bytes > self.max_bytes {
            let victim = index
                .lru
                .values()
                .find(|k| Some(**k) != keep && !index.pins.contains_key(*k))
                .copied();
            let Some(victim) = victim else { break };
            if let Err(e) = fs::remove_file(self.path(victim)) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!("host cache: cannot evict {:?} {}: {e}", victim.0, victim.1);
                }
            }
            index.forget(victim);
            index.evictions += 1;
        }
    }
}

/// Entries protected from eviction for the guard's lifetime.
struct Pin<'a> {
    cache: &'a HostCache,
    keys: Vec<Key>,
}

impl<'a> Pin<'a> {
    fn new(cache: &'a HostCache, keys: Vec<Key>) -> Self {
        let mut index = cache.lock();
        for k in &keys {
            *index.pins.entry(*k).or_insert(0) += 1;
        }
        drop(index);
        Pin { cache, keys }
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut index = self.cache.lock();
        for k in &self.keys {
            if let Some(n) = index.pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    index.pins.remove(k);
                }
            }
        }
        // Pinned entries may have kept the cache over its bound.
        self.cache.evict(&mut index, None);
    }
}

fn not_found_chunks(missing: &[Hash]) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} chunk(s) not in the host cache, first {}", missing.len(), missing[0]),
    )
}

/// Mark a cache entry as just used (mtime = now), for recency across
/// restarts. Fails with ENOENT if the entry no longer exists.
fn touch_mtime(path: &Path) -> nix::Result<()> {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    utimensat(None, path, &TimeSpec::UTIME_OMIT, &TimeSpec::UTIME_NOW, UtimensatFlags::NoFollowSymlink)
}

/// Remove temporary files abandoned by crashed writers. Recent ones may
/// belong to another live process and are left alone.
pub(crate) fn remove_stale_tmp(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let now = SystemTime::now();
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
            .is_some_and(|t| now.duration_since(t).is_ok_and(|age| age > STALE_TMP));
        if stale {
            let _ = fs::remove_file(e.path());
        }
    }
}
