//! The source side: pre-copy while the process runs, freeze, hand over,
//! serve what the target still lacks, and end the process here.

use crate::capture::{capture, freeze_tree, precheck, CaptureOptions, ReadAhead};
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
use std::time::Instant;

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
}

impl SourceOptions {
    pub fn new(capture: CaptureOptions, page_server_ip: IpAddr) -> SourceOptions {
        SourceOptions { capture, max_rounds: 8, converged_pages: 64, freeze_send_pages: 256, page_server_ip, stop_and_copy: false, key: starling_proto::SecretKey::random(), encrypt: true }
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
}

impl Tracked {
    /// Pages written since the last scan; none once tracking is lost. A
    /// process gone is the root's end (`Gone`), else the move's failure.
    fn scan(&mut self) -> Result<Vec<u64>> {
        let Some(t) = &self.tracker else { return Ok(Vec::new()) };
        match t.scan() {
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
    let members = precheck(pid, &opts.capture)?;
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
        // Round 0: everything there is to fetch.
        let first = fetch_pages(&dump_regions(m.pid, region_opts)?);
        report.footprint_pages += first.len() as u64;
        report.bytes += send_pages(m.pid, index, &first, &mut w)?;
        report.precopy_pages += first.len() as u64;
        tracked.push((index, Tracked { pid: m.pid, tracker: Some(tracker), sent: first.into_iter().collect() }));
    }
    // Rounds: what was written meanwhile, until it stops shrinking.
    let mut counts = vec![tracked.iter().map(|(_, t)| t.sent.len()).sum::<usize>()];
    // (counts[i] is round i's: the rule below stops at max_rounds; with 0 none runs.)
    while counts.len() <= usize::try_from(opts.max_rounds).unwrap_or(usize::MAX) {
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
    let freezing_at = Instant::now();
    let (frozen, members) = freeze_tree(pid)?;
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
    drop(tracked);

    finish(frozen, &mut reader, servers, hooks, freezing_at, start, report)
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
    let frozen_at = Instant::now();
    let (frozen, members) = freeze_tree(pid)?;
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
    finish(frozen, reader, servers, hooks, frozen_at, start, report)
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
fn finish(
    frozen: Vec<Frozen>,
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
    for f in frozen.into_iter().rev() {
        f.kill();
    }
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
    fn a_first_copy_alone_goes_on() {
        assert_eq!(end(&[16411]), RoundEnd::Continue);
        assert_eq!(end(&[]), RoundEnd::Continue);
    }
}
