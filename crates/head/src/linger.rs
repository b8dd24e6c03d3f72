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
struct View {
    name: String,
    /// The host's own policy (its agent's `--policy`).
    policy: Option<GuestPolicy>,
    /// PM: the pause before a move.
    pause: Duration,
    idle: bool,
    cpu: f64,
    free: u32,
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
        let mut evict: Vec<String> = Vec::new();
        let moves: Vec<(TaskId, String)> = {
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
                })
                .collect();
            views.sort_by_key(|v| natural_key(&v.name));
            let now = Instant::now();
            let mut moves = Vec::new();
            let mut taken: HashMap<String, u32> = HashMap::new();
            for v in &views {
                if v.idle {
                    lg.episodes.remove(&v.name);
                    lg.doing.remove(&v.name);
                    continue;
                }
                let start = *lg.episodes.entry(v.name.clone()).or_insert(now);
                let age = now.duration_since(start);
                let on_host = |r: &crate::Route| r.host == v.name;
                if st.routes.values().any(|r| on_host(r) && crate::eviction::is_ie(r.policy, v.policy)) {
                    evict.push(v.name.clone());
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
                    .filter(|c| c.name != v.name && c.idle && c.free >= cores + taken.get(&c.name).copied().unwrap_or(0))
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
                    *taken.entry(target.name.clone()).or_default() += cores;
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
                    moves.push((task, target.name.clone()));
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
        for host in evict {
            let gone = self.evict(&host).await;
            if !gone.is_empty() {
                let what = gone.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
                self.lingering.lock().unwrap().doing.insert(host, format!("IE: owner active; evicted {what} for a rerun on an idle host"));
            }
        }
        // Reruns wait for an idle owner; owners that became idle may let them start.
        self.drain_queue().await;
        for (task, to) in moves {
            // Stop-and-copy, as eq. 3.5 models it: a lingering guest barely runs, so pre-copy buys
            // little, and its pages all leave the owner's machine before it resumes.
            match self.migrate(task, Some(to.clone()), true, None).await {
                Ok(id) => log::info!("migration {id}: task {task} leaves its busy owner for {to}"),
                Err(e) => log::warn!("cannot move task {task} to {to}: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
