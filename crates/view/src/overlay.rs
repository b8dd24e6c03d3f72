//! The per-task copy-on-write layer: overlayfs over the read-only view.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::mount::{umount2, MntFlags, MsFlags};

/// overlayfs with lower = the view mount and upper/work/root created under a
/// task directory (which must be on a file system overlayfs accepts as upper,
/// e.g. ext4). The task chroots into [`Overlay::root`].
///
/// Options: `redirect_dir=nofollow` (redirects are neither created nor
/// followed: renaming a lower directory fails with EXDEV, so userspace copies
/// and the upper dir never holds redirect xattrs; unlike `off`, which Debian
/// builds turn into `follow`, it is also accepted inside a user namespace),
/// `index=off`, `metacopy=off` (a modified file's upper copy holds all its
/// bytes), `xino=off`, and `volatile` where the kernel has it (5.10+): the
/// upper dir is scratch (the task's changes are read from it and sent; it is
/// removed afterwards), so the task's fsyncs and the unmount need not flush
/// it to disk — unmounting a non-volatile overlay syncs the whole upper file
/// system, which cost 12–33 ms per task on a loaded machine (issue 18);
/// mount flags `nosuid,nodev`.
#[derive(Debug)]
pub struct Overlay {
    root: PathBuf,
    upper: PathBuf,
    mounted: bool,
}

const OPTIONS: &str = "redirect_dir=nofollow,index=off,metacopy=off,xino=off";

/// overlayfs option values cannot contain these (`:` separates lower dirs,
/// `,` separates options, `\` escapes); refuse rather than mis-mount.
fn option_path(p: &Path) -> io::Result<&str> {
    let s = p
        .to_str()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not UTF-8", p.display())))?;
    if s.bytes().any(|b| matches!(b, b',' | b':' | b'\\' | b'\n')) || !p.as_os_str().as_bytes().starts_with(b"/") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{s}: overlay paths must be absolute and free of ',' ':' '\\'"),
        ));
    }
    Ok(s)
}

impl Overlay {
    /// Create `task_dir/{upper,work,root}` and mount the overlay at `root`.
    pub fn mount(lower: &Path, task_dir: &Path) -> io::Result<Overlay> {
        let task_dir = task_dir.canonicalize()?;
        let lower = lower.canonicalize()?;
        let upper = task_dir.join("upper");
        let work = task_dir.join("work");
        let root = task_dir.join("root");
        for d in [&upper, &work, &root] {
            fs::create_dir_all(d)?;
        }
        let data = format!(
            "lowerdir={},upperdir={},workdir={},{OPTIONS}",
            option_path(&lower)?,
            option_path(&upper)?,
            option_path(&work)?
        );
        // nosuid: a setuid binary from the client must not grant privileges
        // on the host. nodev: device nodes the client shows must not open the
        // host's devices (the sandbox bind-mounts a minimal /dev on top).
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        let volatile = format!("{data},volatile");
        nix::mount::mount(Some("overlay"), &root, Some("overlay"), flags, Some(volatile.as_str()))
            .or_else(|e| match e {
                // A kernel without `volatile` (before 5.10): the same overlay, synced.
                nix::errno::Errno::EINVAL => nix::mount::mount(Some("overlay"), &root, Some("overlay"), flags, Some(data.as_str())),
                e => Err(e),
            })
            .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("mount overlay at {}: {e} ({data})", root.display())))?;
        Ok(Overlay { root, upper, mounted: true })
    }

    /// The merged directory the task chroots into.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The upper directory: after unmount, [`crate::scan_upper`] reads the task's changes from it.
    pub fn upper(&self) -> &Path {
        &self.upper
    }

    /// Unmount. If still busy (a straggling process), detach lazily: the
    /// upper dir is complete either way once the task's processes are gone.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        match umount2(&self.root, MntFlags::empty()) {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::EBUSY) => umount2(&self.root, MntFlags::MNT_DETACH).map_err(io::Error::from),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        if self.mounted {
            self.mounted = false;
            if let Err(e) = umount2(&self.root, MntFlags::MNT_DETACH) {
                log::warn!("overlay: detaching {} failed: {e}", self.root.display());
            }
        }
    }
}
