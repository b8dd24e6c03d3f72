//! The target side: stage the pre-copied pages, take the image, and serve
//! the restored process (staged pages here, the rest from the source's page
//! server, all of it pushed in the background until the source holds
//! nothing).

use crate::staging::Staging;
use crate::wire::{self, ToSource, ToTarget};
use crate::{MigrateError, Result};
use starling_fork::fault::{FaultHandler, FaultOptions};
use starling_fork::page_server::{Halves, PageClient};
use starling_fork::stream::StreamWriter;
use starling_fork::restore::Serve;
use starling_image::Descriptor;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};

/// A migration whose image has arrived.
pub struct Incoming {
    pub descriptor: Descriptor,
    /// The source's caller's payload (sent at the freeze).
    pub payload: Vec<u8>,
    /// The source's page servers (each frozen process's memory), in the
    /// tree's order (`Descriptor::processes`).
    pub page_servers: Vec<SocketAddr>,
    /// The move's secret (proved to the page server).
    pub key: starling_proto::SecretKey,
    /// Ask the page server for encryption (this host's `fork.encrypt`).
    pub encrypt: bool,
    /// Per process of the tree, the pages staged for it.
    pub staged: Vec<Arc<Staging>>,
    replies: Arc<Mutex<Replies>>,
    switch: Arc<Switch>,
}

/// Whether the restored tree runs (true) or never will (false): the
/// drains wait for it. Pushing every page while the restore runs would
/// take the CPU and the process's memory map from the restore, so the
/// pause would grow with the memory; the drain belongs after the switch.
#[derive(Default)]
struct Switch {
    outcome: Mutex<Option<bool>>,
    decided: std::sync::Condvar,
}

impl Switch {
    fn decide(&self, runs: bool) {
        let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if o.is_none() {
            *o = Some(runs);
            self.decided.notify_all();
        }
    }

    fn wait(&self) -> bool {
        let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(runs) = *o {
                return runs;
            }
            o = self.decided.wait(o).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The connection back to the source. `Complete` never overtakes
/// `Resumed`: a small process can be drained before it runs.
struct Replies {
    stream: StreamWriter<TcpStream>,
    resumed: bool,
    complete: Option<ToSource>,
}

impl Replies {
    fn send(&mut self, frame: &ToSource) -> std::result::Result<(), wire::WireError> {
        wire::send(&mut self.stream, frame)
    }

    /// The drain's end: sent at once if the process runs, else after `Resumed`.
    fn complete(&mut self, frame: ToSource) -> std::result::Result<(), wire::WireError> {
        if self.resumed {
            self.send(&frame)
        } else {
            self.complete = Some(frame);
            Ok(())
        }
    }

    fn resumed(&mut self, phases_ms: Vec<(String, f64)>) -> std::result::Result<(), wire::WireError> {
        self.send(&ToSource::Resumed { phases_ms })?;
        self.resumed = true;
        match self.complete.take() {
            Some(frame) => self.send(&frame),
            None => Ok(()),
        }
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        // Neither resumed nor failed: the restore never got that far.
        self.switch.decide(false);
    }
}

/// The drains of a tree's processes: `Complete` goes when the last ends.
struct Drains {
    left: usize,
    /// Each handler's counters, by process index.
    stats: Vec<(u32, Arc<starling_fork::fault::FaultStats>)>,
    local_pages: u64,
    remote_pages: u64,
}

/// Called when the process cannot go on here (its source went away before
/// every page arrived): the caller ends it and reports it lost.
pub type OnLost = Arc<dyn Fn(String) + Send + Sync>;

/// Receive a migration on `conn` (proven with the move's `key`:
/// `page_server::prove_server`, then `halves`) until its image:
/// `on_prepare` gets the source's first payload at once (to prepare while
/// pages arrive: pages wait while it runs) and the source is told
/// `Prepared` when it returns. `encrypt`: this host's `fork.encrypt`, for
/// its connections to the source's page server.
pub fn receive(
    conn: Halves,
    key: starling_proto::SecretKey,
    encrypt: bool,
    on_prepare: &mut dyn FnMut(Vec<u8>) -> std::result::Result<(), String>,
) -> Result<Incoming> {
    let (mut r, stream) = conn;
    let replies = Arc::new(Mutex::new(Replies { stream, resumed: false, complete: None }));
    let mut frames = FrameReader::default();
    let fail = |reason: String| {
        let _ = replies.lock().unwrap_or_else(|p| p.into_inner()).send(&ToSource::Failed { reason });
    };
    loop {
        let frame = wire::recv::<ToTarget>(&mut r)?;
        match frames.take(frame) {
            Err(e) => {
                fail(e.to_string());
                return Err(e);
            }
            Ok(Taken::Staged) => {}
            Ok(Taken::Prepare(payload)) => {
                if let Err(reason) = on_prepare(payload) {
                    fail(reason.clone());
                    return Err(MigrateError::Hook { stage: "prepare", reason });
                }
                replies.lock().unwrap_or_else(|p| p.into_inner()).send(&ToSource::Prepared)?;
            }
            Ok(Taken::Image { descriptor, page_servers, payload }) => {
                let mut staged: Vec<Arc<Staging>> = frames.into_staging().into_iter().map(Arc::new).collect();
                staged.resize_with(page_servers.len(), Arc::default);
                return Ok(Incoming { descriptor: *descriptor, payload, page_servers, key, encrypt, staged, replies, switch: Arc::default() });
            }
        }
    }
}

/// The target's reading of the source's frames, one at a time and with no
/// I/O of its own: [`receive`] drives it over the connection, and the
/// `migrate_stream` fuzz target over arbitrary bytes.
#[derive(Default)]
pub struct FrameReader {
    /// Per process of the tree (by index).
    staging: Vec<Staging>,
}

/// What one frame from the source asks of the target.
pub enum Taken {
    /// Prepare the task's surroundings from this payload, then answer `Prepared`.
    Prepare(Vec<u8>),
    /// Pages kept for the restore.
    Staged,
    /// The tree is frozen: restore it from this (pages written since
    /// they were sent are already dropped from the staging); a page server
    /// per process.
    Image { descriptor: Box<Descriptor>, page_servers: Vec<SocketAddr>, payload: Vec<u8> },
}

impl FrameReader {
    /// Take one frame; an error is the source's fault and ends the move.
    pub fn take(&mut self, frame: ToTarget) -> Result<Taken> {
        match frame {
            ToTarget::Prepare { payload } => Ok(Taken::Prepare(payload)),
            ToTarget::Pages { process, addrs, data } => {
                let i = usize::try_from(process).unwrap_or(usize::MAX);
                if i >= starling_image::MAX_TREE_PROCESSES {
                    return Err(MigrateError::Stream(format!("pages of process {process} of a tree")));
                }
                if self.staging.len() <= i {
                    self.staging.resize_with(i + 1, Staging::default);
                }
                if self.staging[i].add(&addrs, data) {
                    Ok(Taken::Staged)
                } else {
                    Err(MigrateError::Stream("a pages frame whose bytes do not match its addresses".into()))
                }
            }
            ToTarget::Stale { process, addrs } => {
                if let Some(staging) = self.staging.get_mut(usize::try_from(process).unwrap_or(usize::MAX)) {
                    staging.invalidate(&addrs);
                }
                Ok(Taken::Staged)
            }
            ToTarget::Image { descriptor, stale, page_servers, payload } => {
                let descriptor = Descriptor::decode(&descriptor)?;
                let processes = descriptor.processes().len();
                if page_servers.len() != processes || stale.len() != processes {
                    return Err(MigrateError::Stream(format!(
                        "an image of {processes} processes with {} page servers and {} stale lists",
                        page_servers.len(),
                        stale.len()
                    )));
                }
                // Pages of a process that ended while its tree was copied.
                self.staging.truncate(processes);
                let page_servers = page_servers
                    .iter()
                    .map(|a| a.parse().map_err(|_| MigrateError::Stream(format!("bad page server address {a:?}"))))
                    .collect::<Result<Vec<SocketAddr>>>()?;
                for (staging, stale) in self.staging.iter_mut().zip(&stale) {
                    staging.invalidate(stale);
                }
                Ok(Taken::Image { descriptor: Box::new(descriptor), page_servers, payload })
            }
        }
    }

    /// The pages staged so far, per process.
    pub fn into_staging(self) -> Vec<Staging> {
        self.staging
    }
}

impl Incoming {
    /// The fault-handler function for the restore (`starling_fork::restore`):
    /// per process of the tree (its clone ID is its index), staged pages
    /// from here, the rest from its page server at the source, and a drain;
    /// the source is told `Complete` once every process's drain is done.
    /// `desc` is the descriptor as the handlers see files (under the task's root).
    pub fn serve(&self, desc: Descriptor, prefetch: usize, on_lost: OnLost) -> Serve {
        let images: Vec<Arc<Descriptor>> = desc
            .processes()
            .into_iter()
            .map(|(_, d)| Arc::new(Descriptor { descendants: Vec::new(), ..d.clone() }))
            .collect();
        let drains = Arc::new(Mutex::new(Drains { left: images.len(), stats: Vec::new(), local_pages: 0, remote_pages: 0 }));
        let (staged, servers, replies, key, encrypt) = (self.staged.clone(), self.page_servers.clone(), self.replies.clone(), self.key, self.encrypt);
        let switch = self.switch.clone();
        Arc::new(move |id, uffd, stats, stop| {
            let i = id as usize;
            let (Some(image), Some(staged), Some(&server)) = (images.get(i), staged.get(i), servers.get(i)) else {
                return Err(starling_fork::ForkError::HandlerPanicked(id));
            };
            let opts = FaultOptions { mcdist: starling_mcdist::Switch::Off, probe_timeout: std::time::Duration::ZERO, prefetch, encrypt, reply_spin: std::time::Duration::ZERO };
            let mut h = FaultHandler::new_with(uffd, image, PageClient::connect(server, &key, encrypt)?, stats.clone(), opts)
                .with_local_pages(staged.clone());
            let (replies2, lost2, stats2, drains2) = (replies.clone(), on_lost.clone(), stats.clone(), drains.clone());
            drains.lock().unwrap_or_else(|p| p.into_inner()).stats.push((id, stats.clone()));
            let switch = switch.clone();
            h.spawn_drain_after(
                Box::new(move || switch.wait()),
                PageClient::connect(server, &key, encrypt)?,
                Box::new(move |r| {
                    let mut s = replies2.lock().unwrap_or_else(|p| p.into_inner());
                    match r {
                        Ok(rep) => {
                            let mut d = drains2.lock().unwrap_or_else(|p| p.into_inner());
                            d.left = d.left.saturating_sub(1);
                            d.local_pages += rep.local_pages;
                            d.remote_pages += rep.remote_pages;
                            if d.left > 0 {
                                return;
                            }
                            let root = d.stats.iter().find(|(i, _)| *i == 0).map_or(&stats2, |(_, s)| s);
                            let done = ToSource::Complete {
                                local_pages: d.local_pages,
                                remote_pages: d.remote_pages,
                                faults: d.stats.iter().map(|(_, s)| s.faults.load(std::sync::atomic::Ordering::Relaxed)).sum(),
                                // The root's service times.
                                fault_p50_us: root.service_us.quantile_us(0.5),
                                fault_p99_us: root.service_us.quantile_us(0.99),
                                discarded_pages: d.stats.iter().map(|(_, s)| s.pages_discarded.load(std::sync::atomic::Ordering::Relaxed)).sum(),
                            };
                            if let Err(e) = s.complete(done) {
                                log::warn!("migration: telling the source it is done: {e}");
                            }
                        }
                        Err(e) => {
                            let _ = s.send(&ToSource::Failed { reason: e.to_string() });
                            lost2(format!("its memory could not be moved from the source host: {e}"));
                        }
                    }
                }),
            )?;
            let r = h.run(stop);
            if let Err(e) = &r {
                on_lost(format!("its memory could not be fetched from the source host: {e}"));
            }
            r
        })
    }

    /// How many processes the image holds (the task's tree).
    pub fn processes(&self) -> usize {
        self.page_servers.len()
    }

    /// Tell the source the process runs here now (with where the target's
    /// part of the pause went), and start pushing the rest of its memory.
    pub fn resumed(&self, phases_ms: Vec<(String, f64)>) -> Result<()> {
        let r = self.replies.lock().unwrap_or_else(|p| p.into_inner()).resumed(phases_ms);
        self.switch.decide(true);
        Ok(r?)
    }

    /// Tell the source the restore failed (it keeps the process).
    pub fn failed(&self, reason: &str) {
        self.switch.decide(false);
        let _ = self.replies.lock().unwrap_or_else(|p| p.into_inner()).send(&ToSource::Failed { reason: reason.to_string() });
    }
}
