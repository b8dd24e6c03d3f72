//! Jobs: many tasks launched together (`starling run -n N`, `starling batch`).
//!
//! A job is one process, one connection and one launch message: its tasks
//! share one prethrow and one consistency point (UCop's job-end-to-start
//! consistency), and the head starts each as soon as a core is free.

use crate::exec::report_commit;
use crate::session::{Session, SessionOptions, TaskEvent};
use crate::EXIT_STARLING_FAILURE;
use anyhow::Result;
use starling_proto::{JobTask, Stream, TaskId, TaskSpec, WirePath};
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
    pub cluster: Option<String>,
    pub compress: bool,
    pub prethrow: bool,
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
    Exit(starling_proto::ExitStatus),
    /// Lost, refused, or its commit failed (already reported).
    Failed,
}

/// Run a job: `argvs[i]` is task i's argv, or `None` for `base.argv`.
pub async fn run(base: TaskSpec, argvs: Vec<Option<Vec<Vec<u8>>>>, opts: JobOptions) -> Result<i32> {
    let n = argvs.len();
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = crate::exec::forwarded_signals()?;
    let session = Session::connect(SessionOptions { cluster: opts.cluster.clone(), compress: opts.compress }).await?;
    let (base, mut prediction) = crate::exec::prepare_launch(&session, base, opts.prethrow, opts.compress).await?;

    // Launch: one message for the whole job, or (for measurements) one per task.
    let mut pendings = Vec::with_capacity(n);
    if opts.prethrow_per_task {
        for (i, argv) in argvs.into_iter().enumerate() {
            let mut s = base.clone();
            if let Some(a) = argv {
                s.argv = a;
            }
            s.env.push((b"STARLING_TASK".to_vec(), i.to_string().into_bytes()));
            s.env.push((b"STARLING_TASKS".to_vec(), n.to_string().into_bytes()));
            pendings.push(session.launch_pending(s, i).await?);
        }
    } else {
        pendings = session.launch_job(base, argvs.into_iter().map(|argv| JobTask { argv }).collect()).await?;
    }
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<(usize, TaskEvent)>();
    for mut p in pendings {
        let ev_tx = ev_tx.clone();
        tokio::spawn(async move {
            while let Some(ev) = p.events.recv().await {
                let _ = ev_tx.send((p.index, ev));
            }
        });
    }
    drop(ev_tx);

    let bar = (opts.report == Report::Auto && n > 3 && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(n as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} done  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b.enable_steady_tick(std::time::Duration::from_millis(200));
        b
    });
    let say = |bar: &Option<indicatif::ProgressBar>, stream: Stream, data: &[u8]| match bar {
        Some(b) => b.suspend(|| emit(stream, data)),
        None => emit(stream, data),
    };

    let mut lines = LineBuf { pending: HashMap::new() };
    let mut started: HashMap<usize, (TaskId, String)> = HashMap::new();
    let mut ends: Vec<Option<End>> = vec![None; n];
    let mut accessed: BTreeSet<WirePath> = BTreeSet::new();
    let (mut bytes_out, mut bytes_in) = (0u64, 0u64);
    let mut interrupted = None;
    let t0 = std::time::Instant::now();
    loop {
        let (idx, ev) = tokio::select! {
            e = ev_rx.recv() => match e { Some(e) => e, None => break },
            Some(no) = sigs.recv() => {
                interrupted = Some(no);
                for (task, _) in started.values() {
                    session.signal(*task, no).await;
                }
                continue;
            }
        };
        match ev {
            TaskEvent::Started { task, host, .. } => {
                if let Some(no) = interrupted {
                    session.signal(task, no).await;
                }
                if opts.report == Report::Json {
                    json_line(serde_json::json!({"event": "started", "task": idx, "host": host}));
                }
                started.insert(idx, (task, host));
            }
            TaskEvent::Output(stream, data) => {
                bytes_in += data.len() as u64;
                if opts.report == Report::Json {
                    let s = if stream == Stream::Stdout { "stdout" } else { "stderr" };
                    json_line(serde_json::json!({"event": "output", "task": idx, "stream": s, "data": String::from_utf8_lossy(&data)}));
                } else {
                    let complete = lines.push(idx, stream, &data);
                    if !complete.is_empty() {
                        say(&bar, stream, &complete);
                    }
                }
            }
            TaskEvent::Finished { status, commit, accessed: acc } => {
                for (s, b) in lines.flush(idx) {
                    say(&bar, s, &b);
                }
                accessed.extend(acc);
                if let Ok(r) = &commit {
                    bytes_in += r.bytes;
                }
                let ok = match &bar {
                    Some(b) => b.suspend(|| report_commit(&commit)),
                    None => report_commit(&commit),
                };
                if opts.report == Report::Json {
                    let conflicts: Vec<String> =
                        commit.as_ref().map(|r| r.conflicts.iter().map(|c| c.path.to_string()).collect()).unwrap_or_default();
                    json_line(serde_json::json!({"event": "finished", "task": idx, "exit": status.shell_code(),
                        "commit_ok": commit.is_ok(), "conflicts": conflicts}));
                }
                ends[idx] = Some(if ok { End::Exit(status) } else { End::Failed });
            }
            TaskEvent::CloneStats { .. } => {}
            TaskEvent::Refused(why) | TaskEvent::Lost(why) => {
                for (s, b) in lines.flush(idx) {
                    say(&bar, s, &b);
                }
                match &bar {
                    Some(b) => b.suspend(|| eprintln!("starling: task {idx}: {why}")),
                    None => eprintln!("starling: task {idx}: {why}"),
                }
                if opts.report == Report::Json {
                    json_line(serde_json::json!({"event": "lost", "task": idx, "why": why}));
                }
                ends[idx] = Some(End::Failed);
            }
        }
        let done = ends.iter().filter(|e| e.is_some()).count();
        bytes_out = session.files().stats().chunk_bytes_sent;
        if let Some(b) = &bar {
            b.set_position(done as u64);
            let running = started.len() - done.min(started.len());
            let queued = n - started.len().max(done);
            b.set_message(format!(
                "{running} running, {queued} queued   sent {}, received {}",
                human(bytes_out),
                human(bytes_in)
            ));
        }
        if done == n {
            break;
        }
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if let Some(p) = prediction.as_mut() {
        // One run of the job is one run of the program: count each path once.
        let acc: Vec<WirePath> = accessed.into_iter().collect();
        p.finish(session.files(), &acc);
    }
    crate::exec::write_stats(session.files(), prediction.as_ref(), n, t0.elapsed());
    let failed = ends.iter().filter(|e| !matches!(e, Some(End::Exit(starling_proto::ExitStatus::Code(0))))).count();
    if opts.report == Report::Json {
        json_line(serde_json::json!({"event": "summary", "tasks": n, "failed": failed,
            "seconds": t0.elapsed().as_secs_f64(), "bytes_sent": bytes_out, "bytes_received": bytes_in}));
    } else if opts.report == Report::Auto && n > 3 {
        eprintln!("starling: {n} tasks in {:.1} s, {failed} failed; sent {}, received {}", t0.elapsed().as_secs_f64(), human(bytes_out), human(bytes_in));
    }
    // Exit status: starling's own failure wins, then the first failing task's status.
    if ends.iter().any(|e| matches!(e, Some(End::Failed) | None)) {
        return Ok(EXIT_STARLING_FAILURE);
    }
    Ok(ends
        .iter()
        .filter_map(|e| match e {
            Some(End::Exit(s)) if s.shell_code() != 0 => Some(s.shell_code()),
            _ => None,
        })
        .next()
        .unwrap_or(0))
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
