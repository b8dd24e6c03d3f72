//! The client's stat cache of recipes: hash a file again only when its
//! identity `(dev, inode, size, mtime_ns, ctime_ns)` changed.
//!
//! mtime alone (what UCop used) misses a modification followed by setting
//! the mtime back (`touch -r`, `tar`, `rsync -t`); ctime cannot be set by
//! user space, and chmod/chown change it too, so the recipe's metadata stays
//! right as well.
//!
//! A file modified within one timestamp tick of being hashed could keep an
//! identical identity (git's "racily clean" problem), so a recipe is only
//! remembered if the file's ctime was at least [`RACY_WINDOW_NS`] older than
//! the start of hashing.
//!
//! On disk: one small file per `(dev, inode)` holding a checksum, the
//! identity and the recipe. Writers use temp + rename, so concurrent
//! processes never see torn files; a file that fails its checksum or does
//! not decode is a miss.

use crate::chunker::{self, ctime_ns, mtime_ns, Chunking};
use serde::{Deserialize, Serialize};
use starling_proto::{Hash, Recipe};
use std::collections::HashMap;
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

/// A file whose ctime is this close to the moment it was hashed is hashed
/// again next time (timestamps are only as fine as the kernel's clock tick).
pub const RACY_WINDOW_NS: i64 = 100_000_000;
/// How often a file may change under us while hashing before we give up.
const HASH_ATTEMPTS: usize = 3;
/// Record files start with this (format version included).
const MAGIC: &[u8; 8] = b"STRRCP01";
/// Larger record files are corrupt (see host cache's recipe bound).
const MAX_RECORD: u64 = 256 << 20;

/// What must be unchanged for a cached recipe to still describe a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
}

impl Identity {
    fn of(meta: &Metadata) -> Identity {
        Identity { dev: meta.dev(), ino: meta.ino(), size: meta.len(), mtime_ns: mtime_ns(meta), ctime_ns: ctime_ns(meta) }
    }
}

#[derive(Clone, Serialize, Deserialize)]
struct Record {
    identity: Identity,
    recipe: Recipe,
}

#[derive(Default)]
struct Memory {
    by_file: HashMap<(u64, u64), Record>,
    by_name: HashMap<Hash, (PathBuf, Recipe)>,
}

/// The client's recipe cache, persisted under a directory shared by
/// concurrent processes (e.g. `~/.cache/starling/recipes`). Thread-safe.
pub struct RecipeCache {
    dir: PathBuf,
    memory: Mutex<Memory>,
    /// How files are cut (a cache holds recipes of one kind only).
    chunking: Chunking,
}

impl RecipeCache {
    pub fn open(dir: &Path, chunking: Chunking) -> io::Result<RecipeCache> {
        fs::create_dir_all(dir)?;
        crate::host_cache::remove_stale_tmp(&dir.join("tmp"));
        fs::create_dir_all(dir.join("tmp"))?;
        Ok(RecipeCache { dir: dir.to_path_buf(), memory: Mutex::new(Memory::default()), chunking })
    }

    /// The recipe of the regular file at `path`, whose metadata `meta` the
    /// caller got from `lstat`. The bool says whether the file was hashed.
    /// The recipe is remembered for [`RecipeCache::lookup_name`].
    pub fn recipe(&self, path: &Path, meta: &Metadata) -> io::Result<(Recipe, bool)> {
        if !meta.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: not a regular file", path.display())));
        }
        let identity = Identity::of(meta);
        let cached = self.cached(identity);
        if let Some(recipe) = cached {
            self.remember_name(path, &recipe);
            return Ok((recipe, false));
        }
        let recipe = self.hash(path)?;
        self.remember_name(path, &recipe);
        Ok((recipe, true))
    }

    /// A recipe this process handed out, by name, with a path holding it.
    pub fn lookup_name(&self, name: &Hash) -> Option<(PathBuf, Recipe)> {
        self.lock().by_name.get(name).cloned()
    }

    fn lock(&self) -> MutexGuard<'_, Memory> {
        // Plain maps, consistent after any panic: ignore poison.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remember_name(&self, path: &Path, recipe: &Recipe) {
        self.lock().by_name.insert(recipe.name(), (path.to_path_buf(), recipe.clone()));
    }

    /// A remembered recipe for exactly this identity (memory, then disk).
    fn cached(&self, identity: Identity) -> Option<Recipe> {
        let key = (identity.dev, identity.ino);
        if let Some(r) = self.lock().by_file.get(&key) {
            if r.identity == identity {
                return Some(r.recipe.clone());
            }
        }
        let record = self.read_record(key)?;
        if record.identity != identity {
            return None;
        }
        let recipe = record.recipe.clone();
        self.lock().by_file.insert(key, record);
        Some(recipe)
    }

    /// Hash the file, retrying if it changes while being read; remember
    /// the result unless it is too fresh to trust (see [`RACY_WINDOW_NS`]).
    fn hash(&self, path: &Path) -> io::Result<Recipe> {
        for _ in 0..HASH_ATTEMPTS {
            // The recipe must describe what we read, so identity and
            // metadata come from the open file, not the caller's lstat.
            let file = File::options().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
            let before = file.metadata()?;
            if !before.is_file() {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: not a regular file", path.display())));
            }
            let started_ns = now_ns();
            let recipe = chunker::chunk_reader(&file, &before, self.chunking, |_, _| {})?;
            let identity = Identity::of(&before);
            if Identity::of(&file.metadata()?) != identity || recipe.size != identity.size {
                continue; // changed while we read it
            }
            if started_ns.saturating_sub(identity.ctime_ns) >= RACY_WINDOW_NS {
                let record = Record { identity, recipe: recipe.clone() };
                if let Err(e) = self.write_record(&record) {
                    log::warn!("recipe cache: cannot persist the recipe of {}: {e}", path.display());
                }
                self.lock().by_file.insert((identity.dev, identity.ino), record);
            }
            return Ok(recipe);
        }
        Err(io::Error::other(format!("{}: changed {HASH_ATTEMPTS} times while being hashed", path.display())))
    }

    fn record_path(&self, (dev, ino): (u64, u64)) -> PathBuf {
        self.dir.join(format!("{:02x}", ino & 0xff)).join(format!("{dev:x}-{ino:x}"))
    }

    /// The record for (dev, ino), or None if absent or damaged.
    fn read_record(&self, key: (u64, u64)) -> Option<Record> {
        let mut bytes = Vec::new();
        File::open(self.record_path(key)).ok()?.take(MAX_RECORD).read_to_end(&mut bytes).ok()?;
        let body = bytes.strip_prefix(MAGIC)?;
        let (sum, body) = body.split_at_checked(32)?;
        if Hash::of(body).0 != sum {
            return None;
        }
        let record: Record = bincode::deserialize(body).ok()?;
        let ok = (record.identity.dev, record.identity.ino) == key
            && record.recipe.validate().is_ok()
            && record.recipe.size == record.identity.size;
        ok.then_some(record)
    }

    fn write_record(&self, record: &Record) -> io::Result<()> {
        let body = bincode::serialize(record).map_err(io::Error::other)?;
        let dest = self.record_path((record.identity.dev, record.identity.ino));
        fs::create_dir_all(dest.parent().expect("record paths have a shard directory"))?;
        let mut tmp = tempfile::NamedTempFile::new_in(self.dir.join("tmp"))?;
        tmp.write_all(MAGIC)?;
        tmp.write_all(&Hash::of(&body).0)?;
        tmp.write_all(&body)?;
        tmp.persist(&dest).map_err(|e| e.error)?;
        Ok(())
    }
}

fn now_ns() -> i64 {
    match SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}
