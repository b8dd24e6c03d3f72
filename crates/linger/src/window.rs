//! Disk and network rate windows for guests (the seed's `B_w / T_w ≤ R_t`,
//! as the kernel's throttles), applied only while the owner does I/O (its
//! disk bytes plus its network bytes, see [`crate::owner`] and
//! [`crate::netio`]) and removed (with hysteresis) once its I/O has been
//! quiet for the seed's 5 s window. An owner at the keyboard or using the
//! CPU does not switch them on: CPU is what `cpu.idle` protects, and a
//! guest's I/O hurts an owner only when the owner does I/O too. One
//! trigger for both windows: the owner's I/O of either kind.
//!
//! * Disk: `blkio.throttle.{read,write}_bps_device` of the guest group (v1
//!   `blkio`) on every whole disk of the machine. v1 throttles direct I/O
//!   and reads; buffered writeback is charged to the root group and escapes.
//! * Network: the guests' sockets are told apart by their cgroup2 group
//!   (`starling/NAME/guest` in the unified mount, which every guest joins):
//!   an nftables table `starling_NAME` in the agent's network namespace
//!   sets such packets' priority to [`NET_CLASS`], which an htb qdisc
//!   (handle [`NET_QDISC`]) on each interface but `lo` rate-limits; other
//!   traffic passes unshaped. An interface whose root qdisc is a `tbf` (the
//!   embedded cluster's `--host-link`) gets the htb below the tbf.
//!
//! Everything is removed by [`NetWindow::remove`] (also what a restarted
//! agent does first: a killed agent's table and qdiscs stay behind); the
//! disk rules go with the guest group.

use crate::cgroup::{CgroupError, Controller, Group};
use crate::nft::{delete_inet_table, inet_tables, program, run, CommandError, Nft};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The htb qdisc's handle (`0x5354`, "ST") on each interface.
pub const NET_QDISC: &str = "5354:";
/// The guests' class of that qdisc (what nftables sets as the packets' priority).
pub const NET_CLASS: &str = "5354:1";

/// Owner I/O (disk plus network, bytes/s) at or above which the windows are applied.
pub const OWNER_IO_HIGH: u64 = 1 << 20;
/// Owner I/O below this counts as quiet.
pub const OWNER_IO_LOW: u64 = 256 << 10;
/// Quiet samples in a row (one a second: the seed's 5 s window) before the windows are removed.
pub const QUIET_SAMPLES: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("disk window: {0}")]
    Cgroup(#[from] CgroupError),
    #[error("disk window: the guest group has no blkio directory (is the v1 blkio controller mounted?)")]
    NoBlkio,
    #[error("network window: no cgroup2 mount, so the guests' sockets cannot be told apart")]
    NoUnified,
    #[error("network window: {0}")]
    Command(#[from] CommandError),
}

/// What the hysteresis says to do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Apply,
    Remove,
    Keep,
}

/// Windows on as soon as the owner's I/O reaches [`OWNER_IO_HIGH`];
/// off only after [`QUIET_SAMPLES`] samples in a row below [`OWNER_IO_LOW`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hysteresis {
    pub applied: bool,
    quiet: u32,
}

impl Hysteresis {
    /// One sample of the owner's I/O rate (disk plus network).
    pub fn step(&mut self, owner_io_bps: u64) -> Step {
        if owner_io_bps >= OWNER_IO_HIGH {
            self.quiet = 0;
            if !self.applied {
                self.applied = true;
                return Step::Apply;
            }
            return Step::Keep;
        }
        if !self.applied {
            return Step::Keep;
        }
        if owner_io_bps < OWNER_IO_LOW {
            self.quiet += 1;
            if self.quiet >= QUIET_SAMPLES {
                self.applied = false;
                self.quiet = 0;
                return Step::Remove;
            }
        } else {
            // Between the thresholds: the windows stay, and the quiet run starts over.
            self.quiet = 0;
        }
        Step::Keep
    }
}

/// A whole disk: its name and `MAJ:MIN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    pub name: String,
    pub dev: String,
}

/// The machine's whole disks backed by a device (`/sys/block/*/device`:
/// not loop, ram or zram devices; v1 throttle rules take whole disks only).
pub fn disks() -> Vec<Disk> {
    let mut v: Vec<Disk> = std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("device").exists())
        .filter_map(|e| {
            let dev = std::fs::read_to_string(e.path().join("dev")).ok()?.trim().to_string();
            Some(Disk { name: e.file_name().to_string_lossy().into_owned(), dev })
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// The guests' disk window: read and write bytes/s per disk.
#[derive(Debug)]
pub struct DiskWindow {
    pub bps: u64,
    pub disks: Vec<Disk>,
}

const DISK_FILES: [&str; 2] = ["blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"];

impl DiskWindow {
    /// Limit the guest group's reads and writes on every disk to `bps`.
    pub fn apply(&self, guest: &Group) -> Result<(), WindowError> {
        self.set(guest, self.bps)
    }

    /// Lift the limits (a rule of 0 is removed).
    pub fn remove(&self, guest: &Group) -> Result<(), WindowError> {
        self.set(guest, 0)
    }

    fn set(&self, guest: &Group, bps: u64) -> Result<(), WindowError> {
        if guest.dir(Controller::Blkio).is_none() {
            return Err(WindowError::NoBlkio);
        }
        for d in &self.disks {
            for f in DISK_FILES {
                guest.write(Controller::Blkio, f, &format!("{} {bps}", d.dev))?;
            }
        }
        Ok(())
    }

    /// The rules the guest group holds now (`MAJ:MIN BPS` lines of both files).
    pub fn rules(guest: &Group) -> Vec<String> {
        DISK_FILES.iter().filter_map(|f| guest.read(Controller::Blkio, f).ok()).flat_map(|t| t.lines().map(str::to_string).collect::<Vec<_>>()).collect()
    }
}

/// Make the kernel count every group's disk bytes on `disks`.
///
/// v1 blkio keeps a group's `blkio.throttle.io_service_bytes*` (what the
/// owner monitor reads: the owner's group on an emulated host, every
/// starling group on a real one) only for a disk whose throttling is
/// active, and the kernel activates it when the first rule for that disk is
/// written, in any group; until then every group reads 0 bytes. A rule of 0
/// (no limit) on each disk activates it and limits nothing.
pub fn start_io_accounting(group: &Group, disks: &[Disk]) -> Result<(), WindowError> {
    if group.dir(Controller::Blkio).is_none() {
        return Err(WindowError::NoBlkio);
    }
    for d in disks {
        group.write(Controller::Blkio, DISK_FILES[0], &format!("{} 0", d.dev))?;
    }
    Ok(())
}

/// The guests' network window in the agent's network namespace.
#[derive(Debug)]
pub struct NetWindow {
    pub bps: u64,
    /// The nftables table (`inet` family).
    pub table: String,
    /// `nft` resolving the guest group below the cgroup2 mount.
    nft: Nft,
    guest_rel: PathBuf,
}

fn tc(args: &[&str]) -> Result<String, WindowError> {
    let mut c = Command::new(program("tc"));
    c.args(args);
    Ok(run(c, None)?)
}

/// The network interfaces of this namespace but `lo` (asked of `ip`: `/sys/class/net` shows the
/// namespace sysfs was mounted in, which need not be ours).
pub fn interfaces() -> Result<Vec<String>, WindowError> {
    let mut c = Command::new(program("ip"));
    c.args(["-o", "link", "show"]);
    Ok(link_names(&run(c, None)?))
}

/// Names in `ip -o link show` lines (`2: eth0@if5: <...> ...`), but `lo`.
fn link_names(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?;
            Some(name.split('@').next()?.trim().to_string())
        })
        .filter(|n| !n.is_empty() && n != "lo")
        .collect();
    v.sort();
    v.dedup();
    v
}

/// From `tc qdisc show dev IF`: where our htb sits (`root` or `parent X:Y`), if it is there.
fn our_qdisc_parent(show: &str) -> Option<Vec<String>> {
    for line in show.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 4 && f[0] == "qdisc" && f[1] == "htb" && f[2] == NET_QDISC {
            return Some(match f[3] {
                "root" => vec!["root".into()],
                "parent" => vec!["parent".into(), f.get(4)?.to_string()],
                _ => continue,
            });
        }
    }
    None
}

/// Where a new htb goes on an interface whose `tc qdisc show dev IF root` is `show`: below a tbf
/// (the host-link emulation, whose one class is `H:1`), else at the root (replacing a default qdisc).
fn new_qdisc_parent(show: &str) -> Vec<String> {
    for line in show.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 4 && f[0] == "qdisc" && f[1] == "tbf" && f[3] == "root" {
            return vec!["parent".into(), format!("{}1", f[2])];
        }
    }
    vec!["root".into()]
}

impl NetWindow {
    /// A window for the guest group `guest_rel` (relative to the cgroup2 mount `unified`); `name`
    /// (the agent's cgroup name) names the nftables table.
    pub fn new(bps: u64, unified: &Path, guest_rel: &Path, name: &str) -> NetWindow {
        let table = format!("starling_{}", name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect::<String>());
        NetWindow { bps, table, nft: Nft::new(unified), guest_rel: guest_rel.to_path_buf() }
    }

    /// Shape the guests' sends on every interface but `lo`; returns the interfaces.
    pub fn apply(&self) -> Result<Vec<String>, WindowError> {
        // Whatever an earlier agent left first: applying twice must not stack qdiscs.
        self.remove()?;
        let bits = format!("{}bit", self.bps.saturating_mul(8).max(8));
        let ifaces = interfaces()?;
        for i in &ifaces {
            let parent = new_qdisc_parent(&tc(&["qdisc", "show", "dev", i, "root"])?);
            let mut add: Vec<&str> = vec!["qdisc", "add", "dev", i];
            add.extend(parent.iter().map(String::as_str));
            add.extend(["handle", NET_QDISC, "htb"]);
            tc(&add)?;
            tc(&["class", "add", "dev", i, "parent", NET_QDISC, "classid", NET_CLASS, "htb", "rate", &bits, "ceil", &bits])?;
        }
        let level = self.guest_rel.components().count();
        let script = format!(
            "add table inet {t}\nadd chain inet {t} guests {{ type filter hook output priority 0; policy accept; }}\n\
             add rule inet {t} guests socket cgroupv2 level {level} \"{rel}\" meta priority set {NET_CLASS}\n",
            t = self.table,
            rel = self.guest_rel.display(),
        );
        self.nft.apply(&script)?;
        Ok(ifaces)
    }

    /// Remove the table and every interface's htb of ours (nothing there is fine).
    pub fn remove(&self) -> Result<(), WindowError> {
        delete_inet_table(&self.table)?;
        for i in interfaces()? {
            // An interface that went away meanwhile has nothing left to remove.
            let Ok(show) = tc(&["qdisc", "show", "dev", &i]) else { continue };
            if let Some(parent) = our_qdisc_parent(&show) {
                let mut del: Vec<&str> = vec!["qdisc", "del", "dev", &i];
                del.extend(parent.iter().map(String::as_str));
                del.extend(["handle", NET_QDISC]);
                tc(&del)?;
            }
        }
        Ok(())
    }

    /// Whether this namespace holds the table.
    pub fn has_table(&self) -> Result<bool, WindowError> {
        Ok(inet_tables()?.contains(&self.table))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hysteresis_applies_at_once_on_owner_io_and_removes_after_a_quiet_window() {
        let mut h = Hysteresis::default();
        assert_eq!(h.step(0), Step::Keep, "an owner doing no I/O changes nothing");
        assert_eq!(h.step(OWNER_IO_LOW), Step::Keep, "I/O between the thresholds does not apply");
        assert_eq!(h.step(OWNER_IO_HIGH), Step::Apply, "owner I/O applies at once");
        assert_eq!(h.step(OWNER_IO_HIGH), Step::Keep);
        for i in 1..QUIET_SAMPLES {
            assert_eq!(h.step(0), Step::Keep, "quiet sample {i} of {QUIET_SAMPLES}");
        }
        assert_eq!(h.step(0), Step::Remove);
        assert!(!h.applied);
        // I/O between the thresholds keeps the windows and restarts the count.
        assert_eq!(h.step(OWNER_IO_HIGH), Step::Apply);
        for _ in 1..QUIET_SAMPLES {
            assert_eq!(h.step(0), Step::Keep);
        }
        assert_eq!(h.step(OWNER_IO_LOW), Step::Keep, "between the thresholds is not quiet");
        for _ in 1..QUIET_SAMPLES {
            assert_eq!(h.step(OWNER_IO_LOW - 1), Step::Keep);
        }
        assert_eq!(h.step(OWNER_IO_LOW - 1), Step::Remove);
    }

    #[test]
    fn link_names_skip_lo_and_peer_suffixes() {
        let text = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\\    link/loopback 00:00:00:00:00:00\n\
                    2: v1@v0: <BROADCAST,MULTICAST,M-DOWN> mtu 1500 qdisc noop state DOWN\n\
                    3: eth0@if17: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc htb state UP\n";
        assert_eq!(link_names(text), vec!["eth0".to_string(), "v1".to_string()]);
    }

    #[test]
    fn finds_our_qdisc_where_it_sits() {
        let root = "qdisc htb 5354: root refcnt 2 r2q 10 default 0 direct_packets_stat 3 direct_qlen 1000\n";
        assert_eq!(our_qdisc_parent(root), Some(vec!["root".to_string()]));
        let below = "qdisc tbf 8001: root refcnt 2 rate 100Mbit burst 16Kb lat 50ms\n\
                     qdisc htb 5354: parent 8001:1 r2q 10 default 0 direct_packets_stat 0 direct_qlen 1000\n";
        assert_eq!(our_qdisc_parent(below), Some(vec!["parent".to_string(), "8001:1".to_string()]));
        assert_eq!(our_qdisc_parent("qdisc htb 1: root refcnt 2\nqdisc noqueue 0: root refcnt 2\n"), None);
    }

    #[test]
    fn a_new_htb_goes_below_a_tbf_else_at_the_root() {
        assert_eq!(new_qdisc_parent("qdisc tbf 8001: root refcnt 2 rate 100Mbit\n"), vec!["parent", "8001:1"]);
        assert_eq!(new_qdisc_parent("qdisc noqueue 0: root refcnt 2\n"), vec!["root"]);
        assert_eq!(new_qdisc_parent(""), vec!["root"]);
    }
}
