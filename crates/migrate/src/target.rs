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
    /// The source's page server (the frozen process's memory).
    pub page_server: SocketAddr,
    /// The move's secret (proved to the page server).
    pub key: starling_proto::SecretKey,
    /// Ask the page server for encryption (this host's `fork.encrypt`).
    pub encrypt: bool,
    pub staged: Arc<Staging>,
    replies: Arc<Mutex<Replies>>,
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

    fn resumed(&mut self) -> std::result::Result<(), wire::WireError> {
        self.send(&ToSource::Resumed)?;
        self.resumed = true;
        match self.complete.take() {
            Some(frame) => self.send(&frame),
            None => Ok(()),
        }
    }
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
            Ok(Taken::Image { descriptor, page_server, payload }) => {
                let staged = Arc::new(frames.into_staging());
                return Ok(Incoming { descriptor: *descriptor, payload, page_server, key, encrypt, staged, replies });
            }
        }
    }
}

/// The target's reading of the source's frames, one at a time and with no
/// I/O of its own: [`receive`] drives it over the connection, and the
/// `migrate_stream` fuzz target over arbitrary bytes.
#[derive(Default)]
pub struct FrameReader {
    staging: Staging,
}

/// What one frame from the source asks of the target.
pub enum Taken {
    /// Prepare the task's surroundings from this payload, then answer `Prepared`.
    Prepare(Vec<u8>),
    /// Pages kept for the restore.
    Staged,
    /// The process is frozen: restore it from this (pages written since
    /// they were sent are already dropped from the staging).
    Image { descriptor: Box<Descriptor>, page_server: SocketAddr, payload: Vec<u8> },
}

impl FrameReader {
    /// Take one frame; an error is the source's fault and ends the move.
    pub fn take(&mut self, frame: ToTarget) -> Result<Taken> {
        match frame {
            ToTarget::Prepare { payload } => Ok(Taken::Prepare(payload)),
            ToTarget::Pages { addrs, data } => {
                if self.staging.add(&addrs, data) {
                    Ok(Taken::Staged)
                } else {
                    Err(MigrateError::Stream("a pages frame whose bytes do not match its addresses".into()))
                }
            }
            ToTarget::Image { descriptor, stale, page_server, payload } => {
                let descriptor = Descriptor::decode(&descriptor)?;
                let page_server = page_server
                    .parse()
                    .map_err(|_| MigrateError::Stream(format!("bad page server address {page_server:?}")))?;
                self.staging.invalidate(&stale);
                Ok(Taken::Image { descriptor: Box::new(descriptor), page_server, payload })
            }
        }
    }

    /// The pages staged so far.
    pub fn into_staging(self) -> Staging {
        self.staging
    }
}

impl Incoming {
    /// The fault-handler function for the restore (`starling_fork::restore`):
    /// staged pages from here, the rest from the source, and a drain that
    /// tells the source `Complete` once nothing is left there. `desc` is the
    /// descriptor as the handler sees files (under the task's root).
    pub fn serve(&self, desc: Descriptor, prefetch: usize, on_lost: OnLost) -> Serve {
        let desc = Arc::new(desc);
        let (staged, server, replies, key, encrypt) = (self.staged.clone(), self.page_server, self.replies.clone(), self.key, self.encrypt);
        Arc::new(move |_id, uffd, stats, stop| {
            let opts = FaultOptions { mcdist: starling_mcdist::Switch::Off, probe_timeout: std::time::Duration::ZERO, prefetch, encrypt };
            let mut h = FaultHandler::new_with(uffd, &desc, PageClient::connect(server, &key, encrypt)?, stats.clone(), opts)
                .with_local_pages(staged.clone());
            let (replies2, lost2, stats2) = (replies.clone(), on_lost.clone(), stats.clone());
            h.spawn_drain(
                PageClient::connect(server, &key, encrypt)?,
                Box::new(move |r| {
                    let mut s = replies2.lock().unwrap_or_else(|p| p.into_inner());
                    match r {
                        Ok(rep) => {
                            let done = ToSource::Complete {
                                local_pages: rep.local_pages,
                                remote_pages: rep.remote_pages,
                                faults: stats2.faults.load(std::sync::atomic::Ordering::Relaxed),
                                fault_p50_us: stats2.service_us.quantile_us(0.5),
                                fault_p99_us: stats2.service_us.quantile_us(0.99),
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

    /// Tell the source the process runs here now.
    pub fn resumed(&self) -> Result<()> {
        Ok(self.replies.lock().unwrap_or_else(|p| p.into_inner()).resumed()?)
    }

    /// Tell the source the restore failed (it keeps the process).
    pub fn failed(&self, reason: &str) {
        let _ = self.replies.lock().unwrap_or_else(|p| p.into_inner()).send(&ToSource::Failed { reason: reason.to_string() });
    }
}
