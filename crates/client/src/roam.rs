//! `starling exec --roam`: a roaming task's migration manager (Snowbird's,
//! one per task, at home: in the task's own client).
//!
//! Sensors: the task's CPU demand (CPU seconds per second and runnable
//! threads, from its agent's task stats through `starling ps`), interaction
//! intensity (reads of the user's terminal per averaging window: a paste is
//! one; X input events, counted by the X relay: `crate::xsense`) and
//! smoothness (keystroke → first output byte; X input → the frames drawn
//! after it, FPS = n/T). A profile is a small
//! finite-state machine ([`Profile`], TOML): each state names a site (`home`,
//! `cluster` or a host), rules over the averaged sensors fire transitions.
//! Interactivity wins ties (a rule that sends the task home beats one that
//! sends it away), a minimum dwell time between moves is the hysteresis
//! Snowbird named but never built, and a move to the cluster is made only
//! when the expected crunch speedup beats the measured move cost:
//! speedup > C / (C − m). Every decision goes to the head with the sensor
//! values behind it (`starling ps --why TASK`).

use serde::Deserialize;
use starling_proto::conn::Outgoing;
use starling_proto::{Msg, RoamDecision, TaskId, TaskRow};
use starling_session::discover::Target;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The generic profile (Snowbird's: 10 s averaging, 15 inputs per 10 s, 20 FPS ≈ 50 ms per
/// update), used when `exec --roam` is given no `--profile`.
pub const GENERIC_PROFILE: &str = r#"
# Snowbird's generic profile: 10 s averaging, 15 inputs per 10 s window, 20 FPS (50 ms from a
# keystroke to its echo; 20 frames per second drawn after an X input).
window_s = 10
sample_ms = 1000
min_dwell_s = 30
speedup = 2.0
crunch_s = 120
move_cost_s = 5
initial = "cognitive"

[states.cognitive]
site = "home"

[states.crunch]
site = "cluster"

[[rules]]
from = "cognitive"
to = "crunch"
cpu_min = 0.8
inputs_max = 15
x_inputs_max = 15

[[rules]]
from = "crunch"
to = "cognitive"
inputs_min = 15

[[rules]]
from = "crunch"
to = "cognitive"
x_inputs_min = 15

[[rules]]
from = "crunch"
to = "cognitive"
inputs_min = 3
latency_min_ms = 50

[[rules]]
from = "crunch"
to = "cognitive"
x_inputs_min = 3
fps_max = 20
"#;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("the profile: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("the profile's initial state {0:?} is not one of its states")]
    NoInitial(String),
    #[error("a rule of the profile names state {0:?}, which it does not define")]
    NoState(String),
    #[error("the profile's {0} must be positive")]
    NotPositive(&'static str),
}

/// Where a profile state runs the task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Site {
    Home,
    /// Any host of the cluster (the head picks the least loaded).
    Cluster,
    Host(String),
}

impl Site {
    fn parse(s: &str) -> Site {
        match s {
            "home" => Site::Home,
            "cluster" => Site::Cluster,
            h => Site::Host(h.to_string()),
        }
    }

    fn name(&self) -> &str {
        match self {
            Site::Home => HOME,
            Site::Cluster => "cluster",
            Site::Host(h) => h,
        }
    }

    /// The task, running on `host`, is where this site is.
    fn holds(&self, host: &str) -> bool {
        match self {
            Site::Home => host == HOME,
            Site::Cluster => host != HOME,
            Site::Host(h) => h == host,
        }
    }
}

/// The home site's name (`starling_cluster::HOME_SITE`, as the head knows it).
pub const HOME: &str = "home";

/// One transition: fires when the task's manager is in `from` and every bound given holds
/// (`*_min`: the averaged value ≥ it; `*_max`: below it).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub from: String,
    pub to: String,
    /// CPU seconds per second (cores' worth) the task used, averaged.
    pub cpu_min: Option<f64>,
    pub cpu_max: Option<f64>,
    /// Runnable threads, averaged over the samples.
    pub runnable_min: Option<f64>,
    pub runnable_max: Option<f64>,
    /// Terminal inputs in the window.
    pub inputs_min: Option<f64>,
    pub inputs_max: Option<f64>,
    /// Mean keystroke → first output byte, ms (windows without a keystroke answered: no value,
    /// and the bound does not hold).
    pub latency_min_ms: Option<f64>,
    /// X input events (keys, buttons, pointer motion) in the window.
    pub x_inputs_min: Option<f64>,
    pub x_inputs_max: Option<f64>,
    /// Mean frames per second drawn after an X input (windows without an input answered by
    /// drawing: no value, and the bound does not hold).
    pub fps_min: Option<f64>,
    pub fps_max: Option<f64>,
}

impl Rule {
    fn holds(&self, s: &Sensors) -> bool {
        let min = |b: Option<f64>, v: Option<f64>| b.is_none_or(|b| v.is_some_and(|v| v >= b));
        let max = |b: Option<f64>, v: Option<f64>| b.is_none_or(|b| v.is_some_and(|v| v < b));
        min(self.cpu_min, Some(s.cpu))
            && max(self.cpu_max, Some(s.cpu))
            && min(self.runnable_min, Some(s.runnable))
            && max(self.runnable_max, Some(s.runnable))
            && min(self.inputs_min, Some(s.inputs))
            && max(self.inputs_max, Some(s.inputs))
            && min(self.latency_min_ms, s.latency_ms)
            && min(self.x_inputs_min, Some(s.x_inputs))
            && max(self.x_inputs_max, Some(s.x_inputs))
            && min(self.fps_min, s.fps)
            && max(self.fps_max, s.fps)
    }

    /// The rule in words, with the values that made it hold.
    fn explain(&self, s: &Sensors) -> String {
        let mut parts = Vec::new();
        let mut bound = |name: &str, v: Option<f64>, b: Option<f64>, op: &str| {
            if let Some(b) = b {
                parts.push(format!("{name} {} {op} {b}", v.map_or("-".into(), |v| format!("{v:.2}"))));
            }
        };
        bound("cpu", Some(s.cpu), self.cpu_min, ">=");
        bound("cpu", Some(s.cpu), self.cpu_max, "<");
        bound("runnable", Some(s.runnable), self.runnable_min, ">=");
        bound("runnable", Some(s.runnable), self.runnable_max, "<");
        bound("inputs", Some(s.inputs), self.inputs_min, ">=");
        bound("inputs", Some(s.inputs), self.inputs_max, "<");
        bound("latency_ms", s.latency_ms, self.latency_min_ms, ">=");
        bound("x_inputs", Some(s.x_inputs), self.x_inputs_min, ">=");
        bound("x_inputs", Some(s.x_inputs), self.x_inputs_max, "<");
        bound("fps", s.fps, self.fps_min, ">=");
        bound("fps", s.fps, self.fps_max, "<");
        format!("{} -> {}: {}", self.from, self.to, parts.join(", "))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    site: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    window_s: Option<f64>,
    sample_ms: Option<u64>,
    min_dwell_s: Option<f64>,
    speedup: Option<f64>,
    crunch_s: Option<f64>,
    move_cost_s: Option<f64>,
    initial: String,
    states: BTreeMap<String, StateFile>,
    #[serde(default)]
    rules: Vec<Rule>,
}

/// A roaming profile: a finite-state machine over averaged sensors (TOML; see [`GENERIC_PROFILE`]).
#[derive(Clone, Debug)]
pub struct Profile {
    /// Averaging history.
    pub window: Duration,
    /// How often the task's CPU use is sampled.
    pub sample: Duration,
    /// No move sooner than this after the last one (or the start).
    pub min_dwell: Duration,
    /// Expected crunch speedup on the cluster (its cores against home's).
    pub speedup: f64,
    /// Expected crunch length C, seconds, at home.
    pub crunch_s: f64,
    /// Move cost m, seconds, until a move has been measured.
    pub move_cost_s: f64,
    pub initial: String,
    pub states: BTreeMap<String, Site>,
    pub rules: Vec<Rule>,
}

impl Profile {
    pub fn parse(text: &str) -> Result<Profile, ProfileError> {
        let f: ProfileFile = toml::from_str(text)?;
        let positive = |v: Option<f64>, d: f64, what| match v.unwrap_or(d) {
            v if v > 0.0 && v.is_finite() => Ok(v),
            _ => Err(ProfileError::NotPositive(what)),
        };
        let window_s = positive(f.window_s, 10.0, "window_s")?;
        let dwell_s = f.min_dwell_s.unwrap_or(30.0);
        if !(dwell_s >= 0.0 && dwell_s.is_finite()) {
            return Err(ProfileError::NotPositive("min_dwell_s"));
        }
        let states: BTreeMap<String, Site> = f.states.into_iter().map(|(k, v)| (k, Site::parse(&v.site))).collect();
        if !states.contains_key(&f.initial) {
            return Err(ProfileError::NoInitial(f.initial));
        }
        for r in &f.rules {
            for s in [&r.from, &r.to] {
                if !states.contains_key(s) {
                    return Err(ProfileError::NoState(s.clone()));
                }
            }
        }
        Ok(Profile {
            window: Duration::from_secs_f64(window_s),
            sample: Duration::from_millis(f.sample_ms.unwrap_or(1000).max(50)),
            min_dwell: Duration::from_secs_f64(dwell_s),
            speedup: positive(f.speedup, 2.0, "speedup")?,
            crunch_s: positive(f.crunch_s, 120.0, "crunch_s")?,
            move_cost_s: positive(f.move_cost_s, 5.0, "move_cost_s")?,
            initial: f.initial,
            states,
            rules: f.rules,
        })
    }

    pub fn generic() -> Profile {
        Profile::parse(GENERIC_PROFILE).expect("the generic profile parses")
    }
}

/// The averaged sensors of one window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sensors {
    pub cpu: f64,
    pub runnable: f64,
    pub inputs: f64,
    pub latency_ms: Option<f64>,
    pub x_inputs: f64,
    pub fps: Option<f64>,
}

impl Sensors {
    fn list(&self) -> Vec<(String, f64)> {
        let mut v = vec![("cpu".to_string(), self.cpu), ("runnable".to_string(), self.runnable), ("inputs".to_string(), self.inputs)];
        if let Some(l) = self.latency_ms {
            v.push(("latency_ms".to_string(), l));
        }
        v.push(("x_inputs".to_string(), self.x_inputs));
        if let Some(f) = self.fps {
            v.push(("fps".to_string(), f));
        }
        v
    }
}

/// What the terminal relay saw: input events and the latency to the first output after each;
/// and what the X relay saw (`x`).
#[derive(Default)]
pub struct Interaction {
    inputs: VecDeque<Instant>,
    /// An input not yet answered by output.
    waiting: Option<Instant>,
    latencies: VecDeque<(Instant, Duration)>,
    /// X input events and the frames drawn after each (`crate::x11`'s relays record them).
    pub x: crate::xsense::XInteraction,
}

/// Shared between the terminal and X relays (which record) and the manager (which averages).
pub type InteractionLog = Arc<Mutex<Interaction>>;

impl Interaction {
    /// The user typed (one read of the terminal: a paste is one input).
    pub fn input(&mut self, at: Instant) {
        self.inputs.push_back(at);
        self.waiting.get_or_insert(at);
    }

    /// The task printed something.
    pub fn output(&mut self, at: Instant) {
        if let Some(t) = self.waiting.take() {
            self.latencies.push_back((at, at.saturating_duration_since(t)));
        }
    }

    /// Inputs and mean latency over the `window` before `now` (older ones are forgotten).
    fn averaged(&mut self, now: Instant, window: Duration) -> (f64, Option<f64>) {
        let start = now.checked_sub(window).unwrap_or(now);
        while self.inputs.front().is_some_and(|t| *t < start) {
            self.inputs.pop_front();
        }
        while self.latencies.front().is_some_and(|(t, _)| *t < start) {
            self.latencies.pop_front();
        }
        let lat = (!self.latencies.is_empty()).then(|| {
            self.latencies.iter().map(|(_, d)| d.as_secs_f64() * 1e3).sum::<f64>() / self.latencies.len() as f64
        });
        (self.inputs.len() as f64, lat)
    }
}

/// One sample of the task's stats.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    cpu_seconds: f64,
    runnable: u32,
}

/// What the manager decides at one look.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// No rule fired.
    Nothing,
    /// Move to `to_state` (its site).
    Move { rule: String, to_state: String },
    /// A rule fired but the move is held back (dwell time, cost/benefit).
    Hold { rule: String, to_state: String, why: String },
}

/// The decision proper, a pure function: in `state`, with these sensors, `since_move` after the
/// last move, and `move_cost_s` the measured cost of a move.
pub fn decide(p: &Profile, state: &str, s: &Sensors, since_move: Duration, move_cost_s: f64) -> Verdict {
    let fired: Vec<&Rule> = p.rules.iter().filter(|r| r.from == state && r.to != state && r.holds(s)).collect();
    // Interactivity wins ties: a rule towards home before one away from it.
    let Some(rule) = fired.iter().find(|r| p.states.get(&r.to) == Some(&Site::Home)).or(fired.first()) else {
        return Verdict::Nothing;
    };
    let (explained, to_state) = (rule.explain(s), rule.to.clone());
    if since_move < p.min_dwell {
        let why = format!("dwell: {:.1} s since the last move, minimum {:.1} s", since_move.as_secs_f64(), p.min_dwell.as_secs_f64());
        return Verdict::Hold { rule: explained, to_state, why };
    }
    if p.states.get(&to_state) != Some(&Site::Home) {
        // Snowbird's rule: m + C/speedup < C, i.e. speedup > C / (C − m).
        let (c, m) = (p.crunch_s, move_cost_s);
        if c <= m || p.speedup <= c / (c - m) {
            let why = format!("cost/benefit: speedup {:.2} does not beat C/(C-m) = {c:.1}/({c:.1}-{m:.2}) = {}", p.speedup, if c > m { format!("{:.3}", c / (c - m)) } else { "inf".into() });
            return Verdict::Hold { rule: explained, to_state, why };
        }
        let why = format!("{explained}; speedup {:.2} > C/(C-m) = {:.3}", p.speedup, c / (c - m));
        return Verdict::Move { rule: why, to_state };
    }
    Verdict::Move { rule: format!("{explained}; interactivity"), to_state }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Send one request to the head on a connection of its own and wait for the reply `pick` accepts.
async fn ask<T>(target: &Target, req: Msg, mut pick: impl FnMut(Msg) -> Option<T>) -> Option<T> {
    let (mut incoming, tx) = starling_session::connect(target).await.ok()?;
    tx.send(req).await.ok()?;
    loop {
        let m = incoming.recv().await.ok()?;
        if let Some(v) = pick(m) {
            return Some(v);
        }
    }
}

/// The manager of one roaming task: runs until the task's client ends it.
pub struct Manager {
    pub profile: Profile,
    /// What the profile is called in the log (its file, or `generic`).
    pub profile_name: String,
    pub target: Target,
    pub task: TaskId,
    /// The task's own connection (decisions are noted there: only its client may).
    pub notes: Outgoing,
    pub interaction: InteractionLog,
}

impl Manager {
    async fn note(&self, d: RoamDecision) {
        let _ = self.notes.send(Msg::RoamNote { task: self.task, decision: d }).await;
    }

    async fn row(&self) -> Option<TaskRow> {
        let task = self.task;
        ask(&self.target, Msg::PsRequest, |m| match m {
            Msg::PsReply(rows) => Some(rows.into_iter().find(|r| r.task == task)),
            _ => None,
        })
        .await
        .flatten()
    }

    pub async fn run(self) {
        let p = &self.profile;
        let mut state = p.initial.clone();
        let mut host = HOME.to_string();
        self.note(RoamDecision {
            at_ms: now_ms(),
            from_state: state.clone(),
            to_state: state.clone(),
            from_site: HOME.into(),
            to_site: HOME.into(),
            action: "started".into(),
            reason: format!("started at home (exec --roam, profile {})", self.profile_name),
            sensors: Vec::new(),
        })
        .await;
        let mut samples: VecDeque<Sample> = VecDeque::new();
        let mut last_move = Instant::now();
        let mut move_cost_s = p.move_cost_s;
        // The latest hold, so a held rule is logged once per episode, not every sample.
        let mut held: Option<String> = None;
        let mut tick = tokio::time::interval(p.sample);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(row) = self.row().await else { continue };
            if row.state.starts_with("moving") {
                continue;
            }
            let now = Instant::now();
            if row.host != host {
                // Moved (by hand): CPU rates across a move mean nothing; the dwell starts over.
                host.clone_from(&row.host);
                samples.clear();
                last_move = now;
                if let Some(s) = p.states.iter().find(|(_, s)| s.holds(&host)).map(|(n, _)| n.clone()) {
                    state = s;
                }
            }
            let Some(cpu) = row.cpu_seconds else { continue };
            samples.push_back(Sample { at: now, cpu_seconds: cpu, runnable: row.runnable.unwrap_or(0) });
            // Keep one sample at or before the window's start (the rate's base).
            while samples.len() > 2 && samples.get(1).is_some_and(|s| now.saturating_duration_since(s.at) >= p.window) {
                samples.pop_front();
            }
            let (first, last) = (samples[0], samples[samples.len() - 1]);
            let span = last.at.saturating_duration_since(first.at);
            if span < p.window.mul_f64(0.9) {
                continue; // not a full window yet
            }
            let ((inputs, latency_ms), (x_inputs, fps)) = {
                let mut i = self.interaction.lock().unwrap();
                (i.averaged(now, p.window), i.x.averaged(now, p.window))
            };
            let sensors = Sensors {
                cpu: (last.cpu_seconds - first.cpu_seconds).max(0.0) / span.as_secs_f64(),
                runnable: samples.iter().map(|s| f64::from(s.runnable)).sum::<f64>() / samples.len() as f64,
                inputs,
                latency_ms,
                x_inputs,
                fps,
            };
            let verdict = decide(p, &state, &sensors, now.saturating_duration_since(last_move), move_cost_s);
            let (rule, to_state) = match verdict {
                Verdict::Nothing => {
                    held = None;
                    continue;
                }
                Verdict::Hold { rule, to_state, why } => {
                    if held.as_deref() != Some(why.split(':').next().unwrap_or_default()) {
                        held = Some(why.split(':').next().unwrap_or_default().to_string());
                        self.note(RoamDecision {
                            at_ms: now_ms(),
                            from_state: state.clone(),
                            to_state,
                            from_site: host.clone(),
                            to_site: host.clone(),
                            action: "stay".into(),
                            reason: format!("{rule}; held: {why}"),
                            sensors: sensors.list(),
                        })
                        .await;
                    }
                    continue;
                }
                Verdict::Move { rule, to_state } => (rule, to_state),
            };
            held = None;
            let site = p.states[&to_state].clone();
            if site.holds(&host) {
                state = to_state;
                continue;
            }
            self.note(RoamDecision {
                at_ms: now_ms(),
                from_state: state.clone(),
                to_state: to_state.clone(),
                from_site: host.clone(),
                to_site: site.name().to_string(),
                action: "move".into(),
                reason: rule,
                sensors: sensors.list(),
            })
            .await;
            let to = match &site {
                Site::Cluster => None,
                s => Some(s.name().to_string()),
            };
            let asked = Instant::now();
            let task = self.task;
            let reply = ask(&self.target, Msg::Migrate { task, to, stop_and_copy: false }, |m| match m {
                Msg::MigrateReply { task: t, result } if t == task => Some(result),
                Msg::Error { message, .. } => Some(Err(message)),
                _ => None,
            })
            .await
            .unwrap_or_else(|| Err("the head did not answer".into()));
            match reply {
                Ok(report) => {
                    // m: detection (the averaging window) plus the move as measured.
                    move_cost_s = p.window.as_secs_f64() + asked.elapsed().as_secs_f64();
                    log::info!("roam: task {task} moved {} -> {} (pause {:.1} ms)", report.from, report.to, report.pause_ms);
                    host = report.to;
                    state = to_state;
                }
                Err(why) => {
                    self.note(RoamDecision {
                        at_ms: now_ms(),
                        from_state: state.clone(),
                        to_state,
                        from_site: host.clone(),
                        to_site: site.name().to_string(),
                        action: "failed".into(),
                        reason: why,
                        sensors: sensors.list(),
                    })
                    .await;
                }
            }
            samples.clear();
            last_move = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sensors(cpu: f64, inputs: f64) -> Sensors {
        Sensors { cpu, runnable: cpu, inputs, ..Sensors::default() }
    }

    fn x_sensors(cpu: f64, x_inputs: f64, fps: Option<f64>) -> Sensors {
        Sensors { cpu, runnable: cpu, x_inputs, fps, ..Sensors::default() }
    }

    #[test]
    fn the_generic_profile_parses_with_snowbirds_numbers() {
        let p = Profile::generic();
        assert_eq!(p.window, Duration::from_secs(10));
        assert_eq!(p.states["cognitive"], Site::Home);
        assert_eq!(p.states["crunch"], Site::Cluster);
        assert!(p.rules.iter().any(|r| r.inputs_min == Some(15.0)));
    }

    #[test]
    fn crunching_moves_to_the_cluster_and_typing_brings_it_home() {
        let p = Profile::generic();
        let long = Duration::from_secs(3600);
        assert!(matches!(decide(&p, "cognitive", &sensors(0.95, 2.0), long, 1.0), Verdict::Move { ref to_state, .. } if to_state == "crunch"));
        assert_eq!(decide(&p, "cognitive", &sensors(0.5, 2.0), long, 1.0), Verdict::Nothing);
        assert_eq!(decide(&p, "cognitive", &sensors(0.95, 20.0), long, 1.0), Verdict::Nothing, "typing: stays home");
        assert!(matches!(decide(&p, "crunch", &sensors(0.95, 20.0), long, 1.0), Verdict::Move { ref to_state, .. } if to_state == "cognitive"));
    }

    #[test]
    fn x_input_keeps_a_crunch_home_and_brings_it_back_and_jerky_drawing_does_sooner() {
        let p = Profile::generic();
        let long = Duration::from_secs(3600);
        assert_eq!(decide(&p, "cognitive", &x_sensors(0.95, 20.0, Some(60.0)), long, 1.0), Verdict::Nothing, "X input: stays home");
        assert!(matches!(decide(&p, "crunch", &x_sensors(0.95, 20.0, Some(60.0)), long, 1.0), Verdict::Move { ref to_state, .. } if to_state == "cognitive"));
        // A few inputs answered at 10 frames per second (below Snowbird's 20): home.
        let v = decide(&p, "crunch", &x_sensors(0.95, 4.0, Some(10.0)), long, 1.0);
        assert!(matches!(v, Verdict::Move { ref to_state, ref rule } if to_state == "cognitive" && rule.contains("fps 10.00 < 20")), "{v:?}");
        // The same few answered smoothly, or not answered at all: it goes on crunching there.
        assert_eq!(decide(&p, "crunch", &x_sensors(0.95, 4.0, Some(30.0)), long, 1.0), Verdict::Nothing);
        assert_eq!(decide(&p, "crunch", &x_sensors(0.95, 4.0, None), long, 1.0), Verdict::Nothing);
    }

    #[test]
    fn interactivity_wins_ties() {
        let mut p = Profile::generic();
        // A rule that would keep crunching and one that brings it home both hold.
        p.states.insert("crunch2".into(), Site::Host("h2".into()));
        p.rules.insert(0, Rule { from: "crunch".into(), to: "crunch2".into(), cpu_min: Some(0.5), ..Rule::default() });
        let v = decide(&p, "crunch", &sensors(0.95, 20.0), Duration::from_secs(3600), 1.0);
        assert!(matches!(v, Verdict::Move { ref to_state, .. } if to_state == "cognitive"), "{v:?}");
    }

    #[test]
    fn dwell_time_holds_a_move_back() {
        let p = Profile::generic();
        let v = decide(&p, "crunch", &sensors(0.0, 20.0), Duration::from_secs(5), 1.0);
        assert!(matches!(v, Verdict::Hold { ref why, .. } if why.starts_with("dwell")), "{v:?}");
    }

    #[test]
    fn a_move_that_costs_more_than_the_speedup_saves_is_not_made() {
        let mut p = Profile::generic();
        p.crunch_s = 60.0;
        // speedup 2 pays when C/(C-m) < 2, i.e. m < 30 s.
        assert!(matches!(decide(&p, "cognitive", &sensors(1.0, 0.0), Duration::from_secs(3600), 29.0), Verdict::Move { .. }));
        let v = decide(&p, "cognitive", &sensors(1.0, 0.0), Duration::from_secs(3600), 31.0);
        assert!(matches!(v, Verdict::Hold { ref why, .. } if why.starts_with("cost/benefit")), "{v:?}");
        p.speedup = 1.0;
        assert!(matches!(decide(&p, "cognitive", &sensors(1.0, 0.0), Duration::from_secs(3600), 0.5), Verdict::Hold { .. }), "no speedup: never pays");
    }

    #[test]
    fn a_profile_naming_an_unknown_state_is_refused() {
        let bad = GENERIC_PROFILE.replace("to = \"crunch\"", "to = \"cruncj\"");
        assert!(matches!(Profile::parse(&bad), Err(ProfileError::NoState(s)) if s == "cruncj"));
        assert!(matches!(Profile::parse("initial = \"x\"\n[states.y]\nsite = \"home\"\n"), Err(ProfileError::NoInitial(_))));
    }

    #[test]
    fn interaction_counts_inputs_and_first_output_latency_in_the_window() {
        let mut i = Interaction::default();
        let t0 = Instant::now();
        i.input(t0);
        i.input(t0 + Duration::from_millis(10));
        i.output(t0 + Duration::from_millis(40));
        i.output(t0 + Duration::from_millis(90)); // not a first byte: no new latency
        let (n, lat) = i.averaged(t0 + Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(n, 2.0);
        assert_eq!(lat, Some(40.0));
        let (n, lat) = i.averaged(t0 + Duration::from_secs(5), Duration::from_secs(1));
        assert_eq!((n, lat), (0.0, None));
    }
}
