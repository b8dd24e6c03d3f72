//! A [`Source`] backed by a local directory: for tests and local runs.

use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use starling_proto::{Attr, DirEntry, Hash, Lookup, NodeKind, WirePath};

use crate::Source;

/// Mirrors a local directory as if it were a client's `/`.
///
/// `lookup` of a regular file reads it, names it by the BLAKE3 hash of its
/// bytes (a stand-in for a real recipe name) and stores a copy in the cache
/// directory under that name, so `materialize` returns exactly the bytes the
/// binding describes even if the directory changes afterwards — the same
/// guarantee a content-addressed host cache gives.
///
/// *Grafts* map a path prefix to another host directory, e.g. `/usr` → the
/// host's `/usr`, so a test can run real programs inside a small tree.
pub struct DirSource {
    root: PathBuf,
    cache: PathBuf,
    grafts: Vec<(WirePath, PathBuf)>,
    lookups: AtomicU64,
    tmp_seq: AtomicU64,
}

impl DirSource {
    /// Mirror `root`; copies of looked-up files go to `cache` (created if missing).
    pub fn new(root: impl Into<PathBuf>, cache: impl Into<PathBuf>) -> io::Result<DirSource> {
        let cache = cache.into();
        fs::create_dir_all(&cache)?;
        Ok(DirSource {
            root: root.into(),
            cache,
            grafts: Vec::new(),
            lookups: AtomicU64::new(0),
            tmp_seq: AtomicU64::new(0),
        })
    }

    /// Serve `prefix` and everything below it from `host_dir` instead of the root.
    pub fn graft(mut self, prefix: WirePath, host_dir: impl Into<PathBuf>) -> DirSource {
        self.grafts.push((prefix, host_dir.into()));
        self
    }

    /// How many times `lookup` was called.
    pub fn lookup_count(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }

    /// The host path that backs `path`.
    pub fn host_path(&self, path: &WirePath) -> PathBuf {
        let p = path.as_bytes();
        for (prefix, host) in &self.grafts {
            let pre = prefix.as_bytes();
            if p == pre {
                return host.clone();
            }
            if p.starts_with(pre) && p.get(pre.len()) == Some(&b'/') {
                return host.join(std::ffi::OsStr::from_bytes(&p[pre.len() + 1..]));
            }
        }
        self.root.join(std::ffi::OsStr::from_bytes(&p[1..]))
    }

    fn cache_path(&self, name: &Hash) -> PathBuf {
        self.cache.join(name.to_hex())
    }

    /// Copy `bytes` into the cache under `name` unless already there.
    fn store(&self, name: &Hash, bytes: &[u8]) -> io::Result<()> {
        let dest = self.cache_path(name);
        if dest.exists() {
            return Ok(());
        }
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self.cache.join(format!(".tmp-{}-{seq}", std::process::id()));
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        drop(f);
        // Rename makes the entry appear complete or not at all.
        fs::rename(&tmp, &dest)
    }
}

impl Source for DirSource {
    fn lookup(&self, path: &WirePath) -> io::Result<Lookup> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let host = self.host_path(path);
        let meta = match fs::symlink_metadata(&host) {
            Ok(m) => m,
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound) || e.raw_os_error() == Some(libc::ENOTDIR) => {
                return Ok(Lookup::Absent)
            }
            Err(e) => return Err(e),
        };
        let mut attr = Attr::of(&meta);
        Ok(match attr.kind {
            NodeKind::Dir => Lookup::Dir(attr),
            NodeKind::Symlink => Lookup::Symlink(attr, fs::read_link(&host)?.into_os_string().into_encoded_bytes()),
            NodeKind::Special => Lookup::Special(attr),
            NodeKind::File => {
                let bytes = fs::read(&host)?;
                // The size in the binding is that of the bytes captured.
                attr.size = bytes.len() as u64;
                let name = Hash::of(&bytes);
                self.store(&name, &bytes)?;
                Lookup::File(attr, name)
            }
        })
    }

    fn readdir(&self, path: &WirePath) -> Result<Vec<DirEntry>, i32> {
        let errno = |e: io::Error| e.raw_os_error().unwrap_or(libc::EIO);
        let mut out = Vec::new();
        for entry in fs::read_dir(self.host_path(path)).map_err(errno)? {
            let entry = entry.map_err(errno)?;
            let kind = NodeKind::of(entry.file_type().map_err(errno)?);
            out.push(DirEntry { name: entry.file_name().as_bytes().to_vec(), kind });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn materialize(&self, _path: &WirePath, recipe: &Hash) -> io::Result<fs::File> {
        fs::File::open(self.cache_path(recipe))
    }
}

impl std::fmt::Debug for DirSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirSource").field("root", &self.root).field("cache", &self.cache).finish()
    }
}
