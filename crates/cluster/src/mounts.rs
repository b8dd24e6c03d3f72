//! Finding and detaching mounts left behind in the root mount namespace.
//!
//! Host roots are built inside each host's private mount namespace, so they normally vanish with their last
//! process. This is the safety net for anything that did land in ours (an older or interrupted boot, a manual
//! mount while debugging).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Mount points listed in a mountinfo file (`/proc/self/mountinfo` or `/proc/PID/mountinfo`).
pub fn mount_points(mountinfo: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string(mountinfo) else { return Vec::new() };
    // Field 5 (1-based) is the mount point, with space, tab, newline and backslash escaped as \ooo.
    text.lines().filter_map(|line| line.split(' ').nth(4)).map(|p| PathBuf::from(unescape_octal(p))).collect()
}

fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            // Three octal digits: at most 0o777, which wraps as the kernel's own u8 arithmetic would.
            let v = (bytes[i + 1] - b'0').wrapping_mul(64).wrapping_add((bytes[i + 2] - b'0') * 8).wrapping_add(bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mounts in our namespace at or below any of `roots`, deepest first (children before their parents).
pub fn mounts_under(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mount_points(Path::new("/proc/self/mountinfo"))
        .into_iter()
        .filter(|m| roots.iter().any(|r| m.starts_with(r)))
        .collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    found.dedup();
    found
}

/// Lazily detach every mount at or below `roots`, deepest first; returns what was detached.
pub fn detach_under(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut detached = Vec::new();
    // A path can carry several stacked mounts; repeat until a pass finds nothing (bounded against surprises).
    for _ in 0..8 {
        let found = mounts_under(roots);
        if found.is_empty() {
            break;
        }
        for m in found {
            match umount2(&m, MntFlags::MNT_DETACH) {
                Ok(()) => detached.push(m),
                Err(e) => log::warn!("cannot detach {}: {e}", m.display()),
            }
        }
    }
    detached
}

/// Where the kernel lists FUSE connections (the `fusectl` file system).
const FUSE_CONNECTIONS: &str = "/sys/fs/fuse/connections";

/// The FUSE connections of the starling file views mounted in a mountinfo text, by the number naming each
/// under `/sys/fs/fuse/connections`: the kernel names a connection by its super block's device number, which
/// mountinfo's third field gives as `major:minor` (encoded in the kernel as `major << 20 | minor`).
pub fn view_connections(mountinfo: &str) -> BTreeSet<u64> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let mut fs = fs.split(' ');
            // The type is `fuse`, or `fuse.starling` where the mount helper applies the subtype.
            let fstype = fs.next()?;
            if !(fstype == "fuse" || fstype == "fuse.starling") || fs.next()? != "starling-view" {
                return None;
            }
            let (major, minor) = mount.split(' ').nth(2)?.split_once(':')?;
            Some((major.parse::<u64>().ok()? << 20) | minor.parse::<u64>().ok()?)
        })
        .collect()
}

/// Abort FUSE connection `n`: every request waiting on it fails at once, and so does every later one. A
/// process waiting in a view whose agent is gone can otherwise stay in uninterruptible sleep, out of reach of
/// SIGKILL, for as long as anything holds the connection open. Returns whether it was aborted (false if the
/// connection is already gone).
pub fn abort_fuse_connection(n: u64) -> bool {
    let dir = Path::new(FUSE_CONNECTIONS);
    if !dir.join(n.to_string()).exists() {
        // fusectl may not be mounted yet; EBUSY (already mounted) and a missing connection are the same to us.
        let _ = mount(Some("fusectl"), dir, Some("fusectl"), MsFlags::empty(), None::<&str>);
    }
    std::fs::write(dir.join(n.to_string()).join("abort"), "1").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mountinfo_paths() {
        assert_eq!(unescape_octal(r"/tmp/a\040b\134c"), r"/tmp/a b\c");
        assert_eq!(unescape_octal(r"/plain"), "/plain");
        assert_eq!(unescape_octal(r"/trailing\04"), r"/trailing\04");
    }

    #[test]
    fn names_the_connections_of_starling_views_only() {
        let mountinfo = "\
1203 1190 0:93 / /tmp/task-7/view rw,nosuid,nodev,relatime shared:600 - fuse.starling starling-view rw,user_id=0,group_id=0
1204 1203 0:94 / /tmp/task-7/root rw,relatime - overlay overlay rw,lowerdir=/tmp/task-7/view
1205 1190 0:95 / /mnt/other rw,relatime - fuse.sshfs host:/ rw,user_id=0,group_id=0
1206 1190 1:3 / /tmp/task-8/view rw,relatime - fuse.starling starling-view rw,user_id=0,group_id=0
1207 1190 0:96 / /tmp/task-9/view ro,nosuid,nodev,relatime - fuse starling-view ro,user_id=0,group_id=0
1208 1190 0:97 / /mnt/fusefs rw,relatime - fuse somefs rw,user_id=0,group_id=0
";
        // 0:93 is connection 93; 1:3 is (1 << 20) | 3 = 1048579; the overlay, the sshfs mount and the other
        // plain `fuse` mount are not ours.
        assert_eq!(view_connections(mountinfo), BTreeSet::from([93, 96, 1_048_579]));
    }

    #[test]
    fn finds_root_mount_in_own_mountinfo() {
        let points = mount_points(Path::new("/proc/self/mountinfo"));
        assert!(points.iter().any(|p| p == Path::new("/")), "{points:?}");
    }
}
