//! Reading a task's changes out of an overlayfs upper directory.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use starling_proto::WirePath;

/// One node in an upper dir: something the task created, modified or deleted.
///
/// `mode` holds the permission bits only (`st_mode & 0o7777`); the variant
/// says the type. Directories appear both when the task created them and when
/// overlayfs copied them up to hold a changed child — the caller tells the
/// two apart by comparing with the binding the task saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpperEntry {
    /// A file created, or an existing file modified (copied up in full), or
    /// one whose metadata changed.
    File { path: WirePath, host_path: PathBuf, mode: u32, uid: u32, gid: u32, mtime_ns: i64 },
    /// `opaque` (xattr `trusted.overlay.opaque=y`): the lower directory's
    /// contents were deleted, and this directory replaces it wholesale.
    Dir { path: WirePath, mode: u32, opaque: bool },
    Symlink { path: WirePath, target: Vec<u8> },
    /// A character device 0:0: the lower node at `path` was deleted.
    Whiteout { path: WirePath },
}

impl UpperEntry {
    pub fn path(&self) -> &WirePath {
        match self {
            UpperEntry::File { path, .. }
            | UpperEntry::Dir { path, .. }
            | UpperEntry::Symlink { path, .. }
            | UpperEntry::Whiteout { path } => path,
        }
    }
}

/// What the task changed, read from an overlay upper dir (after the task
/// exited and the overlay is unmounted). Parents come before children;
/// siblings in byte order of their names. The upper dir itself is not listed.
///
/// FIFOs, sockets and device nodes other than whiteouts cannot be sent back
/// to the client; they are skipped with a warning.
pub fn scan_upper(upper: &Path) -> io::Result<Vec<UpperEntry>> {
    let mut out = Vec::new();
    let meta = fs::symlink_metadata(upper)?;
    if !meta.is_dir() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a directory", upper.display())));
    }
    scan_dir(upper, &WirePath::root(), &mut out)?;
    Ok(out)
}

fn scan_dir(dir: &Path, wire: &WirePath, out: &mut Vec<UpperEntry>) -> io::Result<()> {
    let mut names: Vec<_> = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<_>>()?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let host_path = dir.join(&name);
        let path = wire.join(name.as_bytes()).map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", host_path.display()))
        })?;
        let meta = fs::symlink_metadata(&host_path)?;
        let ft = meta.file_type();
        let mode = meta.mode() & 0o7777;
        if ft.is_dir() {
            let opaque = xattr(&host_path, "trusted.overlay.opaque")?.as_deref() == Some(b"y");
            out.push(UpperEntry::Dir { path: path.clone(), mode, opaque });
            scan_dir(&host_path, &path, out)?;
        } else if ft.is_file() {
            let mtime_ns = meta.mtime().saturating_mul(1_000_000_000).saturating_add(meta.mtime_nsec());
            out.push(UpperEntry::File { path, host_path, mode, uid: meta.uid(), gid: meta.gid(), mtime_ns });
        } else if ft.is_symlink() {
            let target = fs::read_link(&host_path)?.into_os_string().into_vec();
            out.push(UpperEntry::Symlink { path, target });
        } else if ft.is_char_device() && meta.rdev() == 0 {
            out.push(UpperEntry::Whiteout { path });
        } else {
            log::warn!("upper: skipping special file {} (mode {:o})", host_path.display(), meta.mode());
        }
    }
    Ok(())
}

use std::os::unix::ffi::OsStringExt;

/// The value of extended attribute `name` on `path` (not following a
/// symlink), or None if it is not set or xattrs are unsupported.
fn xattr(path: &Path, name: &str) -> io::Result<Option<Vec<u8>>> {
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let cname = CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
    // Overlay xattr values we read are tiny ("y"); 256 bytes is ample, and ERANGE is reported.
    let mut buf = vec![0u8; 256];
    // SAFETY: cpath and cname are valid NUL-terminated strings that outlive
    // the call; buf is a writable allocation of exactly buf.len() bytes, and
    // the kernel writes at most that many.
    let n = unsafe {
        libc::lgetxattr(cpath.as_ptr(), cname.as_ptr(), buf.as_mut_ptr().cast::<libc::c_void>(), buf.len())
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(None),
            _ => Err(e),
        };
    }
    buf.truncate(n.cast_unsigned());
    Ok(Some(buf))
}
