//! Committing a finished task's file changes to this machine.
//!
//! Rules (UCop's task-end-to-start contract, extended to overwrites):
//! - Nothing is touched until every byte the changes need is here.
//! - Each change replaces its path atomically: files and symlinks are
//!   written beside the target and renamed over it; a removed directory is
//!   renamed aside before it is deleted. Nothing is ever half-written.
//! - A change applies only if the path still holds what the task saw when
//!   it started (its *base*). Otherwise the user changed it meanwhile: their
//!   copy is kept, the task's version is saved beside it as
//!   `PATH.starling-conflict`, and the conflict is reported.
//! - Nothing is written through a symlink. The directory that holds a
//!   change's path is opened component by component with `O_NOFOLLOW`
//!   (the paths a task's changes name are real paths: its overlay records
//!   where it wrote, not the symlinks it went through), and every step is
//!   made relative to that open directory. A path whose way leads through
//!   a symlink here — a task of the same job left one where a directory
//!   was, or a peer sent one — is a conflict and nothing of it is written.

use crate::files::FileServer;
use starling_proto::{Base, Change, Hash, Recipe, WirePath};
use std::collections::HashMap;
use nix::errno::Errno;
use nix::fcntl::{openat, renameat, OFlag};
use nix::sys::stat::{fstatat, mkdirat, Mode, SFlag};
use nix::unistd::{symlinkat, unlinkat, UnlinkatFlags};
use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("the task's output {path} is incomplete (chunk {hash:?} never arrived); nothing was committed")]
    Incomplete { path: WirePath, hash: Hash },
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: String, #[source] source: std::io::Error },
    #[error("the commit was interrupted")]
    Interrupted,
}

type Result<T, E = CommitError> = std::result::Result<T, E>;

/// `map_err` for an I/O step on `path`.
fn failed(action: &'static str, path: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> CommitError {
    move |source| CommitError::Io { action, path: path.to_string(), source }
}

#[derive(Debug, Default)]
pub struct CommitReport {
    pub applied: usize,
    pub conflicts: Vec<Conflict>,
    /// Bytes of file content written here.
    pub bytes: u64,
}

#[derive(Debug)]
pub struct Conflict {
    pub path: WirePath,
    pub why: Why,
    /// Where the task's version was saved, if it had content.
    pub saved_as: Option<PathBuf>,
}

/// Why a change was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    ChangedHere,
    DirectoryRemoved,
    NonDirectoryAppeared,
    DeletedButChanged,
    SymlinkOnTheWay,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Why::ChangedHere => "changed on this machine while the task ran",
            Why::DirectoryRemoved => "its directory was removed on this machine while the task ran",
            Why::NonDirectoryAppeared => "a non-directory appeared here on this machine while the task ran",
            Why::DeletedButChanged => "the task deleted it, but it changed on this machine meanwhile (kept)",
            Why::SymlinkOnTheWay => "a directory on its way is a symlink on this machine: not followed, nothing written",
        })
    }
}

/// What is at `path` on this machine now, in the terms of a [`Base`].
pub fn current_base(files: &FileServer, path: &WirePath) -> Result<Base> {
    use starling_proto::Lookup;
    Ok(match files.lookup(path).map_err(failed("inspect", path))? {
        Lookup::Absent => Base::Absent,
        Lookup::Dir(_) => Base::Dir,
        Lookup::Symlink(_, t) => Base::Symlink(t),
        Lookup::File(_, name) => Base::File(name),
        Lookup::Special(_) => Base::Special,
    })
}

/// The directory that holds a change's path, reached without following a symlink.
enum Parent {
    Open(OwnedFd),
    /// A component is missing or not a directory.
    Missing,
    /// A component is a symlink here.
    ThroughSymlink,
}

/// Open the directory holding `path`, one component at a time from `/`,
/// never following a symlink (`O_NOFOLLOW` on each step).
fn open_parent(path: &WirePath) -> Result<Parent> {
    let Some(parent) = path.parent() else { return Ok(Parent::Missing) };
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = own(openat(None, "/", dir_flags, Mode::empty()).map_err(|e| failed("open", "/")(e.into()))?);
    for comp in parent.as_bytes().split(|&c| c == b'/').filter(|c| !c.is_empty()) {
        let name = OsStr::from_bytes(comp);
        match openat(Some(dir.as_raw_fd()), name, dir_flags, Mode::empty()) {
            Ok(fd) => dir = own(fd),
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                let st = fstatat(Some(dir.as_raw_fd()), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
                let is_link = st.is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK);
                return Ok(if is_link { Parent::ThroughSymlink } else { Parent::Missing });
            }
            Err(Errno::ENOENT) => return Ok(Parent::Missing),
            Err(e) => return Err(failed("open", &parent)(e.into())),
        }
    }
    Ok(Parent::Open(dir))
}

fn own(fd: std::os::fd::RawFd) -> OwnedFd {
    // SAFETY: `openat` just returned this descriptor; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `name` inside the open directory `dir`, as a path the kernel resolves
/// to exactly that directory (its `/proc/self/fd` link), for library calls
/// that take paths.
fn in_dir(dir: &OwnedFd, name: &OsStr) -> PathBuf {
    Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

/// Whether `name` exists in `dir` (without following it).
fn exists_in(dir: &OwnedFd, name: &OsStr) -> bool {
    fstatat(Some(dir.as_raw_fd()), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok()
}

fn tmp_name(name: &[u8], tag: &str) -> OsString {
    let mut t = b".".to_vec();
    t.extend_from_slice(&name[..name.len().min(200)]);
    t.extend_from_slice(format!(".starling-{tag}-{:x}", rand::random::<u64>()).as_bytes());
    OsStr::from_bytes(&t).to_owned()
}

/// A free `NAME.starling-conflict[.N]` in `dir`.
fn conflict_name(dir: &OwnedFd, name: &[u8]) -> OsString {
    let mut base = name.to_vec();
    base.extend_from_slice(b".starling-conflict");
    let base = OsStr::from_bytes(&base).to_owned();
    if !exists_in(dir, &base) {
        return base;
    }
    (1..)
        .map(|i| {
            let mut n = base.clone();
            n.push(format!(".{i}"));
            n
        })
        .find(|n| !exists_in(dir, n))
        .expect("some suffix is free")
}

/// Write `recipe`'s bytes to a new file `name` in `dir` (it must not exist:
/// `O_EXCL` also refuses a symlink there), with its mode and mtime.
fn write_file(dir: &OwnedFd, name: &OsStr, shown: &Path, recipe: &Recipe, chunks: &HashMap<Hash, Vec<u8>>) -> Result<()> {
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(Some(dir.as_raw_fd()), name, flags, Mode::from_bits_truncate(0o600))
        .map_err(|e| failed("create", shown.display())(e.into()))?;
    let mut f = std::fs::File::from(own(fd));
    let res = (|| -> std::io::Result<()> {
        for c in &recipe.chunks {
            f.write_all(chunks.get(&c.hash).expect("checked before commit"))?;
        }
        f.set_permissions(std::fs::Permissions::from_mode(recipe.mode & 0o7777))?;
        if nix::unistd::geteuid().is_root() {
            let _ = std::os::unix::fs::fchown(&f, Some(recipe.uid), Some(recipe.gid));
            f.set_permissions(std::fs::Permissions::from_mode(recipe.mode & 0o7777))?;
        }
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(u64::try_from(recipe.mtime_ns).unwrap_or(0));
        f.set_modified(t)?;
        Ok(())
    })();
    if res.is_err() {
        let _ = unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir);
    }
    res.map_err(failed("write", shown.display()))
}

/// chmod the directory `name` in `dir`, not following a symlink there.
fn chmod_dir(dir: &OwnedFd, name: &OsStr, mode: u32) -> std::io::Result<()> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = own(openat(Some(dir.as_raw_fd()), name, flags, Mode::empty())?);
    std::fs::File::from(fd).set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
}

fn remove_any(dir: &OwnedFd, name: &OsStr) -> std::io::Result<()> {
    let st = fstatat(Some(dir.as_raw_fd()), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
        // Rename aside first so the directory disappears in one step.
        let aside = tmp_name(name.as_bytes(), "rm");
        renameat(Some(dir.as_raw_fd()), name, Some(dir.as_raw_fd()), aside.as_os_str())?;
        // remove_dir_all does not follow symlinks inside the tree.
        std::fs::remove_dir_all(in_dir(dir, &aside))?;
    } else {
        unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)?;
    }
    Ok(())
}

/// Apply `changes` (parents before children), with file contents from `chunks`.
pub fn apply(files: &FileServer, changes: &[Change], chunks: &HashMap<Hash, Vec<u8>>) -> Result<CommitReport> {
    // Phase 1: everything needed must be here before anything is touched.
    for c in changes {
        if let Change::File { path, recipe, .. } = c {
            if let Some(m) = recipe.chunks.iter().find(|k| !chunks.contains_key(&k.hash)) {
                return Err(CommitError::Incomplete { path: path.clone(), hash: m.hash });
            }
        }
    }
    // Phase 2: apply, one atomic step per path.
    let mut report = CommitReport::default();
    for c in changes {
        let path = c.path();
        let p = path.as_path();
        let name = OsStr::from_bytes(path.file_name());
        let dir = match open_parent(path)? {
            Parent::Open(dir) => dir,
            Parent::ThroughSymlink => {
                report.conflicts.push(Conflict { path: path.clone(), why: Why::SymlinkOnTheWay, saved_as: None });
                continue;
            }
            Parent::Missing => {
                // Nothing to remove or chmod; anything else has lost its directory.
                if !matches!(c, Change::Remove { .. } | Change::Chmod { .. }) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::DirectoryRemoved, saved_as: None });
                }
                continue;
            }
        };
        let fd = Some(dir.as_raw_fd());
        // Its directory was reached without a symlink: the lookup sees what the steps below touch.
        let now = current_base(files, path)?;
        let base_ok = |base: &Base| -> bool {
            match (base, &now) {
                (a, b) if a == b => true,
                // Both sides created the same directory: nothing to fight over.
                (Base::Absent, Base::Dir) => matches!(c, Change::Mkdir { .. }),
                _ => false,
            }
        };
        match c {
            Change::File { recipe, base, .. } => {
                if !base_ok(base) || now == Base::Dir {
                    let saved = conflict_name(&dir, path.file_name());
                    let shown = p.with_file_name(&saved);
                    write_file(&dir, &saved, &shown, recipe, chunks)?;
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::ChangedHere, saved_as: Some(shown) });
                    continue;
                }
                let tmp = tmp_name(path.file_name(), "new");
                write_file(&dir, &tmp, p, recipe, chunks)?;
                report.bytes += recipe.size;
                if let Err(e) = renameat(fd, tmp.as_os_str(), fd, name) {
                    let _ = unlinkat(fd, tmp.as_os_str(), UnlinkatFlags::NoRemoveDir);
                    return Err(failed("replace", path)(e.into()));
                }
            }
            Change::Symlink { target, base, .. } => {
                if !base_ok(base) || now == Base::Dir {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::ChangedHere, saved_as: None });
                    continue;
                }
                let tmp = tmp_name(path.file_name(), "ln");
                symlinkat(OsStr::from_bytes(target), fd, tmp.as_os_str()).map_err(|e| failed("create symlink", path)(e.into()))?;
                if let Err(e) = renameat(fd, tmp.as_os_str(), fd, name) {
                    let _ = unlinkat(fd, tmp.as_os_str(), UnlinkatFlags::NoRemoveDir);
                    return Err(failed("replace", path)(e.into()));
                }
            }
            Change::Mkdir { mode, base, .. } => {
                if !base_ok(base) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::NonDirectoryAppeared, saved_as: None });
                    continue;
                }
                if now == Base::Absent {
                    mkdirat(fd, name, Mode::from_bits_truncate(0o700)).map_err(|e| failed("create directory", path)(e.into()))?;
                }
                chmod_dir(&dir, name, *mode).map_err(failed("chmod", path))?;
            }
            Change::Remove { base, .. } => {
                if now == Base::Absent {
                    continue;
                }
                if !base_ok(base) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::DeletedButChanged, saved_as: None });
                    continue;
                }
                remove_any(&dir, name).map_err(failed("remove", path))?;
            }
            Change::Chmod { mode, .. } => {
                if now == Base::Dir {
                    chmod_dir(&dir, name, *mode).map_err(failed("chmod", path))?;
                }
            }
        }
        report.applied += 1;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::ChunkRef;

    struct Setup {
        _dir: tempfile::TempDir,
        files: FileServer,
        /// The task's working tree.
        work: PathBuf,
        /// Somewhere a hostile change would like to write: must stay as it is.
        outside: PathBuf,
    }

    fn setup() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        // Canonical, as a task's paths are (the overlay records real paths).
        let root = dir.path().canonicalize().unwrap();
        let cache = starling_store::RecipeCache::open(&root.join("cache"), starling_store::chunker::Chunking::ContentDefined)
            .unwrap();
        let (work, outside) = (root.join("work"), root.join("etc"));
        std::fs::create_dir_all(work.join("sub")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("passwd"), "root:x:0:0\n").unwrap();
        Setup { _dir: dir, files: FileServer::new(cache, false), work, outside }
    }

    fn wire(p: &Path) -> WirePath {
        WirePath::new(p.as_os_str().as_bytes().to_vec()).unwrap()
    }

    fn file(path: &Path, data: &[u8], base: Base) -> (Change, HashMap<Hash, Vec<u8>>) {
        let hash = Hash::of(data);
        let len = u32::try_from(data.len()).unwrap();
        let recipe = Recipe {
            size: u64::from(len),
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 0,
            chunks: vec![ChunkRef { hash, len }],
        };
        (Change::File { path: wire(path), recipe, base }, HashMap::from([(hash, data.to_vec())]))
    }

    /// Every entry under `dir`, with its content (files) or target (symlinks).
    fn snapshot(dir: &Path) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                "dir".into()
            } else {
                std::fs::read_to_string(&p).unwrap()
            };
            out.push((p, what));
        }
        out.sort();
        out
    }

    #[test]
    fn an_ordinary_commit_writes_files_dirs_and_symlinks() {
        let s = setup();
        let (f, chunks) = file(&s.work.join("sub/out.txt"), b"result\n", Base::Absent);
        let changes = vec![
            f,
            Change::Mkdir { path: wire(&s.work.join("new")), mode: 0o750, base: Base::Absent },
            Change::Symlink { path: wire(&s.work.join("link")), target: b"sub/out.txt".to_vec(), base: Base::Absent },
        ];
        let r = apply(&s.files, &changes, &chunks).unwrap();
        assert_eq!((r.applied, r.conflicts.len()), (3, 0));
        assert_eq!(std::fs::read_to_string(s.work.join("link")).unwrap(), "result\n");
        assert_eq!(std::fs::metadata(s.work.join("new")).unwrap().permissions().mode() & 0o777, 0o750);
    }

    #[test]
    fn a_directory_replaced_by_a_symlink_is_not_written_through() {
        let s = setup();
        let before = snapshot(&s.outside);
        // A peer (or a task of the same job, committed first) turned sub/ into a symlink out of the tree ...
        let sub = s.work.join("sub");
        let mut changes = vec![
            Change::Remove { path: wire(&sub), base: Base::Dir },
            Change::Symlink { path: wire(&sub), target: s.outside.as_os_str().as_bytes().to_vec(), base: Base::Absent },
        ];
        // ... then files "in" it: a new one, and one where the target has a file (a conflict copy would go beside it).
        let (new, mut chunks) = file(&sub.join("new"), b"pwned\n", Base::Absent);
        let (over, more) = file(&sub.join("passwd"), b"pwned\n", Base::Absent);
        chunks.extend(more);
        changes.extend([
            new,
            over,
            Change::Mkdir { path: wire(&sub.join("d")), mode: 0o777, base: Base::Absent },
            Change::Chmod { path: wire(&sub), mode: 0o777 },
            Change::Remove { path: wire(&sub.join("passwd")), base: Base::Absent },
        ]);
        let r = apply(&s.files, &changes, &chunks).unwrap();
        assert_eq!(snapshot(&s.outside), before, "nothing changed outside the working tree");
        let refused: Vec<_> = r.conflicts.iter().filter(|c| c.why == Why::SymlinkOnTheWay).map(|c| c.path.clone()).collect();
        assert_eq!(refused, [sub.join("new"), sub.join("passwd"), sub.join("d"), sub.join("passwd")].map(|p| wire(&p)));
        assert!(r.conflicts.iter().all(|c| c.saved_as.is_none()));
    }

    #[test]
    fn a_symlink_where_the_output_goes_is_replaced_not_followed() {
        let s = setup();
        let before = snapshot(&s.outside);
        let out = s.work.join("out.txt");
        std::os::unix::fs::symlink(s.outside.join("passwd"), &out).unwrap();
        let target = s.outside.join("passwd").as_os_str().as_bytes().to_vec();
        // The task saw the symlink and replaced it with its file: applied, as a new file.
        let (f, chunks) = file(&out, b"mine\n", Base::Symlink(target));
        let r = apply(&s.files, &[f], &chunks).unwrap();
        assert_eq!((r.applied, r.conflicts.len()), (1, 0));
        assert!(std::fs::symlink_metadata(&out).unwrap().is_file());
        // A task that did not see it there: a conflict, saved beside it in the tree.
        std::fs::remove_file(&out).unwrap();
        std::os::unix::fs::symlink(s.outside.join("passwd"), &out).unwrap();
        let (f, chunks) = file(&out, b"theirs\n", Base::Absent);
        let r = apply(&s.files, &[f], &chunks).unwrap();
        assert_eq!(r.conflicts.len(), 1);
        assert_eq!(r.conflicts[0].saved_as.as_deref(), Some(s.work.join("out.txt.starling-conflict").as_path()));
        assert_eq!(std::fs::read_to_string(s.work.join("out.txt.starling-conflict")).unwrap(), "theirs\n");
        assert_eq!(snapshot(&s.outside), before, "nothing changed outside the working tree");
    }
}
