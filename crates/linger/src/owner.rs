//! The owner monitor: how busy the machine's owner is.
//!
//! * Owner CPU `h` (share of all the host's cores): on an emulated host the
//!   owner cgroup's `cpuacct.usage` (what `starling owner HOST -- CMD` runs
//!   is charged there); on a real host every CPU cycle of `/proc/stat` that
//!   is not the guest group's (`cpuacct.usage`) nor idle.
//! * Owner I/O (bytes/s read and written on disk): on an emulated host the
//!   owner's blkio group; on a real host the whole disks' sectors of
//!   `/proc/diskstats` minus those of every group under `starling/` (the
//!   guests of every agent on the machine; v1 charges buffered writeback to
//!   no group, so a guest's writeback counts as the owner's).
//! * Owner network I/O (bytes/s sent and received on interfaces but `lo`):
//!   nftables counters in the agent's network namespace, see [`crate::netio`]
//!   (only where the guests' rate windows are configured).
//! * Free memory: `MemAvailable` of `/proc/meminfo`.
//! * Keyboard: on an emulated host, what `starling owner HOST --active|--idle`
//!   wrote into the agent's state directory; on a real host, the newest
//!   access time of a terminal (`/dev/tty[0-9]*`, `/dev/pts/*`, what `w`
//!   shows) within the last minute.
//!
//! The owner is *idle* with no keyboard activity and CPU < 10% (the NOW
//! rule of the seed's traces), *active-busy* at ≥ 50% CPU, else
//! *active-light*.

use std::path::{Path, PathBuf};
use crate::netio::NetCounters;
use std::time::{Duration, Instant, SystemTime};

/// Owner CPU below this (share of the host) counts as idle.
pub const IDLE_CPU: f64 = 0.10;
/// Owner CPU at or above this is busy.
pub const BUSY_CPU: f64 = 0.50;
/// A keystroke keeps the owner active this long.
pub const KEYBOARD_WINDOW: Duration = Duration::from_secs(60);
/// The file (in the agent's state directory) `starling owner --active|--idle` writes.
pub const KEYBOARD_FILE: &str = "owner-keyboard";

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OwnerState {
    Idle,
    ActiveLight,
    ActiveBusy,
}

impl OwnerState {
    pub fn as_str(self) -> &'static str {
        match self {
            OwnerState::Idle => "idle",
            OwnerState::ActiveLight => "active-light",
            OwnerState::ActiveBusy => "active-busy",
        }
    }

    pub fn classify(cpu: f64, keyboard: Keyboard) -> OwnerState {
        if cpu >= BUSY_CPU {
            OwnerState::ActiveBusy
        } else if keyboard == Keyboard::Idle && cpu < IDLE_CPU {
            OwnerState::Idle
        } else {
            OwnerState::ActiveLight
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keyboard {
    Idle,
    Active,
}

/// Where the owner's CPU time is read.
#[derive(Clone, Debug)]
pub enum OwnerCpu {
    /// An emulated host: the owner group's `cpuacct.usage`.
    Cgroup { usage: PathBuf },
    /// A real host: `/proc/stat` busy time minus the guests' `cpuacct.usage`.
    Machine { guest_usage: PathBuf },
}

/// Where the owner's disk I/O is read.
#[derive(Clone, Debug)]
pub enum OwnerIo {
    /// An emulated host: the owner group's `blkio.throttle.io_service_bytes_recursive`.
    Cgroup { stats: PathBuf },
    /// A real host: `/proc/diskstats` minus `blkio.throttle.io_service_bytes_recursive` of the
    /// `starling/` tree (every agent's guests on this machine, not only this agent's).
    Machine { starling_stats: PathBuf },
}

/// The `Total` of a `blkio.throttle.io_service_bytes_recursive` (0 if absent).
fn blkio_total(stats: &Path) -> u64 {
    std::fs::read_to_string(stats)
        .ok()
        .and_then(|t| t.lines().find_map(|l| l.strip_prefix("Total ").and_then(|n| n.trim().parse().ok())))
        .unwrap_or(0)
}

/// Bytes read and written on the machine's whole disks so far (`/proc/diskstats` sectors × 512).
fn disk_bytes() -> u64 {
    let disks: Vec<String> = crate::window::disks().into_iter().map(|d| d.name).collect();
    std::fs::read_to_string("/proc/diskstats")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if !disks.iter().any(|d| Some(&d.as_str()) == f.get(2)) {
                return None;
            }
            let sectors = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            Some((sectors(5) + sectors(9)) * 512)
        })
        .sum()
}

impl OwnerIo {
    /// The owner's bytes so far.
    fn bytes(&self) -> u64 {
        match self {
            OwnerIo::Cgroup { stats } => blkio_total(stats),
            OwnerIo::Machine { starling_stats } => disk_bytes().saturating_sub(blkio_total(starling_stats)),
        }
    }
}

/// Where the keyboard state comes from.
#[derive(Clone, Debug)]
pub enum KeyboardSource {
    /// `starling owner HOST --active|--idle` writes this file.
    File(PathBuf),
    /// Terminal access times.
    Terminals,
}

/// One look at the owner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OwnerSample {
    /// Share of all cores the owner used since the last sample (0..=1).
    pub cpu: f64,
    /// Share of all cores the guests used since the last sample.
    pub guest_cpu: f64,
    pub keyboard: Keyboard,
    pub mem_available: u64,
    /// The owner's disk I/O since the last sample (bytes/s).
    pub disk_bps: u64,
    /// The owner's network I/O since the last sample (bytes/s sent and received).
    pub net_bps: u64,
    pub state: OwnerState,
}

/// Samples the owner; each [`Monitor::sample`] covers the time since the previous one.
pub struct Monitor {
    cpu: OwnerCpu,
    guest_usage: PathBuf,
    keyboard: KeyboardSource,
    io: OwnerIo,
    net: Option<NetCounters>,
    /// The network counters failed: said once in the log, then counted as 0.
    net_failed: bool,
    cores: u32,
    last: Option<Last>,
}

/// The previous sample's counters.
#[derive(Clone, Copy)]
struct Last {
    at: Instant,
    guest_ns: u64,
    owner_ns: u64,
    /// The machine's total CPU time (a real host).
    total_ns: u64,
    disk_bytes: u64,
    net_bytes: u64,
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// (busy, total) time of the machine in ns from `/proc/stat`'s first line.
fn machine_times() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?;
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest, guest_nice are in user/nice).
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    let total = busy + get(3) + get(4);
    // SAFETY: sysconf with a constant name.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100).max(1);
    Some((busy * (1_000_000_000 / hz), total * (1_000_000_000 / hz)))
}

/// `MemAvailable` in bytes.
pub fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("MemAvailable:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

fn keyboard(src: &KeyboardSource) -> Keyboard {
    match src {
        KeyboardSource::File(p) => match std::fs::read_to_string(p) {
            Ok(s) if s.trim() == "active" => Keyboard::Active,
            _ => Keyboard::Idle,
        },
        KeyboardSource::Terminals => {
            let now = SystemTime::now();
            let mut paths: Vec<PathBuf> =
                std::fs::read_dir("/dev/pts").into_iter().flatten().flatten().map(|e| e.path()).collect();
            for e in std::fs::read_dir("/dev").into_iter().flatten().flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.strip_prefix("tty").is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit())) {
                    paths.push(e.path());
                }
            }
            let recent = paths.iter().filter_map(|p| std::fs::metadata(p).ok()?.accessed().ok()).any(|t| {
                now.duration_since(t).map_or(true, |age| age < KEYBOARD_WINDOW)
            });
            if recent {
                Keyboard::Active
            } else {
                Keyboard::Idle
            }
        }
    }
}

/// `part` of `whole` ns as a share in 0..=1.
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    #[allow(clippy::cast_precision_loss, reason = "a CPU share; ns counts fit a double's 52 bits for centuries")]
    let s = part as f64 / whole as f64;
    s.clamp(0.0, 1.0)
}

impl Monitor {
    /// `net`: the owner's network counters (`None`: network I/O is not measured).
    pub fn new(cpu: OwnerCpu, guest_usage: PathBuf, keyboard: KeyboardSource, io: OwnerIo, net: Option<NetCounters>, cores: u32) -> Monitor {
        Monitor { cpu, guest_usage, keyboard, io, net, net_failed: false, cores: cores.max(1), last: None }
    }

    /// The owner's network bytes so far (0 if not measured).
    fn net_bytes(&mut self) -> u64 {
        let Some(n) = &self.net else { return 0 };
        match n.owner_bytes() {
            Ok(b) => b,
            Err(e) => {
                if !self.net_failed {
                    log::warn!("owner network I/O not measured: {e}");
                    self.net_failed = true;
                }
                0
            }
        }
    }


    /// The owner since the previous call (the first call only starts the interval and reports 0 CPU).
    pub fn sample(&mut self) -> OwnerSample {
        let now = Instant::now();
        let guest = read_u64(&self.guest_usage).unwrap_or(0);
        let (owner, total) = match &self.cpu {
            OwnerCpu::Cgroup { usage } => (read_u64(usage).unwrap_or(0), 0),
            OwnerCpu::Machine { .. } => machine_times().unwrap_or((0, 0)),
        };
        let disk = self.io.bytes();
        let net = self.net_bytes();
        let (disk_bps, net_bps) = match self.last {
            None => (0, 0),
            Some(l) => {
                let ms = u64::try_from(now.duration_since(l.at).as_millis()).unwrap_or(u64::MAX).max(1);
                let per_s = |now: u64, then: u64| now.saturating_sub(then).saturating_mul(1000) / ms;
                (per_s(disk, l.disk_bytes), per_s(net, l.net_bytes))
            }
        };
        let (cpu, guest_cpu) = match self.last {
            None => (0.0, 0.0),
            Some(l) => {
                let wall = u64::try_from(now.duration_since(l.at).as_nanos()).unwrap_or(u64::MAX) * u64::from(self.cores);
                let dg = guest.saturating_sub(l.guest_ns);
                match &self.cpu {
                    OwnerCpu::Cgroup { .. } => (share(owner.saturating_sub(l.owner_ns), wall), share(dg, wall)),
                    OwnerCpu::Machine { .. } => {
                        let whole = total.saturating_sub(l.total_ns);
                        (share(owner.saturating_sub(l.owner_ns).saturating_sub(dg), whole), share(dg, whole))
                    }
                }
            }
        };
        self.last = Some(Last { at: now, guest_ns: guest, owner_ns: owner, total_ns: total, disk_bytes: disk, net_bytes: net });
        let kb = keyboard(&self.keyboard);
        OwnerSample {
            cpu,
            guest_cpu,
            keyboard: kb,
            mem_available: mem_available(),
            disk_bps,
            net_bps,
            state: OwnerState::classify(cpu, kb),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_like_the_seed() {
        assert_eq!(OwnerState::classify(0.05, Keyboard::Idle), OwnerState::Idle);
        assert_eq!(OwnerState::classify(0.05, Keyboard::Active), OwnerState::ActiveLight);
        assert_eq!(OwnerState::classify(0.20, Keyboard::Idle), OwnerState::ActiveLight);
        assert_eq!(OwnerState::classify(0.90, Keyboard::Idle), OwnerState::ActiveBusy);
        assert_eq!(OwnerState::classify(0.50, Keyboard::Active), OwnerState::ActiveBusy);
    }

    #[test]
    fn keyboard_file_says_active_or_idle() {
        let dir = std::env::temp_dir().join(format!("starling-linger-kb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(KEYBOARD_FILE);
        let src = KeyboardSource::File(f.clone());
        assert_eq!(keyboard(&src), Keyboard::Idle, "no file: idle");
        std::fs::write(&f, "active\n").unwrap();
        assert_eq!(keyboard(&src), Keyboard::Active);
        std::fs::write(&f, "idle\n").unwrap();
        assert_eq!(keyboard(&src), Keyboard::Idle);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn blkio_total_is_the_total_line() {
        let dir = std::env::temp_dir().join(format!("starling-linger-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("blkio.throttle.io_service_bytes_recursive");
        assert_eq!(blkio_total(&f), 0, "no file: nothing");
        std::fs::write(&f, "254:0 Read 4096\n254:0 Write 8192\n254:0 Total 12288\nTotal 12288\n").unwrap();
        assert_eq!(blkio_total(&f), 12288);
        std::fs::write(&f, "Total 0\n").unwrap();
        assert_eq!(blkio_total(&f), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shares_are_clamped() {
        assert!((share(1, 4) - 0.25).abs() < 1e-12);
        assert!((share(5, 4) - 1.0).abs() < 1e-12);
        assert!(share(1, 0).abs() < 1e-12);
    }
}
