//! The agent's side of Linger-Longer (see `starling_linger`): the guest
//! cgroup every task's processes start in, the owner monitor that samples
//! the host once a second, applies the memory band and keeps the report
//! the agent sends the head with its load.

use starling_config::{AgentSettings, GuestPolicy, OwnerKind};
use starling_linger::guest::{BandAction, Guest, MemoryBand};
use starling_linger::owner::{KeyboardSource, Monitor, OwnerCpu, KEYBOARD_FILE};
use starling_linger::{cgroup::Controller, Hierarchies, Keyboard};
use starling_proto::OwnerReport;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the owner is sampled.
pub(crate) const PERIOD: Duration = Duration::from_secs(1);

/// The agent's guest group, if it could be made.
pub(crate) struct Linger {
    pub guest: Option<Arc<Guest>>,
    pub report: Arc<Mutex<Option<OwnerReport>>>,
}

const MIB: u64 = 1 << 20;

impl Linger {
    /// No guest group: the home site runs the user's own work.
    pub fn none() -> Linger {
        Linger { guest: None, report: Arc::new(Mutex::new(None)) }
    }

    /// Make the guest group (removing a stale one first). Without cgroups
    /// tasks run uncontained: said in the log and by `starling status`.
    pub fn start(settings: &AgentSettings, name: &str, cores: u32) -> Linger {
        let cg = settings.cgroup.clone().unwrap_or_else(|| name.to_string());
        let report = Arc::new(Mutex::new(None));
        let guest = match Guest::create(Hierarchies::discover(), &cg) {
            Ok(g) => {
                log::info!("guests run in cgroup {} at {} priority", g.rel().display(), g.cpu.as_str());
                Arc::new(g)
            }
            Err(e) => {
                log::warn!("tasks run WITHOUT guest containment (owner not protected): {e}");
                return Linger { guest: None, report };
            }
        };
        let band = MemoryBand {
            low_water: settings.low_water_mib * MIB,
            high_water: settings.high_water_mib.max(settings.low_water_mib) * MIB,
        };
        let guest_usage = guest.group().dir(Controller::Cpuacct).map(|d| d.join("cpuacct.usage")).unwrap_or_default();
        let (cpu, keyboard) = match settings.owner {
            OwnerKind::Emulated => (
                OwnerCpu::Cgroup {
                    usage: guest.owner_group().dir(Controller::Cpuacct).map(|d| d.join("cpuacct.usage")).unwrap_or_default(),
                },
                KeyboardSource::File(settings.state.join(KEYBOARD_FILE)),
            ),
            OwnerKind::Machine => (OwnerCpu::Machine { guest_usage: guest_usage.clone() }, KeyboardSource::Terminals),
        };
        let mut monitor = Monitor::new(cpu, guest_usage, keyboard, cores);
        let (policy, pause_s) = (settings.policy, settings.pm_pause_s);
        let (g, r) = (guest.clone(), report.clone());
        let mut tick = move || {
            let s = monitor.sample();
            let action = match g.apply_band(&band, s.mem_available) {
                Ok(a) => a,
                Err(e) => {
                    log::warn!("memory band: {e}");
                    BandAction::Nothing
                }
            };
            // PM: the guests are suspended while the owner is active (the head moves them after the pause).
            if policy == GuestPolicy::PauseAndMigrate {
                let on = s.state != starling_linger::OwnerState::Idle;
                if let Err(e) = g.suspend(on) {
                    log::warn!("PM: suspending the guests: {e}");
                }
            }
            let st = g.band_state();
            let cap = g.memory_cap();
            let mib = |b: u64| b / MIB;
            match action {
                BandAction::Cap => log::warn!(
                    "free memory {} MiB < low water {} MiB: guests capped at {} MiB",
                    mib(s.mem_available),
                    mib(band.low_water),
                    mib(cap.unwrap_or(0))
                ),
                BandAction::Freeze => {
                    log::warn!("free memory {} MiB < half the low water: guests frozen", mib(s.mem_available));
                }
                BandAction::Release => log::info!("free memory {} MiB ≥ high water: guests released", mib(s.mem_available)),
                BandAction::Nothing => {}
            }
            let busy = !g.group().pids().is_empty();
            let doing = if st.suspended {
                format!("guests suspended (PM): moved to an idle host if the owner is still active after {} s", pause_s)
            } else if st.frozen {
                format!("guests frozen: free memory {} MiB < {} MiB (LF does not move them)", mib(s.mem_available), mib(band.low_water / 2))
            } else if let Some(c) = cap {
                format!("guest memory capped at {} MiB: free memory below {} MiB", mib(c), mib(band.low_water))
            } else if !busy {
                "no guests".to_string()
            } else if s.state == starling_linger::OwnerState::Idle {
                "guests run freely".to_string()
            } else {
                match policy {
                    GuestPolicy::LingerForever => format!("lingering at {} (LF: never moves)", g.cpu.as_str()),
                    GuestPolicy::LingerLonger => format!("lingering at {} (LL: the head moves guests after T_lingr)", g.cpu.as_str()),
                    GuestPolicy::PauseAndMigrate => format!("running at {} (PM)", g.cpu.as_str()),
                    GuestPolicy::ImmediateEviction => format!("running at {} (IE: the head evicts guests and reruns them elsewhere)", g.cpu.as_str()),
                }
            };
            #[allow(clippy::cast_possible_truncation, reason = "a share in 0..=1 shown to a few digits")]
            let rep = OwnerReport {
                state: s.state.as_str().to_string(),
                cpu: s.cpu as f32,
                guest_cpu: s.guest_cpu as f32,
                keyboard: if s.keyboard == Keyboard::Active { "active" } else { "idle" }.to_string(),
                mem_available: s.mem_available,
                guest_mem: g.memory_bytes(),
                guest_mem_cap: cap,
                guests_frozen: st.frozen,
                priority: g.cpu.as_str().to_string(),
                policy: policy.as_str().to_string(),
                pause_s,
                suspended: st.suspended,
                doing,
                guest_cgroup: g.rel().display().to_string(),
                owner_cgroup: g.owner_group().rel.display().to_string(),
            };
            *r.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(rep);
        };
        // The first report exists before the agent first reports to the head.
        tick();
        let spawned = std::thread::Builder::new().name("owner-monitor".into()).spawn(move || loop {
            std::thread::sleep(PERIOD);
            tick();
        });
        if let Err(e) = spawned {
            log::warn!("no owner monitor: {e}");
        }
        Linger { guest: Some(guest), report }
    }

    /// What a task's sandbox does to itself before it runs anything.
    pub fn placement(&self) -> starling_sandbox::Placement {
        match &self.guest {
            Some(g) => {
                let j = g.join();
                starling_sandbox::Placement { cgroup_procs: j.procs_files, sched_idle: j.sched_idle, oom_score_adj: j.oom_score_adj }
            }
            None => starling_sandbox::Placement::default(),
        }
    }

    /// A guest being moved is captured under ptrace with code injected into
    /// it: at starvation priority under a busy owner that takes seconds, so
    /// its processes leave the idle CPU group (they are frozen meanwhile, and
    /// stay in the guest's memory and accounting groups). Returns who was moved.
    /// A suspended (PM) guest leaves the frozen freezer group the same way
    /// (it thaws; the capture stops it under ptrace).
    pub fn boost(&self, pids: &[i32]) -> Vec<i32> {
        let Some(g) = &self.guest else { return Vec::new() };
        let h = Hierarchies::discover();
        for c in [Controller::Cpu, Controller::Freezer] {
            let Some(root) = h.dir(c).map(|d| d.join("cgroup.procs")) else { continue };
            if g.group().dir(c).is_some() {
                for p in pids {
                    let _ = std::fs::write(&root, p.to_string());
                }
            }
        }
        pids.to_vec()
    }

    /// After a move: what is still here goes back to the guest's CPU and freezer groups.
    pub fn unboost(&self, pids: &[i32]) {
        let Some(g) = &self.guest else { return };
        for c in [Controller::Cpu, Controller::Freezer] {
            if let Some(dir) = g.group().dir(c).map(|d| d.join("cgroup.procs")) {
                for p in pids {
                    let _ = std::fs::write(&dir, p.to_string());
                }
            }
        }
    }

    /// At exit: kill every guest and remove the agent's cgroups.
    pub fn remove(&self) {
        if let Some(g) = &self.guest {
            match g.remove() {
                Ok(()) => log::info!("removed guest cgroup {}", g.rel().display()),
                Err(e) => log::warn!("removing the guest cgroup: {e}"),
            }
        }
    }
}
