//! `starling exec`: run one command on the cluster as if it ran here.

use crate::session::{Session, SessionOptions, TaskEvent, TaskHandle};
use crate::EXIT_STARLING_FAILURE;
use anyhow::Result;
use starling_proto::{Msg, Stream, TaskSpec};
use std::io::{Read, Write};
use tokio::signal::unix::{signal, SignalKind};

pub use crate::session::{cache_dir, connect};

pub struct ExecOptions {
    pub cluster: Option<String>,
    pub host: Option<String>,
    pub job: Option<String>,
    /// Compress chunk transfers and frames on the link (zstd).
    pub compress: bool,
    /// Send predicted path bindings with the launch.
    pub prethrow: bool,
}

/// Learned prethrow state of one launch: the profile and what was sent.
pub struct Prediction {
    pub profile: crate::prethrow::Profile,
    pub sent: Vec<starling_proto::WirePath>,
    /// Content the head lacks, to push in the launch flight.
    pub push: (Vec<starling_proto::Recipe>, Vec<starling_proto::ChunkData>),
    pub shadow: Option<crate::shadow::Shadow>,
    pub job: Option<crate::shadow::JobBindings>,
    /// For reports: bindings sent, and (recipes, chunks, bytes) pushed.
    pub sent_bindings: usize,
    pub pushed: (usize, usize, u64),
}

impl Prediction {
    /// After the run: learn the profile, and remember what the head now holds.
    pub fn finish(&mut self, files: &crate::files::FileServer, accessed: &[starling_proto::WirePath]) {
        self.profile.record(accessed, &self.sent);
        self.profile.save();
        if let Some(s) = self.shadow.as_mut() {
            for h in files.take_served() {
                s.note(h);
            }
            s.save();
        }
    }
}

/// With `STARLING_STATS_FILE=PATH`, append one JSON line per launch: what
/// the client had to answer while the task ran (each request is a round trip
/// on the critical path), what it pushed, and how long it took. For benchmarks.
pub fn write_stats(files: &crate::files::FileServer, prediction: Option<&Prediction>, tasks: usize, wall: std::time::Duration) {
    let Some(path) = std::env::var_os("STARLING_STATS_FILE") else { return };
    let st = files.stats();
    let line = serde_json::json!({
        "tasks": tasks,
        "wall_s": wall.as_secs_f64(),
        "file_requests": st.requests,
        "serve": st,
        "prethrow_bindings": prediction.map(|p| p.sent_bindings).unwrap_or(0),
        "pushed_recipes": prediction.map(|p| p.pushed.0).unwrap_or(0),
        "pushed_chunks": prediction.map(|p| p.pushed.1).unwrap_or(0),
        "pushed_bytes": prediction.map(|p| p.pushed.2).unwrap_or(0),
    });
    // One write(2) per line: concurrent clients (make -j) append to the same
    // file, and O_APPEND keeps whole writes apart but not the many small
    // writes `writeln!` makes while formatting a JSON value.
    let record = format!("{line}\n");
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(record.as_bytes());
    }
}

/// Pushing can be switched off (`STARLING_PUSH=off`) to measure what it
/// saves; it is pointless when the head keeps no relay cache.
fn push_enabled() -> bool {
    std::env::var("STARLING_PUSH").map(|v| v != "off").unwrap_or(true) && crate::discover::relay_cache_on(None)
}

/// Bind the program's predicted paths (and files named in argv) into
/// `spec`, and plan the push of what the head lacks. With a job name, the
/// head already holds the job's earlier bindings: only changed ones are
/// sent, and every binding the head holds is re-validated here first, so
/// none can go stale.
pub fn predict(files: &crate::files::FileServer, spec: &mut TaskSpec, cluster_id: &str, compress: bool) -> Prediction {
    use crate::prethrow;
    let key = prethrow::profile_key(spec);
    let profile = prethrow::Profile::load(&cache_dir().join("profiles"), &key);
    let mut job = spec.job.as_deref().map(|j| crate::shadow::JobBindings::load(&cache_dir().join("jobs"), cluster_id, j));
    let mut paths = profile.predicted();
    // The root is looked up when the view mounts, before the task runs.
    paths.push(starling_proto::WirePath::root());
    paths.extend(prethrow::argv_paths(spec));
    if let Some(j) = &job {
        paths.extend(j.paths());
    }
    paths.sort();
    paths.dedup();
    let bindings = prethrow::bind(files, &paths);
    spec.listings = prethrow::list(files, &prethrow::listing_dirs(spec));
    let mut shadow = push_enabled().then(|| crate::shadow::Shadow::load(&cache_dir().join("shadow"), cluster_id));
    let push = match shadow.as_mut() {
        Some(s) => s.plan_push(files, &bindings, compress),
        None => (Vec::new(), Vec::new()),
    };
    let total = bindings.len();
    spec.prethrow = match job.as_mut() {
        Some(j) => {
            let d = j.delta(bindings);
            j.save();
            d
        }
        None => bindings,
    };
    log::info!(
        "prethrow for {key}: {total} bindings, {} sent; pushing {} recipes, {} chunks",
        spec.prethrow.len(),
        push.0.len(),
        push.1.len()
    );
    let pushed = (push.0.len(), push.1.len(), push.1.iter().map(|c| c.data.len() as u64).sum());
    Prediction { profile, sent: paths, push, shadow, job, sent_bindings: spec.prethrow.len(), pushed }
}

/// Copy our stdin to the task from a plain thread (stdin may be a terminal
/// or a pipe; blocking reads are simplest and never stall the runtime).
fn stdin_pump(handle: &TaskHandle) {
    let task = handle.task;
    let tx = handle.sender();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 256 << 10];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(Msg::StdinEof { task });
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Msg::Stdin { task, data: buf[..n].to_vec() }).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

/// Signals we pass on to the task instead of dying of them.
pub(crate) fn forwarded_signals() -> Result<tokio::sync::mpsc::Receiver<i32>> {
    let (sig_tx, sig_rx) = tokio::sync::mpsc::channel::<i32>(8);
    for (kind, no) in [
        (SignalKind::interrupt(), libc::SIGINT),
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::hangup(), libc::SIGHUP),
        (SignalKind::quit(), libc::SIGQUIT),
    ] {
        let mut s = signal(kind)?;
        let sig_tx = sig_tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                let _ = sig_tx.send(no).await;
            }
        });
    }
    Ok(sig_rx)
}

/// Print a finished task's commit outcome; returns false if the commit failed.
pub fn report_commit(commit: &Result<crate::commit::CommitReport, String>) -> bool {
    match commit {
        Ok(report) => {
            for c in &report.conflicts {
                match &c.saved_as {
                    Some(s) => eprintln!("starling: conflict: {} {}; the task's version was saved as {}", c.path, c.why, s.display()),
                    None => eprintln!("starling: conflict: {} {}", c.path, c.why),
                }
            }
            true
        }
        Err(e) => {
            eprintln!("starling: committing the task's changes failed: {e}");
            false
        }
    }
}

/// Before a launch: bind the predicted paths into `spec` and push what the
/// head lacks (the same flight as the launch that follows). `None` when
/// prethrow is off.
pub async fn prepare_launch(
    session: &Session,
    spec: TaskSpec,
    prethrow: bool,
    compress: bool,
) -> Result<(TaskSpec, Option<Prediction>)> {
    if !prethrow {
        return Ok((spec, None));
    }
    let files = session.files().clone();
    let cluster = session.cluster_id.clone();
    let (mut p, spec) = tokio::task::spawn_blocking(move || {
        let mut spec = spec;
        let p = predict(&files, &mut spec, &cluster, compress);
        (p, spec)
    })
    .await?;
    let (recipes, chunks) = std::mem::take(&mut p.push);
    if !recipes.is_empty() || !chunks.is_empty() {
        session.push(recipes, chunks).await?;
    }
    Ok((spec, Some(p)))
}

/// Run `spec` on the cluster; returns the exit status `starling exec` should use.
pub async fn run(mut spec: TaskSpec, opts: ExecOptions) -> Result<i32> {
    spec.host = opts.host.clone();
    spec.job = opts.job.clone();
    // SIGPIPE would kill us mid-commit if our stdout goes away; handle EPIPE instead.
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = forwarded_signals()?;
    let t0 = std::time::Instant::now();
    let session = Session::connect(SessionOptions { cluster: opts.cluster.clone(), compress: opts.compress }).await?;
    let (spec, mut prediction) = prepare_launch(&session, spec, opts.prethrow, opts.compress).await?;
    let launch = session.launch(spec);
    tokio::pin!(launch);
    let mut handle = loop {
        tokio::select! {
            h = &mut launch => break h?,
            // Not started yet: nothing remote to stop.
            Some(no) = sigs.recv() => return Ok(128 + no),
        }
    };
    log::info!("task {} started on {}", handle.task, handle.host);
    if handle.job_fresh {
        if let Some(j) = prediction.as_mut().and_then(|p| p.job.as_mut()) {
            if j.had_record {
                // We sent a delta the head could not apply; next time, everything.
                j.forget();
            }
        }
    }
    stdin_pump(&handle);

    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut stdout_gone = false;
    loop {
        let ev = tokio::select! {
            ev = handle.events.recv() => ev,
            Some(no) = sigs.recv() => { handle.signal(no).await; continue; }
        };
        match ev {
            Some(TaskEvent::Output(stream, data)) => {
                let res = match stream {
                    Stream::Stdout if !stdout_gone => stdout.write_all(&data).and_then(|_| stdout.flush()),
                    Stream::Stdout => Ok(()),
                    Stream::Stderr => stderr.write_all(&data).and_then(|_| stderr.flush()),
                };
                if res.is_err() && stream == Stream::Stdout {
                    // Like a local pipeline: the writer gets SIGPIPE when the reader is gone.
                    stdout_gone = true;
                    handle.signal(libc::SIGPIPE).await;
                }
            }
            Some(TaskEvent::Finished { status, commit, accessed }) => {
                if let Some(p) = prediction.as_mut() {
                    p.finish(session.files(), &accessed);
                }
                write_stats(session.files(), prediction.as_ref(), 1, t0.elapsed());
                if !report_commit(&commit) {
                    return Ok(EXIT_STARLING_FAILURE);
                }
                log::info!("task {} ended {status:?}; {:?}", handle.task, session.files().stats());
                return Ok(status.shell_code());
            }
            Some(TaskEvent::Started { .. }) | Some(TaskEvent::CloneStats { .. }) => {}
            Some(TaskEvent::Refused(why)) | Some(TaskEvent::Lost(why)) => {
                eprintln!("starling: {why}");
                return Ok(EXIT_STARLING_FAILURE);
            }
            None => {
                eprintln!("starling: lost connection to the cluster head; no changes were committed");
                return Ok(EXIT_STARLING_FAILURE);
            }
        }
    }
}
