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

use crate::files::FileServer;
use starling_proto::{Base, Change, Hash, Recipe, WirePath};
use std::collections::HashMap;
use std::io::Write;
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
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Why::ChangedHere => "changed on this machine while the task ran",
            Why::DirectoryRemoved => "its directory was removed on this machine while the task ran",
            Why::NonDirectoryAppeared => "a non-directory appeared here on this machine while the task ran",
            Why::DeletedButChanged => "the task deleted it, but it changed on this machine meanwhile (kept)",
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

fn tmp_beside(path: &Path, tag: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.as_bytes().to_vec()).unwrap_or_default();
    let mut t = b".".to_vec();
    t.extend_from_slice(&name[..name.len().min(200)]);
    t.extend_from_slice(format!(".starling-{tag}-{:x}", rand::random::<u64>()).as_bytes());
    path.with_file_name(std::ffi::OsStr::from_bytes(&t))
}

fn conflict_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".starling-conflict");
    let base = PathBuf::from(p);
    if std::fs::symlink_metadata(&base).is_err() {
        return base;
    }
    (1..).map(|i| PathBuf::from(format!("{}.{i}", base.display()))).find(|p| std::fs::symlink_metadata(p).is_err()).unwrap()
}

/// Write `recipe`'s bytes to a new file at `dest` (which must not exist), with its mode and mtime.
fn write_file(dest: &Path, recipe: &Recipe, chunks: &HashMap<Hash, Vec<u8>>) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(failed("create", dest.display()))?;
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
        let _ = std::fs::remove_file(dest);
    }
    res.map_err(failed("write", dest.display()))
}

fn remove_any(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        // Rename aside first so the directory disappears in one step.
        let aside = tmp_beside(path, "rm");
        std::fs::rename(path, &aside)?;
        std::fs::remove_dir_all(&aside)?;
    } else {
        std::fs::remove_file(path)?;
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
                    let saved = conflict_path(p);
                    write_file(&saved, recipe, chunks)?;
                    report.conflicts.push(Conflict {
                        path: path.clone(),
                        why: Why::ChangedHere,
                        saved_as: Some(saved),
                    });
                    continue;
                }
                if p.parent().map(|d| !d.is_dir()).unwrap_or(true) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::DirectoryRemoved, saved_as: None });
                    continue;
                }
                let tmp = tmp_beside(p, "new");
                write_file(&tmp, recipe, chunks)?;
                report.bytes += recipe.size;
                if let Err(e) = std::fs::rename(&tmp, p) {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(failed("replace", path)(e));
                }
            }
            Change::Symlink { target, base, .. } => {
                if !base_ok(base) || now == Base::Dir {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::ChangedHere, saved_as: None });
                    continue;
                }
                let tmp = tmp_beside(p, "ln");
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target), &tmp)
                    .map_err(failed("create symlink", path))?;
                std::fs::rename(&tmp, p).map_err(failed("replace", path))?;
            }
            Change::Mkdir { mode, base, .. } => {
                if !base_ok(base) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::NonDirectoryAppeared, saved_as: None });
                    continue;
                }
                if now == Base::Absent {
                    std::fs::create_dir(p).map_err(failed("create directory", path))?;
                }
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode & 0o7777)).map_err(failed("chmod", path))?;
            }
            Change::Remove { base, .. } => {
                if now == Base::Absent {
                    continue;
                }
                if !base_ok(base) {
                    report.conflicts.push(Conflict { path: path.clone(), why: Why::DeletedButChanged, saved_as: None });
                    continue;
                }
                remove_any(p).map_err(failed("remove", path))?;
            }
            Change::Chmod { mode, .. } => {
                if now == Base::Dir {
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode & 0o7777)).map_err(failed("chmod", path))?;
                }
            }
        }
        report.applied += 1;
    }
    Ok(report)
}
