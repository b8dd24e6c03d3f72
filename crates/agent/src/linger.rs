//! The agent's side of Linger-Longer (see `starling_linger`): the guest
//! cgroup every task's processes start in, the owner monitor that samples
//! the host once a second, applies the memory band and the guests' disk and
//! network rate windows, and keeps the report the agent sends the head with
//! its load.

use starling_config::{AgentSettings, GuestPolicy, OwnerKind};
use starling_linger::guest::{self, BandAction, Guest, MemoryBand};
use starling_linger::netio::{NetCounters, NetSource};
use starling_linger::owner::{KeyboardSource, Monitor, OwnerCpu, OwnerIo, KEYBOARD_FILE};
use starling_linger::window::{self, DiskWindow, Hysteresis, NetWindow, Step};
use starling_linger::{cgroup::Controller, Hierarchies, Keyboard};
use starling_proto::OwnerReport;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the owner is sampled.
pub(crate) const PERIOD: Duration = Duration::from_secs(1);

/// The agent's guest group, if it could be made.
pub(crate) struct Linger {
    pub guest: Option<Arc<Guest>>,
    /// The host's policy: a task's own `--policy` wins.
    policy: GuestPolicy,
    pub report: Arc<Mutex<Option<OwnerReport>>>,
    /// The network window's table and qdiscs outlive a killed agent: removed at exit and at start.
    net: Option<Arc<NetWindow>>,
    /// The owner's network counters (their table too outlives a killed agent).
    net_io: Option<NetCounters>,
}

const MIB: u64 = 1 << 20;

/// The guest's groups a task being moved away leaves for its capture ([`Linger::boost`]).
const MOVED_OUT: [Controller; 3] = [Controller::Cpu, Controller::Freezer, Controller::Memory];

/// Processes taken out of the guest's CPU and freezer groups for a move.
#[derive(Debug, Default)]
pub(crate) struct Boosted {
    pids: Vec<i32>,
    /// Those that were in the PM tasks' freezer group.
    in_pm: Vec<i32>,
}

/// The guests' rate windows and whether they are on.
struct Windows {
    disk: Option<DiskWindow>,
    net: Option<Arc<NetWindow>>,
    hysteresis: Hysteresis,
    /// What is applied now, in words (`None`: nothing).
    applied: Option<String>,
}

fn rate(bps: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "a rate shown to one decimal")]
    let mib = bps as f64 / MIB as f64;
    format!("{mib:.1} MiB/s")
}

impl Windows {
    /// One owner sample: apply or remove the windows as the hysteresis says.
    fn step(&mut self, g: &Guest, disk_bps: u64, net_bps: u64) {
        if self.disk.is_none() && self.net.is_none() {
            return;
        }
        match self.hysteresis.step(disk_bps.saturating_add(net_bps)) {
            Step::Keep => {}
            Step::Apply => {
                let mut on = Vec::new();
                if let Some(d) = &self.disk {
                    match d.apply(g.group()) {
                        Ok(()) => on.push(format!(
                            "disk {} on {}",
                            rate(d.bps),
                            d.disks.iter().map(|k| k.name.as_str()).collect::<Vec<_>>().join(",")
                        )),
                        Err(e) => log::warn!("guests' disk window not applied: {e}"),
                    }
                }
                if let Some(n) = &self.net {
                    match n.apply() {
                        Ok(ifaces) => on.push(format!("net {} on {}", rate(n.bps), ifaces.join(","))),
                        Err(e) => log::warn!("guests' network window not applied: {e}"),
                    }
                }
                log::info!("owner I/O (disk {disk_bps} B/s, network {net_bps} B/s): guests' rate windows applied: {}", on.join(", "));
                self.applied = (!on.is_empty()).then(|| on.join(", "));
            }
            Step::Remove => {
                if let Some(d) = &self.disk {
                    if let Err(e) = d.remove(g.group()) {
                        log::warn!("removing the guests' disk window: {e}");
                    }
                }
                if let Some(n) = &self.net {
                    if let Err(e) = n.remove() {
                        log::warn!("removing the guests' network window: {e}");
                    }
                }
                log::info!("owner I/O quiet for {} s: guests' rate windows removed", window::QUIET_SAMPLES);
                self.applied = None;
            }
        }
    }
}

impl Linger {
    /// No guest group: the home site runs the user's own work.
    pub fn none() -> Linger {
        Linger { guest: None, policy: GuestPolicy::LingerForever, report: Arc::new(Mutex::new(None)), net: None, net_io: None }
    }

    /// Make the guest group (removing a stale one first). Without cgroups
    /// tasks run uncontained: said in the log and by `starling status`.
    pub fn start(settings: &AgentSettings, name: &str, cores: u32) -> Linger {
        let cg = settings.cgroup.clone().unwrap_or_else(|| name.to_string());
        let report = Arc::new(Mutex::new(None));
        let windows_on = settings.guest_net_bps > 0 || settings.guest_disk_bps > 0;
        let guest = match Guest::create(Hierarchies::discover(), &cg, windows_on) {
            Ok(g) => {
                log::info!("guests run in cgroup {} at {} priority", g.rel().display(), g.cpu.as_str());
                Arc::new(g)
            }
            Err(e) => {
                log::warn!("tasks run WITHOUT guest containment (owner not protected): {e}");
                return Linger { guest: None, policy: settings.policy, report, net: None, net_io: None };
            }
        };
        let band = MemoryBand {
            low_water: settings.low_water_mib * MIB,
            high_water: settings.high_water_mib.max(settings.low_water_mib) * MIB,
        };
        let guest_usage = guest.group().dir(Controller::Cpuacct).map(|d| d.join("cpuacct.usage")).unwrap_or_default();
        const IO_STATS: &str = "blkio.throttle.io_service_bytes_recursive";
        let (cpu, keyboard, io) = match settings.owner {
            OwnerKind::Emulated => (
                OwnerCpu::Cgroup {
                    usage: guest.owner_group().dir(Controller::Cpuacct).map(|d| d.join("cpuacct.usage")).unwrap_or_default(),
                },
                KeyboardSource::File(settings.state.join(KEYBOARD_FILE)),
                OwnerIo::Cgroup { stats: guest.owner_group().dir(Controller::Blkio).map(|d| d.join(IO_STATS)).unwrap_or_default() },
            ),
            OwnerKind::Machine => (
                OwnerCpu::Machine { guest_usage: guest_usage.clone() },
                KeyboardSource::Terminals,
                // Every starling group's I/O is left out (all agents' guests on this machine, of any
                // instance), not only this agent's: another cluster's guests are no owner of ours.
                OwnerIo::Machine {
                    starling_stats: Hierarchies::discover()
                        .path(Controller::Blkio, std::path::Path::new(starling_linger::cgroup::ROOT))
                        .map(|d| d.join(IO_STATS))
                        .unwrap_or_default(),
                },
            ),
        };
        // The owner's network I/O (what switches the windows on with its disk I/O) is counted by
        // nftables, which tells sockets apart by their cgroup2 group.
        let net_io = match (Hierarchies::discover().unified(), settings.owner) {
            (Some(mount), OwnerKind::Emulated) if guest.owner_unified_dir().is_some() => {
                Some((mount.to_path_buf(), NetSource::Group(guest::owner_rel(&cg))))
            }
            (Some(mount), OwnerKind::Machine) if guest.unified_dir().is_some() => {
                Some((mount.to_path_buf(), NetSource::AllBut(std::path::PathBuf::from(starling_linger::cgroup::ROOT))))
            }
            _ => {
                if windows_on {
                    log::warn!("owner network I/O is not measured (no cgroup2 mount): only its disk I/O switches the guests' rate windows on");
                }
                None
            }
        }
        .and_then(|(mount, source)| match NetCounters::install(&mount, &cg, source) {
            Ok(n) => Some(n),
            Err(e) => {
                log::warn!("owner network I/O is not measured (only its disk I/O switches the guests' rate windows on): {e}");
                None
            }
        });
        let mut monitor = Monitor::new(cpu, guest_usage, keyboard, io, net_io.clone(), cores);
        // The owner's I/O (and, on a real host, the guests' I/O left out of it) is counted only once
        // the disks' throttling is active.
        if let Err(e) = window::start_io_accounting(guest.group(), &window::disks()) {
            log::warn!("owner disk I/O is not measured (the guests' rate windows never switch on): {e}");
        }
        let disk = (settings.guest_disk_bps > 0).then(|| DiskWindow { bps: settings.guest_disk_bps, disks: window::disks() });
        if disk.as_ref().is_some_and(|d| d.disks.is_empty()) {
            log::warn!("guests' disk window: no disks found under /sys/block");
        }
        let net = if settings.guest_net_bps == 0 {
            None
        } else {
            match (Hierarchies::discover().unified(), guest.unified_dir()) {
                (Some(mount), Some(_)) => {
                    let n = NetWindow::new(settings.guest_net_bps, mount, guest.rel(), &cg);
                    // A killed agent's table and qdiscs are still here.
                    if let Err(e) = n.remove() {
                        log::warn!("removing a stale network window: {e}");
                    }
                    Some(Arc::new(n))
                }
                _ => {
                    log::warn!("guests' network window off: {}", window::WindowError::NoUnified);
                    None
                }
            }
        };
        let mut windows = Windows { disk, net: net.clone(), hysteresis: Hysteresis::default(), applied: None };
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
            // PM tasks (by their own policy or the host's) are suspended while the owner is active;
            // the head moves them after the pause.
            if let Err(e) = g.suspend(s.state != starling_linger::OwnerState::Idle) {
                log::warn!("PM: suspending the PM guests: {e}");
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
            windows.step(&g, s.disk_bps, s.net_bps);
            let busy = !g.group().pids().is_empty();
            let suspended = st.suspended && !g.pm_pids().is_empty();
            let doing = if suspended {
                format!("PM guests suspended: moved to an idle host if the owner is still active after {} s", pause_s)
            } else if st.frozen {
                format!(
                    "guests frozen: free memory {} MiB < {} MiB (the head moves LL and PM guests away; LF ones stay frozen)",
                    mib(s.mem_available),
                    mib(band.low_water / 2)
                )
            } else if let Some(c) = cap {
                format!(
                    "guest memory capped at {} MiB: free memory below {} MiB (the head moves LL and PM guests away; LF ones stay capped)",
                    mib(c),
                    mib(band.low_water)
                )
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
                low_water: band.low_water,
                high_water: band.high_water,
                priority: g.cpu.as_str().to_string(),
                policy: policy.as_str().to_string(),
                pause_s,
                suspended,
                doing,
                guest_cgroup: g.rel().display().to_string(),
                owner_cgroup: g.owner_group().rel.display().to_string(),
                rate_windows: windows.applied.clone(),
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
        Linger { guest: Some(guest), policy: settings.policy, report, net, net_io }
    }

    /// What a task's sandbox does to itself before it runs anything: a
    /// task whose policy (its own, else the host's) is PM joins the group PM suspends.
    pub fn placement(&self, task_policy: Option<GuestPolicy>) -> starling_sandbox::Placement {
        match &self.guest {
            Some(g) => {
                let j = g.join(task_policy.unwrap_or(self.policy) == GuestPolicy::PauseAndMigrate);
                starling_sandbox::Placement { cgroup_procs: j.procs_files, sched_idle: j.sched_idle, oom_score_adj: j.oom_score_adj }
            }
            None => starling_sandbox::Placement::default(),
        }
    }

    /// [`Linger::placement`] of a task restored here (moved in), and the
    /// `cgroup.procs` files its restorer joins as its last step (its CPU and
    /// freezer groups: `Guest::join_restored`).
    pub fn restore_placement(&self, task_policy: Option<GuestPolicy>) -> (starling_sandbox::Placement, Vec<std::path::PathBuf>) {
        match &self.guest {
            Some(g) => {
                let j = g.join_restored(task_policy.unwrap_or(self.policy) == GuestPolicy::PauseAndMigrate);
                (starling_sandbox::Placement { cgroup_procs: j.procs_files, sched_idle: j.sched_idle, oom_score_adj: j.oom_score_adj }, j.at_resume)
            }
            None => (starling_sandbox::Placement::default(), Vec::new()),
        }
    }

    /// A guest being moved is captured under ptrace with code injected into
    /// it: at starvation priority under a busy owner that takes seconds, so
    /// its processes leave the idle CPU group (they are frozen meanwhile, and
    /// stay in the guest's accounting groups). Returns who was moved.
    /// A suspended (PM) guest, or one the memory band froze, leaves the frozen
    /// freezer group the same way (it thaws; the capture stops it under
    /// ptrace). It leaves the memory group too: the capture's scratch page and
    /// the copy-on-write of its poked code are new pages, which a guest capped
    /// at what it used (the band) would wait for forever; what it already used
    /// stays charged to the guest group.
    pub fn boost(&self, pids: &[i32]) -> Boosted {
        let Some(g) = &self.guest else { return Boosted::default() };
        let in_pm: Vec<i32> = {
            let pm = g.pm_pids();
            pids.iter().copied().filter(|p| pm.contains(p)).collect()
        };
        let h = Hierarchies::discover();
        for c in MOVED_OUT {
            let Some(root) = h.dir(c).map(|d| d.join("cgroup.procs")) else { continue };
            if g.group().dir(c).is_some() {
                for p in pids {
                    let _ = std::fs::write(&root, p.to_string());
                }
            }
        }
        Boosted { pids: pids.to_vec(), in_pm }
    }

    /// After a move: what is still here goes back to the CPU, freezer and
    /// memory groups it came from.
    pub fn unboost(&self, boosted: &Boosted) {
        let Some(g) = &self.guest else { return };
        for c in MOVED_OUT {
            let Some(dir) = g.group().dir(c) else { continue };
            for p in &boosted.pids {
                let back = match g.pm_dir() {
                    Some(pm) if c == Controller::Freezer && boosted.in_pm.contains(p) => pm,
                    _ => dir,
                };
                let _ = std::fs::write(back.join("cgroup.procs"), p.to_string());
            }
        }
    }

    /// At exit: remove the network window and counters, kill every guest and
    /// remove the agent's cgroups (the disk window's rules go with them).
    pub fn remove(&self) {
        if let Some(n) = &self.net_io {
            if let Err(e) = n.remove() {
                log::warn!("removing the owner's network counters: {e}");
            }
        }
        if let Some(n) = &self.net {
            if let Err(e) = n.remove() {
                log::warn!("removing the guests' network window: {e}");
            }
        }
        if let Some(g) = &self.guest {
            match g.remove() {
                Ok(()) => log::info!("removed guest cgroup {}", g.rel().display()),
                Err(e) => log::warn!("removing the guest cgroup: {e}"),
            }
        }
    }
}
