//! Prethrow (UCop §4): send path bindings ahead of execution.
//!
//! Hosts report which paths each task looked at. The client keeps, per
//! program, how often each path was used; paths used in more than one past
//! run are bound *at launch* (lstat + recipe, all local) and travel with the
//! launch, so the task finds them without asking back across the link.
//! A prediction is only a hint: a wrong one costs speed, never correctness,
//! because every binding is computed from the file as it is at launch
//! (never a stale prethrow). Entries reported unused expire. Names in the
//! task's temp directory are not learned (they are new every run, and the
//! directory's listing travels with every launch anyway). A profile is
//! rewritten only when what it predicts or expires changed: a warm
//! program's launches leave it as it is.
//!
//! The profile key is the resolved program, plus the script for
//! interpreters (all Python programs would otherwise share one profile).

use crate::files::FileServer;
use serde::{Deserialize, Serialize};
use starling_proto::{Lookup, TaskSpec, WirePath};
use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A path used in at least this many past runs is prethrown (`seen` counts
/// no further: a predicted path's profile entry stays as it is).
const MIN_SEEN: u32 = 2;
/// A prethrown path the task did not use this many times in a row is dropped.
const EXPIRE_UNUSED: u32 = 2;
/// Bound on a profile's size.
const MAX_ENTRIES: usize = 20_000;

const INTERPRETERS: [&str; 12] =
    ["python", "python3", "perl", "ruby", "node", "sh", "bash", "dash", "lua", "Rscript", "octave", "php"];

#[derive(Serialize, Deserialize, Default, Clone, Copy)]
struct Entry {
    seen: u32,
    unused: u32,
}

#[derive(Serialize, Deserialize, Default)]
pub struct Profile {
    key: String,
    entries: BTreeMap<String, Entry>,
    #[serde(skip)]
    file: PathBuf,
    /// Changed since loaded: [`Profile::save`] writes it.
    #[serde(skip)]
    changed: bool,
}

fn find_in_path(prog: &[u8], spec: &TaskSpec) -> Option<PathBuf> {
    let cwd = spec.cwd.as_path();
    if prog.contains(&b'/') {
        return std::fs::canonicalize(cwd.join(std::ffi::OsStr::from_bytes(prog))).ok();
    }
    let path = spec.env.iter().find(|(k, _)| k == b"PATH").map(|(_, v)| v.clone()).unwrap_or_else(|| b"/usr/bin:/bin".to_vec());
    for dir in path.split(|&c| c == b':') {
        let d = if dir.is_empty() { cwd.to_path_buf() } else { cwd.join(std::ffi::OsStr::from_bytes(dir)) };
        let cand = d.join(std::ffi::OsStr::from_bytes(prog));
        if let Ok(m) = std::fs::metadata(&cand) {
            if m.is_file() {
                return std::fs::canonicalize(cand).ok();
            }
        }
    }
    None
}

/// The profile key of a task: its resolved program, plus the script it runs
/// when the program is an interpreter.
pub fn profile_key(spec: &TaskSpec) -> String {
    let prog = find_in_path(&spec.argv[0], spec)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| String::from_utf8_lossy(&spec.argv[0]).into_owned());
    let base = Path::new(&prog).file_name().map(|b| b.to_string_lossy().into_owned()).unwrap_or_default();
    let is_interp = INTERPRETERS.iter().any(|i| base == *i || (base.starts_with(i) && base[i.len()..].chars().all(|c| c.is_ascii_digit() || c == '.')));
    if is_interp {
        if let Some(script) = spec.argv.iter().skip(1).find(|a| !a.starts_with(b"-")) {
            let p = spec.cwd.as_path().join(std::ffi::OsStr::from_bytes(script));
            if p.is_file() {
                return format!("{prog} {}", std::fs::canonicalize(&p).unwrap_or(p).display());
            }
        }
    }
    prog
}

impl Profile {
    pub fn load(dir: &Path, key: &str) -> Profile {
        let file = dir.join(format!("{}.json", &blake3::hash(key.as_bytes()).to_hex()[..32]));
        let mut p: Profile = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .filter(|p: &Profile| p.key == key)
            .unwrap_or_else(|| Profile { key: key.to_string(), ..Default::default() });
        p.file = file;
        p
    }

    /// Paths worth binding at launch.
    pub fn predicted(&self) -> Vec<WirePath> {
        self.entries
            .iter()
            .filter(|(_, e)| e.seen >= MIN_SEEN)
            .filter_map(|(p, _)| WirePath::new(p.as_bytes().to_vec()).ok())
            .collect()
    }

    /// Learn from one finished run: what it accessed, and what we had
    /// prethrown. New names under `temp_dirs` are not learned.
    pub fn record(&mut self, accessed: &[WirePath], prethrown: &[WirePath], temp_dirs: &[WirePath]) {
        let used: std::collections::HashSet<&[u8]> = accessed.iter().map(|p| p.as_bytes()).collect();
        for p in accessed {
            let key = String::from_utf8_lossy(p.as_bytes());
            let e = match self.entries.get_mut(&*key) {
                Some(e) => e,
                None if temp_dirs.iter().any(|d| is_under(p, d)) => continue,
                None => {
                    self.changed = true;
                    self.entries.entry(key.into_owned()).or_default()
                }
            };
            if e.seen < MIN_SEEN || e.unused != 0 {
                e.seen = e.seen.saturating_add(1).min(MIN_SEEN);
                e.unused = 0;
                self.changed = true;
            }
        }
        for p in prethrown {
            if !used.contains(p.as_bytes()) {
                if let Some(e) = self.entries.get_mut(&*String::from_utf8_lossy(p.as_bytes())) {
                    e.unused += 1;
                    self.changed = true;
                }
            }
        }
        self.entries.retain(|_, e| e.unused < EXPIRE_UNUSED);
        if self.entries.len() > MAX_ENTRIES {
            // Keep the predicted ones.
            let mut v: Vec<(String, Entry)> = std::mem::take(&mut self.entries).into_iter().collect();
            v.sort_by_key(|e| std::cmp::Reverse(e.1.seen));
            v.truncate(MAX_ENTRIES);
            self.entries = v.into_iter().collect();
        }
    }

    /// Save if changed (atomically; concurrent runs of one program may race:
    /// last wins, it's a hint).
    pub fn save(&mut self) {
        if !std::mem::take(&mut self.changed) {
            return;
        }
        if let Some(dir) = self.file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = self.file.with_extension(format!("tmp{}", std::process::id()));
        if let Ok(bytes) = serde_json::to_vec(self) {
            if std::fs::write(&tmp, bytes).is_ok() {
                let _ = std::fs::rename(&tmp, &self.file);
            }
        }
    }
}

/// Bind `paths` now, as the task would see them at launch.
pub fn bind(files: &FileServer, paths: &[WirePath]) -> Vec<(WirePath, Lookup)> {
    paths.iter().filter_map(|p| files.lookup(p).ok().map(|l| (p.clone(), l))).collect()
}

/// Existing files named on the command line (e.g. `gcc -c foo.c`): bound at
/// launch too, so a compile of a changed source needs no extra round trip.
pub fn argv_paths(spec: &TaskSpec) -> Vec<WirePath> {
    let cwd = spec.cwd.as_path();
    let mut out = Vec::new();
    for a in spec.argv.iter().skip(1) {
        let a = a.strip_prefix(b"-o").filter(|r| !r.is_empty()).unwrap_or(a);
        if a.is_empty() || a.starts_with(b"-") {
            continue;
        }
        let p = cwd.join(std::ffi::OsStr::from_bytes(a));
        if p.is_file() {
            if let Some(w) = normalise(&p) {
                out.push(w);
            }
        }
    }
    out
}

/// The task's temp directory (`TMPDIR`, else /tmp).
pub fn temp_dirs(spec: &TaskSpec) -> Vec<WirePath> {
    let tmp = spec.env.iter().find(|(k, _)| k == b"TMPDIR").map(|(_, v)| v.clone()).unwrap_or_else(|| b"/tmp".to_vec());
    normalise(&spec.cwd.as_path().join(std::ffi::OsStr::from_bytes(&tmp))).into_iter().collect()
}

/// Include-path flags whose directory is searched (`-Idir` or `-I dir`).
const INCLUDE_FLAGS: [&[u8]; 4] = [b"-I", b"-iquote", b"-isystem", b"-idirafter"];

/// Directories worth binding whole at launch: the temp directory, the
/// working directory, the directories of paths named on the command line
/// (outputs, sources) and the directories its include flags (`-I`) name.
/// Their new names (temp files, outputs) are then known absent without
/// asking back across the link, and a header search answers its misses
/// from the listing.
pub fn listing_dirs(spec: &TaskSpec) -> Vec<WirePath> {
    let cwd = spec.cwd.as_path();
    let tmp = spec.env.iter().find(|(k, _)| k == b"TMPDIR").map(|(_, v)| v.clone()).unwrap_or_else(|| b"/tmp".to_vec());
    let mut dirs = vec![cwd.join(std::ffi::OsStr::from_bytes(&tmp)), cwd.to_path_buf()];
    let mut args = spec.argv.iter().skip(1).peekable();
    while let Some(a) = args.next() {
        if let Some(flag) = INCLUDE_FLAGS.iter().find(|f| a.starts_with(f)) {
            let dir = match &a[flag.len()..] {
                b"" => args.next().map(|d| d.as_slice()),
                d => Some(d),
            };
            if let Some(d) = dir {
                dirs.push(cwd.join(std::ffi::OsStr::from_bytes(d)));
            }
            continue;
        }
        let a = a.strip_prefix(b"-o").filter(|r| !r.is_empty()).unwrap_or(a);
        if a.starts_with(b"-") || !a.contains(&b'/') {
            continue;
        }
        if let Some(parent) = cwd.join(std::ffi::OsStr::from_bytes(a)).parent() {
            dirs.push(parent.to_path_buf());
        }
    }
    let mut out: Vec<WirePath> = dirs.iter().filter(|d| d.is_dir()).filter_map(|d| normalise(d)).collect();
    out.sort();
    out.dedup();
    out
}

/// Most entries in a directory listing sent at launch.
pub const MAX_LISTING: usize = 4096;

/// The listings of `dirs`, as the task will see them (small directories only).
pub fn list(files: &FileServer, dirs: &[WirePath]) -> Vec<(WirePath, Vec<starling_proto::DirEntry>)> {
    dirs.iter()
        .filter_map(|d| files.readdir(d).ok().filter(|e| e.len() <= MAX_LISTING).map(|e| (d.clone(), e)))
        .collect()
}

/// Whether `p` is strictly below directory `dir` (`/` counts as no directory).
pub fn is_under(p: &WirePath, dir: &WirePath) -> bool {
    let (p, d) = (p.as_bytes(), dir.as_bytes());
    d != b"/" && p.len() > d.len() && p.starts_with(d) && p[d.len()] == b'/'
}

/// Lexically normalise an absolute path (no symlink resolution: the task
/// resolves symlinks itself, through bindings).
pub fn normalise(p: &Path) -> Option<WirePath> {
    let mut parts: Vec<&[u8]> = Vec::new();
    for c in p.as_os_str().as_bytes().split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let mut v = Vec::new();
    for c in parts {
        v.push(b'/');
        v.extend_from_slice(c);
    }
    if v.is_empty() {
        v.push(b'/');
    }
    WirePath::new(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wp(s: &str) -> WirePath {
        WirePath::new(s.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn paths_seen_twice_are_predicted_and_unused_ones_expire() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Profile::load(dir.path(), "/usr/bin/gcc");
        p.record(&[wp("/a"), wp("/b")], &[], &[]);
        assert!(p.predicted().is_empty(), "one run predicts nothing");
        p.record(&[wp("/a")], &[], &[]);
        assert_eq!(p.predicted(), vec![wp("/a")], "only paths seen in more than one run");
        p.save();
        let mut q = Profile::load(dir.path(), "/usr/bin/gcc");
        assert_eq!(q.predicted(), vec![wp("/a")], "persisted");
        q.record(&[], &[wp("/a")], &[]);
        assert_eq!(q.predicted(), vec![wp("/a")], "one unused report keeps it");
        q.record(&[], &[wp("/a")], &[]);
        assert!(q.predicted().is_empty(), "reported unused twice: expired");
        assert!(Profile::load(dir.path(), "/usr/bin/cc").predicted().is_empty(), "profiles are per program");
    }

    #[test]
    fn temp_names_are_not_learned_and_a_warm_profile_is_not_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = [wp("/tmp")];
        let mut p = Profile::load(dir.path(), "/usr/bin/gcc");
        for s in ["/tmp/cc1.s", "/tmp/cc2.s"] {
            p.record(&[wp("/a"), wp(s)], &[], &tmp);
        }
        p.save();
        let file = dir.path().join(format!("{}.json", &blake3::hash(b"/usr/bin/gcc").to_hex()[..32]));
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains("/tmp/"), "no temp name in the profile: {text}");
        assert!(text.contains("\"/a\""), "the path it used: {text}");
        // A run that uses what was predicted changes nothing: no rewrite.
        std::fs::write(&file, b"{\"key\":\"/usr/bin/gcc\",\"entries\":{\"/a\":{\"seen\":2,\"unused\":0}},\"marker\":1}").unwrap();
        let mut q = Profile::load(dir.path(), "/usr/bin/gcc");
        q.record(&[wp("/a"), wp("/tmp/cc3.s")], &[wp("/a")], &tmp);
        q.save();
        assert!(std::fs::read_to_string(&file).unwrap().contains("marker"), "unchanged profile rewritten");
        // A new path is learned and saved.
        q.record(&[wp("/a"), wp("/c")], &[wp("/a")], &tmp);
        q.save();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("\"/c\"") && !text.contains("marker"), "{text}");
    }

    #[test]
    fn include_flags_name_listing_dirs() {
        let dir = tempfile::tempdir().unwrap();
        for d in ["inc", "sys", "src"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let cwd = dir.path().canonicalize().unwrap();
        let argv: Vec<Vec<u8>> =
            ["gcc", "-Iinc", "-isystem", "sys", "-I", "missing", "-c", "src/a.c"].iter().map(|a| a.as_bytes().to_vec()).collect();
        let spec = TaskSpec {
            env: vec![(b"TMPDIR".to_vec(), cwd.join("src").as_os_str().as_bytes().to_vec())],
            ..TaskSpec::new(argv, normalise(&cwd).unwrap())
        };
        let got = listing_dirs(&spec);
        let want = |s: &str| normalise(&cwd.join(s)).unwrap();
        for d in ["inc", "sys", "src"] {
            assert!(got.contains(&want(d)), "{d} listed: {got:?}");
        }
        assert!(got.contains(&normalise(&cwd).unwrap()), "the working directory");
        assert!(!got.contains(&want("missing")), "a directory that does not exist is not listed");
        assert_eq!(temp_dirs(&spec), vec![want("src")]);
    }

    #[test]
    fn normalise_is_lexical() {
        assert_eq!(normalise(Path::new("/a/./b/../c")).unwrap(), wp("/a/c"));
        assert_eq!(normalise(Path::new("/..")).unwrap(), wp("/"));
    }
}
