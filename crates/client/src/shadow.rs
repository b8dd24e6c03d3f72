//! The client's shadow of the cluster's caches (UCop's proposed "shadow
//! index"), so a launch can carry what the head lacks without being asked.
//!
//! - [`Shadow`]: recipe and chunk names the head's relay cache is known to
//!   hold (because we sent them). Append-only file per cluster; a wrong
//!   entry (the head evicted it) only costs a later fetch, never correctness.
//! - [`JobBindings`]: for `exec --job NAME`, the bindings the head already
//!   holds for the job, so each launch sends only the delta.

use starling_proto::{ChunkData, Hash, Lookup, Recipe, WirePath};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Most bytes of content pushed with one launch; the rest is fetched on demand.
pub const MAX_PUSH_BYTES: u64 = 32 << 20;

fn key_name(parts: &[&str]) -> String {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update(&[0]);
    }
    h.finalize().to_hex()[..32].to_string()
}

pub struct Shadow {
    file: PathBuf,
    known: HashSet<Hash>,
    added: Vec<Hash>,
}

impl Shadow {
    /// The shadow for the cluster reached at `head_addr`.
    /// The file holding the shadow for the cluster reached at `head_addr`.
    pub fn file_for(dir: &Path, head_addr: &str) -> PathBuf {
        dir.join(format!("{}.bin", key_name(&[head_addr])))
    }

    pub fn load(dir: &Path, head_addr: &str) -> Shadow {
        let file = Shadow::file_for(dir, head_addr);
        let bytes = std::fs::read(&file).unwrap_or_default();
        let known = bytes.chunks_exact(32).map(|c| Hash(c.try_into().expect("32 bytes"))).collect();
        Shadow { file, known, added: Vec::new() }
    }

    pub fn has(&self, h: &Hash) -> bool {
        self.known.contains(h)
    }

    pub fn note(&mut self, h: Hash) {
        if self.known.insert(h) {
            self.added.push(h);
        }
    }

    /// Append what this process learned (O_APPEND: concurrent clients interleave whole records).
    pub fn save(&mut self) {
        if self.added.is_empty() {
            return;
        }
        if let Some(d) = self.file.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let mut buf = Vec::with_capacity(self.added.len() * 32);
        for h in self.added.drain(..) {
            buf.extend_from_slice(&h.0);
        }
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&self.file) {
            let _ = f.write_all(&buf);
        }
    }

    /// Content of `bindings` the head lacks, up to [`MAX_PUSH_BYTES`]: the
    /// recipes and chunks to push in the launch flight. Marks them known and
    /// saves at once, so concurrent launches (make -j) don't push them again.
    pub fn plan_push(
        &mut self,
        files: &starling_session::files::FileServer,
        bindings: &[(WirePath, Lookup)],
        compress: bool,
    ) -> (Vec<Recipe>, Vec<ChunkData>) {
        let mut recipes = Vec::new();
        let mut chunks = Vec::new();
        let mut budget = MAX_PUSH_BYTES;
        for (path, l) in bindings {
            let Lookup::File(_, name) = l else { continue };
            // Only content that changed since this client last looked: what it
            // has seen before, the cluster most likely fetched already (a
            // wrong guess costs a fetch, not a redundant upload).
            if self.has(name) || !files.is_fresh(name) {
                continue;
            }
            let Some((local, recipe)) = files.recipe_by_name(name) else { continue };
            let wanted: Vec<Hash> = recipe.chunks.iter().map(|c| c.hash).filter(|h| !self.has(h)).collect();
            let size: u64 = recipe.chunks.iter().filter(|c| wanted.contains(&c.hash)).map(|c| u64::from(c.len)).sum();
            if size > budget {
                continue;
            }
            match starling_store::read_chunks(&local, &recipe, &wanted) {
                Ok(got) => {
                    budget -= size;
                    for (h, bytes) in got {
                        self.note(h);
                        chunks.push(ChunkData::seal(&bytes, compress));
                    }
                    self.note(*name);
                    recipes.push(recipe);
                }
                Err(e) => log::debug!("not pushing {path}: {e}"),
            }
        }
        self.save();
        (recipes, chunks)
    }
}

/// Bindings the head holds for a job, as digests.
pub struct JobBindings {
    file: PathBuf,
    sent: HashMap<WirePath, Hash>,
    /// We believed the head already held some of the job's bindings.
    pub had_record: bool,
}

fn digest(l: &Lookup) -> Hash {
    Hash::of(&bincode::serialize(l).expect("lookup encodes"))
}

impl JobBindings {
    pub fn load(dir: &Path, head_addr: &str, job: &str) -> JobBindings {
        let file = dir.join(format!("{}.bin", key_name(&[head_addr, job])));
        let sent: HashMap<WirePath, Hash> = std::fs::read(&file).ok().and_then(|b| bincode::deserialize(&b).ok()).unwrap_or_default();
        JobBindings { file, had_record: !sent.is_empty(), sent }
    }

    /// Paths the head holds bindings for: they must be re-validated at each
    /// launch so the head's copy never goes stale.
    pub fn paths(&self) -> Vec<WirePath> {
        self.sent.keys().cloned().collect()
    }

    /// Of `current` (bindings made now), those the head doesn't already hold identically.
    pub fn delta(&mut self, current: Vec<(WirePath, Lookup)>) -> Vec<(WirePath, Lookup)> {
        let mut out = Vec::new();
        for (p, l) in current {
            let d = digest(&l);
            if self.sent.get(&p) != Some(&d) {
                self.sent.insert(p.clone(), d);
                out.push((p, l));
            }
        }
        out
    }

    /// The head no longer holds the job (it restarted, or forgot it): the
    /// next launch must send every binding.
    pub fn forget(&mut self) {
        self.sent.clear();
        let _ = std::fs::remove_file(&self.file);
    }

    pub fn save(&self) {
        if let Some(d) = self.file.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let tmp = self.file.with_extension(format!("tmp{}", std::process::id()));
        if let Ok(b) = bincode::serialize(&self.sent) {
            if std::fs::write(&tmp, b).is_ok() {
                let _ = std::fs::rename(&tmp, &self.file);
            }
        }
    }
}

/// Most paths one job remembers for one program (the oldest are dropped).
pub const MAX_JOB_PATHS: usize = 20_000;

/// Paths the earlier tasks of one program used in jobs (`exec --job NAME`,
/// or the tasks of `run`/`batch`) run from one directory, in this build or
/// the last: the
/// next task of the job binds them all from its first launch, instead of
/// waiting until the program's own profile has seen a path twice. A wrong
/// guess costs bytes of bindings, never correctness (bindings are computed
/// from the files at launch). Append-only file of length-prefixed paths, so
/// concurrent execs of one build (make -j) add to it without losing each
/// other's records; it is compacted when it holds many duplicates.
pub struct JobPaths {
    file: PathBuf,
    known: std::collections::BTreeSet<WirePath>,
    records: usize,
}

impl JobPaths {
    /// The paths of `program`'s tasks in jobs of kind `pool` run from `cwd`.
    pub fn load(dir: &Path, pool: &str, program: &str, cwd: &str) -> JobPaths {
        let file = dir.join(format!("{}.paths", key_name(&[pool, program, cwd])));
        let (known, records) = JobPaths::read(&file);
        JobPaths { file, known, records }
    }

    /// The distinct paths in `file`, and how many records it holds.
    fn read(file: &Path) -> (std::collections::BTreeSet<WirePath>, usize) {
        let bytes = std::fs::read(file).unwrap_or_default();
        let mut known = std::collections::BTreeSet::new();
        let mut records = 0;
        let mut rest = &bytes[..];
        while rest.len() >= 4 {
            let len = usize::try_from(u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]])).unwrap_or(usize::MAX);
            let Some(p) = rest.get(4..).and_then(|r| r.get(..len)) else { break };
            if let Ok(w) = WirePath::new(p.to_vec()) {
                known.insert(w);
            }
            records += 1;
            rest = &rest[4 + len..];
        }
        (known, records)
    }

    pub fn paths(&self) -> Vec<WirePath> {
        self.known.iter().cloned().collect()
    }

    /// Remember what one task used, except paths under `skip` (the temp
    /// directory: its names are new every run, and its listing travels
    /// with every launch anyway).
    pub fn record(&mut self, accessed: &[WirePath], skip: &[WirePath]) {
        let new: Vec<&WirePath> = accessed
            .iter()
            .filter(|p| !self.known.contains(*p) && !skip.iter().any(|d| starling_session::prethrow::is_under(p, d)))
            .collect();
        if new.is_empty() {
            return;
        }
        if let Some(d) = self.file.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        // Writers take turns (a lock file beside the record, since compacting
        // replaces the record's inode): compacting rewrites the record from
        // what it holds now, so it never drops what a concurrent task of the
        // build appended since this one loaded it (a make -j's first wave
        // would otherwise lose all but one task's paths). Unlocked if the
        // lock can't be had: it is a hint.
        let _turn = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.file.with_extension("lock"))
            .ok()
            .and_then(|f| nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).ok());
        let compact = self.records > 4 * (self.known.len() + new.len()) || self.known.len() + new.len() > MAX_JOB_PATHS;
        let mut buf = Vec::new();
        let mut put = |p: &WirePath| {
            let b = p.as_bytes();
            if let Ok(n) = u32::try_from(b.len()) {
                buf.extend_from_slice(&n.to_le_bytes());
                buf.extend_from_slice(b);
            }
        };
        for p in &new {
            self.known.insert((*p).clone());
        }
        if compact {
            let (now, _) = JobPaths::read(&self.file);
            self.known.extend(now);
            while self.known.len() > MAX_JOB_PATHS {
                self.known.pop_first();
            }
            for p in &self.known {
                put(p);
            }
            let tmp = self.file.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &buf).is_ok() {
                let _ = std::fs::rename(&tmp, &self.file);
            }
            self.records = self.known.len();
        } else {
            for p in &new {
                put(p);
            }
            // One write(2), O_APPEND: concurrent clients interleave whole records.
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&self.file) {
                let _ = f.write_all(&buf);
            }
            self.records += new.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::{Attr, NodeKind};

    fn attr(size: u64) -> Attr {
        Attr { kind: NodeKind::File, ino: 1, size, mode: 0o100644, nlink: 1, uid: 0, gid: 0, rdev: 0, atime_ns: 0, mtime_ns: 0, ctime_ns: 0 }
    }

    #[test]
    fn job_delta_sends_only_changes_and_persists() {
        let dir = tempfile::tempdir().unwrap();
        let p = WirePath::new(b"/a".to_vec()).unwrap();
        let q = WirePath::new(b"/b".to_vec()).unwrap();
        let mut j = JobBindings::load(dir.path(), "head:1", "build");
        let first = vec![(p.clone(), Lookup::File(attr(1), Hash::of(b"1"))), (q.clone(), Lookup::Absent)];
        assert_eq!(j.delta(first.clone()).len(), 2);
        j.save();
        let mut j = JobBindings::load(dir.path(), "head:1", "build");
        assert_eq!(j.paths().len(), 2);
        assert!(j.delta(first).is_empty(), "unchanged: nothing to send");
        let changed = vec![(p.clone(), Lookup::File(attr(2), Hash::of(b"2"))), (q, Lookup::Absent)];
        assert_eq!(j.delta(changed), vec![(p, Lookup::File(attr(2), Hash::of(b"2")))], "only the changed binding");
        assert!(JobBindings::load(dir.path(), "head:1", "other").paths().is_empty(), "per job");
    }

    #[test]
    fn job_paths_are_shared_by_later_tasks_and_skip_temp_names() {
        let dir = tempfile::tempdir().unwrap();
        let w = |s: &str| WirePath::new(s.as_bytes().to_vec()).unwrap();
        let mut a = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        let mut b = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        a.record(&[w("/src/a.h"), w("/tmp/cc1.s")], &[w("/tmp")]);
        b.record(&[w("/src/b.h")], &[w("/tmp")]);
        let c = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        assert_eq!(c.paths(), vec![w("/src/a.h"), w("/src/b.h")], "both concurrent tasks' paths, no temp name");
        assert!(JobPaths::load(dir.path(), "run", "/usr/bin/gcc", "/src").paths().is_empty(), "per kind of job");
        assert!(JobPaths::load(dir.path(), "job", "/usr/bin/ld", "/src").paths().is_empty(), "per program");
        assert!(JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/elsewhere").paths().is_empty(), "per directory");
    }

    #[test]
    fn compacting_job_paths_keeps_what_a_concurrent_task_appended() {
        let dir = tempfile::tempdir().unwrap();
        let w = |s: &str| WirePath::new(s.as_bytes().to_vec()).unwrap();
        let mut first = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        first.record(&[w("/x")], &[]);
        // Many duplicate records (concurrent first-wave tasks all appending the
        // same headers): the next task to learn something compacts the record.
        let mut f = std::fs::OpenOptions::new().append(true).open(&first.file).unwrap();
        for _ in 0..20 {
            f.write_all(&[2, 0, 0, 0, b'/', b'x']).unwrap();
        }
        let mut a = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        let mut b = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        b.record(&[w("/b")], &[]);
        a.record(&[w("/a")], &[]);
        let c = JobPaths::load(dir.path(), "job", "/usr/bin/gcc", "/src");
        assert_eq!(c.records, 3, "compacted");
        assert_eq!(c.paths(), vec![w("/a"), w("/b"), w("/x")], "the path b appended after a loaded is kept");
    }

    #[test]
    fn shadow_persists_appends() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Shadow::load(dir.path(), "h:1");
        s.note(Hash::of(b"x"));
        s.save();
        let mut t = Shadow::load(dir.path(), "h:1");
        assert!(t.has(&Hash::of(b"x")));
        t.note(Hash::of(b"y"));
        t.save();
        let u = Shadow::load(dir.path(), "h:1");
        assert!(u.has(&Hash::of(b"x")) && u.has(&Hash::of(b"y")));
        assert!(!Shadow::load(dir.path(), "h:2").has(&Hash::of(b"x")));
    }
}
