//! The LL (Linger-Longer) policy, run by the head once a second over what
//! the hosts report (`HostInfo::owner`).
//!
//! A host whose agent runs `--policy LL` and whose owner is active starts an
//! *episode*. Its guests linger (at starvation priority, on the host) for
//! T_lingr = ((1−l)/(h−l))·T_migr (eq. 3.4): h is the host's owner CPU, l
//! the owner CPU of the idle host with a free core the guest would go to,
//! T_migr the mean of the cluster's measured migrations (eq. 3.5 measured,
//! not modelled; [`DEFAULT_T_MIGR`] until one was measured). After that the
//! guest moves through the head's live migration ([`Head::migrate`]), one
//! task per host and tick. The episode ends when the owner is idle again.
//! PM hosts' guests are suspended by their agent while the owner is active;
//! the head moves them the same way once the episode is older than the
//! host's pause (`agent.pm_pause_s`). LF hosts are left alone. IE guests
//! are killed at once and rerun on an idle host (`eviction`). A task's own
//! policy (`exec/run --policy`) replaces its host's for these decisions (a
//! PM host's agent still suspends all of its guests).
//!
//! Memory is no CPU episode: a host whose agent reports its guests capped or
//! frozen by its memory band (free memory below its LowWater) gets no T_lingr
//! or pause. Capping and freezing give no memory back (there is no swap): the
//! head moves an LL or PM guest away at once, the biggest resident first, one
//! per host and tick, to a host whose guests are neither capped nor frozen and
//! whose free memory minus the guest's resident size stays above that host's
//! HighWater ([`memory_move`]). IE guests are killed and rerun elsewhere; LF
//! guests stay, capped or frozen, until free memory is back above HighWater.

use crate::{placement::natural_key, Head};
use starling_proto::{GuestPolicy, TaskId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// T_migr before any migration was measured.
pub(crate) const DEFAULT_T_MIGR: Duration = Duration::from_secs(1);
/// How often the policy looks.
pub(crate) const TICK: Duration = Duration::from_secs(1);

/// The policy's memory: episodes and what it says it is doing per host.
#[derive(Default)]
pub(crate) struct Lingering {
    episodes: HashMap<String, Instant>,
    pub(crate) doing: HashMap<String, String>,
    /// Moves started per task since it last moved: a task whose moves keep failing is left
    /// alone for [`RETRY_AFTER`] after [`MAX_TRIES`], then tried again. A move that succeeds
    /// clears its count ([`Head::moved_away`]). Before, every move counted and the count never
    /// expired: a PM task was left suspended for the rest of its owner's episode (and of every
    /// later one) after its third move.
    tries: HashMap<TaskId, Tries>,
    /// Per host under memory pressure: the last guest moved away for it (for `doing`, until the
    /// band is released).
    moved_for_memory: HashMap<String, String>,
}

/// Moves tried per task in a row.
const MAX_TRIES: u32 = 3;
/// How long a task whose last [`MAX_TRIES`] moves failed is left where it is.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// A task's moves since it last moved.
#[derive(Clone, Copy)]
struct Tries {
    started: u32,
    last: Instant,
}

impl Tries {
    /// Whether the policy may move the task now.
    fn allow(t: Option<&Tries>, now: Instant) -> bool {
        t.is_none_or(|t| t.started < MAX_TRIES || now.duration_since(t.last) >= RETRY_AFTER)
    }
}

/// One host as the policy sees it.
#[derive(Clone)]
struct View {
    name: String,
    /// The host's own policy (its agent's `--policy`).
    policy: Option<GuestPolicy>,
    /// PM: the pause before a move.
    pause: Duration,
    idle: bool,
    cpu: f64,
    free: u32,
    /// Its memory band, if it reports one.
    memory: Option<Memory>,
}

/// A host's free memory and band as its owner report gives them (bytes).
#[derive(Clone, Copy, Debug)]
struct Memory {
    available: u64,
    low_water: u64,
    high_water: u64,
    /// The band capped or froze the host's guests.
    pressed: bool,
}

/// A guest the memory policy may move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Resident {
    task: TaskId,
    /// Its resident size as its agent last said (0 if it did not answer).
    bytes: u64,
    cores: u32,
}

/// What this tick's moves already send to a host.
#[derive(Clone, Copy, Debug, Default)]
struct Taken {
    cores: u32,
    bytes: u64,
}

const MIB: u64 = 1 << 20;

/// Memory: which of a pressed host's `guests` goes where. The biggest resident first (a guest
/// that fits nowhere gives way to the next); a target is another host whose guests are neither
/// capped nor frozen, with free cores for it, and whose free memory, less what this tick already
/// sends there and the guest's resident size, stays above its HighWater; among those an idle
/// owner first, then the lightest owner, then the most free memory.
fn memory_move<'a>(from: &str, guests: &[Resident], views: &'a [View], taken: &HashMap<String, Taken>) -> Option<(Resident, &'a View)> {
    let mut by_size = guests.to_vec();
    by_size.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.task.cmp(&b.task)));
    by_size.into_iter().find_map(|g| {
        views
            .iter()
            .filter(|c| c.name != from)
            .filter_map(|c| {
                let m = c.memory.filter(|m| !m.pressed)?;
                let t = taken.get(&c.name).copied().unwrap_or_default();
                let left = m.available.checked_sub(t.bytes)?.checked_sub(g.bytes)?;
                (c.free >= g.cores + t.cores && left > m.high_water).then_some((c, left))
            })
            .min_by(|(a, a_left), (b, b_left)| b.idle.cmp(&a.idle).then(a.cpu.total_cmp(&b.cpu)).then(b_left.cmp(a_left)))
            .map(|(c, _)| (g, c))
    })
}

impl Head {
    /// `task` moved: its next host's policy may move it again.
    pub(crate) fn moved_away(&self, task: TaskId) {
        self.lingering.lock().unwrap().tries.remove(&task);
    }

    /// T_migr: the mean of the measured migrations' total times.
    fn t_migr(&self) -> Duration {
        let recent = self.recent_migrations();
        if recent.is_empty() {
            return DEFAULT_T_MIGR;
        }
        #[allow(clippy::cast_precision_loss, reason = "at most RECENT_MIGRATIONS reports")]
        let mean_ms = recent.iter().map(|r| r.total_ms).sum::<f64>() / recent.len() as f64;
        Duration::try_from_secs_f64(mean_ms / 1e3).unwrap_or(DEFAULT_T_MIGR)
    }

    /// One look at every host: start/end episodes, move guests whose T_lingr has passed.
    pub(crate) async fn linger_tick(&self) {
        let t_migr = self.t_migr();
        // Resident sizes of the guests of hosts under memory pressure (asked only then).
        let pressed: Vec<String> = {
            let st = self.state.lock().unwrap();
            st.hosts
                .values()
                .filter(|h| h.info.owner.as_ref().is_some_and(|o| o.guest_mem_cap.is_some() || o.guests_frozen))
                .map(|h| h.info.name.clone())
                .collect()
        };
        let usage = if pressed.is_empty() { HashMap::new() } else { self.usage(Some(&pressed)).await };
        // (host, why) whose IE guests are evicted.
        let mut evict: Vec<(String, &'static str)> = Vec::new();
        // (task, target, why: its owner's CPU or memory).
        let moves: Vec<(TaskId, String, &'static str)> = {
            let st = self.state.lock().unwrap();
            let mut lg = self.lingering.lock().unwrap();
            // The home site has no owner to linger beside, and takes no guests.
            let mut views: Vec<View> = st
                .hosts
                .values()
                .filter(|h| !h.info.home)
                .map(|h| View {
                    name: h.info.name.clone(),
                    policy: h.info.owner.as_ref().and_then(|o| GuestPolicy::parse(&o.policy).ok()),
                    pause: Duration::from_secs(h.info.owner.as_ref().map_or(0, |o| o.pause_s)),
                    idle: h.info.owner.as_ref().is_none_or(|o| o.state == "idle"),
                    cpu: h.info.owner.as_ref().map_or(0.0, |o| f64::from(o.cpu)),
                    free: h.info.cores.max(1).saturating_sub(h.cores_busy),
                    memory: h.info.owner.as_ref().map(|o| Memory {
                        available: o.mem_available,
                        low_water: o.low_water,
                        high_water: o.high_water,
                        pressed: o.guest_mem_cap.is_some() || o.guests_frozen,
                    }),
                })
                .collect();
            views.sort_by_key(|v| natural_key(&v.name));
            let now = Instant::now();
            let mut moves = Vec::new();
            let mut taken: HashMap<String, Taken> = HashMap::new();
            for v in &views {
                if let Some(m) = v.memory.filter(|m| m.pressed) {
                    // The CPU episode goes on meanwhile (its countdown is not reset).
                    if v.idle {
                        lg.episodes.remove(&v.name);
                    } else {
                        lg.episodes.entry(v.name.clone()).or_insert(now);
                    }
                    let on_host = |r: &crate::Route| r.host == v.name;
                    let why = format!("free {} MiB < {} MiB", m.available / MIB, m.low_water / MIB);
                    let moved = lg.moved_for_memory.get(&v.name).map(|w| format!("; moved {w}")).unwrap_or_default();
                    if st.routes.values().any(|r| on_host(r) && crate::eviction::is_ie(r.policy, v.policy)) {
                        evict.push((v.name.clone(), "free memory below the low water"));
                    }
                    // LL and PM guests (by their own policy, else the host's) may move; LF ones stay.
                    let (mut guests, mut lf, mut retrying) = (Vec::new(), 0, 0);
                    for (t, r) in st.routes.iter().filter(|(_, r)| on_host(r) && !r.clone_task && r.moving.is_none()) {
                        match r.policy.or(v.policy) {
                            Some(GuestPolicy::LingerLonger | GuestPolicy::PauseAndMigrate) if Tries::allow(lg.tries.get(t), now) => {
                                guests.push(Resident {
                                    task: *t,
                                    bytes: st.hosts.get(&r.host).and_then(|h| usage.get(&(h.conn_id, *t))).map_or(0, |u| u.rss_bytes),
                                    cores: r.cores,
                                });
                            }
                            Some(GuestPolicy::LingerLonger | GuestPolicy::PauseAndMigrate) => retrying += 1,
                            Some(GuestPolicy::LingerForever) | None => lf += 1,
                            Some(GuestPolicy::ImmediateEviction) => {}
                        }
                    }
                    let doing = if guests.is_empty() {
                        if retrying > 0 {
                            format!("memory: {why}; {retrying} guests' last {MAX_TRIES} moves failed, tried again within {} s{moved}", RETRY_AFTER.as_secs())
                        } else if lf > 0 {
                            format!("memory: {why}; {lf} LF guests stay capped or frozen (LF never moves){moved}")
                        } else {
                            format!("memory: {why}; no guests to move{moved}")
                        }
                    } else if let Some((g, target)) = memory_move(&v.name, &guests, &views, &taken) {
                        let t = taken.entry(target.name.clone()).or_default();
                        t.cores += g.cores;
                        t.bytes += g.bytes;
                        let tries = lg.tries.entry(g.task).or_insert(Tries { started: 0, last: now });
                        tries.started = if tries.started >= MAX_TRIES { 1 } else { tries.started + 1 };
                        tries.last = now;
                        let what = format!("{} ({} MiB resident) to {}", g.task, g.bytes / MIB, target.name);
                        lg.moved_for_memory.insert(v.name.clone(), what.clone());
                        moves.push((g.task, target.name.clone(), "free memory below the low water"));
                        format!("memory: moving {what}, {why}")
                    } else {
                        format!("memory: {why}; no host with a free core keeps its free memory above its high water with a guest of this one{moved}")
                    };
                    lg.doing.insert(v.name.clone(), doing);
                    continue;
                }
                lg.moved_for_memory.remove(&v.name);
                if v.idle {
                    lg.episodes.remove(&v.name);
                    lg.doing.remove(&v.name);
                    continue;
                }
                let start = *lg.episodes.entry(v.name.clone()).or_insert(now);
                let age = now.duration_since(start);
                let on_host = |r: &crate::Route| r.host == v.name;
                if st.routes.values().any(|r| on_host(r) && crate::eviction::is_ie(r.policy, v.policy)) {
                    evict.push((v.name.clone(), "owner active"));
                }
                // LL and PM guests (by their own policy, else the host's), oldest first.
                let mut guests: Vec<(TaskId, u32, GuestPolicy)> = st
                    .routes
                    .iter()
                    .filter(|(t, r)| {
                        on_host(r) && !r.clone_task && r.moving.is_none() && Tries::allow(lg.tries.get(*t), now)
                    })
                    .filter_map(|(t, r)| match r.policy.or(v.policy) {
                        Some(p @ (GuestPolicy::LingerLonger | GuestPolicy::PauseAndMigrate)) => Some((*t, r.cores, p)),
                        _ => None,
                    })
                    .collect();
                guests.sort_by_key(|(t, _, _)| *t);
                let Some(&(task, cores, policy)) = guests.first() else {
                    match v.policy {
                        Some(p @ (GuestPolicy::LingerLonger | GuestPolicy::PauseAndMigrate)) => {
                            lg.doing.insert(v.name.clone(), format!("{}: owner active, no guests", p.as_str()));
                        }
                        Some(GuestPolicy::ImmediateEviction) => {
                            lg.doing.insert(v.name.clone(), "IE: owner active; guests are evicted and rerun on idle hosts".into());
                        }
                        _ => {}
                    }
                    continue;
                };
                let pm = (policy == GuestPolicy::PauseAndMigrate).then_some(v.pause);
                // The idlest idle host with room (lowest owner CPU, then most free cores).
                let target = views
                    .iter()
                    .filter(|c| c.name != v.name && c.idle && c.free >= cores + taken.get(&c.name).map_or(0, |t| t.cores))
                    .min_by(|a, b| a.cpu.total_cmp(&b.cpu).then(b.free.cmp(&a.free)));
                let Some(target) = target else {
                    lg.doing.insert(v.name.clone(), format!(
                            "{}: {} {:.0} s; no idle host with a free core",
                            if pm.is_some() { "PM" } else { "LL" },
                            if pm.is_some() { "suspended" } else { "lingering" },
                            age.as_secs_f64()
                        ));
                    continue;
                };
                let wait = match pm {
                    Some(pause) => Some(pause),
                    None => starling_linger::policy::t_lingr(target.cpu, v.cpu, t_migr),
                };
                let Some(t_lingr) = wait else {
                    lg.doing.insert(
                        v.name.clone(),
                        format!("LL: lingering; owner CPU {:.0}% is not above {}'s {:.0}%", v.cpu * 100.0, target.name, target.cpu * 100.0),
                    );
                    continue;
                };
                if age >= t_lingr {
                    taken.entry(target.name.clone()).or_default().cores += cores;
                    let t = lg.tries.entry(task).or_insert(Tries { started: 0, last: now });
                    // A new round after RETRY_AFTER.
                    t.started = if t.started >= MAX_TRIES { 1 } else { t.started + 1 };
                    t.last = now;
                    lg.doing.insert(
                        v.name.clone(),
                        match pm {
                            Some(_) => format!("PM: moving {task} to {} after a {:.1} s pause", target.name, age.as_secs_f64()),
                            None => format!(
                                "LL: moving {task} to {} after lingering {:.1} s (T_lingr {:.1} s)",
                                target.name,
                                age.as_secs_f64(),
                                t_lingr.as_secs_f64()
                            ),
                        },
                    );
                    moves.push((task, target.name.clone(), "its owner is active"));
                } else if pm.is_some() {
                    lg.doing.insert(
                        v.name.clone(),
                        format!("PM: suspended {:.1} of {:.0} s, then to {}", age.as_secs_f64(), t_lingr.as_secs_f64(), target.name),
                    );
                } else {
                    lg.doing.insert(
                        v.name.clone(),
                        format!(
                            "LL: lingering {:.1} of T_lingr {:.1} s (h {:.0}%, l {:.0}%, T_migr {:.2} s), then to {}",
                            age.as_secs_f64(),
                            t_lingr.as_secs_f64(),
                            v.cpu * 100.0,
                            target.cpu * 100.0,
                            t_migr.as_secs_f64(),
                            target.name
                        ),
                    );
                }
            }
            lg.tries.retain(|t, _| st.routes.contains_key(t));
            moves
        };
        for (host, why) in evict {
            let gone = self.evict(&host).await;
            if !gone.is_empty() {
                let what = gone.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
                self.lingering.lock().unwrap().doing.insert(host, format!("IE: {why}; evicted {what} for a rerun on an idle host"));
            }
        }
        // Reruns wait for an idle owner; owners that became idle may let them start.
        self.drain_queue().await;
        for (task, to, why) in moves {
            // Stop-and-copy, as eq. 3.5 models it: a lingering guest barely runs, so pre-copy buys
            // little, and its pages all leave the owner's machine before it resumes.
            match self.migrate(task, Some(to.clone()), true, None).await {
                Ok(id) => log::info!("migration {id}: task {task} leaves its host for {to} ({why})"),
                Err(e) => log::warn!("cannot move task {task} to {to}: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A host with 2 free cores, `available` GiB free, a 1/2 GiB band.
    fn host(name: &str, idle: bool, cpu: f64, available: u64, pressed: bool) -> View {
        View {
            name: name.into(),
            policy: Some(GuestPolicy::LingerLonger),
            pause: Duration::ZERO,
            idle,
            cpu,
            free: 2,
            memory: Some(Memory { available: available * GIB, low_water: GIB, high_water: 2 * GIB, pressed }),
        }
    }

    fn guest(task: u64, mib: u64) -> Resident {
        Resident { task: TaskId(task), bytes: mib * MIB, cores: 1 }
    }

    fn chosen(from: &str, guests: &[Resident], views: &[View], taken: &HashMap<String, Taken>) -> Option<(u64, String)> {
        memory_move(from, guests, views, taken).map(|(g, v)| (g.task.0, v.name.clone()))
    }

    #[test]
    fn memory_moves_the_biggest_guest_to_a_host_that_keeps_its_high_water() {
        let none = HashMap::new();
        let guests = [guest(7, 100), guest(3, 900), guest(5, 300)];
        // h2: its guests capped too; h3: 2.5 GiB free, above its 2 GiB high water only for guests under
        // 512 MiB.
        let mut views = vec![host("h1", true, 0.0, 0, true), host("h2", true, 0.0, 9, true), host("h3", true, 0.0, 2, false)];
        views[2].memory.as_mut().unwrap().available = 2 * GIB + GIB / 2;
        assert_eq!(chosen("h1", &guests, &views, &none), Some((5, "h3".into())), "900 MiB fits nowhere: the next biggest");
        views.push(host("h4", false, 0.6, 6, false)); // owner at work
        assert_eq!(chosen("h1", &guests, &views, &none), Some((3, "h4".into())), "the biggest, to the only host it fits");
        views.push(host("h5", true, 0.0, 4, false));
        assert_eq!(chosen("h1", &guests, &views, &none), Some((3, "h5".into())), "an idle owner before more free memory");
        views.push(host("h6", true, 0.0, 5, false));
        assert_eq!(chosen("h1", &guests, &views, &none), Some((3, "h6".into())), "then the most free memory");
        // What this tick already sends to h6 counts against its room and cores.
        let taken = HashMap::from([("h6".to_string(), Taken { cores: 0, bytes: 2 * GIB + GIB / 2 })]);
        assert_eq!(chosen("h1", &guests, &views, &taken), Some((3, "h5".into())));
        let taken = HashMap::from([("h6".to_string(), Taken { cores: 2, bytes: 0 }), ("h5".to_string(), Taken { cores: 2, bytes: 0 })]);
        assert_eq!(chosen("h1", &guests, &views, &taken), Some((3, "h4".into())));
    }

    #[test]
    fn memory_moves_nothing_without_a_host_that_has_room() {
        let none = HashMap::new();
        let guests = [guest(1, 200)];
        let mut full = host("h2", true, 0.0, 8, false);
        full.free = 0;
        let mut unknown = host("h3", true, 0.0, 8, false);
        unknown.memory = None;
        // Exactly at the high water after the move is not above it.
        let mut tight = host("h4", true, 0.0, 2, false);
        tight.memory.as_mut().unwrap().available = 2 * GIB + 200 * MIB;
        let views = [host("h1", true, 0.0, 0, true), full, unknown, tight, host("h5", true, 0.0, 8, true)];
        assert_eq!(chosen("h1", &guests, &views, &none), None);
        assert_eq!(chosen("h1", &[], &views, &none), None, "no guests");
        assert_eq!(chosen("h1", &guests, &[host("h1", true, 0.0, 9, false)], &none), None, "never to itself");
    }

    #[test]
    fn a_task_whose_moves_failed_is_tried_again_after_a_while() {
        let t0 = Instant::now();
        assert!(Tries::allow(None, t0), "never tried");
        let failed = |started| Tries { started, last: t0 };
        assert!(Tries::allow(Some(&failed(MAX_TRIES - 1)), t0));
        assert!(!Tries::allow(Some(&failed(MAX_TRIES)), t0), "left alone after MAX_TRIES");
        assert!(!Tries::allow(Some(&failed(MAX_TRIES)), t0 + RETRY_AFTER - Duration::from_millis(1)));
        assert!(Tries::allow(Some(&failed(MAX_TRIES)), t0 + RETRY_AFTER), "tried again, never left for good");
    }
}
