//! The fault handler: serves a clone's userfaultfd (the process-level memtap).
//!
//! It runs outside the clone (a thread of the local backend; later a
//! process of the cluster agent). For each missing-page fault it looks the
//! page up in the descriptor:
//! * `Zero` → `UFFDIO_ZEROPAGE`;
//! * `File` → read from the host's copy of the mapped file, `UFFDIO_COPY`;
//! * `Fetch` → one request to the page server for the page, and, when the
//!   clone walks its memory in order, its not-yet-served `Fetch` neighbours
//!   (read-ahead, see [`FaultHandler::read_ahead`]), each installed with
//!   `UFFDIO_COPY` (EEXIST — already present — is fine).
//!
//! With mcdist (see `starling-mcdist`; switch `STARLING_MCDIST=off|on|push`,
//! default on) `Fetch` pages come from the ticket's multicast group, through
//! the one receiver the host's clones of the ticket share (see
//! [`crate::host`]; joined on the interface of the page server's TCP
//! connection): its receive thread installs every page any clone asked for
//! into this clone too, in batches (`UFFDIO_COPY` of contiguous runs, EEXIST
//! fine). The faulting path only waits for its own pages. If no multicast
//! arrives (detected by a probe when the host joins, or a fetch that times
//! out later) the handler falls back to the page server's TCP unicast and
//! says so: a warning in the log and [`FaultStats::mode`].
//!
//! A per-region state byte per page is the presence bitmap. REMOVE and UNMAP
//! events (MADV_DONTNEED, munmap) turn pages into `Zero`, so a range that the
//! clone discarded reads as zero instead of template data; REMAP events
//! (mremap of registered memory, e.g. realloc) are followed by translating
//! the new addresses back to the template's.

use crate::{Descriptor, PageClass};
use starling_image::abi::counters::{realtime_ns, CloneCounters};
use starling_image::abi::plan::MapKind;
use starling_image::RegionKind;
use crate::host::{Group, HostTicket, Member};
use crate::page_server::PageClient;
use crate::{ForkError, Result, PAGE_SIZE};
use starling_mcdist::{Fetched, Mode, PageSink, Receiver, ReceiverConfig, Switch};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use crate::uffd::{Event, Uffd};

/// Largest number of pages fetched per fault (faulting page + prefetch).
pub const DEFAULT_PREFETCH: usize = 16;

const ST_ZERO: u8 = 0;
const ST_FILE: u8 = 1;
const ST_FETCH: u8 = 2;
const ST_DONE: u8 = 3;
/// A `Fetch` page the fault handler has asked for (its fault or read-ahead):
/// the drain leaves it alone and waits for it.
const ST_FAULTING: u8 = 4;
/// A `Fetch` page the drain has asked for: a fault on it waits (parked) for
/// the drain's install, which wakes the thread, instead of asking again.
const ST_PUSHING: u8 = 5;

/// Whether a page in state `st` is still to come from the page server (or
/// the pages held here): not asked for yet, or asked for and not in place.
fn missing(st: u8) -> bool {
    matches!(st, ST_FETCH | ST_FAULTING | ST_PUSHING)
}

/// Claim a `Fetch` page for one fetcher (`ST_FAULTING` or `ST_PUSHING`):
/// false if it is not `Fetch` any more (the other one has it, or it is in
/// place, or discarded). The one who claimed it asks for it; nobody else.
fn claim(state: &AtomicU8, by: u8) -> bool {
    state.compare_exchange(ST_FETCH, by, Ordering::AcqRel, Ordering::Acquire).is_ok()
}

/// Give back a page claimed `by` that did not go in (refused for now, or
/// in a range that moved): `Fetch` again, unless meanwhile it was put in
/// place or discarded.
fn unclaim(state: &AtomicU8, by: u8) {
    let _ = state.compare_exchange(by, ST_FETCH, Ordering::AcqRel, Ordering::Acquire);
}

/// Counters of one handler (shared with whoever wants to report them).
#[derive(Default, Debug)]
pub struct FaultStats {
    pub faults: AtomicU64,
    pub pages_fetched: AtomicU64,
    pub pages_zero: AtomicU64,
    pub pages_file: AtomicU64,
    pub fetch_requests: AtomicU64,
    pub events_remove: AtomicU64,
    /// Pages installed from the multicast group without this clone asking
    /// (included in `pages_fetched`).
    pub pages_multicast_unsolicited: AtomicU64,
    /// A [`starling_mcdist::Mode`] as u8: how this clone gets its pages.
    pub mode: AtomicU8,
    /// How long faults took to serve, from the handler reading the fault
    /// to the page in place: counts per power-of-two microseconds.
    pub service_us: ServiceTimes,
    /// CLOCK_REALTIME ns when the restorer handed over this clone's
    /// userfaultfd (the clone is mapped); 0 until then.
    pub restorer_running_ns: AtomicU64,
    /// CLOCK_REALTIME ns when the first page from the page server was
    /// installed; 0 until then.
    pub first_page_ns: AtomicU64,
    /// Pages that arrived (fetched or pushed) when they were in place
    /// already, so were thrown away: what a page came twice cost.
    pub pages_discarded: AtomicU64,
}

/// Fault service times as a histogram of power-of-two microsecond buckets
/// (bucket k: below 2^k µs), enough for a median and a 99th percentile
/// within a factor of two.
#[derive(Debug, Default)]
pub struct ServiceTimes([AtomicU64; 32]);

impl ServiceTimes {
    pub fn record(&self, took: std::time::Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let k = usize::try_from(u64::BITS - us.leading_zeros()).unwrap_or(31).min(31);
        self.0[k].fetch_add(1, Ordering::Relaxed);
    }

    /// The upper bound (µs) of the bucket holding quantile `q` (0..=1);
    /// None when nothing was recorded.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        let counts: Vec<u64> = self.0.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        // The rank of the quantile, counted from 1 (a float rank rounded up).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (k, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(1u64 << k);
            }
        }
        None
    }
}

impl FaultStats {
    /// Count `n` pages from the page server now present (stamping the first).
    pub fn add_fetched(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.pages_fetched.fetch_add(n, Ordering::Relaxed);
        if self.first_page_ns.load(Ordering::Relaxed) == 0 {
            // Only the first installer's time stays (the receive thread may race the handler).
            let _ = self.first_page_ns.compare_exchange(0, realtime_ns(), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// How this clone gets its pages (for `starling status`).
    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Relaxed))
    }

    /// The counters now, by name.
    pub fn snapshot(&self) -> CloneCounters {
        let c = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CloneCounters {
            faults: c(&self.faults),
            pages_fetched: c(&self.pages_fetched),
            pages_zero: c(&self.pages_zero),
            pages_file: c(&self.pages_file),
            fetch_requests: c(&self.fetch_requests),
            events_remove: c(&self.events_remove),
            mode: u64::from(self.mode.load(Ordering::Relaxed)),
            pages_multicast_unsolicited: c(&self.pages_multicast_unsolicited),
            stamp_restorer_running_ns: c(&self.restorer_running_ns),
            stamp_first_page_ns: c(&self.first_page_ns),
            ..CloneCounters::default()
        }
    }
}

struct HandlerRegion {
    start: u64,
    end: u64,
    /// Atomic: the multicast receive thread reads and sets it too.
    state: Vec<AtomicU8>,
    /// For File pages: (path, file offset of `start`).
    file: Option<(String, u64)>,
}

/// What the handler thread and the multicast receive thread share.
struct Shared {
    uffd: Uffd,
    regions: Vec<HandlerRegion>,
    /// Held by the handler while it reads and applies a non-fault event, and
    /// by the receive thread while it installs: so a page the clone
    /// discarded (REMOVE → state Zero) is never filled with template data
    /// after the fact. Holds the template ranges that moved (REMAP): the
    /// receive thread leaves those to the faulting path.
    events: Mutex<Vec<(u64, u64)>>,
    /// Fetched pages the clone could not take yet, by template address: the
    /// kernel refuses every install with EAGAIN while one of the clone's
    /// memory-map changes (a REMOVE/UNMAP/REMAP event) is unread, e.g. while
    /// a thread ending on a stack glibc cached in the template discards it.
    /// The refault installs these bytes instead of asking again: with mcdist
    /// a repeated request within the lockstep window is not answered, so it
    /// would wait for a re-request timeout (and cut the sender's rate).
    /// Dropped when the range is discarded (it then reads as zero). Filled
    /// by both threads; taken while holding `events` or alone, never the
    /// other way round.
    held: Mutex<HashMap<u64, Fetched>>,
}

impl Shared {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Fetched>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep a page the kernel refused (EAGAIN) for its next fault.
    fn hold(&self, tmpl_addr: u64, page: Fetched) {
        let mut held = self.held();
        if held.len() < MAX_HELD_PAGES {
            held.insert(tmpl_addr, page);
        }
    }

    fn locate(&self, tmpl_addr: u64) -> Option<(usize, usize)> {
        let i = self.regions.partition_point(|r| r.end <= tmpl_addr);
        let r = self.regions.get(i).filter(|r| r.start <= tmpl_addr)?;
        Some((i, ((tmpl_addr - r.start) / PAGE_SIZE) as usize))
    }

    fn state(&self, ri: usize, pi: usize) -> u8 {
        self.regions[ri].state[pi].load(Ordering::Acquire)
    }

    fn set_state(&self, ri: usize, pi: usize, st: u8) {
        self.regions[ri].state[pi].store(st, Ordering::Release);
    }
}

/// Pages this host already holds for a restore, by image address (a
/// migration's pre-copied pages).
pub trait LocalPages: Send + Sync {
    fn page(&self, addr: u64) -> Option<&[u8]>;
}

/// What a drain moved.
#[derive(Debug, Default, Clone, Copy)]
pub struct DrainReport {
    /// Pages installed from those held here.
    pub local_pages: u64,
    /// Pages fetched from the page server.
    pub remote_pages: u64,
}

/// Options of [`FaultHandler::new_with`].
#[derive(Debug, Clone)]
pub struct FaultOptions {
    /// Use the ticket's multicast group if the page server offers one.
    pub mcdist: Switch,
    /// How long to listen for the sender's probe before falling back.
    pub probe_timeout: std::time::Duration,
    /// Most pages fetched per fault: the faulting page and following unserved
    /// `Fetch` pages of its region, when the faults are sequential (see
    /// `FaultHandler::read_ahead`; `fork.prefetch`, default
    /// [`DEFAULT_PREFETCH`]; 1..=`MAX_BATCH`).
    pub prefetch: usize,
    /// Take pages only encrypted (`fork.encrypt`): page-server connections
    /// ask for it, and a multicast group in clear is not joined.
    pub encrypt: bool,
    /// How long the faulting path busy-polls for a page-server reply before
    /// it sleeps (`fork.reply_spin_us`; zero: it sleeps at once).
    pub reply_spin: std::time::Duration,
}

impl FaultOptions {
    /// As the settings say (`fork.mcdist` = off refuses multicast; `fork.prefetch`, `fork.encrypt`).
    pub fn from_settings(settings: &starling_config::ForkSettings) -> FaultOptions {
        FaultOptions {
            mcdist: settings.mcdist.unwrap_or(Switch::On),
            probe_timeout: std::time::Duration::from_millis(300),
            prefetch: settings.prefetch,
            encrypt: settings.encrypt,
            reply_spin: std::time::Duration::from_micros(u64::from(settings.reply_spin_us)),
        }
    }
}

pub struct FaultHandler {
    shared: Arc<Shared>,
    /// Pages this host already holds (a migration's pre-copy), served
    /// without asking the page server.
    local: Option<Arc<dyn LocalPages>>,
    files: HashMap<String, std::fs::File>,
    client: PageClient,
    /// The host's multicast receiver and this clone's place among the
    /// clones it installs into, while multicast works.
    mc: Option<(Arc<Receiver>, Member)>,
    stats: Arc<FaultStats>,
    prefetch: usize,
    /// The clone address just past the last page fetched by a fault: a fault
    /// at or shortly after it is the next step of a sequential walk (see
    /// [`FaultHandler::read_ahead`]).
    walk_next: u64,
    /// (clone start, len, template start) after REMAP events, latest last; a template start of
    /// `None` marks the range a REMAP moved away from (the kernel then sends an UNMAP for it,
    /// which must not discard the moved pages).
    remaps: Vec<(u64, u64, Option<u64>)>,
    /// Faulting addresses (in the clone), with when their fault was read,
    /// whose page the kernel refused with EAGAIN, or which the drain is
    /// bringing (`ST_PUSHING`: its install wakes the thread). Their threads
    /// are left asleep and served again once the pending map change has
    /// been read (see [`FaultHandler::run`]): woken now, they would fault
    /// again at once, and faults are read before events, so the handler
    /// would spin on refusals.
    parked: Vec<(u64, std::time::Instant)>,
    /// Readable once the drain (see [`FaultHandler::spawn_drain`]) has put
    /// every page from the page server in place: the handler then fills the
    /// file pages still missing and lets go of the process.
    drained: Option<OwnedFd>,
    /// A request to fetch everything and let go of the process (see
    /// [`Materialize`]), with the page server to fetch from.
    materialize: Option<(Materialize, SocketAddr)>,
}

/// Asks a fault handler to put every page still at the page server in
/// place and then let go of its process (see [`FaultHandler::spawn_drain`]):
/// a remote-fork clone that is about to move becomes an ordinary process
/// first, whose memory is all its own.
#[derive(Clone)]
pub struct Materialize(Arc<MaterializeInner>);

struct MaterializeInner {
    /// Readable when asked (a byte), polled by the handler.
    asked_r: OwnedFd,
    asked_w: Mutex<std::fs::File>,
    outcome: Mutex<Outcome>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct Outcome {
    /// The answer to the request under way.
    answer: Option<std::result::Result<(), String>>,
    /// The answer to every request from now on, once the handler is gone:
    /// it let go of the process (its memory is all its own: Ok), or it
    /// ended without (nothing would read a request again). A clone whose
    /// move was refused after its memory became its own is asked again by
    /// the next move, and must not wait for a handler that is no more.
    settled: Option<std::result::Result<(), String>>,
}

impl Materialize {
    pub fn new() -> Result<Materialize> {
        let (r, w) = crate::restore::pipe()?;
        Ok(Materialize(Arc::new(MaterializeInner {
            asked_r: r,
            asked_w: Mutex::new(std::fs::File::from(w)),
            outcome: Mutex::new(Outcome::default()),
            changed: std::sync::Condvar::new(),
        })))
    }

    /// Ask, and wait until every page is in place and the handler let go of
    /// the process, or it says why it cannot (at most `timeout`).
    pub fn request(&self, timeout: std::time::Duration) -> std::result::Result<(), String> {
        let inner = &self.0;
        {
            let mut o = inner.outcome.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(settled) = &o.settled {
                return settled.clone();
            }
            o.answer = None;
        }
        inner.asked_w.lock().unwrap_or_else(|p| p.into_inner()).write_all(&[1]).map_err(|e| format!("asking its fault handler: {e}"))?;
        let guard = inner.outcome.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) = inner
            .changed
            .wait_timeout_while(guard, timeout, |o| o.answer.is_none() && o.settled.is_none())
            .unwrap_or_else(|p| p.into_inner());
        let settled = guard.settled.clone();
        guard.answer.take().or(settled).unwrap_or_else(|| Err(format!("its memory did not arrive within {} s", timeout.as_secs())))
    }

    fn answer(&self, outcome: std::result::Result<(), String>) {
        self.0.outcome.lock().unwrap_or_else(|p| p.into_inner()).answer = Some(outcome);
        self.0.changed.notify_all();
    }

    /// The handler is gone: `outcome` answers this request and all later ones.
    fn settle(&self, outcome: std::result::Result<(), String>) {
        let mut o = self.0.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if o.settled.is_none() {
            o.settled = Some(outcome);
        }
        self.0.changed.notify_all();
    }
}

/// How long the handler waits before serving parked faults again when no
/// message arrives meanwhile (the kernel accepts installs again once the
/// thread that changed the map has run on after its event was read).
const PARKED_RETRY_MS: i32 = 1;

/// Most pages [`Shared::held`] keeps (16 MiB); past it a refused page
/// is fetched again on its next fault.
const MAX_HELD_PAGES: usize = 4096;

/// Most pages [`Installer::offer`] installs under one hold of the events
/// lock (128 KiB: one `UFFDIO_COPY` of that takes tens of µs; a fault
/// waited for a drain's whole 1 MiB runs, behind every page it pushed).
const INSTALL_RUN: usize = 32;

/// Installs pages nobody is faulting on: pages other clones asked for (the
/// multicast receive thread) or a migration's remaining pages (the drain).
struct Installer {
    shared: Arc<Shared>,
    stats: Arc<FaultStats>,
    /// Count installs as multicast pages this clone did not ask for.
    unsolicited: bool,
}

impl PageSink for Installer {
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        let mut out = vec![false; pages.len()];
        let mut new_installs = 0u64;
        let wanted = |moved: &[(u64, u64)], addr: u64| -> Option<(usize, usize)> {
            if moved.iter().any(|&(s, l)| addr >= s && addr < s + l) {
                return None;
            }
            let (ri, pi) = self.shared.locate(addr)?;
            missing(self.shared.state(ri, pi)).then_some((ri, pi))
        };
        let mut discarded = 0u64;
        // Runs of consecutive data pages go in with one UFFDIO_COPY each,
        // each run under the events lock, taken again for the next: the
        // handler reads every fault under it too, so a fault waits for at
        // most one run (INSTALL_RUN pages), not for the whole batch. A run's
        // bytes are put together before the lock is taken, which also leaves
        // the handler a moment to take it between runs.
        let mut i = 0;
        while i < pages.len() {
            let (addr, ref page) = pages[i];
            let mut end = i + 1;
            let mut run = Vec::new();
            if let Fetched::Data(first) = page {
                run.extend_from_slice(first);
                while end < pages.len() && end - i < INSTALL_RUN {
                    let (a, Fetched::Data(d)) = &pages[end] else { break };
                    if *a != addr + (end - i) as u64 * PAGE_SIZE {
                        break;
                    }
                    run.extend_from_slice(d);
                    end += 1;
                }
            }
            let moved = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
            let Some((ri, pi)) = wanted(&moved, addr) else {
                // Present already (or not ours to fill): nothing to install.
                out[i] = self.shared.locate(addr).is_some_and(|(ri, pi)| self.shared.state(ri, pi) == ST_DONE);
                discarded += u64::from(out[i] && !matches!(page, Fetched::Installed | Fetched::Unreadable));
                i += 1;
                continue;
            };
            match page {
                Fetched::Zero => {
                    let r = self.shared.uffd.zeropage(addr, PAGE_SIZE);
                    new_installs += u64::from(r.is_ok());
                    out[i] = install_result(r);
                    if out[i] {
                        self.shared.set_state(ri, pi, ST_DONE);
                    } else if r == Err(libc::EAGAIN) {
                        // Refused for now: the lockstep sender will not send
                        // it again soon, so keep it for this clone's fault.
                        self.shared.hold(addr, Fetched::Zero);
                    }
                    i += 1;
                }
                Fetched::Data(_) => {
                    // The part of the run still wanted now, under the lock.
                    let mut j = i + 1;
                    while j < end && wanted(&moved, pages[j].0).is_some() {
                        j += 1;
                    }
                    let run = &run[..(j - i) * PAGE];
                    let whole = self.shared.uffd.copy(addr, run).is_ok();
                    if whole {
                        new_installs += (j - i) as u64;
                    }
                    for k in i..j {
                        let a = pages[k].0;
                        // A run that failed part-way is retried page by page.
                        out[k] = whole || {
                            let page = &run[(k - i) * PAGE..(k - i + 1) * PAGE];
                            let r = self.shared.uffd.copy(a, page);
                            new_installs += u64::from(r.is_ok());
                            if r == Err(libc::EAGAIN) {
                                // As for a zero page above.
                                self.shared.hold(a, Fetched::Data(page.to_vec()));
                            }
                            install_result(r)
                        };
                        if out[k] {
                            if let Some((ri, pi)) = self.shared.locate(a) {
                                self.shared.set_state(ri, pi, ST_DONE);
                            }
                        }
                    }
                    i = j;
                }
                Fetched::Unreadable | Fetched::Installed => i += 1,
            }
        }
        // Multicast pages another clone asked for still arrived from the
        // template into this clone: they count as fetched, too.
        if self.unsolicited {
            self.stats.pages_multicast_unsolicited.fetch_add(new_installs, Ordering::Relaxed);
        }
        self.stats.add_fetched(new_installs);
        self.stats.pages_discarded.fetch_add(discarded, Ordering::Relaxed);
        out
    }
}

#[allow(clippy::cast_possible_truncation)] // 4096 fits in any usize
const PAGE: usize = PAGE_SIZE as usize;

/// Outcome of installing one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Install {
    /// Installed now.
    New,
    /// Was there already (EEXIST), or the range is gone (ENOENT/ESRCH).
    Present,
    /// Nothing installed (EAGAIN: a change of the clone's map is unread): serve
    /// the fault again once it has been read.
    Retry,
}

/// Whether an install left the page present: done, or present before (EEXIST).
fn install_result(r: std::result::Result<(), i32>) -> bool {
    matches!(r, Ok(()) | Err(libc::EEXIST))
}

static RECEIVER_SEQ: AtomicU64 = AtomicU64::new(0);

impl FaultHandler {
    pub fn new(uffd: OwnedFd, desc: &Descriptor, client: PageClient, stats: Arc<FaultStats>) -> FaultHandler {
        Self::new_with(uffd, desc, client, stats, FaultOptions::from_settings(&Default::default()))
    }

    /// As [`FaultHandler::new`] with explicit options, for a clone that shares
    /// nothing with others (its own multicast receiver). Never fails: without
    /// working multicast the handler is unicast (see [`FaultStats::mode`]).
    pub fn new_with(uffd: OwnedFd, desc: &Descriptor, client: PageClient, stats: Arc<FaultStats>, opts: FaultOptions) -> FaultHandler {
        let host = HostTicket::new(client.peer_addr(), *client.key(), opts);
        Self::on_host(uffd, desc, client, stats, &host)
    }

    /// A handler for one of the clones of `host`'s ticket on this host: it
    /// fetches through the host's multicast receiver (joined by the first
    /// clone that asks) and installs the pages it brings for any of them.
    /// Never fails, as [`FaultHandler::new_with`].
    pub fn on_host(uffd: OwnedFd, desc: &Descriptor, mut client: PageClient, stats: Arc<FaultStats>, host: &HostTicket) -> FaultHandler {
        let opts = host.options();
        let uffd = Uffd::new(uffd);
        let regions: Vec<HandlerRegion> = desc
            .regions
            .iter()
            .filter(|r| starling_image::map_kind(r) == MapKind::AnonRegister)
            .map(|r| HandlerRegion {
                start: r.start,
                end: r.end,
                state: r.pages.expand().into_iter().map(|c| AtomicU8::new(match c {
                    PageClass::Zero => ST_ZERO,
                    PageClass::File => ST_FILE,
                    PageClass::Fetch => ST_FETCH,
                })).collect(),
                file: match &r.kind {
                    RegionKind::File { path, offset, .. } => Some((path.clone(), *offset)),
                    _ => None,
                },
            })
            .collect();
        let shared = Arc::new(Shared { uffd, regions, events: Mutex::new(Vec::new()), held: Mutex::new(HashMap::new()) });
        let mc = match host.group(&mut client) {
            Group::Joined(rx, mode) => {
                stats.mode.store(mode as u8, Ordering::Relaxed);
                let installer = Arc::new(Installer { shared: shared.clone(), stats: stats.clone(), unsolicited: true });
                Some((rx, host.join(installer)))
            }
            Group::Unicast(mode) => {
                stats.mode.store(mode as u8, Ordering::Relaxed);
                None
            }
        };
        let prefetch = opts.prefetch.clamp(1, crate::page_server::MAX_BATCH as usize);
        client.set_reply_spin(opts.reply_spin);
        FaultHandler { shared, local: None, files: HashMap::new(), client, mc, stats, prefetch, walk_next: 0, remaps: vec![], parked: vec![], drained: None, materialize: None }
    }

    /// Serve pages held here (see [`LocalPages`]) without asking the page server.
    pub fn with_local_pages(mut self, local: Arc<dyn LocalPages>) -> FaultHandler {
        self.local = Some(local);
        self
    }

    /// Answer [`Materialize`] requests, fetching from `server`.
    pub fn with_materialize(mut self, m: Materialize, server: SocketAddr) -> FaultHandler {
        self.materialize = Some((m, server));
        self
    }

    /// Start a thread that puts every page still to fetch in place — those
    /// held here first, then the rest from the page server over `client` —
    /// while the handler serves faults, and calls `done` once the page
    /// server holds nothing the process still needs (live migration's
    /// post-copy push: then the source can go). Pages of ranges the process
    /// moved (mremap) are fetched and held for their fault.
    ///
    /// Once the drain has succeeded, [`FaultHandler::run`] fills the file
    /// pages not yet read, returns and closes the userfaultfd: the process
    /// is then an ordinary one again (no registered range, nothing served
    /// from here), so it can be moved once more.
    pub fn spawn_drain(
        &mut self,
        client: PageClient,
        done: Box<dyn FnOnce(Result<DrainReport>) + Send>,
    ) -> Result<std::thread::JoinHandle<()>> {
        self.spawn_drain_after(Box::new(|| true), client, done)
    }

    /// [`FaultHandler::spawn_drain`], whose thread first waits for `start`:
    /// false, and it ends without draining (`done` is not called). Faults
    /// are served meanwhile.
    pub fn spawn_drain_after(
        &mut self,
        start: Box<dyn FnOnce() -> bool + Send>,
        mut client: PageClient,
        done: Box<dyn FnOnce(Result<DrainReport>) + Send>,
    ) -> Result<std::thread::JoinHandle<()>> {
        let shared = self.shared.clone();
        let local = self.local.clone();
        let installer = Installer { shared: shared.clone(), stats: self.stats.clone(), unsolicited: false };
        let (drained_r, drained_w) = crate::restore::pipe()?;
        self.drained = Some(drained_r);
        std::thread::Builder::new()
            .name("drain".into())
            .spawn(move || {
                if !start() {
                    return;
                }
                lower_priority();
                let r = drain(&shared, local.as_deref(), &installer, &mut client);
                drop(installer);
                drop(shared);
                // A byte on success; after a failure the pipe just closes and
                // the handler keeps serving what it can until it is stopped.
                let ok = r.is_ok();
                done(r);
                if ok {
                    let _ = std::fs::File::from(drained_w).write_all(&[1]);
                }
            })
            .map_err(|e| ForkError::io("start the drain thread", e))
    }

    /// How this handler gets its pages.
    pub fn mode(&self) -> Mode {
        self.stats.mode()
    }

    /// Serve faults until `stop` becomes readable (or hangs up).
    /// Also returns once a drain has put everything in place and nothing is
    /// left to serve (see [`FaultHandler::spawn_drain`]).
    pub fn run(mut self, stop: BorrowedFd<'_>) -> Result<()> {
        loop {
            let mut fds = [
                libc::pollfd { fd: self.shared.uffd.raw(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.drained.as_ref().map_or(-1, |d| d.as_raw_fd()), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.materialize.as_ref().map_or(-1, |m| m.0 .0.asked_r.as_raw_fd()), events: libc::POLLIN, revents: 0 },
            ];
            let timeout = if self.parked.is_empty() { -1 } else { PARKED_RETRY_MS };
            // SAFETY: polls four fds we hold for the duration of the call (a negative fd is ignored).
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 4, timeout) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(ForkError::errno("poll userfaultfd"));
            }
            if fds[1].revents != 0 {
                return Ok(());
            }
            if fds[2].revents != 0 {
                let mut byte = [0u8; 1];
                let succeeded = self.drained.take().is_some_and(|d| matches!(std::fs::File::from(d).read(&mut byte), Ok(1)));
                let released = succeeded && self.release()?;
                if released {
                    // Let go first (the userfaultfd closes with the last
                    // reference: the handler's, the multicast receiver's),
                    // then say so.
                    let m = self.materialize.take();
                    drop(self);
                    if let Some((m, _)) = m {
                        m.settle(Ok(()));
                    }
                    return Ok(());
                }
                if let Some((m, _)) = &self.materialize {
                    m.answer(Err(if succeeded {
                        "it is changing its memory map (mremap, discards): try again".into()
                    } else {
                        "its memory could not be fetched from the page server".into()
                    }));
                }
            }
            if fds[3].revents != 0 {
                self.start_materialize();
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                return Ok(());
            }
            loop {
                // Events are read and applied under the events lock (see `Shared::events`).
                let shared = self.shared.clone();
                let mut moved = shared.events.lock().unwrap_or_else(|p| p.into_inner());
                let ev = match self.shared.uffd.read_event() {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(ForkError::io("read userfaultfd event", e)),
                };
                if let Event::Pagefault { addr } = ev {
                    drop(moved);
                    self.stats.faults.fetch_add(1, Ordering::Relaxed);
                    let page = addr & !(PAGE_SIZE - 1);
                    let started = std::time::Instant::now();
                    if self.serve_fault(page)? == Install::Retry {
                        self.parked.push((page, started));
                    } else {
                        self.stats.service_us.record(started.elapsed());
                        if self.parked.is_empty() {
                            // Back to poll, which returns at once if more
                            // is pending: a lone fault then costs no read
                            // that finds nothing (nothing parked waits for
                            // the rest to be read).
                            break;
                        }
                    }
                } else {
                    self.handle_event(ev, &mut moved);
                }
            }
            // Every message pending was read (map changes included): serve
            // the parked faults again.
            self.serve_parked()?;
        }
    }

    /// Serve the parked faults again; those still refused stay parked.
    fn serve_parked(&mut self) -> Result<()> {
        for (page, started) in std::mem::take(&mut self.parked) {
            if self.serve_fault(page)? == Install::Retry {
                self.parked.push((page, started));
            } else {
                self.stats.service_us.record(started.elapsed());
            }
        }
        Ok(())
    }

    /// A [`Materialize`] request: start a drain from the page server (its
    /// end comes back through `drained`).
    fn start_materialize(&mut self) {
        let Some((m, server)) = self.materialize.clone() else { return };
        let mut byte = [0u8; 1];
        // SAFETY: read(2) of one byte into a local buffer from a pipe we hold.
        let _ = unsafe { libc::read(m.0.asked_r.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
        if self.drained.is_some() {
            return; // one is under way
        }
        let (key, encrypt) = (*self.client.key(), self.client.wants_encryption());
        let started = PageClient::connect(server, &key, encrypt).and_then(|client| {
            let m2 = m.clone();
            self.spawn_drain(
                client,
                Box::new(move |r| {
                    if let Err(e) = r {
                        m2.answer(Err(format!("its memory could not be fetched: {e}")));
                    }
                }),
            )
        });
        if let Err(e) = started {
            m.answer(Err(format!("its memory could not be fetched: {e}")));
        }
    }

    /// After a successful drain: put the file pages not read yet in place,
    /// then say whether the process can be let go (its userfaultfd closed:
    /// every range unregistered, later faults are the kernel's own, and
    /// untouched anonymous pages read as zero as they would have). Not while
    /// anything is parked or held, or after the process moved memory
    /// (`remaps`): those pages are still this handler's to serve.
    fn release(&mut self) -> Result<bool> {
        // A fault parked on a page the drain brought is served by now.
        self.serve_parked()?;
        if !self.parked.is_empty() || !self.remaps.is_empty() || !self.shared.held().is_empty() {
            return Ok(false);
        }
        for ri in 0..self.shared.regions.len() {
            let region = &self.shared.regions[ri];
            let (start, pages) = (region.start, region.state.len());
            for pi in 0..pages {
                match self.shared.state(ri, pi) {
                    ST_FILE => {
                        let addr = start + pi as u64 * PAGE_SIZE;
                        if self.serve_fault(addr)? == Install::Retry {
                            return Ok(false);
                        }
                    }
                    ST_FETCH | ST_FAULTING | ST_PUSHING => return Ok(false),
                    _ => {}
                }
            }
        }
        log::debug!("fault handler: every page in place, releasing the process");
        Ok(true)
    }

    /// The template address behind clone address `addr`; `None` if its memory moved away.
    fn translate(&self, addr: u64) -> Option<u64> {
        for &(new, len, old) in self.remaps.iter().rev() {
            if addr >= new && addr < new + len {
                return old.map(|old| old + (addr - new));
            }
        }
        Some(addr)
    }

    fn locate(&self, tmpl_addr: u64) -> Option<(usize, usize)> {
        self.shared.locate(tmpl_addr)
    }

    fn mark_range(&self, start: u64, end: u64, state: u8) {
        let mut held = self.shared.held();
        let mut a = start & !(PAGE_SIZE - 1);
        while a < end {
            let Some(t) = self.translate(a) else {
                a += PAGE_SIZE;
                continue;
            };
            if let Some((ri, pi)) = self.locate(t) {
                self.shared.set_state(ri, pi, state);
            }
            if !held.is_empty() {
                held.remove(&t);
            }
            a += PAGE_SIZE;
        }
    }

    /// A non-fault event; the caller holds the events lock (`moved`).
    fn handle_event(&mut self, ev: Event, moved: &mut Vec<(u64, u64)>) {
        match ev {
            Event::Remove { start, end } | Event::Unmap { start, end } => {
                self.stats.events_remove.fetch_add(1, Ordering::Relaxed);
                // Discarded: from now on the range reads as zero.
                self.mark_range(start, end, ST_ZERO);
            }
            Event::Remap { from, to, len } => {
                let Some(old) = self.translate(from) else { return };
                self.remaps.push((from, len, None));
                self.remaps.push((to, len, Some(old)));
                moved.push((old, len));
            }
            Event::Pagefault { .. } | Event::Fork | Event::Unknown(_) => {}
        }
    }

    /// Install a zero page.
    fn zero(&self, addr: u64) -> Result<Install> {
        self.installed(addr, self.shared.uffd.zeropage(addr, PAGE_SIZE), "UFFDIO_ZEROPAGE")
    }

    /// Install a page.
    fn copy(&self, addr: u64, page: &[u8]) -> Result<Install> {
        self.installed(addr, self.shared.uffd.copy(addr, page), "UFFDIO_COPY")
    }

    fn installed(&self, addr: u64, r: std::result::Result<(), i32>, what: &'static str) -> Result<Install> {
        match r {
            Ok(()) => Ok(Install::New),
            // EAGAIN: a change of the clone's memory map is unread; nothing
            // was installed. The faulting thread stays asleep (parked).
            Err(libc::EAGAIN) => Ok(Install::Retry),
            Err(e) if benign(e) => {
                self.shared.uffd.wake(addr, PAGE_SIZE);
                Ok(Install::Present)
            }
            Err(errno) => Err(ForkError::Uffd { what, addr, errno }),
        }
    }

    /// Serve a fault at `addr` (page aligned, in the clone); returns how its
    /// page went in (`Retry`: not yet, park the fault).
    fn serve_fault(&mut self, addr: u64) -> Result<Install> {
        let Some((t, (ri, pi))) = self.translate(addr).and_then(|t| Some((t, self.locate(t)?))) else {
            // Registered memory outside the descriptor (grown stack): zero.
            self.stats.pages_zero.fetch_add(1, Ordering::Relaxed);
            return self.zero(addr);
        };
        match self.shared.state(ri, pi) {
            ST_ZERO | ST_DONE => {
                self.stats.pages_zero.fetch_add(1, Ordering::Relaxed);
                self.shared.set_state(ri, pi, ST_DONE);
                self.zero(addr)
            }
            ST_FILE => {
                let region = &self.shared.regions[ri];
                let (path, off) = region.file.clone().ok_or_else(|| {
                    starling_image::DescriptorError::Invalid(format!("file page at {t:#x} of a region without a file"))
                })?;
                let file_off = off + (t - region.start);
                let mut page = vec![0u8; PAGE];
                if !self.files.contains_key(&path) {
                    let f = std::fs::File::open(&path).map_err(|e| ForkError::io(format!("open {path}"), e))?;
                    self.files.insert(path.clone(), f);
                }
                let f = &self.files[&path];
                // Short read past EOF leaves zeros, as the mapping would.
                let mut got = 0;
                while got < page.len() {
                    match f.read_at(&mut page[got..], file_off + got as u64) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(ForkError::io(format!("read {path}"), e)),
                    }
                }
                self.stats.pages_file.fetch_add(1, Ordering::Relaxed);
                let done = self.copy(addr, &page)?;
                if done != Install::Retry {
                    self.shared.set_state(ri, pi, ST_DONE);
                }
                Ok(done)
            }
            // The drain has asked for it: its install wakes the thread.
            ST_PUSHING => Ok(Install::Retry),
            _ => self.fetch_batch(addr, ri, pi),
        }
    }

    /// Fetch the faulting page plus following not-yet-served Fetch pages of
    /// the same region (in clone addresses, contiguous with `addr`). Returns
    /// how the faulting page went in.
    fn fetch_batch(&mut self, addr: u64, ri: usize, pi: usize) -> Result<Install> {
        let region = &self.shared.regions[ri];
        let tmpl_base = region.start + pi as u64 * PAGE_SIZE;
        let held = self.shared.held().remove(&tmpl_base);
        if let Some(page) = held {
            // Fetched before, refused then (EAGAIN): install it now.
            let done = self.install_fetched(addr, tmpl_base, ri, pi, page)?;
            self.stats.add_fetched(u64::from(done == Install::New));
            return Ok(done);
        }
        if !claim(&region.state[pi], ST_FAULTING) {
            // The drain took it (or put it in place) since the fault was read.
            return Ok(Install::Retry);
        }
        let mut pages = vec![pi];
        let mut j = pi + 1;
        let window = self.read_ahead(addr);
        while pages.len() < window
            && j < region.state.len()
            && !self.shared.held().contains_key(&(region.start + j as u64 * PAGE_SIZE))
            && claim(&region.state[j], ST_FAULTING)
        {
            pages.push(j);
            j += 1;
        }
        let tmpl_addrs: Vec<u64> = pages.iter().map(|&p| region.start + p as u64 * PAGE_SIZE).collect();
        self.walk_next = addr + pages.len() as u64 * PAGE_SIZE;
        let replies = self.fetch(&tmpl_addrs)?;
        self.stats.fetch_requests.fetch_add(1, Ordering::Relaxed);
        let mut fetched = 0;
        let mut faulting = Install::Retry;
        for (k, (p, reply)) in pages.iter().zip(replies).enumerate() {
            let dst = addr + (tmpl_addrs[k] - tmpl_base);
            let done = self.install_fetched(dst, tmpl_addrs[k], ri, *p, reply)?;
            if k == 0 {
                faulting = done;
            }
            // Counted where a page becomes present, so that pages the
            // receive thread installed are not counted twice.
            fetched += u64::from(done == Install::New);
        }
        self.stats.add_fetched(fetched);
        Ok(faulting)
    }

    /// How many pages to fetch for a fault at `addr` (the faulting one
    /// included): `prefetch` when the fault continues a sequential walk — it
    /// lands at most `prefetch` pages past the last page fetched (pages in
    /// between may have been zero or present) — else 1. A page fetched ahead
    /// costs a read at the page server, its bytes on the wire (sealed and
    /// opened when encrypted) and a `UFFDIO_COPY`, all before the faulting
    /// thread runs again: ~10 µs per page on this machine, so 16 pages made
    /// every fault of a random or strided walk several times slower than
    /// one page (bench/README.md, fork_bench "fault service"). A walk pays
    /// one single-page fault before its read-ahead starts.
    fn read_ahead(&self, addr: u64) -> usize {
        read_ahead_window(self.walk_next, addr, self.prefetch)
    }

    /// Install one fetched page at `dst` (template page `tmpl`, page `pi` of
    /// region `ri`). A page the kernel refuses for now (EAGAIN: a change of
    /// the clone's map is unread) stays `Fetch` — marking it served would
    /// have its next fault filled with zeros — and its bytes are held for
    /// that fault.
    fn install_fetched(&mut self, dst: u64, tmpl: u64, ri: usize, pi: usize, page: Fetched) -> Result<Install> {
        let done = match &page {
            Fetched::Data(d) => self.copy(dst, d)?,
            Fetched::Zero => self.zero(dst)?,
            // The receive thread installed it (and woke the clone).
            Fetched::Installed => {
                self.shared.uffd.wake(dst, PAGE_SIZE);
                Install::Present
            }
            Fetched::Unreadable => return Err(ForkError::PageUnreadable(tmpl)),
        };
        if done == Install::Present && !matches!(page, Fetched::Installed) {
            self.stats.pages_discarded.fetch_add(1, Ordering::Relaxed);
        }
        if done == Install::Retry {
            // Held before it is given back: a fault then finds its bytes.
            self.shared.hold(tmpl, page);
            unclaim(&self.shared.regions[ri].state[pi], ST_FAULTING);
        } else {
            self.shared.set_state(ri, pi, ST_DONE);
        }
        Ok(done)
    }

    /// Pages held here, else from the multicast group, or by unicast if
    /// multicast fails.
    fn fetch(&mut self, tmpl_addrs: &[u64]) -> Result<Vec<Fetched>> {
        let Some(local) = self.local.clone() else { return self.fetch_remote(tmpl_addrs) };
        let mut out: Vec<Option<Fetched>> = tmpl_addrs.iter().map(|&a| local.page(a).map(|p| Fetched::Data(p.to_vec()))).collect();
        let missing: Vec<u64> = tmpl_addrs.iter().zip(&out).filter(|(_, f)| f.is_none()).map(|(&a, _)| a).collect();
        if !missing.is_empty() {
            let mut remote = self.fetch_remote(&missing)?.into_iter();
            for slot in out.iter_mut().filter(|f| f.is_none()) {
                *slot = remote.next();
            }
        }
        Ok(out.into_iter().map(|f| f.unwrap_or(Fetched::Unreadable)).collect())
    }

    fn fetch_remote(&mut self, tmpl_addrs: &[u64]) -> Result<Vec<Fetched>> {
        if let Some((rx, _)) = &self.mc {
            let shared = &self.shared;
            // Pages the host's receiver installed into this clone since the batch was chosen.
            let present = |a: u64| shared.locate(a).is_some_and(|(ri, pi)| !missing(shared.state(ri, pi)));
            match rx.fetch_unless(tmpl_addrs, &present) {
                Ok(r) => return Ok(r),
                Err(e) => {
                    log::warn!("mcdist: {e}; this clone falls back to unicast page fetches");
                    self.stats.mode.store(Mode::UnicastFallback as u8, Ordering::Relaxed);
                    self.mc = None;
                }
            }
        }
        Ok(self.client.fetch(tmpl_addrs)?.into_iter().map(Fetched::from).collect())
    }
}

/// The drain's loop (see [`FaultHandler::spawn_drain`]).
fn drain(shared: &Shared, local: Option<&dyn LocalPages>, installer: &Installer, client: &mut PageClient) -> Result<DrainReport> {
    const RUN: usize = 256;
    let mut report = DrainReport::default();
    loop {
        let mut left = false;
        // Pages the fault handler is fetching: the page server must stay
        // until they are in place (or given back, then fetched here).
        let mut awaited = false;
        for region in &shared.regions {
            let mut pi = 0;
            while pi < region.state.len() {
                // A run of pages still to fetch, not held, claimed.
                let is_held = |p: usize| {
                    let held = shared.held();
                    !held.is_empty() && held.contains_key(&(region.start + p as u64 * PAGE_SIZE))
                };
                let next = claim_run(&region.state, pi, RUN, is_held);
                (pi, awaited) = (next.end, awaited || next.awaited);
                if next.pages.is_empty() {
                    continue;
                }
                let run: Vec<u64> = next.pages.iter().map(|&p| region.start + p as u64 * PAGE_SIZE).collect();
                left = true;
                let mut pages = Vec::with_capacity(run.len());
                let mut remote = Vec::new();
                for &a in &run {
                    match local.and_then(|l| l.page(a)) {
                        Some(p) => pages.push((a, Fetched::Data(p.to_vec()))),
                        None => remote.push(a),
                    }
                }
                report.local_pages += pages.len() as u64;
                for batch in remote.chunks(crate::page_server::MAX_BATCH as usize) {
                    let got = client.fetch(batch)?;
                    report.remote_pages += batch.len() as u64;
                    pages.extend(batch.iter().copied().zip(got.into_iter().map(Fetched::from)));
                }
                pages.sort_by_key(|p| p.0);
                if let Some((a, _)) = pages.iter().find(|p| matches!(p.1, Fetched::Unreadable)) {
                    return Err(ForkError::PageUnreadable(*a));
                }
                installer.offer(&pages);
                // What could not go in now (a moved range, or refused while a
                // map change is unread) is kept here for its fault, then
                // given back (under the held lock: a fault finds its bytes).
                let mut held = shared.held();
                for (a, p) in pages {
                    let Some((r, i)) = shared.locate(a) else { continue };
                    if shared.state(r, i) == ST_PUSHING && matches!(p, Fetched::Data(_) | Fetched::Zero) {
                        held.insert(a, p);
                    }
                    unclaim(&shared.regions[r].state[i], ST_PUSHING);
                }
            }
        }
        if !left && !awaited {
            return Ok(report);
        }
        if !left {
            // Only the handler's fetches are left: wait for them, not spin.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Run the calling thread (the drain) at a lower priority: on a host with
/// few cores the faulting thread's fetches and installs get the CPU before
/// the bulk push (they use a connection and a page-server thread of their
/// own, so no request waits behind the push's in a queue; only for a core).
fn lower_priority() {
    // SAFETY: gettid has no arguments; setpriority only changes this thread's nice value.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, u32::try_from(libc::gettid()).unwrap_or(0), 10) };
    if r != 0 {
        log::debug!("drain: lowering its priority: {}", std::io::Error::last_os_error());
    }
}

/// A run of pages the drain claimed ([`claim_run`]).
#[derive(Debug, PartialEq, Eq)]
struct Run {
    /// Page indices claimed (`ST_PUSHING`), ascending.
    pages: Vec<usize>,
    /// Where the next run's search starts.
    end: usize,
    /// Whether pages the fault handler is fetching were passed over.
    awaited: bool,
}

/// The drain's next run in a region's page `states` from index `from`: up
/// to `max` `Fetch` pages not `held`, each claimed for the drain, from the
/// first such page to the first page after it that is not (a gap ends the
/// run, so its pages are mostly contiguous). Pages the fault handler has
/// claimed are left to it, and noted.
fn claim_run(states: &[AtomicU8], from: usize, max: usize, held: impl Fn(usize) -> bool) -> Run {
    let mut run = Run { pages: Vec::new(), end: from, awaited: false };
    while run.end < states.len() && run.pages.len() < max {
        let p = run.end;
        let state = &states[p];
        run.end += 1;
        run.awaited |= state.load(Ordering::Acquire) == ST_FAULTING;
        if state.load(Ordering::Acquire) == ST_FETCH && !held(p) && claim(state, ST_PUSHING) {
            run.pages.push(p);
        } else if !run.pages.is_empty() {
            break;
        }
    }
    run
}

/// Join the multicast group the page server behind `client` offers, with
/// `sink` for pages nobody here waits for. Returns the receiver (None:
/// unicast) and the resulting distribution mode.
pub(crate) fn join_group(client: &mut PageClient, opts: &FaultOptions, sink: Arc<dyn PageSink>) -> (Option<Receiver>, Mode) {
    if opts.mcdist == Switch::Off {
        return (None, Mode::Unicast);
    }
    let info = match client.mcdist_info() {
        Ok(Some(info)) => info,
        Ok(None) => return (None, Mode::Unicast),
        Err(e) => {
            log::warn!("mcdist: page server did not answer ({e}); unicast");
            return (None, Mode::UnicastFallback);
        }
    };
    if opts.encrypt && !info.encrypted {
        log::warn!("mcdist: the ticket's multicast pages are not encrypted and this host's fork.encrypt requires it; unicast");
        return (None, Mode::Unicast);
    }
    let iface = match client.local_addr() {
        Some(SocketAddr::V4(a)) => *a.ip(),
        _ => Ipv4Addr::LOCALHOST,
    };
    // Only the sequence's low bits matter: it just tells one process's receivers apart.
    #[allow(clippy::cast_possible_truncation)]
    let seq = RECEIVER_SEQ.fetch_add(1, Ordering::Relaxed) as u32;
    let id = (std::process::id() << 12) ^ seq;
    let mut cfg = ReceiverConfig::new(info.ticket, *client.key(), info.group, iface, info.sender, id);
    cfg.probe_timeout = opts.probe_timeout;
    cfg.encrypted = info.encrypted;
    match Receiver::start(cfg, sink) {
        Ok(rx) => (Some(rx), if info.push { Mode::MulticastPush } else { Mode::Multicast }),
        Err(e) => {
            log::warn!("mcdist: {e} (group {}); falling back to unicast", info.group);
            (None, Mode::UnicastFallback)
        }
    }
}

/// [`FaultHandler::read_ahead`] for a fault at `addr` after a fetch that
/// ended at `walk_next`.
fn read_ahead_window(walk_next: u64, addr: u64, prefetch: usize) -> usize {
    let span = prefetch as u64 * PAGE_SIZE;
    if addr >= walk_next && addr - walk_next < span {
        prefetch
    } else {
        1
    }
}

/// Errors that mean "nothing to do": page already present (EEXIST), range
/// gone (ENOENT, after munmap), clone gone (ESRCH).
fn benign(errno: i32) -> bool {
    errno == libc::EEXIST || errno == libc::ENOENT || errno == libc::ESRCH || errno == libc::EAGAIN
}
impl Drop for FaultHandler {
    fn drop(&mut self) {
        let s = &self.stats;
        log::debug!(
            "fault handler done: {:?} unsolicited={} mode={}",
            s.snapshot(),
            s.pages_multicast_unsolicited.load(Ordering::Relaxed),
            s.mode().as_str()
        );
        if let Some((rx, _)) = &self.mc {
            log::debug!("mcdist receiver (this host's): {:?}", rx.stats());
        }
        // Ended without letting go of its process (which ended, or was
        // stopped): no request will be read again.
        if let Some((m, _)) = &self.materialize {
            m.settle(Err("its fault handler has ended".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{claim, claim_run, missing, read_ahead_window, unclaim, Materialize, Run, ST_DONE, ST_FAULTING, ST_FETCH, ST_FILE, ST_PUSHING, ST_ZERO};
    use std::sync::atomic::{AtomicU8, Ordering};

    // Long enough never to be reached by a request that is answered: one
    // that is not fails with "did not arrive" once it passes.
    const NEVER: std::time::Duration = std::time::Duration::from_secs(120);

    #[test]
    fn a_request_after_the_handler_let_go_is_answered_at_once() {
        // A clone's memory became its own (the handler let go), then its move
        // was refused: the next move asks again, and nothing reads the request.
        let m = Materialize::new().unwrap();
        m.settle(Ok(()));
        assert_eq!(m.request(NEVER), Ok(()));
        assert_eq!(m.request(NEVER), Ok(()));
    }

    #[test]
    fn a_request_after_the_handler_ended_says_so_at_once() {
        let m = Materialize::new().unwrap();
        m.settle(Err("its fault handler has ended".into()));
        assert_eq!(m.request(NEVER), Err("its fault handler has ended".into()));
    }

    #[test]
    fn a_request_is_answered_by_the_handler() {
        let m = Materialize::new().unwrap();
        let handler = m.clone();
        let t = std::thread::spawn(move || {
            // As the handler: the request's byte arrives, then the answer.
            let mut byte = [0u8; 1];
            // SAFETY: read(2) of one byte into a local buffer from a pipe the Materialize holds.
            let n = unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(&handler.0.asked_r), byte.as_mut_ptr().cast(), 1) };
            assert_eq!(n, 1);
            handler.answer(Err("it is changing its memory map (mremap, discards): try again".into()));
        });
        assert_eq!(m.request(NEVER), Err("it is changing its memory map (mremap, discards): try again".into()));
        t.join().unwrap();
    }

    fn states(s: &[u8]) -> Vec<AtomicU8> {
        s.iter().map(|&x| AtomicU8::new(x)).collect()
    }

    fn now(s: &[AtomicU8]) -> Vec<u8> {
        s.iter().map(|x| x.load(Ordering::Relaxed)).collect()
    }

    const F: u8 = ST_FETCH;
    const D: u8 = ST_DONE;
    const Z: u8 = ST_ZERO;
    const H: u8 = ST_FAULTING;
    const U: u8 = ST_PUSHING;

    #[test]
    fn a_page_is_asked_for_by_one_fetcher_only() {
        let s = states(&[F, F, D]);
        assert!(claim(&s[0], H), "the handler takes a Fetch page");
        assert!(!claim(&s[0], U), "the drain does not ask for it again");
        assert!(claim(&s[1], U));
        assert!(!claim(&s[1], H), "nor the handler for one the drain has");
        assert!(!claim(&s[2], H), "a page in place is not asked for");
        assert_eq!(now(&s), [H, U, D]);
        // Refused for now: Fetch again, for whoever comes next.
        unclaim(&s[0], H);
        // Given back by the wrong one, or in place meanwhile: unchanged.
        unclaim(&s[1], H);
        s[2].store(D, Ordering::Relaxed);
        unclaim(&s[2], U);
        assert_eq!(now(&s), [F, U, D]);
        assert!([F, H, U].iter().all(|&x| missing(x)));
        assert!([D, Z, ST_FILE].iter().all(|&x| !missing(x)));
    }

    #[test]
    fn the_drain_claims_runs_and_leaves_the_handlers_pages() {
        // 0 in place, 1-2 to fetch, 3 the handler's, 4-6 to fetch (5 held), 7 zero.
        let s = states(&[D, F, F, H, F, F, F, Z]);
        let held = |p: usize| p == 5;
        assert_eq!(claim_run(&s, 0, 256, held), Run { pages: vec![1, 2], end: 4, awaited: true });
        assert_eq!(now(&s), [D, U, U, H, F, F, F, Z]);
        assert_eq!(claim_run(&s, 4, 256, held), Run { pages: vec![4], end: 6, awaited: false });
        assert_eq!(claim_run(&s, 6, 256, held), Run { pages: vec![6], end: 8, awaited: false });
        assert_eq!(claim_run(&s, 8, 256, held), Run { pages: vec![], end: 8, awaited: false });
        assert_eq!(now(&s), [D, U, U, H, U, F, U, Z]);
        // A second pass finds nothing but the handler's page and the held one.
        assert_eq!(claim_run(&s, 0, 256, held), Run { pages: vec![], end: 8, awaited: true });
        // At most `max` pages per run.
        let s = states(&[F, F, F, F, F]);
        assert_eq!(claim_run(&s, 0, 2, |_| false), Run { pages: vec![0, 1], end: 2, awaited: false });
        assert_eq!(claim_run(&s, 2, 2, |_| false), Run { pages: vec![2, 3], end: 4, awaited: false });
        assert_eq!(now(&s), [U, U, U, U, F]);
    }

    const P: u64 = 4096;

    #[test]
    fn read_ahead_only_for_faults_that_continue_a_walk() {
        let end = 0x7f00_0000_0000 + 16 * P; // a fetch of 16 pages ended here
        assert_eq!(read_ahead_window(end, end, 16), 16, "the next page");
        assert_eq!(read_ahead_window(end, end + 15 * P, 16), 16, "past a few zero or present pages");
        assert_eq!(read_ahead_window(end, end + 16 * P, 16), 1, "too far ahead: a stride");
        assert_eq!(read_ahead_window(end, end + 64 * P, 16), 1, "fork_bench's stride");
        assert_eq!(read_ahead_window(end, end - P, 16), 1, "behind the walk");
        assert_eq!(read_ahead_window(0, 0x7f00_0000_0000, 16), 1, "the first fault");
        assert_eq!(read_ahead_window(end, end, 1), 1, "fork.prefetch = 1");
    }
}
