//! The source side: pre-copy while the process runs, freeze, hand over,
//! serve what the target still lacks, and end the process here.

use crate::capture::{capture, freeze_tree, held_socket, precheck, refuses_socket, CaptureOptions, Member, ReadAhead};
use crate::dirty::DirtyTracker;
use crate::freeze::Frozen;
use crate::inject::Injector;
use crate::wire::{self, ToSource, ToTarget};
use crate::{MigrateError, Result};
use starling_fork::dump::{dump_regions, regions_of, Layout, RegionOptions};
use starling_fork::page_server::{Halves, PageServer, PageServerOptions};
use starling_fork::stream::{StreamReader, StreamWriter};
use starling_image::{PageClass, Region, RegionKind, PAGE_BYTES, PAGE_SIZE};
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Pages per `Pages` frame (1 MiB).
const BATCH_PAGES: usize = 256;
/// Addresses per `Stale` frame (1 MiB of them).
const STALE_BATCH: usize = 1 << 17;

#[derive(Debug, Clone)]
pub struct SourceOptions {
    pub capture: CaptureOptions,
    /// Pre-copy rounds after the first full copy (P.Haul: 8).
    pub max_rounds: u32,
    /// A round that found at most this many written pages ends pre-copy.
    pub converged_pages: usize,
    /// Written pages found at the freeze are sent during it when at most
    /// this many (1 MiB); more are left for the target to fetch.
    pub freeze_send_pages: usize,
    /// Address the page server listens on (reachable by the target).
    pub page_server_ip: IpAddr,
    /// The move's secret: the key of its page server.
    pub key: starling_proto::SecretKey,
    /// Encrypt the page server's connections (`fork.encrypt`).
    pub encrypt: bool,
    /// Snowbird's way, kept as the baseline: no copy while it runs, every
    /// page sent while it is frozen.
    pub stop_and_copy: bool,
    /// Looks at a task that holds a socket before the move is refused (so
    /// many before pre-copy, so many frozen at the switch): between two looks it runs on
    /// for a moment ([`SOCKET_WAITS_MS`]), so a task that opens short
    /// connections now and then is caught between two of them.
    pub socket_looks: u32,
}

impl SourceOptions {
    pub fn new(capture: CaptureOptions, page_server_ip: IpAddr) -> SourceOptions {
        SourceOptions { capture, max_rounds: 8, converged_pages: 64, freeze_send_pages: 256, page_server_ip, stop_and_copy: false, key: starling_proto::SecretKey::random(), encrypt: true, socket_looks: 10 }
    }
}

/// How long a task found holding a socket runs on before the next look
/// (ms; ~1.7 s for 10 looks). Growing, and none a multiple of 50 ms, so a
/// task that connects at a round pace (every 100 ms, 200 ms…) is not looked
/// at in the same phase of its cycle every time.
pub const SOCKET_WAITS_MS: [u64; 9] = [15, 35, 65, 105, 155, 215, 285, 365, 455];

/// The looks at a task, while it holds a socket, that one move may take.
struct SocketWait {
    looks: u32,
    max: u32,
    started: Instant,
}

impl SocketWait {
    fn new(max: u32) -> SocketWait {
        SocketWait { looks: 0, max: max.max(1), started: Instant::now() }
    }

    /// After refusal `e`: Ok once the task ran on for the next look, else
    /// the refusal, saying how often it was looked at when it is a socket's.
    fn again(&mut self, e: MigrateError) -> Result<()> {
        if !refuses_socket(&e) {
            return Err(e);
        }
        self.looks += 1;
        if self.looks >= self.max {
            return Err(match e {
                MigrateError::UnmovableFd { fd, target, what } => MigrateError::UnmovableFd {
                    fd,
                    target,
                    what: format!("{what} (the task held one at each of {} looks over {:.1} s)", self.looks, self.started.elapsed().as_secs_f64()),
                },
                e => e,
            });
        }
        let i = usize::try_from(self.looks - 1).unwrap_or(usize::MAX).min(SOCKET_WAITS_MS.len() - 1);
        log::debug!("migration: {e}; looking again in {} ms", SOCKET_WAITS_MS[i]);
        std::thread::sleep(Duration::from_millis(SOCKET_WAITS_MS[i]));
        Ok(())
    }
}

/// Freeze the tree `pid` is the root of at a moment none of its processes
/// holds a socket (thawed and looked at again after a while, as `wait`
/// allows): the frozen processes, the tree, and when the last freeze began.
fn freeze_movable(pid: i32, opts: &CaptureOptions, wait: &mut SocketWait) -> Result<(Vec<Frozen>, Vec<Member>, Instant)> {
    loop {
        let freezing_at = Instant::now();
        let (frozen, members) = freeze_tree(pid)?;
        let pids: Vec<i32> = members.iter().map(|m| m.pid).collect();
        match held_socket(&pids, opts) {
            Ok(()) => return Ok((frozen, members, freezing_at)),
            Err(e) => {
                // Children first, as `finish` kills them.
                for f in frozen.into_iter().rev() {
                    f.thaw()?;
                }
                wait.again(e)?;
            }
        }
    }
}

/// The tree `pid` is the root of, once nothing in it is unmovable, looked
/// at again while only a socket is (as `wait` allows).
fn precheck_movable(pid: i32, opts: &CaptureOptions, wait: &mut SocketWait) -> Result<Vec<Member>> {
    loop {
        match precheck(pid, opts) {
            Ok(members) => return Ok(members),
            Err(e) => wait.again(e)?,
        }
    }
}

/// What the caller adds to a migration (its task's files, its I/O).
pub trait SourceHooks {
    /// Before pre-copy: what the target prepares from (sent first).
    fn prepare(&mut self) -> std::result::Result<Vec<u8>, String>;
    /// The process is frozen: stop its I/O here, and what else must travel.
    fn at_freeze(&mut self) -> std::result::Result<Vec<u8>, String>;
    /// The target runs the process now.
    fn resumed(&mut self);
}

/// What a migration did, as the source saw it.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct SourceReport {
    pub threads: usize,
    /// Pre-copy rounds sent after the first copy (a last round found
    /// not shrinking is not sent: see [`RoundEnd::StopUnsent`]).
    pub rounds: u32,
    /// Pages of the process to move at the first copy (its resident
    /// anonymous footprint).
    pub footprint_pages: u64,
    pub precopy_pages: u64,
    /// Pages sent while frozen.
    pub freeze_pages: u64,
    /// Pages the target fetched from the page server afterwards.
    pub postcopy_pages: u64,
    /// Pages that reached the target after the switch when it held them
    /// already (fetched by a fault and pushed by the drain both, say).
    pub discarded_pages: u64,
    /// Bytes of page data and frames sent, page-server replies included.
    pub bytes: u64,
    /// Freeze → the target reports the process running.
    pub pause_ms: f64,
    /// Start → the source holds nothing.
    pub total_ms: f64,
    /// Faults the target served after the switch, and their service time
    /// (upper bounds in µs of the median's and the 99th percentile's
    /// power-of-two buckets).
    pub postcopy_faults: u64,
    pub fault_p50_us: Option<u64>,
    pub fault_p99_us: Option<u64>,
    /// Where the pause went, in order: the source's steps while the process
    /// is frozen, then the target's until it runs (named, in ms).
    pub phases_ms: Vec<(String, f64)>,
}

/// What pre-copy does with the pages a round found written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundEnd {
    /// Send them and scan again.
    Continue,
    /// Send them, then freeze: few enough are left, or the rounds are used up.
    SendAndStop,
    /// Freeze without sending them: the set is not clearly smaller than the
    /// round before's, so the process writes its memory about as fast as a
    /// round sends it (or faster), and more rounds would re-send the same
    /// pages without end. They go once, at the freeze or after the switch.
    StopUnsent,
}

/// P.Haul's rule, for the round that found `counts.last()` written pages:
/// `counts[0]` is the first copy's pages, `counts[i]` round i's written
/// pages. Stop when the set stops shrinking: a round that found at least
/// 90% of the round before's pages has not shrunk. Equal rounds must stop
/// as growing ones do (a sweep that rewrites all memory in less than a
/// round found everything written round after round, and re-sent it all,
/// for 8 rounds). Otherwise go on until `converged_pages` or `max_rounds`.
pub fn after_round(counts: &[usize], max_rounds: u32, converged_pages: usize) -> RoundEnd {
    let (Some(&now), Some(&before)) = (counts.last(), counts.len().checked_sub(2).and_then(|i| counts.get(i))) else {
        return RoundEnd::Continue;
    };
    if now <= converged_pages {
        RoundEnd::SendAndStop
    } else if now.saturating_mul(10) >= before.saturating_mul(9) {
        RoundEnd::StopUnsent
    } else if counts.len() > usize::try_from(max_rounds).unwrap_or(usize::MAX) {
        RoundEnd::SendAndStop
    } else {
        RoundEnd::Continue
    }
}

/// Pages of `regions` the image would fetch (anonymous or written).
fn fetch_pages(regions: &[Region]) -> Vec<u64> {
    let mut out = Vec::new();
    for r in regions {
        let mut addr = r.start;
        for &(class, n) in &r.pages.0 {
            if class == PageClass::Fetch {
                out.extend((0..u64::from(n)).map(|i| addr + i * PAGE_SIZE));
            }
            addr += u64::from(n) * PAGE_SIZE;
        }
    }
    out
}

/// Pages of `regions` the image would fetch that `tracker` does not see
/// written: none of a region it tracks whole, so this is cheap however much
/// memory the process has.
fn untracked_fetch_pages(regions: &[Region], tracker: &DirtyTracker) -> Vec<u64> {
    let partly: Vec<Region> = regions.iter().filter(|r| !tracker.tracks_range(r.start, r.end)).cloned().collect();
    fetch_pages(&partly).into_iter().filter(|&a| !tracker.tracks(a)).collect()
}

/// Read `addrs` from `pid` (process `process` of the tree) and send them
/// in batches; returns bytes sent.
fn send_pages(pid: i32, process: u32, addrs: &[u64], w: &mut StreamWriter<TcpStream>) -> Result<u64> {
    let mut bytes = 0;
    let mut buf = vec![0u8; BATCH_PAGES * PAGE_BYTES];
    for batch in addrs.chunks(BATCH_PAGES) {
        let data = &mut buf[..batch.len() * PAGE_BYTES];
        let local = [libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() }];
        let remote: Vec<libc::iovec> =
            batch.iter().map(|&a| libc::iovec { iov_base: a as *mut libc::c_void, iov_len: PAGE_BYTES }).collect();
        // SAFETY: reads into our own buffer of exactly the requested size.
        let n = unsafe { libc::process_vm_readv(pid, local.as_ptr(), 1, remote.as_ptr(), remote.len() as libc::c_ulong, 0) };
        if usize::try_from(n).ok() != Some(data.len()) {
            // A page went away (unmapped meanwhile): send what is there page
            // by page; a missing one is simply not staged.
            let mut addrs_ok = Vec::new();
            let mut ok = Vec::new();
            for (i, &a) in batch.iter().enumerate() {
                let page = &mut data[i * PAGE_BYTES..(i + 1) * PAGE_BYTES];
                let l = [libc::iovec { iov_base: page.as_mut_ptr().cast(), iov_len: page.len() }];
                let r = [libc::iovec { iov_base: a as *mut libc::c_void, iov_len: page.len() }];
                // SAFETY: as above, one page.
                let got = unsafe { libc::process_vm_readv(pid, l.as_ptr(), 1, r.as_ptr(), 1, 0) };
                if usize::try_from(got).ok() == Some(page.len()) {
                    addrs_ok.push(a);
                    ok.extend_from_slice(page);
                }
            }
            if n < 0 && addrs_ok.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return Err(MigrateError::Gone(pid));
            }
            bytes += ok.len() as u64;
            wire::send(w, &ToTarget::Pages { process, addrs: addrs_ok, data: ok })?;
            continue;
        }
        bytes += data.len() as u64;
        wire::send(w, &ToTarget::Pages { process, addrs: batch.to_vec(), data: data.to_vec() })?;
    }
    Ok(bytes)
}

/// Writable private memory: what the process can change while it runs.
fn writable_ranges(regions: &[Region]) -> Vec<(u64, u64)> {
    regions
        .iter()
        .filter(|r| r.prot & 2 != 0 && !r.shared && matches!(r.kind, RegionKind::Anonymous { .. } | RegionKind::File { .. }))
        .map(|r| (r.start, r.end))
        .collect()
}

/// What pre-copy did for one process of the tree.
struct Tracked {
    pid: i32,
    /// None once its tracking was lost: it ran `execve` (a shell's last
    /// command, a forked child becoming its program), whose new memory the
    /// tracker does not see. Everything sent for it is then stale.
    tracker: Option<DirtyTracker>,
    /// Pages the target holds (sent while it ran, not dropped since).
    sent: HashSet<u64>,
    /// Pages found written by the first copy's probe ([`first_copy`]): the
    /// next scan's too (the probe's scans protected them again).
    carried: Vec<u64>,
}

impl Tracked {
    /// Pages written since the last scan (ascending); none once tracking is
    /// lost. A process gone is the root's end (`Gone`), else the move's failure.
    fn scan(&mut self) -> Result<Vec<u64>> {
        let carried = std::mem::take(&mut self.carried);
        let Some(t) = &self.tracker else { return Ok(Vec::new()) };
        match t.scan() {
            Ok(mut written) if !carried.is_empty() => {
                written.extend(carried);
                written.sort_unstable();
                written.dedup();
                Ok(written)
            }
            Ok(written) => Ok(written),
            Err(e) if std::path::Path::new(&format!("/proc/{}/exe", self.pid)).exists() => {
                log::info!("pid {}: write tracking lost ({e}): it ran another program; its memory moves after the switch", self.pid);
                self.tracker = None;
                Ok(Vec::new())
            }
            Err(e) => Err(e),
        }
    }
}

/// A process's first copy probes how fast it writes when it has at least
/// this many pages to send (16 MiB); a smaller one is simply sent.
const PROBE_FROM_PAGES: usize = 4096;
/// The probe: the first sixteenth of the first copy, 4 MiB to 32 MiB.
const PROBE_MIN_PAGES: usize = 1024;
const PROBE_MAX_PAGES: usize = 8192;

/// What the first copy of a process did.
struct FirstCopy {
    bytes: u64,
    /// The pages sent, in order: all of them, or the probe's when the rest was cut.
    sent: usize,
    cut: bool,
}

/// Whether a first copy of `pages` pages should stop after its probe,
/// which sent `probe_pages` pages in `send`: by its end `written_pages`
/// pages were found written since tracking began, `new_pages` of them in
/// the last `write` of it. The copy would take `pages / probe_pages` times
/// `send`; when the process writes half of the pages or more by then
/// (already, or at the pace of its new pages), those would go twice (once
/// before the switch, once after) where post-copy alone sends each once.
/// (A process that rewrites the same few pages again and again writes no
/// new ones, and is copied as before.)
pub fn cut_first_copy(pages: usize, written_pages: usize, probe_pages: usize, send: Duration, new_pages: usize, write: Duration) -> bool {
    if written_pages.saturating_mul(2) >= pages {
        return true;
    }
    if probe_pages == 0 || write.is_zero() || send.is_zero() {
        return false;
    }
    // new / write * (pages / probe * send) >= pages / 2, in integers.
    let wide = |n: usize| u128::try_from(n).unwrap_or(u128::MAX);
    wide(new_pages).saturating_mul(send.as_micros()).saturating_mul(2) >= wide(probe_pages).saturating_mul(write.as_micros())
}

/// The first copy of `t`'s process (`first`: every page to fetch, its
/// tracking armed before they were listed): a large one sends its first part in
/// two halves, scanning after each, and stops there when the process would
/// rewrite most of the copy while it is sent ([`cut_first_copy`]).
fn first_copy(t: &mut Tracked, index: u32, first: &[u64], w: &mut StreamWriter<TcpStream>) -> Result<FirstCopy> {
    if first.len() < PROBE_FROM_PAGES {
        return Ok(FirstCopy { bytes: send_pages(t.pid, index, first, w)?, sent: first.len(), cut: false });
    }
    let probe = (first.len() / 16).clamp(PROBE_MIN_PAGES, PROBE_MAX_PAGES);
    let half = probe / 2;
    let started = Instant::now();
    let mut bytes = send_pages(t.pid, index, &first[..half], w)?;
    let before = t.scan()?;
    let halfway = Instant::now();
    bytes += send_pages(t.pid, index, &first[half..probe], w)?;
    let after = t.scan()?;
    let ended = Instant::now();
    let seen: HashSet<u64> = before.iter().copied().collect();
    let new_pages = after.iter().filter(|a| !seen.contains(a)).count();
    let written = before.len() + new_pages;
    let (send, write) = (ended - started, ended - halfway);
    t.carried = before;
    t.carried.extend(after);
    let cut = cut_first_copy(first.len(), written, probe, send, new_pages, write);
    log::info!(
        "pid {}: first copy probe: {probe} of {} pages sent in {:.0} ms, {written} pages written, {new_pages} new ones in the last {:.0} ms{}",
        t.pid,
        first.len(),
        send.as_secs_f64() * 1e3,
        write.as_secs_f64() * 1e3,
        if cut { ": the rest goes after the switch" } else { "" }
    );
    if cut {
        return Ok(FirstCopy { bytes, sent: probe, cut });
    }
    bytes += send_pages(t.pid, index, &first[probe..], w)?;
    Ok(FirstCopy { bytes, sent: first.len(), cut })
}

/// Arm write tracking in `pid` (a short freeze to inject the userfaultfd).
fn arm(pid: i32, region_opts: RegionOptions) -> Result<DirtyTracker> {
    let untracked = RegionOptions { own_write_tracking: false, ..region_opts };
    let f = Frozen::freeze(pid)?;
    let ranges = writable_ranges(&dump_regions(pid, untracked)?);
    let inj = Injector::new(&f)?;
    let t = DirtyTracker::arm(&f, &inj, &ranges)?;
    inj.finish()?;
    f.thaw()?;
    Ok(t)
}

/// Move process `pid` and the processes descending from it (its tree:
/// they move together) to the target at the other end of `conn` (proven
/// with the move's key: `page_server::prove_client`, then `halves`).
///
/// Before the freeze any failure leaves the processes running here; after
/// the target reported them running, the processes here are killed whatever
/// happens (they must never run twice).
pub fn migrate_out(pid: i32, conn: Halves, opts: &SourceOptions, hooks: &mut dyn SourceHooks) -> Result<SourceReport> {
    let start = Instant::now();
    let mut report = SourceReport::default();
    let members = precheck_movable(pid, &opts.capture, &mut SocketWait::new(opts.socket_looks))?;
    let (mut reader, mut w) = conn;
    let payload = hooks.prepare().map_err(|reason| MigrateError::Hook { stage: "prepare", reason })?;
    wire::send(&mut w, &ToTarget::Prepare { payload })?;

    let region_opts = RegionOptions { heuristics: opts.capture.heuristics, stack_pointer: 0, check_inode: false, own_write_tracking: true };
    if opts.stop_and_copy {
        return stop_and_copy(&mut reader, &mut w, opts, hooks, start, report, pid);
    }
    // Pre-copy per process of the tree as it was at the start; one started
    // later has no tracker and all of its memory is fetched after the switch.
    let mut tracked = Vec::with_capacity(members.len());
    let mut cut = false;
    for (i, m) in members.iter().enumerate() {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let tracker = match arm(m.pid, region_opts) {
            Ok(t) => t,
            // A child that ended or changed meanwhile moves without pre-copy (or is refused at the freeze).
            Err(e) if i > 0 => {
                log::info!("pid {}: no pre-copy: {e}", m.pid);
                continue;
            }
            Err(e) => return Err(e),
        };
        // Round 0: everything there is to fetch (or its first part: see `first_copy`).
        let mut first = fetch_pages(&dump_regions(m.pid, region_opts)?);
        let mut t = Tracked { pid: m.pid, tracker: Some(tracker), sent: HashSet::new(), carried: Vec::new() };
        let copied = first_copy(&mut t, index, &first, &mut w)?;
        report.footprint_pages += first.len() as u64;
        report.bytes += copied.bytes;
        report.precopy_pages += copied.sent as u64;
        cut |= copied.cut;
        first.truncate(copied.sent);
        t.sent = first.into_iter().collect();
        tracked.push((index, t));
    }
    // Rounds: what was written meanwhile, until it stops shrinking (none
    // after a first copy cut short: it would be rewritten as it goes).
    let mut counts = vec![tracked.iter().map(|(_, t)| t.sent.len()).sum::<usize>()];
    // (counts[i] is round i's: the rule below stops at max_rounds; with 0 none runs.)
    while !cut && counts.len() <= usize::try_from(opts.max_rounds).unwrap_or(usize::MAX) {
        let mut found = Vec::with_capacity(tracked.len());
        for (_, t) in &mut tracked {
            found.push(t.scan()?);
        }
        counts.push(found.iter().map(Vec::len).sum());
        let end = after_round(&counts, opts.max_rounds, opts.converged_pages);
        if end == RoundEnd::StopUnsent {
            // Written as fast as a round sends it: sending it again would
            // only be overwritten again. It goes once, at the freeze or
            // after. The target drops its copies now, not in the pause.
            for ((index, t), written) in tracked.iter_mut().zip(found) {
                let stale: Vec<u64> = written.into_iter().filter(|a| t.sent.remove(a)).collect();
                for addrs in stale.chunks(STALE_BATCH) {
                    wire::send(&mut w, &ToTarget::Stale { process: *index, addrs: addrs.to_vec() })?;
                }
            }
            break;
        }
        report.rounds += 1;
        for ((index, t), written) in tracked.iter_mut().zip(found) {
            report.bytes += send_pages(t.pid, *index, &written, &mut w)?;
            report.precopy_pages += written.len() as u64;
            t.sent.extend(written.iter().copied());
        }
        if end == RoundEnd::SendAndStop {
            break;
        }
    }

    // The memory maps and page classes, read while they run (this walks
    // their page tables): frozen, only what changed since is read again.
    let mut ahead: Vec<ReadAhead> = tracked
        .iter()
        .filter_map(|(_, t)| {
            let tracked = t.tracker.as_ref()?.ranges().to_vec();
            let layout = Layout::read(t.pid).ok()?;
            let regions = regions_of(t.pid, &layout, region_opts).ok()?;
            Some(ReadAhead { pid: t.pid, layout, regions, tracked, written: Vec::new() })
        })
        .collect();
    wait_prepared(&mut reader)?;
    // Freeze: from here the pause runs.
    let (frozen, members, freezing_at) = freeze_movable(pid, &opts.capture, &mut SocketWait::new(opts.socket_looks))?;
    let frozen_at = Instant::now();
    report.threads = frozen.iter().map(|f| f.tids.len()).sum();
    let mut written = Vec::with_capacity(tracked.len());
    for (_, t) in &mut tracked {
        let pages = t.scan()?;
        match ahead.iter_mut().find(|a| a.pid == t.pid) {
            // Tracking lost at this scan: what was read ahead may be stale.
            _ if t.tracker.is_none() => ahead.retain(|a| a.pid != t.pid),
            Some(a) => {
                a.written.clone_from(&pages);
                a.written.sort_unstable();
            }
            None => {}
        }
        written.push(pages);
    }
    let scanned_at = Instant::now();
    let desc = capture(&frozen, &members, &opts.capture, &ahead)?;
    let captured_at = Instant::now();
    let payload = hooks.at_freeze().map_err(|reason| MigrateError::Hook { stage: "freeze", reason })?;
    let handed_at = Instant::now();
    // Per process: pages the target holds that are no longer what the
    // process has: written since they were sent, or in memory nobody
    // tracked (all of them when its tracking was lost).
    let mut stale = Vec::with_capacity(members.len());
    let mut servers = Vec::with_capacity(members.len());
    for (i, ((m, image), f)) in members.iter().zip(desc.processes()).zip(&frozen).enumerate() {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let mut fresh = Vec::new();
        // Pre-copy's staging for this process, if it had any: the same PID
        // at the same index of the tree.
        let mut lost = Vec::new();
        if let Some(((_, t), written)) = tracked.iter().zip(&written).find(|((at, t), _)| *at == index && t.pid == m.pid) {
            match &t.tracker {
                Some(tracker) => {
                    fresh.extend(written.iter().copied().filter(|a| t.sent.contains(a)));
                    fresh.extend(untracked_fetch_pages(&image.1.regions, tracker).into_iter().filter(|a| t.sent.contains(a)));
                    fresh.sort_unstable();
                    fresh.dedup();
                }
                None => lost = t.sent.iter().copied().collect(),
            }
        } else if let Some((_, t)) = tracked.iter().find(|(at, _)| *at == index) {
            // Another process at this index now (the tree changed): nothing staged for it is its.
            lost = t.sent.iter().copied().collect();
        }
        if !lost.is_empty() {
            stale.push(lost);
        } else if fresh.len() <= opts.freeze_send_pages {
            report.bytes += send_pages(m.pid, index, &fresh, &mut w)?;
            report.freeze_pages += fresh.len() as u64;
            stale.push(Vec::new());
        } else {
            stale.push(fresh);
        }
        servers.push(serve_pages(f, image.1, opts)?);
    }
    let page_servers = servers.iter().map(|s| s.addr().to_string()).collect();
    wire::send(&mut w, &ToTarget::Image { descriptor: desc.encode(), stale, page_servers, payload })?;
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let sent_at = Instant::now();
    report.phases_ms = vec![
        ("freeze".into(), ms(freezing_at, frozen_at)),
        ("dirty scan".into(), ms(frozen_at, scanned_at)),
        ("capture".into(), ms(scanned_at, captured_at)),
        ("hand-over".into(), ms(captured_at, handed_at)),
        ("last pages + image".into(), ms(handed_at, sent_at)),
    ];
    log::info!("pid {pid}: {} processes frozen: {:?}", members.len(), report.phases_ms);
    let trackers = tracked.into_iter().filter_map(|(_, t)| t.tracker).collect();

    finish(Held { frozen, trackers }, &mut reader, servers, hooks, freezing_at, start, report)
}

/// A page server for frozen process `f`'s memory (`image`: its descriptor).
fn serve_pages(f: &Frozen, image: &starling_image::Descriptor, opts: &SourceOptions) -> Result<PageServer> {
    let served: Vec<(u64, u64)> =
        image.regions.iter().filter(|r| r.pages.count(PageClass::Fetch) > 0).map(|r| (r.start, r.end)).collect();
    let server_opts = PageServerOptions { mcdist: starling_mcdist::Switch::Off, ticket: None, descriptor: Vec::new(), key: opts.key, encrypt: opts.encrypt };
    Ok(PageServer::start_with(f.pid, served, SocketAddr::new(opts.page_server_ip, 0), server_opts)?)
}

/// The baseline: freeze, send every page, resume there.
fn stop_and_copy(
    reader: &mut StreamReader<TcpStream>,
    w: &mut StreamWriter<TcpStream>,
    opts: &SourceOptions,
    hooks: &mut dyn SourceHooks,
    start: Instant,
    mut report: SourceReport,
    pid: i32,
) -> Result<SourceReport> {
    wait_prepared(reader)?;
    // The pause runs from the first thread stopped.
    let (frozen, members, frozen_at) = freeze_movable(pid, &opts.capture, &mut SocketWait::new(opts.socket_looks))?;
    report.threads = frozen.iter().map(|f| f.tids.len()).sum();
    let desc = capture(&frozen, &members, &opts.capture, &[])?;
    let payload = hooks.at_freeze().map_err(|reason| MigrateError::Hook { stage: "freeze", reason })?;
    let mut servers = Vec::with_capacity(frozen.len());
    for (i, (f, (_, image))) in frozen.iter().zip(desc.processes()).enumerate() {
        let pages = fetch_pages(&image.regions);
        report.footprint_pages += pages.len() as u64;
        report.bytes += send_pages(f.pid, u32::try_from(i).unwrap_or(u32::MAX), &pages, w)?;
        report.freeze_pages += pages.len() as u64;
        servers.push(serve_pages(f, image, opts)?);
    }
    let page_servers = servers.iter().map(|s| s.addr().to_string()).collect();
    let stale = vec![Vec::new(); frozen.len()];
    wire::send(w, &ToTarget::Image { descriptor: desc.encode(), stale, page_servers, payload })?;
    finish(Held { frozen, trackers: Vec::new() }, reader, servers, hooks, frozen_at, start, report)
}

/// Wait until the target has what the restore needs besides memory (its
/// file view, the mapped files' bytes): that work stays out of the pause.
fn wait_prepared(reader: &mut StreamReader<TcpStream>) -> Result<()> {
    match wire::recv::<ToSource>(reader) {
        Ok(ToSource::Prepared) => Ok(()),
        Ok(ToSource::Failed { reason }) => Err(MigrateError::TargetFailed(reason)),
        Ok(other) => Err(MigrateError::TargetFailed(format!("unexpected {other:?} before the freeze"))),
        Err(e) => Err(MigrateError::TargetFailed(e.to_string())),
    }
}

/// After the image went: wait for the target to run the process, serve it
/// until it holds everything, then end it here.
/// The frozen processes and their write tracking, kept until they are
/// killed: a tracker's userfaultfd closed while its process lives takes the
/// write protection off every page it tracks (a walk of its page tables,
/// ~25 ms per 512 MiB, which was in the pause), and costs nothing once the
/// process is gone. (Dropped before the switch, the processes are let go
/// first, then their tracking.)
struct Held {
    frozen: Vec<Frozen>,
    trackers: Vec<DirtyTracker>,
}

fn finish(
    held: Held,
    reader: &mut StreamReader<TcpStream>,
    mut servers: Vec<PageServer>,
    hooks: &mut dyn SourceHooks,
    frozen_at: Instant,
    start: Instant,
    mut report: SourceReport,
) -> Result<SourceReport> {
    // The target restores; until it says so, the processes are still ours.
    let sent_at = Instant::now();
    match wire::recv::<ToSource>(reader) {
        Ok(ToSource::Resumed { phases_ms }) => {
            report.phases_ms.extend(phases_ms.into_iter().map(|(name, t)| (format!("target: {name}"), t)));
            report.phases_ms.push(("image sent to resumed (as the source saw it)".into(), sent_at.elapsed().as_secs_f64() * 1e3));
        }
        Ok(ToSource::Failed { reason }) => return Err(MigrateError::TargetFailed(reason)),
        Ok(other) => return Err(MigrateError::TargetFailed(format!("unexpected {other:?}"))),
        Err(e) => return Err(MigrateError::TargetFailed(e.to_string())),
    }
    report.pause_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
    hooks.resumed();
    // They run there now: whatever happens next, they must not run here again.
    let end = wire::recv::<ToSource>(reader);
    for server in &mut servers {
        let served = server.wire_stats();
        report.postcopy_pages += served.pages_served;
        report.bytes += served.bytes_tcp;
        server.stop();
    }
    // Children first: none is re-parented or reaped before it is gone.
    let Held { frozen, trackers } = held;
    for f in frozen.into_iter().rev() {
        f.kill();
    }
    drop(trackers);
    report.total_ms = start.elapsed().as_secs_f64() * 1e3;
    match end {
        Ok(ToSource::Complete { faults, fault_p50_us, fault_p99_us, discarded_pages, .. }) => {
            (report.postcopy_faults, report.fault_p50_us, report.fault_p99_us) = (faults, fault_p50_us, fault_p99_us);
            report.discarded_pages = discarded_pages;
            Ok(report)
        }
        Ok(ToSource::Failed { reason }) => Err(MigrateError::LostAfterSwitch(reason)),
        Ok(other) => Err(MigrateError::LostAfterSwitch(format!("unexpected {other:?}"))),
        Err(e) => Err(MigrateError::LostAfterSwitch(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::{after_round, RoundEnd};

    // P.Haul's 8 rounds, converged at 64 pages, as `SourceOptions::new`.
    fn end(counts: &[usize]) -> RoundEnd {
        after_round(counts, 8, 64)
    }

    #[test]
    fn shrinking_rounds_go_on_until_few_pages_are_left() {
        assert_eq!(end(&[16411, 2300]), RoundEnd::Continue);
        assert_eq!(end(&[16411, 2300, 400]), RoundEnd::Continue);
        assert_eq!(end(&[16411, 2300, 400, 64]), RoundEnd::SendAndStop);
        // Few pages stop it even when they did not shrink.
        assert_eq!(end(&[100, 60]), RoundEnd::SendAndStop);
    }

    #[test]
    fn a_round_as_large_as_the_one_before_stops_unsent() {
        // 64 MiB rewritten by a 100 MiB/s sweep during every round.
        assert_eq!(end(&[16411, 16389]), RoundEnd::StopUnsent);
        assert_eq!(end(&[1000, 500, 500]), RoundEnd::StopUnsent);
        assert_eq!(end(&[1000, 500, 600]), RoundEnd::StopUnsent);
        // 90% of the round before is not clearly smaller; 89% is.
        assert_eq!(end(&[1000, 900]), RoundEnd::StopUnsent);
        assert_eq!(end(&[1000, 890]), RoundEnd::Continue);
    }

    #[test]
    fn the_last_round_allowed_is_sent_and_stops() {
        assert_eq!(after_round(&[10000, 5000, 2500], 3, 64), RoundEnd::Continue);
        assert_eq!(after_round(&[10000, 5000, 2500, 1250], 3, 64), RoundEnd::SendAndStop);
        assert_eq!(end(&[1 << 20, 1 << 19, 1 << 18, 1 << 17, 1 << 16, 1 << 15, 1 << 14, 1 << 13]), RoundEnd::Continue);
        assert_eq!(end(&[1 << 20, 1 << 19, 1 << 18, 1 << 17, 1 << 16, 1 << 15, 1 << 14, 1 << 13, 1 << 12]), RoundEnd::SendAndStop);
        // Not shrinking wins over the last round: it is not sent.
        assert_eq!(after_round(&[10000, 5000, 2500, 2400], 3, 64), RoundEnd::StopUnsent);
    }

    #[test]
    fn a_first_copy_stops_after_its_probe_when_most_of_it_would_be_rewritten_meanwhile() {
        use super::cut_first_copy;
        use std::time::Duration;
        let ms = Duration::from_millis;
        // 64 MiB (16384 pages), a probe of 1024 sent in 40 ms (25600 pages/s: 100 MiB/s; the
        // copy would take 640 ms), new pages found in its last 20 ms: at 100 MiB/s (512 of them)
        // the whole copy is rewritten as it goes.
        assert!(cut_first_copy(16384, 1200, 1024, ms(40), 512, ms(20)));
        // 10 MiB/s (51): a tenth of it, copied as before.
        assert!(!cut_first_copy(16384, 120, 1024, ms(40), 51, ms(20)));
        // Half of it is the bound.
        assert!(cut_first_copy(16384, 600, 1024, ms(40), 256, ms(20)));
        assert!(!cut_first_copy(16384, 600, 1024, ms(40), 255, ms(20)));
        // A few pages rewritten again and again are no new ones.
        assert!(!cut_first_copy(16384, 300, 1024, ms(40), 0, ms(20)));
        // A sweep faster than the probe: every page written already, none new since.
        assert!(cut_first_copy(16384, 16384, 1024, ms(40), 0, ms(20)));
        assert!(cut_first_copy(16384, 8192, 1024, ms(40), 0, ms(20)));
        assert!(!cut_first_copy(16384, 8191, 1024, ms(40), 0, ms(20)));
        // Nothing measured: no cut.
        assert!(!cut_first_copy(16384, 0, 0, Duration::ZERO, 0, Duration::ZERO));
    }

    #[test]
    fn a_first_copy_alone_goes_on() {
        assert_eq!(end(&[16411]), RoundEnd::Continue);
        assert_eq!(end(&[]), RoundEnd::Continue);
    }
}
