//! Preparing a launch: bind the paths the program will look up (learned
//! from its earlier runs, and the files its command line names) and push
//! content the head lacks, all in the launch's flight; after the run,
//! learn from what it used.

use crate::shadow::{JobBindings, JobPaths, Shadow};
use crate::{ClientError, Context, Result};
use starling_session::files::{Asked, AskedKind, FileServer};
use starling_session::prethrow::{self, Profile};
use starling_session::Session;
use starling_proto::{ChunkData, Recipe, TaskSpec, WirePath};
use starling_proto::Hash;
use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::MetadataExt;

/// A planned push of at least this many bytes first asks the head what it
/// holds (one round trip; on a slow link 16 KiB take longer than that).
pub const HOLDS_QUERY_MIN_BYTES: u64 = 16 << 10;

/// Learned prethrow state of one launch: the profile and what was sent.
pub struct Prediction {
    pub profile: Profile,
    pub sent: Vec<WirePath>,
    /// Content the head lacks, to push in the launch flight.
    pub push: (Vec<Recipe>, Vec<ChunkData>),
    pub shadow: Option<Shadow>,
    pub job: Option<JobBindings>,
    /// What earlier tasks of this program used in this job (see [`JobPaths`]).
    pub job_paths: Option<JobPaths>,
    /// The temp directories of the launch (not remembered in `job_paths`).
    pub temp_dirs: Vec<WirePath>,
    /// For reports: bindings sent, and (recipes, chunks, bytes) pushed.
    pub sent_bindings: usize,
    pub pushed: (usize, usize, u64),
    /// Encoded size of the bindings and listings sent with the launch, and
    /// of those bound only because earlier tasks of the job used them: what
    /// the prediction costs on the wire.
    pub prethrow_bytes: u64,
    pub job_predicted: usize,
    /// Planned pushes the head turned out to hold (recipes and chunks).
    pub held_skipped: usize,
    /// Directories whose listings went with the launch.
    pub listed: Vec<WirePath>,
    /// When the bindings were made: a file changed since was not bound as it is now.
    pub bound_at: std::time::SystemTime,
}

/// Why a request reached the client although the launch carried a prediction
/// (for the stats line: which class of request a better prediction would cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Miss {
    /// The path was bound at launch and asked all the same.
    Bound,
    /// A name in the task's temp directory (its listing went with the launch).
    Temp,
    /// The path does not exist (a negative lookup nothing predicted).
    Absent,
    /// The file was created or changed after the launch was bound (by an
    /// earlier or concurrent task of the build, e.g. an output another compile wrote).
    ChangedSinceLaunch,
    /// It exists and its directory's listing went with the launch, but it was not bound.
    ListedNotBound,
    /// It exists and no earlier run of the program (nor task of its jobs) used it.
    Unpredicted,
    /// A directory listing that did not go with the launch.
    Listing,
    /// Content (a recipe or chunks) the cluster did not hold.
    Content,
}

impl Prediction {
    /// Why `asked` reached the client, as far as this client can tell now.
    pub fn classify(&self, asked: &Asked) -> Miss {
        let path = match (asked.kind, &asked.path) {
            (AskedKind::Recipe | AskedKind::Chunks, _) => return Miss::Content,
            (AskedKind::Readdir, _) => return Miss::Listing,
            (AskedKind::Lookup, None) => return Miss::Unpredicted,
            (AskedKind::Lookup, Some(p)) => p,
        };
        if self.sent.binary_search(path).is_ok() {
            return Miss::Bound;
        }
        if self.temp_dirs.iter().any(|d| prethrow::is_under(path, d)) {
            return Miss::Temp;
        }
        let Ok(meta) = std::fs::symlink_metadata(path.as_path()) else { return Miss::Absent };
        let changed = std::time::UNIX_EPOCH + std::time::Duration::new(
            u64::try_from(meta.ctime()).unwrap_or(0),
            u32::try_from(meta.ctime_nsec()).unwrap_or(0),
        );
        if changed >= self.bound_at {
            return Miss::ChangedSinceLaunch;
        }
        let parent = path.as_path().parent().and_then(prethrow::normalise);
        if parent.is_some_and(|d| self.listed.contains(&d)) {
            return Miss::ListedNotBound;
        }
        Miss::Unpredicted
    }
}

impl Prediction {
    /// The head took the launch (`job_fresh`: it held no bindings for the
    /// job until then). Only now does the job's record say what the head
    /// holds, so later launches of the job may send a delta against it.
    pub fn launched(&mut self, job_fresh: bool) {
        let Some(j) = self.job.as_mut() else { return };
        if job_fresh && j.had_record {
            // We sent a delta the head could not apply; next time, everything.
            j.forget();
        } else {
            j.save();
        }
    }

    /// After the run: learn the profile, and remember what the head now holds.
    pub fn finish(&mut self, files: &FileServer, accessed: &[WirePath]) {
        self.profile.record(accessed, &self.sent, &self.temp_dirs);
        self.profile.save();
        if let Some(j) = self.job_paths.as_mut() {
            j.record(accessed, &self.temp_dirs);
        }
        if let Some(s) = self.shadow.as_mut() {
            // Already appended to the shadow as they were served (see `prepare`).
            files.take_served();
            s.save();
        }
    }
}

/// Wall time and process CPU time of each stage of one launch, in order
/// (for `client.stats_file`). The first stage's CPU counts from the
/// process's start, so it includes exec and the dynamic loader.
#[derive(Default, Debug)]
pub struct Stages(Vec<(&'static str, std::time::Duration, std::time::Duration)>);

/// CPU time of this process (all its threads) since it started.
fn process_cpu() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into memory we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    std::time::Duration::new(u64::try_from(ts.tv_sec).unwrap_or(0), u32::try_from(ts.tv_nsec).unwrap_or(0))
}

impl Stages {
    /// Record stage `name` as lasting from `from` to `to`; returns `to`.
    pub fn stamp(&mut self, name: &'static str, from: std::time::Instant, to: std::time::Instant) -> std::time::Instant {
        let cpu = process_cpu();
        let before: std::time::Duration = self.0.iter().map(|s| s.2).sum();
        self.0.push((name, to.saturating_duration_since(from), cpu.saturating_sub(before)));
        to
    }

    fn to_json(&self) -> serde_json::Value {
        self.0.iter().map(|(k, d, _)| ((*k).to_string(), serde_json::json!(d.as_secs_f64() * 1000.0))).collect::<serde_json::Map<_, _>>().into()
    }

    fn cpu_json(&self) -> serde_json::Value {
        self.0.iter().map(|(k, _, c)| ((*k).to_string(), serde_json::json!(c.as_secs_f64() * 1000.0))).collect::<serde_json::Map<_, _>>().into()
    }
}

/// CPU this process used so far: (user, system) in ms.
fn own_cpu_ms() -> (f64, f64) {
    // SAFETY: getrusage writes one rusage struct into memory we own.
    let ru = unsafe {
        let mut ru = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &raw mut ru);
        ru
    };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    (ms(ru.ru_utime), ms(ru.ru_stime))
}

/// With `client.stats_file` set, append one JSON line per launch: what
/// the client had to answer while the task ran (each request is a round
/// trip on the critical path), what it pushed, and how long it took. For
/// benchmarks.
pub fn write_stats(
    ctx: &Context,
    files: &FileServer,
    prediction: Option<&Prediction>,
    tasks: usize,
    wall: std::time::Duration,
    stages: Option<&Stages>,
) {
    let Some(path) = &ctx.settings.stats_file else { return };
    let st = files.stats();
    let (cpu_user_ms, cpu_sys_ms) = own_cpu_ms();
    let line = serde_json::json!({
        "tasks": tasks,
        "wall_s": wall.as_secs_f64(),
        "file_requests": st.requests,
        "serve": st,
        "prethrow_bindings": prediction.map_or(0, |p| p.sent_bindings),
        "pushed_recipes": prediction.map_or(0, |p| p.pushed.0),
        "pushed_chunks": prediction.map_or(0, |p| p.pushed.1),
        "pushed_bytes": prediction.map_or(0, |p| p.pushed.2),
        "prethrow_bytes": prediction.map_or(0, |p| p.prethrow_bytes),
        "job_predicted": prediction.map_or(0, |p| p.job_predicted),
        "push_held_skipped": prediction.map_or(0, |p| p.held_skipped),
        // The first requests answered, as [kind, why, path] (why: see `Miss`).
        "asked": files.asked().iter().map(|a| serde_json::json!([
            a.kind,
            prediction.map(|p| p.classify(a)),
            a.path.as_ref().map(|p| p.to_string()),
        ])).collect::<Vec<_>>(),
        "stages_ms": stages.map(Stages::to_json),
        "stages_cpu_ms": stages.map(Stages::cpu_json),
        "since_main_ms": ctx.started.elapsed().as_secs_f64() * 1000.0,
        // Wall-clock end of this launch (Unix ms): with since_main_ms and the
        // stages, when concurrent launches (make -j) started, waited and ran.
        "ended_unix_ms": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1000.0),
        "cpu_user_ms": cpu_user_ms,
        "cpu_sys_ms": cpu_sys_ms,
    });
    // One write(2) per line: concurrent clients (make -j) append to the same
    // file, and O_APPEND keeps whole writes apart but not the many small
    // writes `writeln!` makes while formatting a JSON value.
    let record = format!("{line}\n");
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(record.as_bytes());
    }
}

/// Bind the program's predicted paths (and files named in argv) into
/// `spec`, and plan the push of what the head lacks. With a job name, the
/// head already holds the job's earlier bindings: only changed ones are
/// sent, and every binding the head holds is re-validated here first, so
/// none can go stale. Pushing is pointless when the head keeps no relay
/// cache, and can be switched off (`client.push`) to measure what it saves.
///
/// `job_pool`: for a task of a job, which kind (`exec --job`: "job";
/// `run`/`batch`: "run"): it then also binds every path earlier tasks of
/// its program used in jobs of that kind run from the same directory —
/// this build's and the last one's, whatever the jobs were named (builds
/// often name theirs afresh) — see [`JobPaths`]. `None` for a lone exec.
pub fn predict(ctx: &Context, files: &FileServer, spec: &mut TaskSpec, job_pool: Option<&str>) -> Prediction {
    let cache_dir = &ctx.settings.cache_dir;
    let cluster_id = &ctx.target.cluster_id;
    let key = prethrow::profile_key(spec);
    let profile = Profile::load(&cache_dir.join("profiles"), &key);
    let mut job = spec.job.as_deref().map(|j| JobBindings::load(&cache_dir.join("jobs"), cluster_id, j));
    let cwd = String::from_utf8_lossy(spec.cwd.as_bytes()).into_owned();
    let job_paths = job_pool.map(|j| JobPaths::load(&cache_dir.join("job-paths"), j, &key, &cwd));
    let mut paths = profile.predicted();
    let own = paths.len();
    if let Some(j) = &job_paths {
        paths.extend(j.paths());
    }
    paths.sort();
    paths.dedup();
    let job_predicted = paths.len() - own;
    // The root is looked up when the view mounts, before the task runs.
    paths.push(WirePath::root());
    paths.extend(prethrow::argv_paths(spec));
    if let Some(j) = &job {
        paths.extend(j.paths());
    }
    paths.sort();
    paths.dedup();
    let bound_at = std::time::SystemTime::now();
    let bindings = prethrow::bind(files, &paths);
    spec.listings = prethrow::list(files, &prethrow::listing_dirs(spec));
    let listed: Vec<WirePath> = spec.listings.iter().map(|(d, _)| d.clone()).collect();
    let temp_dirs = prethrow::temp_dirs(spec);
    let push_on = ctx.settings.push && ctx.target.relay_cache;
    let mut shadow = push_on.then(|| Shadow::load(&cache_dir.join("shadow"), cluster_id));
    let push = match shadow.as_mut() {
        Some(s) => s.plan_push(files, &bindings, ctx.settings.compress),
        None => (Vec::new(), Vec::new()),
    };
    let total = bindings.len();
    // The job's record is saved once the head has taken the launch
    // ([`Prediction::launched`]), not here: a concurrent launch (make -j)
    // that read it earlier could reach the head first and run with only a
    // delta against bindings the head does not hold yet.
    spec.prethrow = match job.as_mut() {
        Some(j) => j.delta(bindings),
        None => bindings,
    };
    log::info!(
        "prethrow for {key}: {total} bindings, {} sent; pushing {} recipes, {} chunks",
        spec.prethrow.len(),
        push.0.len(),
        push.1.len()
    );
    let pushed = (push.0.len(), push.1.len(), push.1.iter().map(|c| c.data.len() as u64).sum());
    let prethrow_bytes =
        bincode::serialized_size(&spec.prethrow).unwrap_or(0) + bincode::serialized_size(&spec.listings).unwrap_or(0);
    Prediction {
        profile,
        sent: paths,
        push,
        shadow,
        job,
        job_paths,
        temp_dirs,
        sent_bindings: spec.prethrow.len(),
        pushed,
        prethrow_bytes,
        job_predicted,
        held_skipped: 0,
        listed,
        bound_at,
    }
}

/// Before a launch: bind the predicted paths into `spec` and push what the
/// head lacks (the same flight as the launch that follows). `None` when
/// prethrow is off (`client.prethrow`).
pub async fn prepare(ctx: &Context, session: &Session, spec: TaskSpec, job_pool: Option<&'static str>) -> Result<(TaskSpec, Option<Prediction>)> {
    if !ctx.settings.prethrow {
        return Ok((spec, None));
    }
    if ctx.settings.push && ctx.target.relay_cache {
        // What the cluster fetches from us it holds from then on: write it to
        // the shadow as it is served, so concurrent execs of one build know
        // at once instead of when this task ends.
        session.files().log_served_to(Shadow::file_for(&ctx.settings.cache_dir.join("shadow"), &ctx.target.cluster_id));
    }
    let files = session.files().clone();
    let ctx2 = ctx.clone();
    let (mut p, spec) = tokio::task::spawn_blocking(move || {
        let mut spec = spec;
        let p = predict(&ctx2, &files, &mut spec, job_pool);
        (p, spec)
    })
    .await
    .map_err(|_| ClientError::Interrupted)?;
    let (mut recipes, mut chunks) = std::mem::take(&mut p.push);
    if p.pushed.2 >= HOLDS_QUERY_MIN_BYTES {
        // A large push: ask first what the head already holds (a shadow knows
        // only what this client cache saw; a fresh one against a warm cluster
        // would push it all). The answer is in the shadow already: the plan
        // marked every planned name known.
        let names: Vec<Hash> = recipes.iter().map(Recipe::name).chain(chunks.iter().map(|c| c.hash)).collect();
        let held: HashSet<Hash> = session.holds(names).await?.into_iter().collect();
        recipes.retain(|r| !held.contains(&r.name()));
        chunks.retain(|c| !held.contains(&c.hash));
        p.pushed = (recipes.len(), chunks.len(), chunks.iter().map(|c| c.data.len() as u64).sum());
        p.held_skipped = held.len();
    }
    if !recipes.is_empty() || !chunks.is_empty() {
        session.push(recipes, chunks).await?;
    }
    Ok((spec, Some(p)))
}

