//! The fault handler: serves a clone's userfaultfd (the process-level memtap).
//!
//! It runs outside the clone (a thread of the local backend; later a
//! process of the cluster agent). For each missing-page fault it looks the
//! page up in the descriptor:
//! * `Zero` → `UFFDIO_ZEROPAGE`;
//! * `File` → read from the host's copy of the mapped file, `UFFDIO_COPY`;
//! * `Fetch` → one batched request to the page server for the page and its
//!   not-yet-served `Fetch` neighbours (prefetch), each installed with
//!   `UFFDIO_COPY` (EEXIST — already present — is fine).
//!
//! A per-region state byte per page is the presence bitmap. REMOVE and UNMAP
//! events (MADV_DONTNEED, munmap) turn pages into `Zero`, so a range that the
//! clone discarded reads as zero instead of template data; REMAP events
//! (mremap of registered memory, e.g. realloc) are followed by translating
//! the new addresses back to the template's.

use crate::descriptor::{Descriptor, PageClass, RegionKind};
use crate::page_server::{PageClient, PageReply};
use crate::{ForkError, Result, PAGE_SIZE};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use crate::uffd::{Event, Uffd};

/// Largest number of pages fetched per fault (faulting page + prefetch).
pub const DEFAULT_PREFETCH: usize = 16;

const ST_ZERO: u8 = 0;
const ST_FILE: u8 = 1;
const ST_FETCH: u8 = 2;
const ST_DONE: u8 = 3;

/// Counters of one handler (shared with whoever wants to report them).
#[derive(Default, Debug)]
pub struct FaultStats {
    pub faults: AtomicU64,
    pub pages_fetched: AtomicU64,
    pub pages_zero: AtomicU64,
    pub pages_file: AtomicU64,
    pub fetch_requests: AtomicU64,
    pub events_remove: AtomicU64,
}

impl FaultStats {
    pub fn snapshot(&self) -> [u64; 6] {
        [&self.faults, &self.pages_fetched, &self.pages_zero, &self.pages_file, &self.fetch_requests, &self.events_remove]
            .map(|c| c.load(Ordering::Relaxed))
    }
}

struct HandlerRegion {
    start: u64,
    end: u64,
    state: Vec<u8>,
    /// For File pages: (path, file offset of `start`).
    file: Option<(String, u64)>,
}

pub struct FaultHandler {
    uffd: Uffd,
    regions: Vec<HandlerRegion>,
    files: HashMap<String, std::fs::File>,
    client: PageClient,
    stats: Arc<FaultStats>,
    prefetch: usize,
    /// (new start, len, template start) after REMAP events.
    remaps: Vec<(u64, u64, u64)>,
}

impl FaultHandler {
    pub fn new(uffd: OwnedFd, desc: &Descriptor, client: PageClient, stats: Arc<FaultStats>) -> FaultHandler {
        let uffd = Uffd::new(uffd);
        let regions = desc
            .regions
            .iter()
            .filter(|r| crate::plan::region_plan_kind(r) == starling_restorer::plan::REGION_ANON_REGISTER)
            .map(|r| HandlerRegion {
                start: r.start,
                end: r.end,
                state: r.pages.expand().into_iter().map(|c| match c {
                    PageClass::Zero => ST_ZERO,
                    PageClass::File => ST_FILE,
                    PageClass::Fetch => ST_FETCH,
                }).collect(),
                file: match &r.kind {
                    RegionKind::File { path, offset, .. } => Some((path.clone(), *offset)),
                    _ => None,
                },
            })
            .collect();
        FaultHandler { uffd, regions, files: HashMap::new(), client, stats, prefetch: DEFAULT_PREFETCH, remaps: vec![] }
    }

    pub fn set_prefetch(&mut self, pages: usize) {
        self.prefetch = pages.clamp(1, crate::page_server::MAX_BATCH as usize);
    }

    /// Serve faults until `stop` becomes readable (or hangs up).
    pub fn run(mut self, stop: BorrowedFd<'_>) -> Result<()> {
        loop {
            let mut fds = [
                libc::pollfd { fd: self.uffd.raw(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: polls two fds we hold for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(ForkError::errno("poll userfaultfd"));
            }
            if fds[1].revents != 0 {
                return Ok(());
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                return Ok(());
            }
            loop {
                let ev = match self.uffd.read_event() {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(ForkError::io("read userfaultfd event", e)),
                };
                self.handle(ev)?;
            }
        }
    }

    fn translate(&self, addr: u64) -> u64 {
        for &(new, len, old) in self.remaps.iter().rev() {
            if addr >= new && addr < new + len {
                return old + (addr - new);
            }
        }
        addr
    }

    fn locate(&self, tmpl_addr: u64) -> Option<(usize, usize)> {
        let i = self.regions.partition_point(|r| r.end <= tmpl_addr);
        let r = self.regions.get(i).filter(|r| r.start <= tmpl_addr)?;
        Some((i, ((tmpl_addr - r.start) / PAGE_SIZE) as usize))
    }

    fn mark_range(&mut self, start: u64, end: u64, state: u8) {
        let mut a = start & !(PAGE_SIZE - 1);
        while a < end {
            let t = self.translate(a);
            if let Some((ri, pi)) = self.locate(t) {
                self.regions[ri].state[pi] = state;
            }
            a += PAGE_SIZE;
        }
    }

    fn handle(&mut self, ev: Event) -> Result<()> {
        match ev {
            Event::Pagefault { addr } => {
                self.stats.faults.fetch_add(1, Ordering::Relaxed);
                self.serve_fault(addr & !(PAGE_SIZE - 1))
            }
            Event::Remove { start, end } | Event::Unmap { start, end } => {
                self.stats.events_remove.fetch_add(1, Ordering::Relaxed);
                // Discarded: from now on the range reads as zero.
                self.mark_range(start, end, ST_ZERO);
                Ok(())
            }
            Event::Remap { from, to, len } => {
                let old = self.translate(from);
                self.remaps.push((to, len, old));
                Ok(())
            }
            Event::Fork | Event::Unknown(_) => Ok(()),
        }
    }

    fn zero(&self, addr: u64) -> Result<()> {
        match self.uffd.zeropage(addr, PAGE_SIZE) {
            Ok(()) => Ok(()),
            Err(e) if benign(e) => self.wake(addr),
            Err(e) => Err(ForkError::Other(format!("UFFDIO_ZEROPAGE {addr:#x}: errno {e}"))),
        }
    }

    fn copy(&self, addr: u64, page: &[u8]) -> Result<()> {
        match self.uffd.copy(addr, page) {
            Ok(()) => Ok(()),
            Err(e) if benign(e) => self.wake(addr),
            Err(e) => Err(ForkError::Other(format!("UFFDIO_COPY {addr:#x}: errno {e}"))),
        }
    }

    fn wake(&self, addr: u64) -> Result<()> {
        self.uffd.wake(addr, PAGE_SIZE);
        Ok(())
    }

    fn serve_fault(&mut self, addr: u64) -> Result<()> {
        let t = self.translate(addr);
        let Some((ri, pi)) = self.locate(t) else {
            // Registered memory outside the descriptor (grown stack): zero.
            self.stats.pages_zero.fetch_add(1, Ordering::Relaxed);
            return self.zero(addr);
        };
        match self.regions[ri].state[pi] {
            ST_ZERO | ST_DONE => {
                self.stats.pages_zero.fetch_add(1, Ordering::Relaxed);
                self.regions[ri].state[pi] = ST_DONE;
                self.zero(addr)
            }
            ST_FILE => {
                let (path, off) = self.regions[ri].file.clone().ok_or_else(|| ForkError::Other("file page without file".into()))?;
                let file_off = off + (t - self.regions[ri].start);
                let mut page = vec![0u8; PAGE_SIZE as usize];
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
                self.regions[ri].state[pi] = ST_DONE;
                self.stats.pages_file.fetch_add(1, Ordering::Relaxed);
                self.copy(addr, &page)
            }
            _ => self.fetch_batch(addr, ri, pi),
        }
    }

    /// Fetch the faulting page plus following not-yet-served Fetch pages of
    /// the same region (in clone addresses, contiguous with `addr`).
    fn fetch_batch(&mut self, addr: u64, ri: usize, pi: usize) -> Result<()> {
        let region = &self.regions[ri];
        let tmpl_base = region.start + pi as u64 * PAGE_SIZE;
        let mut pages = vec![pi];
        let mut j = pi + 1;
        while pages.len() < self.prefetch && j < region.state.len() && region.state[j] == ST_FETCH {
            pages.push(j);
            j += 1;
        }
        let tmpl_addrs: Vec<u64> = pages.iter().map(|&p| region.start + p as u64 * PAGE_SIZE).collect();
        let replies = self.client.fetch(&tmpl_addrs)?;
        self.stats.fetch_requests.fetch_add(1, Ordering::Relaxed);
        self.stats.pages_fetched.fetch_add(pages.len() as u64, Ordering::Relaxed);
        for (k, (p, reply)) in pages.iter().zip(replies).enumerate() {
            let dst = addr + (tmpl_addrs[k] - tmpl_base);
            self.regions[ri].state[*p] = ST_DONE;
            match reply {
                PageReply::Data(d) => self.copy(dst, &d)?,
                PageReply::Zero => self.zero(dst)?,
                PageReply::Unreadable => {
                    return Err(ForkError::Other(format!("template page {:#x} unreadable", tmpl_addrs[k])))
                }
            }
        }
        Ok(())
    }
}

/// Errors that mean "nothing to do": page already present (EEXIST), range
/// gone (ENOENT, after munmap), clone gone (ESRCH).
fn benign(errno: i32) -> bool {
    errno == libc::EEXIST || errno == libc::ENOENT || errno == libc::ESRCH || errno == libc::EAGAIN
}
