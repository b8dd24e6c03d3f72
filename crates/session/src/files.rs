//! Answering a task's file-view faults from this machine's file system.
//!
//! The client is the authority for the task's `/`. A host asks by path
//! (`Lookup`, `ReadDir`) and by content name (`GetRecipe`, `GetChunks`);
//! we answer from `lstat`, the recipe cache (a file is re-hashed only when
//! its identity changed) and the files themselves. Every binding we hand
//! out is remembered so the commit step can tell what the task saw.

use starling_proto::{Attr, ChunkData, ChunkSource, DirEntry, FileReq, FileResp, Hash, Lookup, NodeKind, Recipe, WirePath};
use starling_store::RecipeCache;
use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Directories whose client contents are never exported: the task gets its
/// own `/proc`, `/dev` and `/sys`. They appear as empty mount points.
const MOUNT_POINTS: [&[u8]; 3] = [b"/proc", b"/sys", b"/dev"];
/// starling's own state never appears inside a task.
const HIDDEN: [&[u8]; 2] = [b"/var/lib/starling", b"/run/starling"];

fn under(path: &[u8], dir: &[u8]) -> bool {
    path == dir || (path.starts_with(dir) && path.get(dir.len()) == Some(&b'/'))
}

enum Export {
    Normal,
    EmptyDir,
    Hidden,
}

fn classify(path: &[u8]) -> Export {
    for m in MOUNT_POINTS {
        if path == m {
            return Export::EmptyDir;
        }
        if under(path, m) {
            return Export::Hidden;
        }
    }
    if HIDDEN.iter().any(|h| under(path, h)) {
        return Export::Hidden;
    }
    Export::Normal
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Counters for reports and benchmarks.
#[derive(Default, Debug, Clone, Copy, serde::Serialize)]
pub struct ServeStats {
    /// Every request answered: each is a round trip the task waited for.
    pub requests: u64,
    pub lookups: u64,
    pub readdirs: u64,
    pub recipes: u64,
    pub chunks_sent: u64,
    pub chunk_bytes_sent: u64,
    pub files_hashed: u64,
}

/// One request answered, for the stats line: what kind, about which path
/// (for content requests, the file that holds the content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub kind: AskedKind,
    pub path: Option<WirePath>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AskedKind {
    Lookup,
    Readdir,
    Recipe,
    Chunks,
}

/// Most requests one process remembers (the stats line stays bounded).
pub const MAX_ASKED: usize = 64;

pub struct FileServer {
    recipes: RecipeCache,
    compress: bool,
    /// Recipes handed out by name, and which file holds each chunk.
    by_name: Mutex<HashMap<Hash, (PathBuf, Recipe)>>,
    by_chunk: Mutex<HashMap<Hash, Hash>>,
    stats: Mutex<ServeStats>,
    /// The first [`MAX_ASKED`] requests answered (which paths the prediction missed).
    asked: Mutex<Vec<Asked>>,
    /// Recipe and chunk names handed to the cluster (its relay cache now holds them).
    served: Mutex<Vec<Hash>>,
    /// Where to append the names in `served` as they are served (the
    /// client's shadow index), so concurrent clients learn them at once.
    served_log: Mutex<Option<PathBuf>>,
    /// Recipes this process had to (re)compute: files new or changed since the client last looked.
    fresh: Mutex<std::collections::HashSet<Hash>>,
}

impl FileServer {
    pub fn new(recipes: RecipeCache, compress: bool) -> Self {
        FileServer {
            recipes,
            compress,
            by_name: Mutex::new(HashMap::new()),
            by_chunk: Mutex::new(HashMap::new()),
            stats: Mutex::new(ServeStats::default()),
            asked: Mutex::new(Vec::new()),
            served: Mutex::new(Vec::new()),
            served_log: Mutex::new(None),
            fresh: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Whether this recipe was computed afresh here (its file is new or changed).
    pub fn is_fresh(&self, name: &Hash) -> bool {
        self.fresh.lock().unwrap().contains(name)
    }

    /// A recipe this server has handed out, with the file that holds it.
    pub fn recipe_by_name(&self, name: &Hash) -> Option<(PathBuf, Recipe)> {
        self.by_name.lock().unwrap().get(name).cloned()
    }

    /// From now on, append the name of every recipe and chunk served to the
    /// cluster to `file` (32 bytes each, one write per answer: concurrent
    /// clients appending to one file keep whole records).
    pub fn log_served_to(&self, file: PathBuf) {
        *self.served_log.lock().unwrap() = Some(file);
    }

    fn note_served(&self, names: &[Hash]) {
        if names.is_empty() {
            return;
        }
        self.served.lock().unwrap().extend_from_slice(names);
        let log = self.served_log.lock().unwrap().clone();
        if let Some(file) = log {
            if let Some(d) = file.parent() {
                let _ = std::fs::create_dir_all(d);
            }
            let buf: Vec<u8> = names.iter().flat_map(|h| h.0).collect();
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&file) {
                use std::io::Write;
                let _ = f.write_all(&buf);
            }
        }
    }

    /// Names of the recipes and chunks sent to the cluster since the last call.
    pub fn take_served(&self) -> Vec<Hash> {
        std::mem::take(&mut *self.served.lock().unwrap())
    }

    pub fn stats(&self) -> ServeStats {
        *self.stats.lock().unwrap()
    }

    /// The first [`MAX_ASKED`] requests answered so far.
    pub fn asked(&self) -> Vec<Asked> {
        self.asked.lock().unwrap().clone()
    }

    fn note_asked(&self, req: &FileReq) {
        if self.asked.lock().unwrap().len() >= MAX_ASKED {
            return;
        }
        let path_of = |name: &Hash| self.by_name.lock().unwrap().get(name).and_then(|(p, _)| WirePath::new(p.as_os_str().as_bytes().to_vec()).ok());
        let a = match req {
            FileReq::Lookup { path } => Asked { kind: AskedKind::Lookup, path: Some(path.clone()) },
            FileReq::ReadDir { path } => Asked { kind: AskedKind::Readdir, path: Some(path.clone()) },
            FileReq::GetRecipe { name } => Asked { kind: AskedKind::Recipe, path: path_of(name) },
            FileReq::GetChunks { hashes } | FileReq::FindChunks { hashes } => {
                let file = hashes.first().and_then(|h| self.by_chunk.lock().unwrap().get(h).copied());
                Asked { kind: AskedKind::Chunks, path: file.as_ref().and_then(path_of) }
            }
        };
        self.asked.lock().unwrap().push(a);
    }

    pub fn answer(&self, req: &FileReq) -> FileResp {
        self.stats.lock().unwrap().requests += 1;
        self.note_asked(req);
        match req {
            FileReq::Lookup { path } => {
                self.stats.lock().unwrap().lookups += 1;
                match self.lookup(path) {
                    Ok(l) => FileResp::Lookup(l),
                    Err(e) => FileResp::Errno(errno_of(&e)),
                }
            }
            FileReq::ReadDir { path } => {
                self.stats.lock().unwrap().readdirs += 1;
                FileResp::ReadDir(self.readdir(path))
            }
            FileReq::GetRecipe { name } => {
                self.stats.lock().unwrap().recipes += 1;
                let r = self.by_name.lock().unwrap().get(name).map(|(_, r)| r.clone());
                if r.is_some() {
                    self.note_served(&[*name]);
                }
                FileResp::Recipe(r)
            }
            // A host asking the head for peers reaches the client only
            // when the head keeps no relay cache: the bytes, from here.
            FileReq::GetChunks { hashes } | FileReq::FindChunks { hashes } => match self.chunks(hashes) {
                Ok(c) if matches!(req, FileReq::FindChunks { .. }) => FileResp::ChunkSources(c.into_iter().map(ChunkSource::Data).collect()),
                Ok(c) => FileResp::Chunks(c),
                Err(e) => {
                    log::warn!("serving chunks: {e}");
                    FileResp::Errno(errno_of(&e))
                }
            },
        }
    }

    /// What is at `path` now, as the task will see it.
    pub fn lookup(&self, path: &WirePath) -> std::io::Result<Lookup> {
        match classify(path.as_bytes()) {
            Export::Hidden => return Ok(Lookup::Absent),
            Export::EmptyDir => {
                let meta = std::fs::symlink_metadata(path.as_path())?;
                return Ok(Lookup::Dir(Attr { nlink: 2, ..Attr::of(&meta) }));
            }
            Export::Normal => {}
        }
        // A file may change while we hash it; retry until stat and content agree.
        for _ in 0..5 {
            let meta = match std::fs::symlink_metadata(path.as_path()) {
                Ok(m) => m,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => return Ok(Lookup::Absent),
                Err(e) => return Err(e),
            };
            let attr = Attr::of(&meta);
            let ft = meta.file_type();
            if ft.is_dir() {
                return Ok(Lookup::Dir(attr));
            }
            if ft.is_symlink() {
                let t = std::fs::read_link(path.as_path())?;
                return Ok(Lookup::Symlink(attr, t.as_os_str().as_bytes().to_vec()));
            }
            if ft.is_block_device() || ft.is_char_device() || ft.is_fifo() || ft.is_socket() {
                return Ok(Lookup::Special(attr));
            }
            let (recipe, hashed) = self.recipes.recipe(path.as_path(), &meta)?;
            if hashed {
                self.stats.lock().unwrap().files_hashed += 1;
            }
            let after = std::fs::symlink_metadata(path.as_path())?;
            if Attr::of(&after) != attr {
                continue;
            }
            let name = recipe.name();
            if hashed {
                self.fresh.lock().unwrap().insert(name);
            }
            self.remember(path.as_path(), recipe);
            return Ok(Lookup::File(attr, name));
        }
        Err(std::io::Error::from_raw_os_error(libc::EAGAIN))
    }

    fn remember(&self, path: &Path, recipe: Recipe) {
        let name = recipe.name();
        let mut by_chunk = self.by_chunk.lock().unwrap();
        for c in &recipe.chunks {
            by_chunk.insert(c.hash, name);
        }
        self.by_name.lock().unwrap().insert(name, (path.to_path_buf(), recipe));
    }

    pub fn readdir(&self, path: &WirePath) -> Result<Vec<DirEntry>, i32> {
        match classify(path.as_bytes()) {
            Export::Hidden => return Err(libc::ENOENT),
            Export::EmptyDir => return Ok(Vec::new()),
            Export::Normal => {}
        }
        let rd = std::fs::read_dir(path.as_path()).map_err(|e| errno_of(&e))?;
        let mut out = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| errno_of(&e))?;
            let name = ent.file_name().as_bytes().to_vec();
            let child = match path.join(&name) {
                Ok(c) => c,
                Err(_) => continue,
            };
            if matches!(classify(child.as_bytes()), Export::Hidden) {
                continue;
            }
            let kind = match ent.file_type() {
                Ok(t) if t.is_dir() => NodeKind::Dir,
                Ok(t) if t.is_file() => NodeKind::File,
                Ok(t) if t.is_symlink() => NodeKind::Symlink,
                _ => NodeKind::Special,
            };
            out.push(DirEntry { name, kind });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn chunks(&self, hashes: &[Hash]) -> std::io::Result<Vec<ChunkData>> {
        // Group the wanted chunks by the file that holds them.
        let mut per_file: HashMap<Hash, Vec<Hash>> = HashMap::new();
        {
            let by_chunk = self.by_chunk.lock().unwrap();
            for h in hashes {
                match by_chunk.get(h) {
                    Some(name) => per_file.entry(*name).or_default().push(*h),
                    None => {
                        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, format!("chunk {h:?} was never offered")))
                    }
                }
            }
        }
        let mut found: HashMap<Hash, ChunkData> = HashMap::new();
        for (name, wanted) in per_file {
            let (path, recipe) = self.by_name.lock().unwrap().get(&name).cloned().expect("indexed recipe");
            // read_chunks verified each chunk against its name: seal without hashing again.
            for (h, bytes) in starling_store::read_chunks(&path, &recipe, &wanted)? {
                found.insert(h, ChunkData::seal_named(h, bytes, self.compress));
            }
        }
        // Each chunk is moved into the answer once; a hash asked for twice gets a copy.
        let mut out: Vec<ChunkData> = Vec::with_capacity(hashes.len());
        for h in hashes {
            match found.remove(h) {
                Some(c) => out.push(c),
                None => {
                    if let Some(c) = out.iter().find(|c| c.hash == *h).cloned() {
                        out.push(c);
                    }
                }
            }
        }
        self.note_served(&out.iter().map(|c| c.hash).collect::<Vec<_>>());
        let mut st = self.stats.lock().unwrap();
        st.chunks_sent += out.len() as u64;
        st.chunk_bytes_sent += out.iter().map(|c| c.data.len() as u64).sum::<u64>();
        Ok(out)
    }
}
