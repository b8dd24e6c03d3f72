//! Finding and detaching mounts left behind in the root mount namespace.
//!
//! Host roots are built inside each host's private mount namespace, so they normally vanish with their last
//! process. This is the safety net for anything that did land in ours (an older or interrupted boot, a manual
//! mount while debugging).

use std::path::{Path, PathBuf};

use nix::mount::{umount2, MntFlags};

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
    fn finds_root_mount_in_own_mountinfo() {
        let points = mount_points(Path::new("/proc/self/mountinfo"));
        assert!(points.iter().any(|p| p == Path::new("/")), "{points:?}");
    }
}
