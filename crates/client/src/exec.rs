//! `starling exec`: run one command on the cluster as if it ran here.

use crate::terminal::{RawMode, TerminalMode};
use crate::{launch, ClientError, Context, Result, EXIT_STARLING_FAILURE};
use starling_proto::{Msg, Stream, TaskId, TaskSpec};
use starling_session::commit::{CommitError, CommitReport};
use starling_session::{TaskEvent, TaskHandle};
use std::io::{Read, Write};
use tokio::signal::unix::{signal, SignalKind};

pub struct ExecOptions {
    /// Run on this host; `None`: the least loaded.
    pub host: Option<String>,
    /// The job the task belongs to (a shared consistency point).
    pub job: Option<String>,
    /// Whether the task runs on a terminal (a pty on its host).
    pub terminal: TerminalMode,
    /// `exec --roam`: start at home (`host` is the home site) under a migration manager.
    pub roam: Option<Roam>,
    /// `exec --x11`: the task gets a display relayed to ours (`crate::x11`).
    pub x11: bool,
}

/// A roaming task's profile (`exec --roam [--profile FILE]`).
pub struct Roam {
    pub profile: crate::roam::Profile,
    /// Its name in the decision log (the file, or `generic`).
    pub name: String,
}

/// Copy our stdin to the task from a plain thread (stdin may be a terminal
/// or a pipe; blocking reads are simplest and never stall the runtime).
fn stdin_pump(handle: &TaskHandle, interaction: Option<crate::roam::InteractionLog>) {
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
                    if let Some(i) = &interaction {
                        i.lock().unwrap().input(std::time::Instant::now());
                    }
                    if tx.blocking_send(Msg::Stdin { task, data: buf[..n].to_vec() }).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

/// A spawned task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
        let mut s = signal(kind).map_err(ClientError::Signals)?;
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
pub fn report_commit(commit: &std::result::Result<CommitReport, std::sync::Arc<CommitError>>) -> bool {
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

/// Run `spec` on the cluster; returns the exit status `starling exec` should use.
pub async fn run(ctx: &Context, mut spec: TaskSpec, opts: ExecOptions) -> Result<i32> {
    spec.host = opts.host.clone();
    spec.job = opts.job.clone();
    spec.terminal = crate::terminal::decide(opts.terminal, opts.job.is_some());
    let on_terminal = spec.terminal.is_some();
    let display = match opts.x11.then(crate::x11::prepare) {
        Some(Ok((display, stand_in))) => {
            spec.x11 = Some(stand_in);
            Some(display)
        }
        Some(Err(e)) => {
            eprintln!("starling: X11 forwarding is off: {e}");
            None
        }
        None => None,
    };
    let mut winch = signal(SignalKind::window_change()).map_err(ClientError::Signals)?;
    // SIGPIPE would kill us mid-commit if our stdout goes away; handle EPIPE instead.
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = forwarded_signals()?;
    let t0 = std::time::Instant::now();
    let mut stages = launch::Stages::default();
    stages.stamp("setup", ctx.started, t0);
    let session = ctx.session().await?;
    let mut t = stages.stamp("connect", t0, std::time::Instant::now());
    let (spec, mut prediction) = launch::prepare(ctx, &session, spec, opts.job.as_ref().map(|_| "job")).await?;
    t = stages.stamp("prepare", t, std::time::Instant::now());
    let launch = session.launch(spec);
    tokio::pin!(launch);
    let mut handle = tokio::select! {
        h = &mut launch => h?,
        // Not started yet: nothing remote to stop.
        Some(no) = sigs.recv() => return Ok(128 + no),
    };
    t = stages.stamp("launch", t, std::time::Instant::now());
    log::info!("task {} started on {}", handle.task, handle.host);
    if let Some(p) = prediction.as_mut() {
        p.launched(handle.job_fresh);
    }
    // From here what is typed goes to the task's pty as it is (Ctrl-C
    // included: the remote line discipline makes it a SIGINT there).
    let interaction = opts.roam.as_ref().map(|_| crate::roam::InteractionLog::default());
    let mut x11 = display.map(|d| crate::x11::Forwarder::new(d, handle.task, handle.sender(), interaction.clone()));
    let mut raw = if on_terminal { RawMode::enter() } else { None };
    stdin_pump(&handle, interaction.clone());
    // The roaming task's manager lives as long as this loop (the task's client).
    let _manager = match (opts.roam, &interaction) {
        (Some(r), Some(i)) => {
            let m = crate::roam::Manager {
                profile: r.profile,
                profile_name: r.name,
                target: ctx.target.clone(),
                task: handle.task,
                notes: handle.sender(),
                interaction: i.clone(),
            };
            Some(AbortOnDrop(tokio::spawn(m.run())))
        }
        _ => None,
    };

    let relayed = Relayed { on_terminal, interaction, x11: x11.as_mut(), raw: &mut raw };
    match relay(&mut handle, relayed, &mut sigs, &mut winch).await {
        Relay::Finished { status, commit, accessed } => {
            t = stages.stamp("run_commit", t, std::time::Instant::now());
            if let Some(p) = prediction.as_mut() {
                p.finish(session.files(), &accessed);
            }
            stages.stamp("learn", t, std::time::Instant::now());
            launch::write_stats(ctx, session.files(), prediction.as_ref(), 1, t0.elapsed(), Some(&stages));
            if !report_commit(&commit) {
                return Ok(EXIT_STARLING_FAILURE);
            }
            log::info!("task {} ended {status:?}; {:?}", handle.task, session.files().stats());
            Ok(status.shell_code())
        }
        Relay::Failed => Ok(EXIT_STARLING_FAILURE),
    }
}

/// `starling attach TASK`: become the client of a task on a terminal whose own client went
/// away (killed, or its link lost); returns the exit status `starling attach` should use (the
/// task's, once it ends).
pub async fn attach(ctx: &Context, task: TaskId, force: bool) -> Result<i32> {
    let mut winch = signal(SignalKind::window_change()).map_err(ClientError::Signals)?;
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = forwarded_signals()?;
    let session = ctx.session().await?;
    let mut handle = session.attach(task, force).await?;
    log::info!("attached to task {} on {}", handle.task, handle.host);
    // The task is on a terminal (only such tasks can be attached to): ours, if we are on one,
    // is in raw mode meanwhile, as for `exec`.
    let mut raw = RawMode::enter();
    if let Some((rows, cols)) = crate::terminal::window_size(0).or_else(|| crate::terminal::window_size(1)) {
        // This terminal may not be the size of the one the task started on.
        let _ = handle.sender().send(Msg::Resize { task, rows, cols }).await;
    }
    stdin_pump(&handle, None);
    let relayed = Relayed { on_terminal: true, interaction: None, x11: None, raw: &mut raw };
    match relay(&mut handle, relayed, &mut sigs, &mut winch).await {
        Relay::Finished { status, commit, .. } => {
            if !report_commit(&commit) {
                return Ok(EXIT_STARLING_FAILURE);
            }
            Ok(status.shell_code())
        }
        Relay::Failed => Ok(EXIT_STARLING_FAILURE),
    }
}

/// How a relayed task ended.
enum Relay {
    Finished {
        status: starling_proto::ExitStatus,
        commit: std::result::Result<CommitReport, std::sync::Arc<CommitError>>,
        accessed: Vec<starling_proto::WirePath>,
    },
    /// Lost, refused, or the head lost (said on stderr).
    Failed,
}

/// What the relay works with besides the task.
struct Relayed<'a> {
    /// The task is on a terminal: window-size changes go to it, and each output byte written
    /// is acknowledged (the head keeps what is not, for a `starling attach` if we die).
    on_terminal: bool,
    interaction: Option<crate::roam::InteractionLog>,
    x11: Option<&'a mut crate::x11::Forwarder>,
    raw: &'a mut Option<RawMode>,
}

/// Relay a started task's output, signals and window size until it ends.
async fn relay(
    handle: &mut TaskHandle,
    r: Relayed<'_>,
    sigs: &mut tokio::sync::mpsc::Receiver<i32>,
    winch: &mut tokio::signal::unix::Signal,
) -> Relay {
    let Relayed { on_terminal, interaction, mut x11, raw } = r;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut stdout_gone = false;
    loop {
        let ev = tokio::select! {
            ev = handle.events.recv() => ev,
            Some(no) = sigs.recv() => { handle.signal(no).await; continue; }
            Some(()) = winch.recv(), if on_terminal => {
                if let Some((rows, cols)) = crate::terminal::window_size(0).or_else(|| crate::terminal::window_size(1)) {
                    let _ = handle.sender().send(Msg::Resize { task: handle.task, rows, cols }).await;
                }
                continue;
            }
        };
        if matches!(ev, Some(TaskEvent::Finished { .. } | TaskEvent::Refused(_) | TaskEvent::Lost(_)) | None) {
            // Our own messages below are printed on a terminal in its usual modes.
            drop(raw.take());
        }
        match ev {
            Some(TaskEvent::Output(stream, data)) => {
                if let Some(i) = &interaction {
                    i.lock().unwrap().output(std::time::Instant::now());
                }
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
                handle.written(data.len() as u64).await;
            }
            Some(TaskEvent::Finished { status, commit, accessed }) => return Relay::Finished { status, commit, accessed },
            Some(TaskEvent::X11(ev)) => {
                if let Some(f) = x11.as_deref_mut() {
                    f.handle(ev);
                }
            }
            Some(TaskEvent::Started { .. }) | Some(TaskEvent::CloneStats { .. }) => {}
            Some(TaskEvent::Refused(why)) | Some(TaskEvent::Lost(why)) => {
                eprintln!("starling: {why}");
                if on_terminal {
                    // Lost by us only (our link to the head, a takeover): a task on a terminal outlives its client.
                    let task = handle.task;
                    eprintln!("starling: if task {task} still runs (`starling ps`), `starling attach {task}` re-attaches to it");
                }
                return Relay::Failed;
            }
            None => {
                eprintln!("starling: lost connection to the cluster head; no changes were committed");
                return Relay::Failed;
            }
        }
    }
}
