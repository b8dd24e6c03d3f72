//! The guest group of one agent: every process the agent starts for a task
//! joins it before it runs anything (see [`Guest::join`]).
//!
//! * CPU: `cpu.idle = 1` in the v1 `cpu` hierarchy (Linux 5.15+): the
//!   group's tasks run only when nothing else wants the CPU and a waking
//!   owner task preempts them at once. Without it (no `cpu` hierarchy, or no
//!   `cpu.idle`), each task is started at `SCHED_IDLE` instead (logged).
//! * Memory: a LowWater/HighWater band on the machine's free memory
//!   (`MemAvailable`), see [`MemoryBand`]. Below LowWater the group's
//!   `memory.limit_in_bytes` is lowered to what it uses now, so guests
//!   cannot grow into memory the owner needs; with `memory.oom_control`
//!   `oom_kill_disable = 1`, a guest that reaches the cap waits (it is not
//!   killed) until the cap is lifted. Below half of LowWater (the owner keeps
//!   growing) the guest is frozen (`freezer.state = FROZEN`). There is no
//!   swap here, so neither gives memory back: only the guest leaving does.
//!   The agent reports the hold and the band (`OwnerReport::guest_mem_cap`,
//!   `guests_frozen`, `low_water`, `high_water`); the head moves LL and PM
//!   guests of a held host away at once, reruns IE ones elsewhere, and
//!   leaves LF ones held (`head::linger`). As the last line, every guest process has
//!   `oom_score_adj = 1000`: if the machine runs out of memory the kernel's
//!   OOM killer takes a guest before any owner process. Above HighWater the
//!   guest is thawed and uncapped.
//! * Suspension (the PM policy): tasks whose policy is PM join the freezer
//!   group `guest/pm` instead of `guest` (every other controller is the
//!   guest's), and only that group is frozen while the owner is active, so
//!   one host runs PM tasks beside lingering ones. A v1 freezer group is
//!   frozen while it or an ancestor is, so the band's freeze of `guest`
//!   holds the PM tasks too and its release leaves them suspended.

use crate::cgroup::{self, CgroupError, Controller, Group, Hierarchies};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("guest cgroup: {0}")]
    Cgroup(#[from] CgroupError),
    #[error("bad cgroup name {0:?}: letters, digits, '-', '_' and '.' only")]
    BadName(String),
}

/// How guests get starvation CPU priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuPriority {
    /// The group's `cpu.idle = 1`.
    CgroupIdle,
    /// Per task `SCHED_IDLE` (no `cpu.idle` here).
    SchedIdle,
}

impl CpuPriority {
    pub fn as_str(self) -> &'static str {
        match self {
            CpuPriority::CgroupIdle => "cpu.idle",
            CpuPriority::SchedIdle => "SCHED_IDLE",
        }
    }
}

/// The band on free memory (`MemAvailable`, bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBand {
    /// Below this the guests are capped at what they use.
    pub low_water: u64,
    /// Above this the cap (and a freeze) is lifted.
    pub high_water: u64,
}

/// What the band says to do with the guests now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BandAction {
    Nothing,
    Cap,
    Freeze,
    Release,
}

/// Where the guests stand in the band.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BandState {
    pub capped: bool,
    pub frozen: bool,
    /// The PM tasks' freezer group (`guest/pm`) is frozen.
    pub suspended: bool,
}

impl MemoryBand {
    /// The next action for free memory `available` (hysteresis: capped below
    /// LowWater, frozen below LowWater/2, released only above HighWater).
    pub fn step(&self, available: u64, st: BandState) -> BandAction {
        if st.capped || st.frozen {
            if available >= self.high_water {
                return BandAction::Release;
            }
            if !st.frozen && available < self.low_water / 2 {
                return BandAction::Freeze;
            }
            return BandAction::Nothing;
        }
        if available < self.low_water {
            if available < self.low_water / 2 {
                return BandAction::Freeze;
            }
            return BandAction::Cap;
        }
        BandAction::Nothing
    }
}

/// What a process must do to become a guest (done by the sandbox before exec).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Join {
    /// Write `0` (itself) into each.
    pub procs_files: Vec<PathBuf>,
    /// Write `0` into each as the last step before the program runs its own
    /// code (a restored task: [`Guest::join_restored`]); empty otherwise.
    pub at_resume: Vec<PathBuf>,
    /// Switch to `SCHED_IDLE` (the fallback).
    pub sched_idle: bool,
    /// Its `oom_score_adj`.
    pub oom_score_adj: Option<i32>,
}

/// The agent's guest group (and its host's owner group).
#[derive(Debug)]
pub struct Guest {
    h: Hierarchies,
    /// `starling/NAME`.
    host_rel: PathBuf,
    group: Group,
    /// `guest/pm` in the freezer hierarchy: where tasks that PM suspends freeze.
    pm: Option<PathBuf>,
    owner: Group,
    /// The guest group in the cgroup2 mount (its sockets are what the network window shapes).
    unified: Option<PathBuf>,
    /// The owner group in the cgroup2 mount (an emulated owner's sockets are what its network I/O is).
    owner_unified: Option<PathBuf>,
    pub cpu: CpuPriority,
    state: std::sync::Mutex<BandState>,
}

/// The PM tasks' freezer group, below the guest group.
pub const PM_GROUP: &str = "pm";

/// `starling/NAME/guest`.
pub fn guest_rel(name: &str) -> PathBuf {
    Path::new(cgroup::ROOT).join(name).join("guest")
}

/// `starling/NAME/owner`.
pub fn owner_rel(name: &str) -> PathBuf {
    Path::new(cgroup::ROOT).join(name).join("owner")
}

fn check_name(name: &str) -> Result<(), GuestError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(GuestError::BadName(name.to_string()))
    }
}

/// `cpu.idle = 1` on `rel` and each of its ancestors below the `cpu` hierarchy's root.
fn set_idle_chain(h: &Hierarchies, rel: &Path) -> Result<(), CgroupError> {
    let root = h.dir(Controller::Cpu).ok_or(CgroupError::NotMounted(Controller::Cpu))?;
    let mut at = root.to_path_buf();
    for part in rel.components() {
        at.push(part);
        let f = at.join("cpu.idle");
        std::fs::write(&f, "1").map_err(|source| CgroupError::Io { path: f, source })?;
    }
    Ok(())
}

/// How long removal waits for killed guests to leave.
const PATIENCE: Duration = Duration::from_secs(10);

impl Guest {
    /// Remove a stale guest group of this name (a killed agent's: its
    /// processes are killed), then make a fresh one, and the owner group
    /// beside it if missing. With `in_unified`, guests also join the guest
    /// group in the cgroup2 mount (the network window tells their sockets
    /// apart by it), and an emulated owner joins the owner group there (its
    /// network I/O is counted by it).
    pub fn create(h: Hierarchies, name: &str, in_unified: bool) -> Result<Guest, GuestError> {
        check_name(name)?;
        let rel = guest_rel(name);
        let stale = cgroup::remove_tree(&h, &rel, PATIENCE)?;
        if !stale.is_empty() {
            log::warn!("removed a stale guest cgroup {} ({} directories; an earlier agent was killed)", rel.display(), stale.len());
        }
        let group =
            Group::create(&h, &rel, &[Controller::Cpuacct, Controller::Memory, Controller::Freezer], &[Controller::Cpu, Controller::Blkio])?;
        // The owner's blkio group counts an emulated owner's I/O.
        let owner = Group::create(&h, &owner_rel(name), &[Controller::Cpuacct, Controller::Memory], &[Controller::Blkio])?;
        let in_unified_dir = |rel: &Path| match h.unified() {
            Some(u) if in_unified => {
                let dir = u.join(rel);
                std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Io { path: dir.clone(), source })?;
                Ok(Some(dir))
            }
            _ => Ok::<_, CgroupError>(None),
        };
        let unified = in_unified_dir(&rel)?;
        let owner_unified = in_unified_dir(&owner_rel(name))?;
        // cpu.idle ranks a group against its siblings only: the guest's
        // ancestors under the hierarchy's root must be idle too, or they
        // compete with the owner's tasks at normal weight.
        let cpu = match set_idle_chain(&h, &rel) {
            Ok(()) => CpuPriority::CgroupIdle,
            Err(e) => {
                log::warn!("guests run at SCHED_IDLE per task: cannot set cpu.idle ({e})");
                CpuPriority::SchedIdle
            }
        };
        // A guest at its cap waits instead of being killed by the group's OOM killer.
        if let Err(e) = group.write(Controller::Memory, "memory.oom_control", "1") {
            log::warn!("guests at their memory cap may be OOM-killed: {e}");
        }
        let _ = group.write(Controller::Memory, "memory.limit_in_bytes", "-1");
        let pm = match group.dir(Controller::Freezer) {
            Some(d) => {
                let dir = d.join(PM_GROUP);
                std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Io { path: dir.clone(), source })?;
                Some(dir)
            }
            None => None,
        };
        let host_rel = Path::new(cgroup::ROOT).join(name);
        Ok(Guest { h, host_rel, group, pm, owner, unified, owner_unified, cpu, state: std::sync::Mutex::new(BandState::default()) })
    }

    /// What each task's first process does before exec; a `suspendable`
    /// task (policy PM) joins the PM freezer group instead of the guest's.
    pub fn join(&self, suspendable: bool) -> Join {
        let mut procs_files = self.group.procs_files();
        if let (true, Some(pm), Some(fz)) = (suspendable, &self.pm, self.group.dir(Controller::Freezer)) {
            let guest_freezer = fz.join("cgroup.procs");
            for f in procs_files.iter_mut().filter(|f| **f == guest_freezer) {
                *f = pm.join("cgroup.procs");
            }
        }
        procs_files.extend(self.unified.iter().map(|d| d.join("cgroup.procs")));
        Join {
            procs_files,
            at_resume: Vec::new(),
            sched_idle: self.cpu == CpuPriority::SchedIdle,
            oom_score_adj: Some(1000),
        }
    }

    /// What a task restored here (moved in) does: [`Guest::join`], except
    /// that its CPU and freezer groups are joined only as the restore's last
    /// step, right before the task runs its own code (the files of
    /// [`Join::at_resume`]). Its restore (reading pages, mapping memory,
    /// the restorer's setup) is not guest work: at `cpu.idle` under a busy
    /// owner it barely ran, and frozen by PM it stopped halfway. The memory,
    /// cpuacct and I/O groups account for it from the start.
    pub fn join_restored(&self, suspendable: bool) -> Join {
        let mut j = self.join(suspendable);
        // In this order: the freezer last, since a frozen one stops the process at its write.
        let late: Vec<PathBuf> = [Controller::Cpu, Controller::Freezer]
            .into_iter()
            .filter_map(|c| self.group.dir(c))
            .map(|d| d.join("cgroup.procs"))
            .chain(self.pm.iter().map(|d| d.join("cgroup.procs")))
            .collect();
        j.at_resume = late.into_iter().filter(|f| j.procs_files.contains(f)).collect();
        j.procs_files.retain(|f| !j.at_resume.contains(f));
        j
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The PM tasks' freezer group (`guest/pm`), if there is a freezer hierarchy.
    pub fn pm_dir(&self) -> Option<&Path> {
        self.pm.as_deref()
    }

    /// Processes in the PM tasks' freezer group.
    pub fn pm_pids(&self) -> Vec<i32> {
        self.pm.as_ref().map(|d| cgroup::read_pids(&d.join("cgroup.procs"))).unwrap_or_default()
    }

    pub fn owner_group(&self) -> &Group {
        &self.owner
    }

    /// `starling/NAME/guest`.
    pub fn rel(&self) -> &Path {
        &self.group.rel
    }

    /// The guest group in the cgroup2 mount, if guests join it.
    pub fn unified_dir(&self) -> Option<&Path> {
        self.unified.as_deref()
    }

    /// The owner group in the cgroup2 mount, if there is one.
    pub fn owner_unified_dir(&self) -> Option<&Path> {
        self.owner_unified.as_deref()
    }

    /// CPU time of all guests so far (ns, `cpuacct.usage`).
    pub fn cpu_ns(&self) -> u64 {
        self.group.read_u64(Controller::Cpuacct, "cpuacct.usage").unwrap_or(0)
    }

    /// Memory the guests use (`memory.usage_in_bytes`).
    pub fn memory_bytes(&self) -> u64 {
        self.group.read_u64(Controller::Memory, "memory.usage_in_bytes").unwrap_or(0)
    }

    /// The cap, if one is set.
    pub fn memory_cap(&self) -> Option<u64> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).capped.then(|| {
            self.group.read_u64(Controller::Memory, "memory.limit_in_bytes").unwrap_or(0)
        })
    }

    pub fn band_state(&self) -> BandState {
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Apply the band for free memory `available`; returns what was done.
    pub fn apply_band(&self, band: &MemoryBand, available: u64) -> Result<BandAction, GuestError> {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let action = band.step(available, *st);
        match action {
            BandAction::Nothing => {}
            BandAction::Cap => {
                self.cap()?;
                st.capped = true;
            }
            BandAction::Freeze => {
                if !st.capped {
                    self.cap()?;
                    st.capped = true;
                }
                self.group.write(Controller::Freezer, "freezer.state", "FROZEN")?;
                st.frozen = true;
            }
            BandAction::Release => {
                if st.frozen {
                    self.group.write(Controller::Freezer, "freezer.state", "THAWED")?;
                }
                st.frozen = false;
                self.group.write(Controller::Memory, "memory.limit_in_bytes", "-1")?;
                st.capped = false;
            }
        }
        Ok(action)
    }

    /// Suspend (freeze) or resume the PM tasks' group. Independent of the
    /// band: its freeze of the whole guest group holds them too.
    pub fn suspend(&self, on: bool) -> Result<(), GuestError> {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if st.suspended == on {
            return Ok(());
        }
        let Some(pm) = &self.pm else { return Err(CgroupError::NotMounted(Controller::Freezer).into()) };
        let f = pm.join("freezer.state");
        std::fs::write(&f, if on { "FROZEN" } else { "THAWED" }).map_err(|source| CgroupError::Io { path: f, source })?;
        st.suspended = on;
        Ok(())
    }

    /// Lower the limit to what the guests use now (it may grow between the
    /// read and the write: then the write fails with EBUSY and is retried).
    fn cap(&self) -> Result<(), GuestError> {
        let mut tries = 0;
        loop {
            let used = self.memory_bytes().max(1 << 20);
            // Round up to a page.
            let cap = used.div_ceil(4096) * 4096;
            match self.group.write(Controller::Memory, "memory.limit_in_bytes", &cap.to_string()) {
                Ok(()) => return Ok(()),
                Err(e) if tries >= 10 => return Err(e.into()),
                Err(_) => tries += 1,
            }
        }
    }

    /// Kill every guest and remove the guest group; the owner group and the
    /// host's directory go too if nothing runs there.
    pub fn remove(&self) -> Result<(), GuestError> {
        cgroup::remove_tree(&self.h, &self.group.rel, PATIENCE)?;
        cgroup::remove_if_empty(&self.h, &self.owner.rel);
        cgroup::remove_if_empty(&self.h, &self.host_rel);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn band_has_hysteresis() {
        let band = MemoryBand { low_water: 1000 * MIB, high_water: 2000 * MIB };
        let free = BandState::default();
        let capped = BandState { capped: true, frozen: false, suspended: false };
        let frozen = BandState { capped: true, frozen: true, suspended: false };
        assert_eq!(band.step(3000 * MIB, free), BandAction::Nothing);
        assert_eq!(band.step(1500 * MIB, free), BandAction::Nothing, "inside the band nothing starts");
        assert_eq!(band.step(999 * MIB, free), BandAction::Cap);
        assert_eq!(band.step(1500 * MIB, capped), BandAction::Nothing, "inside the band nothing is released");
        assert_eq!(band.step(2000 * MIB, capped), BandAction::Release);
        assert_eq!(band.step(499 * MIB, capped), BandAction::Freeze);
        assert_eq!(band.step(499 * MIB, free), BandAction::Freeze, "a sudden drop freezes at once");
        assert_eq!(band.step(100 * MIB, frozen), BandAction::Nothing);
        assert_eq!(band.step(1999 * MIB, frozen), BandAction::Nothing);
        assert_eq!(band.step(2500 * MIB, frozen), BandAction::Release);
    }

    #[test]
    fn names_are_single_path_components() {
        assert!(check_name("starling6-h1").is_ok());
        assert!(check_name("host.example").is_ok());
        for bad in ["", "..", "a/b", "a b"] {
            assert!(matches!(check_name(bad), Err(GuestError::BadName(_))), "{bad:?}");
        }
    }
}
