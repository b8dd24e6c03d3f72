//! cgroup v1 hierarchies: where each controller is mounted, and groups in them.
//!
//! A *group* is one relative path (e.g. `starling/starling6-h1/guest`) made
//! in several hierarchies. Removing a tree thaws it, SIGKILLs whatever still
//! runs in it, waits until it is empty and removes the directories bottom-up.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The directory under every hierarchy that holds starling's groups.
pub const ROOT: &str = "starling";

/// The v1 controllers starling uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    Cpu,
    Cpuacct,
    Memory,
    Freezer,
    Blkio,
}

impl Controller {
    pub const ALL: [Controller; 5] =
        [Controller::Cpu, Controller::Cpuacct, Controller::Memory, Controller::Freezer, Controller::Blkio];

    pub fn name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
            Controller::Memory => "memory",
            Controller::Freezer => "freezer",
            Controller::Blkio => "blkio",
        }
    }
}

impl std::fmt::Display for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("the cgroup v1 {0} controller is not mounted (see /proc/self/mounts)")]
    NotMounted(Controller),
    #[error("{path}: {source}")]
    Io { path: PathBuf, #[source] source: io::Error },
    #[error("{path} still holds processes {pids:?} after SIGKILL")]
    Busy { path: PathBuf, pids: Vec<i32> },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io { path: path.to_path_buf(), source }
}

/// Where each v1 controller is mounted (a co-mounted `cpu,cpuacct` gives both the same directory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hierarchies {
    mounts: Vec<(Controller, PathBuf)>,
    /// Every v1 hierarchy's mount point (also named ones such as `name=systemd`).
    all: Vec<PathBuf>,
    /// The cgroup2 (unified) mount, if any: no controllers here, but a
    /// socket remembers its creator's cgroup2 group, which nftables matches
    /// (`socket cgroupv2`) to classify the guests' traffic.
    unified: Option<PathBuf>,
}

impl Hierarchies {
    /// This process's view (`/proc/self/mounts`).
    pub fn discover() -> Hierarchies {
        Hierarchies::from_mounts(&std::fs::read_to_string("/proc/self/mounts").unwrap_or_default())
    }

    /// Parse a `/proc/mounts` text.
    pub fn from_mounts(text: &str) -> Hierarchies {
        let mut h = Hierarchies::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [_, dir, fstype, opts, ..] = f.as_slice() else { continue };
            if *fstype == "cgroup2" && h.unified.is_none() {
                h.unified = Some(PathBuf::from(unescape(dir)));
            }
            if *fstype != "cgroup" {
                continue;
            }
            let dir = PathBuf::from(unescape(dir));
            for c in Controller::ALL {
                if opts.split(',').any(|o| o == c.name()) && h.dir(c).is_none() {
                    h.mounts.push((c, dir.clone()));
                }
            }
            if !h.all.contains(&dir) {
                h.all.push(dir);
            }
        }
        h
    }

    /// The mount point of controller `c`.
    pub fn dir(&self, c: Controller) -> Option<&Path> {
        self.mounts.iter().find(|(k, _)| *k == c).map(|(_, d)| d.as_path())
    }

    /// `rel` in controller `c`'s hierarchy.
    pub fn path(&self, c: Controller, rel: &Path) -> Result<PathBuf, CgroupError> {
        self.dir(c).map(|d| d.join(rel)).ok_or(CgroupError::NotMounted(c))
    }

    /// Every v1 hierarchy's mount point.
    pub fn all(&self) -> &[PathBuf] {
        &self.all
    }

    /// The cgroup2 mount point, if one is mounted.
    pub fn unified(&self) -> Option<&Path> {
        self.unified.as_deref()
    }

    /// Every v1 hierarchy and the cgroup2 mount: where starling's trees are removed from.
    fn every(&self) -> impl Iterator<Item = &PathBuf> {
        self.all.iter().chain(self.unified.iter())
    }
}

/// `\040` and friends in /proc/mounts fields.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One relative path made in several hierarchies.
#[derive(Clone, Debug)]
pub struct Group {
    pub rel: PathBuf,
    dirs: Vec<(Controller, PathBuf)>,
}

impl Group {
    /// Make `rel` in the hierarchies of `required` (an error if one is not
    /// mounted) and of `optional` (skipped if not mounted). Existing
    /// directories are kept.
    pub fn create(h: &Hierarchies, rel: &Path, required: &[Controller], optional: &[Controller]) -> Result<Group, CgroupError> {
        let mut dirs = Vec::new();
        let wanted = required.iter().map(|c| (*c, true)).chain(optional.iter().map(|c| (*c, false)));
        for (c, needed) in wanted {
            let dir = match h.path(c, rel) {
                Ok(d) => d,
                Err(e) if needed => return Err(e),
                Err(_) => continue,
            };
            std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
            dirs.push((c, dir));
        }
        Ok(Group { rel: rel.to_path_buf(), dirs })
    }

    /// The group's directory in controller `c`'s hierarchy, if it was made there.
    pub fn dir(&self, c: Controller) -> Option<&Path> {
        self.dirs.iter().find(|(k, _)| *k == c).map(|(_, d)| d.as_path())
    }

    /// Each distinct directory's `cgroup.procs` (what a process writes itself into to join).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = Vec::new();
        for (_, d) in &self.dirs {
            let p = d.join("cgroup.procs");
            if !v.contains(&p) {
                v.push(p);
            }
        }
        v
    }

    /// Read a control file of controller `c` (trimmed).
    pub fn read(&self, c: Controller, file: &str) -> Result<String, CgroupError> {
        let p = self.dir(c).ok_or(CgroupError::NotMounted(c))?.join(file);
        std::fs::read_to_string(&p).map(|s| s.trim().to_string()).map_err(io_at(&p))
    }

    /// A control file read as a number.
    pub fn read_u64(&self, c: Controller, file: &str) -> Result<u64, CgroupError> {
        let text = self.read(c, file)?;
        let p = self.dir(c).map(|d| d.join(file)).unwrap_or_default();
        text.parse::<u64>().map_err(|_| CgroupError::Io { path: p, source: io::Error::new(io::ErrorKind::InvalidData, text) })
    }

    /// Write a control file of controller `c`.
    pub fn write(&self, c: Controller, file: &str, value: &str) -> Result<(), CgroupError> {
        let p = self.dir(c).ok_or(CgroupError::NotMounted(c))?.join(file);
        std::fs::write(&p, value).map_err(io_at(&p))
    }

    /// Processes in the group (any of its hierarchies, not below it).
    pub fn pids(&self) -> Vec<i32> {
        let mut v = Vec::new();
        for f in self.procs_files() {
            for p in read_pids(&f) {
                if !v.contains(&p) {
                    v.push(p);
                }
            }
        }
        v
    }
}

/// The pids in a `cgroup.procs` (none if it cannot be read).
pub fn read_pids(procs: &Path) -> Vec<i32> {
    std::fs::read_to_string(procs).unwrap_or_default().split_whitespace().filter_map(|s| s.parse().ok()).collect()
}

/// Directories of the tree at `top`, children before parents.
fn post_order(top: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = std::fs::read_dir(top) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                post_order(&e.path(), out);
            }
        }
    }
    out.push(top.to_path_buf());
}

/// Remove the tree `rel` from every v1 hierarchy and the cgroup2 mount: thaw it, SIGKILL its
/// processes until it is empty (up to `patience`), remove its directories
/// bottom-up. Returns the directories removed (none if it did not exist).
pub fn remove_tree(h: &Hierarchies, rel: &Path, patience: Duration) -> Result<Vec<PathBuf>, CgroupError> {
    let tops: Vec<PathBuf> = h.every().map(|m| m.join(rel)).filter(|p| p.is_dir()).collect();
    if tops.is_empty() {
        return Ok(Vec::new());
    }
    // Frozen tasks do not die of SIGKILL until thawed.
    if let Some(fz) = h.dir(Controller::Freezer) {
        let mut dirs = Vec::new();
        post_order(&fz.join(rel), &mut dirs);
        for d in dirs.iter().rev() {
            let _ = std::fs::write(d.join("freezer.state"), "THAWED");
        }
    }
    let mut dirs = Vec::new();
    for t in &tops {
        post_order(t, &mut dirs);
    }
    let deadline = Instant::now() + patience;
    loop {
        let pids: Vec<i32> = dirs.iter().flat_map(|d| read_pids(&d.join("cgroup.procs"))).collect();
        if pids.is_empty() {
            break;
        }
        for p in &pids {
            // SAFETY: kill(2) takes a pid and a signal; no memory is passed.
            unsafe { libc::kill(*p, libc::SIGKILL) };
        }
        if Instant::now() > deadline {
            return Err(CgroupError::Busy { path: tops[0].clone(), pids });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut removed = Vec::new();
    for d in &dirs {
        // An exiting task can keep a group busy for a moment after leaving cgroup.procs.
        let mut tries = 0;
        loop {
            match std::fs::remove_dir(d) {
                Ok(()) => {
                    removed.push(d.clone());
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) if tries < 100 && e.raw_os_error() == Some(libc::EBUSY) => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(CgroupError::Io { path: d.clone(), source: e }),
            }
        }
    }
    Ok(removed)
}

/// Remove an empty directory of every hierarchy (`rel`), leaving it where it is busy or not empty.
pub fn remove_if_empty(h: &Hierarchies, rel: &Path) {
    for m in h.every() {
        let _ = std::fs::remove_dir(m.join(rel));
    }
}

/// Names under `starling/` in any hierarchy (cgroup2 too) that start with `prefix`.
pub fn names_with_prefix(h: &Hierarchies, prefix: &str) -> Vec<String> {
    let mut v = Vec::new();
    for m in h.every() {
        for e in std::fs::read_dir(m.join(ROOT)).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(prefix) && e.file_type().is_ok_and(|t| t.is_dir()) && !v.contains(&n) {
                v.push(n);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";

    #[test]
    fn finds_each_controller_and_comounts() {
        let h = Hierarchies::from_mounts(MOUNTS);
        assert_eq!(h.dir(Controller::Cpu), Some(Path::new("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(h.dir(Controller::Cpuacct), Some(Path::new("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(h.dir(Controller::Memory), Some(Path::new("/sys/fs/cgroup/memory")));
        assert_eq!(h.dir(Controller::Freezer), None);
        assert!(matches!(h.path(Controller::Freezer, Path::new("x")), Err(CgroupError::NotMounted(Controller::Freezer))));
        // Named hierarchies are removed from too; cgroup2 is not a v1 hierarchy.
        assert_eq!(h.all().len(), 3);
        assert!(h.all().contains(&PathBuf::from("/sys/fs/cgroup/systemd")));
        assert_eq!(h.unified(), Some(Path::new("/sys/fs/cgroup/unified")));
        assert_eq!(Hierarchies::from_mounts("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n").unified(), None);
    }

    #[test]
    fn unescapes_mount_points() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
