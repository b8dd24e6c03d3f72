//! Reading the process table from /proc, and killing a set of processes for good.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// What `down` needs to know about one process.
#[derive(Clone, Debug)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    /// Command line split at NULs (empty for kernel threads).
    pub argv: Vec<String>,
    /// Identity of its network namespace (see `net::ns_id`).
    pub netns: Option<(u64, u64)>,
}

impl ProcInfo {
    /// The starling subcommand this process runs (`argv[1]`), if any.
    pub fn role(&self) -> Option<&str> {
        self.argv.get(1).map(String::as_str)
    }
}

/// `(state, ppid)` from /proc/PID/stat; `None` if the process is gone.
fn stat_state(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain ") ", so split after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// True if `pid` exists and is not a zombie (a killed child of ours stays a zombie until reaped, but it no
/// longer holds namespaces or mounts).
pub fn is_alive(pid: u32) -> bool {
    matches!(stat_state(pid), Some((state, _)) if state != 'Z' && state != 'X')
}

pub fn cmdline(pid: u32) -> Vec<String> {
    let Ok(bytes) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return Vec::new() };
    bytes.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
}

/// All live processes except ourselves.
pub fn scan() -> Vec<ProcInfo> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let (state, ppid) = stat_state(pid)?;
            if state == 'Z' || state == 'X' {
                return None;
            }
            Some(ProcInfo {
                pid,
                ppid,
                argv: cmdline(pid),
                netns: crate::net::ns_id(Path::new(&format!("/proc/{pid}/ns/net"))),
            })
        })
        .collect()
}

/// `roots` plus every descendant of them found in `table`.
pub fn with_descendants(table: &[ProcInfo], roots: &BTreeSet<u32>) -> BTreeSet<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for p in table {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut all = BTreeSet::new();
    let mut todo: Vec<u32> = roots.iter().copied().collect();
    while let Some(pid) = todo.pop() {
        if all.insert(pid) {
            todo.extend(children.get(&pid).into_iter().flatten().copied());
        }
    }
    all
}

/// SIGKILL `pids` and wait (up to `timeout`) until none is alive; returns those still alive afterwards.
pub fn kill_and_wait(pids: &BTreeSet<u32>, timeout: Duration) -> Vec<u32> {
    let me = std::process::id();
    for &pid in pids {
        // pid 0/1 or ourselves would be disastrous; an i32 overflow cannot name a real process either.
        if pid <= 1 || pid == me || pid > i32::MAX as u32 {
            continue;
        }
        let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGKILL);
    }
    let deadline = Instant::now() + timeout;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| p > 1 && p != me && is_alive(p)).collect();
        if alive.is_empty() || Instant::now() >= deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_and_kills_a_child_with_its_descendants() {
        let mut child = std::process::Command::new("sh").args(["-c", "sleep 100 & sleep 100; :"]).spawn().unwrap();
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(5);
        let family = loop {
            let table = scan();
            let family = with_descendants(&table, &BTreeSet::from([pid]));
            if family.len() >= 3 || Instant::now() > deadline {
                break family;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(family.len(), 3, "sh and its two sleeps: {family:?}");
        assert!(family.iter().all(|&p| is_alive(p)));
        assert!(cmdline(pid).first().is_some_and(|a| a == "sh"));
        let left = kill_and_wait(&family, Duration::from_secs(5));
        assert!(left.is_empty(), "still alive: {left:?}");
        // Our own child is a zombie until reaped: is_alive must already say false.
        assert!(!is_alive(pid));
        child.wait().unwrap();
    }
}
