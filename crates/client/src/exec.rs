//! `starling exec`: run one command on the cluster as if it ran here.

use crate::commit;
use crate::discover;
use crate::files::FileServer;
use crate::EXIT_STARLING_FAILURE;
use anyhow::{anyhow, Context, Result};
use starling_proto::conn::establish;
use starling_proto::{Hash, Msg, ProtoError, Role, Stream, TaskSpec};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::signal::unix::{signal, SignalKind};

pub struct ExecOptions {
    pub cluster: Option<String>,
    pub host: Option<String>,
    pub job: Option<String>,
    /// Compress chunk transfers (zstd).
    pub compress: bool,
}

pub fn cache_dir() -> std::path::PathBuf {
    if let Ok(d) = std::env::var("STARLING_CACHE") {
        return d.into();
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| "/tmp".into());
    base.join("starling")
}

/// Connect to the head and introduce ourselves as a client.
pub async fn connect(
    cluster: Option<&str>,
) -> Result<(starling_proto::conn::Incoming<tokio::net::tcp::OwnedReadHalf>, starling_proto::conn::Outgoing)> {
    let addr = discover::head_addr(cluster)?;
    let sock = match TcpStream::connect(&addr).await {
        Ok(s) => s,
        Err(e) if cluster.is_none() && std::env::var_os("STARLING_CLUSTER").is_none() => {
            return Err(anyhow!("{} (the cluster recorded at {addr} does not answer: {e})", discover::no_cluster_message()))
        }
        Err(e) => return Err(anyhow!("cannot reach the starling cluster at {addr}: {e}")),
    };
    sock.set_nodelay(true)?;
    let (r, w) = sock.into_split();
    let (_peer, incoming, tx) = establish(r, w, Role::Client, "client").await.context("handshake with the cluster head")?;
    Ok((incoming, tx))
}

fn stdin_pump(task: starling_proto::TaskId, tx: starling_proto::conn::Outgoing) {
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

/// Run `spec` on the cluster; returns the exit status `starling exec` should use.
pub async fn run(mut spec: TaskSpec, opts: ExecOptions) -> Result<i32> {
    spec.host = opts.host.clone();
    spec.job = opts.job.clone();
    let files = Arc::new(FileServer::new(
        starling_store::RecipeCache::open(&cache_dir().join("recipes")).context("opening the recipe cache")?,
        opts.compress,
    ));
    let (mut incoming, tx) = connect(opts.cluster.as_deref()).await?;
    tx.send(Msg::Launch { spec: spec.clone() }).await.map_err(|_| anyhow!("lost connection to the cluster head"))?;

    // SIGPIPE would kill us mid-commit if our stdout goes away; handle EPIPE instead.
    // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety implications.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut sigs = Vec::new();
    for (kind, no) in [
        (SignalKind::interrupt(), libc::SIGINT),
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::hangup(), libc::SIGHUP),
        (SignalKind::quit(), libc::SIGQUIT),
    ] {
        sigs.push((signal(kind)?, no));
    }
    let (sig_tx, mut sig_rx) = tokio::sync::mpsc::channel::<i32>(8);
    for (mut s, no) in sigs {
        let sig_tx = sig_tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                let _ = sig_tx.send(no).await;
            }
        });
    }

    let mut task = None;
    let mut chunks: HashMap<Hash, Vec<u8>> = HashMap::new();
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut stdout_gone = false;
    loop {
        let msg = tokio::select! {
            m = incoming.recv() => m,
            Some(no) = sig_rx.recv() => {
                match task {
                    Some(t) => { let _ = tx.send(Msg::Signal { task: t, signo: no }).await; }
                    // Not started yet: nothing remote to stop.
                    None => return Ok(128 + no),
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(ProtoError::Closed) => {
                eprintln!("starling: lost connection to the cluster head; no changes were committed");
                return Ok(EXIT_STARLING_FAILURE);
            }
            Err(e) => {
                eprintln!("starling: protocol error from the cluster head: {e}; no changes were committed");
                return Ok(EXIT_STARLING_FAILURE);
            }
        };
        match msg {
            Msg::Started { task: t, host } => {
                log::info!("task {t} started on {host}");
                task = Some(t);
                stdin_pump(t, tx.clone());
            }
            Msg::Output { stream, data, .. } => {
                let res = match stream {
                    Stream::Stdout if !stdout_gone => stdout.write_all(&data).and_then(|_| stdout.flush()),
                    Stream::Stdout => Ok(()),
                    Stream::Stderr => stderr.write_all(&data).and_then(|_| stderr.flush()),
                };
                if res.is_err() && matches!(stream, Stream::Stdout) {
                    // Like a local pipeline: the writer gets SIGPIPE when the reader is gone.
                    stdout_gone = true;
                    if let Some(t) = task {
                        let _ = tx.send(Msg::Signal { task: t, signo: libc::SIGPIPE }).await;
                    }
                }
            }
            Msg::FileRequest { task: t, id, req } => {
                let files = files.clone();
                let tx = tx.clone();
                tokio::task::spawn_blocking(move || {
                    let resp = files.answer(&req);
                    let _ = tx.blocking_send(Msg::FileResponse { task: t, id, resp });
                });
            }
            Msg::ChangeChunks { chunks: batch, .. } => {
                for c in batch {
                    let bytes = c.open().map_err(|e| anyhow!("task output failed verification: {e}"))?;
                    chunks.insert(c.hash, bytes);
                }
            }
            Msg::Finished { task: t, status, changes } => {
                let files2 = files.clone();
                let report = tokio::task::spawn_blocking(move || commit::apply(&files2, &changes, &chunks)).await?;
                let report = match report {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("starling: committing the task's changes failed: {e:#}");
                        let _ = tx.send(Msg::Committed { task: t, conflicts: vec![] }).await;
                        return Ok(EXIT_STARLING_FAILURE);
                    }
                };
                for c in &report.conflicts {
                    match &c.saved_as {
                        Some(s) => eprintln!("starling: conflict: {} {}; the task's version was saved as {}", c.path, c.why, s.display()),
                        None => eprintln!("starling: conflict: {} {}", c.path, c.why),
                    }
                }
                let _ = tx.send(Msg::Committed { task: t, conflicts: report.conflicts.iter().map(|c| c.path.clone()).collect() }).await;
                log::info!("task {t} ended {status:?}; {} change(s) committed, {} conflict(s); {:?}", report.applied, report.conflicts.len(), files.stats());
                return Ok(status.shell_code());
            }
            Msg::Error { message, task: t } => {
                if t.is_some() || task.is_none() {
                    eprintln!("starling: {message}");
                    return Ok(EXIT_STARLING_FAILURE);
                }
                log::warn!("head: {message}");
            }
            _ => {}
        }
    }
}
