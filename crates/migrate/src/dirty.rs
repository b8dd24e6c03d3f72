//! Which pages a running process writes: userfaultfd write-protect in
//! asynchronous mode plus the `PAGEMAP_SCAN` ioctl (soft-dirty bits do not
//! exist on this kernel).
//!
//! A userfaultfd belongs to the memory of the process that created it, so
//! one is created inside the process by an injected `userfaultfd()`
//! (user-mode-only: allowed to any user; with `WP_ASYNC` no fault ever
//! waits for a handler anyway), taken with `pidfd_getfd`, and closed there
//! again. With `UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED` the
//! kernel resolves write faults itself and marks the page written; without
//! `WP_UNPOPULATED` anonymous memory would be skipped silently.
//! `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING` returns the pages written since
//! the last scan and protects them again in the same step.
//!
//! Protection is armed before the first page is read, so a write that races
//! a read is always seen by a later scan.

use crate::freeze::Frozen;
use crate::inject::Injector;
use crate::{MigrateError, Result};
use starling_image::abi::uffd::{
    UffdioApi, UffdioRange, UffdioRegister, UffdioWriteprotect, UFFDIO_API, UFFDIO_REGISTER, UFFDIO_REGISTER_MODE_WP,
    UFFDIO_WRITEPROTECT, UFFDIO_WRITEPROTECT_MODE_WP, UFFD_API, UFFD_FEATURE_WP_ASYNC, UFFD_FEATURE_WP_UNPOPULATED,
    UFFD_USER_MODE_ONLY,
};
use starling_image::PAGE_BYTES;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: libc::c_ulong = 0xc060_6610;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// Write tracking of one process.
pub struct DirtyTracker {
    pid: i32,
    _uffd: OwnedFd,
    pagemap: std::fs::File,
    /// The ranges tracked (registered and protected); a page outside them
    /// counts as written whenever asked.
    ranges: Vec<(u64, u64)>,
}

fn ioctl<T>(fd: i32, req: libc::c_ulong, arg: &mut T, what: &'static str) -> Result<i64> {
    // SAFETY: each request reads/writes exactly the struct T passed.
    let r = unsafe { libc::ioctl(fd, req, arg as *mut T) };
    if r < 0 {
        return Err(MigrateError::Tracking { what, source: std::io::Error::last_os_error() });
    }
    Ok(i64::from(r))
}

impl DirtyTracker {
    /// Start tracking writes to `ranges` of the frozen process (it may run
    /// again right after).
    pub fn arm(frozen: &Frozen, inj: &Injector<'_>, ranges: &[(u64, u64)]) -> Result<DirtyTracker> {
        let pid = frozen.pid;
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | UFFD_USER_MODE_ONLY;
        let theirs = inj.call(pid, libc::SYS_userfaultfd, [flags, 0, 0, 0, 0, 0])?;
        // A descriptor number the kernel just returned fits an int.
        let ours = take_fd(pid, i32::try_from(theirs).unwrap_or(-1));
        inj.call(pid, libc::SYS_close, [theirs, 0, 0, 0, 0, 0])?;
        let uffd = ours?;
        let mut api = UffdioApi { api: UFFD_API, features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, ioctls: 0 };
        ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api, "UFFDIO_API (write-protect, async)")?;
        let mut tracked = Vec::new();
        for &(start, end) in ranges {
            let mut reg = UffdioRegister { range: UffdioRange { start, len: end - start }, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
            if let Err(e) = ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg, "UFFDIO_REGISTER") {
                // Untracked: every page of it counts as written at the end.
                log::debug!("migration: not tracking {start:#x}-{end:#x}: {e}");
                continue;
            }
            let mut wp = UffdioWriteprotect { range: UffdioRange { start, len: end - start }, mode: UFFDIO_WRITEPROTECT_MODE_WP };
            ioctl(uffd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp, "UFFDIO_WRITEPROTECT")?;
            tracked.push((start, end));
        }
        let path = format!("/proc/{pid}/pagemap");
        let pagemap = std::fs::File::open(&path).map_err(|e| MigrateError::Proc { path, source: e })?;
        Ok(DirtyTracker { pid, _uffd: uffd, pagemap, ranges: tracked })
    }

    /// The ranges whose writes are tracked, ascending.
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// Whether writes to the page at `addr` are tracked.
    pub fn tracks(&self, addr: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.1 <= addr);
        self.ranges.get(i).is_some_and(|r| r.0 <= addr)
    }

    /// Whether writes to every page of `start..end` are tracked.
    pub fn tracks_range(&self, start: u64, end: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.1 <= start);
        self.ranges.get(i).is_some_and(|r| r.0 <= start && end <= r.1)
    }

    /// Pages written since arming or the last scan (protected again).
    pub fn scan(&self) -> Result<Vec<u64>> {
        let mut pages = Vec::new();
        let mut out = vec![PageRegion::default(); 512];
        for &(start, end) in &self.ranges {
            let mut at = start;
            while at < end {
                let mut arg = PmScanArg {
                    size: std::mem::size_of::<PmScanArg>() as u64,
                    flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                    start: at,
                    end,
                    vec: out.as_mut_ptr() as u64,
                    vec_len: out.len() as u64,
                    category_mask: PAGE_IS_WRITTEN,
                    return_mask: PAGE_IS_WRITTEN,
                    ..PmScanArg::default()
                };
                let n = match ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg, "PAGEMAP_SCAN") {
                    Ok(n) => usize::try_from(n).unwrap_or(0),
                    // The range went away (munmap): nothing left to scan there.
                    Err(MigrateError::Tracking { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => break,
                    Err(MigrateError::Tracking { source, .. }) if source.raw_os_error() == Some(libc::ESRCH) => {
                        return Err(MigrateError::Gone(self.pid));
                    }
                    Err(e) => return Err(e),
                };
                for r in &out[..n.min(out.len())] {
                    pages.extend((r.start..r.end).step_by(PAGE_BYTES));
                }
                if arg.walk_end <= at {
                    break;
                }
                at = arg.walk_end;
            }
        }
        Ok(pages)
    }
}

/// A copy of descriptor `fd` of process `pid` (pidfd_getfd).
fn take_fd(pid: i32, fd: i32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open/pidfd_getfd take integers; results are fresh fds we own.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(MigrateError::Tracking { what: "pidfd_open", source: std::io::Error::last_os_error() });
        }
        // syscall(2) widens the int it returns to long: narrowing back is exact.
        #[allow(clippy::cast_possible_truncation)]
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let ours = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if ours < 0 {
            return Err(MigrateError::Tracking { what: "pidfd_getfd", source: std::io::Error::last_os_error() });
        }
        // As above: an int widened to long.
        #[allow(clippy::cast_possible_truncation)]
        Ok(OwnedFd::from_raw_fd(ours as i32))
    }
}
