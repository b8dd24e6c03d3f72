//! Jobs: many tasks launched together (`starling run -n N`, `starling batch`).
//!
//! A job is one process, one connection and one launch message: its tasks
//! share one prethrow and one consistency point (UCop's job-end-to-start
//! consistency), and the head starts each as soon as a core is free.

use crate::exec::report_commit;
use crate::launch;
use crate::{Context, Result, EXIT_STARLING_FAILURE};
use starling_proto::{ExitStatus, JobTask, Stream, TaskId, TaskSpec, WirePath};
use starling_session::{Session, TaskEvent};
use std::collections::{BTreeSet, HashMap};
use std::io::{IsTerminal, Write};
use tokio::sync::mpsc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Report {
    /// A progress bar on a terminal (jobs of more than a few tasks), nothing otherwise.
    Auto,
    /// No progress, no summary.
    Quiet,
    /// JSON lines on stdout: every event, then a summary (task output included as events).
    Json,
}

pub struct JobOptions {
    /// Send the prethrow with every task instead of once (for measurements).
    pub prethrow_per_task: bool,
    pub report: Report,
}

/// Per-task output is passed through line by line, so lines of different
/// tasks never interleave mid-line.
struct LineBuf {
    pending: HashMap<(usize, Stream), Vec<u8>>,
}

impl LineBuf {
    fn push(&mut self, idx: usize, stream: Stream, data: &[u8]) -> Vec<u8> {
        let buf = self.pending.entry((idx, stream)).or_default();
        buf.extend_from_slice(data);
        match buf.iter().rposition(|&b| b == b'\n') {
            Some(i) => {
                let rest = buf.split_off(i + 1);
                std::mem::replace(buf, rest)
            }
            None => Vec::new(),
        }
    }
    fn flush(&mut self, idx: usize) -> Vec<(Stream, Vec<u8>)> {
        [Stream::Stdout, Stream::Stderr]
            .into_iter()
            .filter_map(|s| self.pending.remove(&(idx, s)).filter(|b| !b.is_empty()).map(|b| (s, b)))
            .collect()
    }
}

fn emit(stream: Stream, data: &[u8]) {
    let _ = match stream {
        Stream::Stdout => std::io::stdout().write_all(data).and_then(|_| std::io::stdout().flush()),
        Stream::Stderr => std::io::stderr().write_all(data).and_then(|_| std::io::stderr().flush()),
    };
}

fn json_line(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// How one task ended.
#[derive(Debug, Clone)]
enum End {
    Exit(ExitStatus),
    /// Lost, refused, or its commit failed (already reported).
    Failed,
}

/// Run a job: `argvs[i]` is task i's argv, or `None` for `base.argv`.
pub async fn run(ctx: &Context, base: TaskSpec, argvs: Vec<Option<Vec<Vec<u8>>>>, opts: JobOptions) -> Result<i32> {
    let n = argvs.len();
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = crate::exec::forwarded_signals()?;
    let session = ctx.session().await?;
    // What the tasks of this run use, the next run's tasks get bound from the start.
    let (base, mut prediction) = launch::prepare(ctx, &session, base, Some("run")).await?;
    let mut events = launch_all(&session, base, argvs, opts.prethrow_per_task).await?;
    let mut view = JobView::new(n, opts.report);
    let mut interrupted = None;
    while !view.all_ended() {
        let (idx, ev) = tokio::select! {
            e = events.recv() => match e { Some(e) => e, None => break },
            Some(no) = sigs.recv() => {
                interrupted = Some(no);
                for (task, _) in view.started.values() {
                    session.signal(*task, no).await;
                }
                continue;
            }
        };
        if let (TaskEvent::Started { task, .. }, Some(no)) = (&ev, interrupted) {
            session.signal(*task, no).await;
        }
        view.on_event(idx, ev);
        view.tick(session.files().stats().chunk_bytes_sent);
    }
    view.close();
    if let Some(p) = prediction.as_mut() {
        // One run of the job is one run of the program: count each path once.
        let accessed: Vec<WirePath> = std::mem::take(&mut view.accessed).into_iter().collect();
        p.finish(session.files(), &accessed);
    }
    launch::write_stats(ctx, session.files(), prediction.as_ref(), n, view.t0.elapsed(), None);
    view.summary();
    Ok(view.exit_status())
}

/// Launch the job: one message for all its tasks, or (for measurements) one
/// per task. Returns every task's events, tagged with its index.
async fn launch_all(
    session: &Session,
    base: TaskSpec,
    argvs: Vec<Option<Vec<Vec<u8>>>>,
    per_task: bool,
) -> Result<mpsc::UnboundedReceiver<(usize, TaskEvent)>> {
    let n = argvs.len();
    let mut pendings = Vec::with_capacity(n);
    if per_task {
        for (i, argv) in argvs.into_iter().enumerate() {
            let mut s = base.clone();
            if let Some(a) = argv {
                s.argv = a;
            }
            s.set_task_index(i, n);
            pendings.push(session.launch_pending(s, i).await?);
        }
    } else {
        pendings = session.launch_job(base, argvs.into_iter().map(|argv| JobTask { argv }).collect()).await?;
    }
    let (ev_tx, ev_rx) = mpsc::unbounded_channel::<(usize, TaskEvent)>();
    for mut p in pendings {
        let ev_tx = ev_tx.clone();
        tokio::spawn(async move {
            while let Some(ev) = p.events.recv().await {
                let _ = ev_tx.send((p.index, ev));
            }
        });
    }
    Ok(ev_rx)
}

/// What the user sees of a running job, and what it adds up to.
struct JobView {
    n: usize,
    report: Report,
    bar: Option<indicatif::ProgressBar>,
    lines: LineBuf,
    started: HashMap<usize, (TaskId, String)>,
    ends: Vec<Option<End>>,
    accessed: BTreeSet<WirePath>,
    bytes_out: u64,
    bytes_in: u64,
    t0: std::time::Instant,
}

impl JobView {
    fn new(n: usize, report: Report) -> JobView {
        let bar = (report == Report::Auto && n > 3 && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(n as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} done  {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(200));
            b
        });
        JobView {
            n,
            report,
            bar,
            lines: LineBuf { pending: HashMap::new() },
            started: HashMap::new(),
            ends: vec![None; n],
            accessed: BTreeSet::new(),
            bytes_out: 0,
            bytes_in: 0,
            t0: std::time::Instant::now(),
        }
    }

    /// Print without tearing the progress bar.
    fn say(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    fn flush_lines(&mut self, idx: usize) {
        for (s, b) in self.lines.flush(idx) {
            self.say(|| emit(s, &b));
        }
    }

    fn on_event(&mut self, idx: usize, ev: TaskEvent) {
        let json = self.report == Report::Json;
        match ev {
            TaskEvent::Started { task, host, .. } => {
                if json {
                    json_line(serde_json::json!({"event": "started", "task": idx, "host": host}));
                }
                self.started.insert(idx, (task, host));
            }
            TaskEvent::Output(stream, data) => {
                self.bytes_in += data.len() as u64;
                if json {
                    let s = if stream == Stream::Stdout { "stdout" } else { "stderr" };
                    json_line(serde_json::json!({"event": "output", "task": idx, "stream": s, "data": String::from_utf8_lossy(&data)}));
                } else {
                    let complete = self.lines.push(idx, stream, &data);
                    if !complete.is_empty() {
                        self.say(|| emit(stream, &complete));
                    }
                }
            }
            TaskEvent::Finished { status, commit, accessed } => {
                self.flush_lines(idx);
                self.accessed.extend(accessed);
                if let Ok(r) = &commit {
                    self.bytes_in += r.bytes;
                }
                let mut ok = false;
                self.say(|| ok = report_commit(&commit));
                if json {
                    let conflicts: Vec<String> =
                        commit.as_ref().map(|r| r.conflicts.iter().map(|c| c.path.to_string()).collect()).unwrap_or_default();
                    json_line(serde_json::json!({"event": "finished", "task": idx, "exit": status.shell_code(),
                        "commit_ok": commit.is_ok(), "conflicts": conflicts}));
                }
                self.ends[idx] = Some(if ok { End::Exit(status) } else { End::Failed });
            }
            TaskEvent::CloneStats { .. } | TaskEvent::X11(_) => {}
            TaskEvent::Refused(why) | TaskEvent::Lost(why) => {
                self.flush_lines(idx);
                self.say(|| eprintln!("starling: task {idx}: {why}"));
                if json {
                    json_line(serde_json::json!({"event": "lost", "task": idx, "why": why}));
                }
                self.ends[idx] = Some(End::Failed);
            }
        }
    }

    fn done(&self) -> usize {
        self.ends.iter().filter(|e| e.is_some()).count()
    }

    fn all_ended(&self) -> bool {
        self.done() == self.n
    }

    /// Update the progress bar; `bytes_out`: content sent so far.
    fn tick(&mut self, bytes_out: u64) {
        self.bytes_out = bytes_out;
        let done = self.done();
        if let Some(b) = &self.bar {
            b.set_position(done as u64);
            let running = self.started.len() - done.min(self.started.len());
            let queued = self.n - self.started.len().max(done);
            b.set_message(format!(
                "{running} running, {queued} queued   sent {}, received {}",
                human(self.bytes_out),
                human(self.bytes_in)
            ));
        }
    }

    fn close(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    fn failed(&self) -> usize {
        self.ends.iter().filter(|e| !matches!(e, Some(End::Exit(ExitStatus::Code(0))))).count()
    }

    fn summary(&self) {
        let (n, failed, secs) = (self.n, self.failed(), self.t0.elapsed().as_secs_f64());
        if self.report == Report::Json {
            json_line(serde_json::json!({"event": "summary", "tasks": n, "failed": failed,
                "seconds": secs, "bytes_sent": self.bytes_out, "bytes_received": self.bytes_in}));
        } else if self.report == Report::Auto && n > 3 {
            eprintln!(
                "starling: {n} tasks in {secs:.1} s, {failed} failed; sent {}, received {}",
                human(self.bytes_out),
                human(self.bytes_in)
            );
        }
    }

    /// Starling's own failure wins, then the first failing task's status.
    fn exit_status(&self) -> i32 {
        if self.ends.iter().any(|e| matches!(e, Some(End::Failed) | None)) {
            return EXIT_STARLING_FAILURE;
        }
        self.ends
            .iter()
            .filter_map(|e| match e {
                Some(End::Exit(s)) if s.shell_code() != 0 => Some(s.shell_code()),
                _ => None,
            })
            .next()
            .unwrap_or(0)
    }
}

pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Read a batch file: one shell command per line (blank lines and `#` comments skipped).
pub fn batch_commands(text: &str) -> Vec<Vec<Vec<u8>>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| vec![b"/bin/sh".to_vec(), b"-c".to_vec(), l.as_bytes().to_vec()])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_never_split() {
        let mut l = LineBuf { pending: HashMap::new() };
        assert_eq!(l.push(0, Stream::Stdout, b"ab"), b"");
        assert_eq!(l.push(1, Stream::Stdout, b"xy\nz"), b"xy\n");
        assert_eq!(l.push(0, Stream::Stdout, b"c\nd\ne"), b"abc\nd\n");
        assert_eq!(l.flush(0), vec![(Stream::Stdout, b"e".to_vec())]);
        assert_eq!(l.flush(1), vec![(Stream::Stdout, b"z".to_vec())]);
    }

    #[test]
    fn batch_file_lines() {
        let c = batch_commands("echo a\n\n# note\n  povray +SR1 +ER2  \n");
        assert_eq!(c.len(), 2);
        assert_eq!(c[1][2], b"povray +SR1 +ER2");
    }
}
