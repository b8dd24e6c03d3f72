//! A simulated template and simulated clones, for the tests and the bench:
//! a [`SyntheticImage`] (deterministic page contents, some all-zero pages)
//! served by a [`starling_mcdist::Sender`], and [`MemoryClone`]s that install pages
//! like a clone's userfaultfd would (first copy wins; later ones are
//! "EEXIST") and run a page-touch workload like a fault handler with
//! prefetch would.

use starling_mcdist::{Fetched, PageSink, Receiver, ReceiverConfig};
use starling_mcdist::{RateSample, Sender, SenderConfig};
use super::netlab::{enter, Lab};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use starling_mcdist::{PageSource, SourcePage};
use starling_mcdist::{McdistError, PAGE_SIZE};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How a simulated clone gets a batch of pages.
type FetchFn<'a> = dyn FnMut(&[u64]) -> Result<Vec<Fetched>, McdistError> + 'a;

/// Page contents derived from (seed, address); every 7th page is all zero.
#[derive(Clone)]
pub struct SyntheticImage {
    pub regions: Vec<(u64, u64)>,
    pub seed: u64,
}

impl SyntheticImage {
    pub fn new(regions: Vec<(u64, u64)>, seed: u64) -> SyntheticImage {
        SyntheticImage { regions, seed }
    }

    pub fn page(&self, addr: u64) -> Vec<u8> {
        let mut out = vec![0u8; starling_mcdist::wire::PAGE];
        if (addr / PAGE_SIZE) % 7 == 3 {
            return out;
        }
        let mut x = self.seed ^ addr.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for chunk in out.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        out
    }

    /// All page addresses, region by region.
    pub fn pages(&self) -> Vec<u64> {
        self.regions.iter().flat_map(|&(s, e)| (s..e).step_by(starling_mcdist::wire::PAGE)).collect()
    }
}

impl PageSource for SyntheticImage {
    fn regions(&self) -> &[(u64, u64)] {
        &self.regions
    }

    fn read(&mut self, addrs: &[u64]) -> Vec<SourcePage> {
        addrs
            .iter()
            .map(|&a| {
                let p = self.page(a);
                if p.iter().all(|&b| b == 0) { SourcePage::Zero } else { SourcePage::Data(p) }
            })
            .collect()
    }
}

/// A clone's memory: pages installed so far.
#[derive(Default)]
pub struct MemoryClone {
    pub pages: Mutex<HashMap<u64, Vec<u8>>>,
}

impl MemoryClone {
    fn install(&self, addr: u64, page: &Fetched) -> bool {
        let data = match page {
            Fetched::Data(d) => d.clone(),
            Fetched::Zero => vec![0u8; starling_mcdist::wire::PAGE],
            Fetched::Unreadable | Fetched::Installed => return false,
        };
        let mut m = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(addr).or_insert(data); // present already: like EEXIST
        true
    }

    pub fn has(&self, addr: u64) -> bool {
        self.pages.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&addr)
    }

    /// Addresses of installed pages whose contents differ from `image`.
    pub fn mismatches(&self, image: &SyntheticImage) -> Vec<u64> {
        let m = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        let mut bad: Vec<u64> = m
            .iter()
            .filter(|(a, d)| blake3::hash(d) != blake3::hash(&image.page(**a)))
            .map(|(a, _)| *a)
            .collect();
        bad.sort();
        bad
    }

    pub fn len(&self) -> usize {
        self.pages.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl PageSink for MemoryClone {
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        pages.iter().map(|(a, p)| self.install(*a, p)).collect()
    }
}

/// What a simulated clone did.
#[derive(Debug, Default, Clone)]
pub struct WorkResult {
    pub faults: u64,
    pub fetches: u64,
    pub pages_touched: usize,
    /// BLAKE3 over the touched pages in touch order (compare with the image's).
    pub checksum: [u8; 32],
}

/// Touch `addrs` in order; a missing page is a fault, served like the fork
/// fault handler does: the page plus up to `prefetch - 1` following missing
/// pages of its region in one fetch.
pub fn run_workload(
    fetch: &mut FetchFn<'_>,
    mem: &MemoryClone,
    image: &SyntheticImage,
    addrs: &[u64],
    prefetch: usize,
) -> Result<WorkResult, McdistError> {
    let mut res = WorkResult::default();
    let mut sum = blake3::Hasher::new();
    for &a in addrs {
        if !mem.has(a) {
            res.faults += 1;
            let end = image.regions.iter().find(|&&(s, e)| s <= a && a < e).map_or(a + PAGE_SIZE, |r| r.1);
            let mut batch = vec![a];
            let mut next = a + PAGE_SIZE;
            while batch.len() < prefetch.max(1) && next < end && !mem.has(next) {
                batch.push(next);
                next += PAGE_SIZE;
            }
            res.fetches += 1;
            let got = fetch(&batch)?;
            for (b, f) in batch.iter().zip(got.iter()) {
                mem.install(*b, f);
            }
        }
        let m = mem.pages.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(&a) {
            Some(p) => sum.update(p),
            None => return Err(McdistError::Timeout { addr: a, waited: std::time::Duration::ZERO }),
        };
        res.pages_touched += 1;
    }
    res.checksum = *sum.finalize().as_bytes();
    Ok(res)
}

/// The checksum `run_workload` must produce for `addrs`.
pub fn expected_checksum(image: &SyntheticImage, addrs: &[u64]) -> [u8; 32] {
    let mut sum = blake3::Hasher::new();
    for &a in addrs {
        sum.update(&image.page(a));
    }
    *sum.finalize().as_bytes()
}

/// Shared handle for a clone's memory.
pub fn new_clone() -> Arc<MemoryClone> {
    Arc::new(MemoryClone::default())
}

/// A minimal unicast page server over TCP (the baseline: every clone gets
/// its own copy of every page). Request: count u32 | count × u64; reply per
/// page: tag u8 (0 zero, 1 data + 4096 bytes).
pub struct UnicastServer {
    pub addr: SocketAddrV4,
    pub pages_sent: Arc<AtomicU64>,
    pub bytes_sent: Arc<AtomicU64>,
}

impl UnicastServer {
    pub fn start(image: SyntheticImage, bind: SocketAddrV4) -> std::io::Result<UnicastServer> {
        let l = TcpListener::bind(bind)?;
        let addr = match l.local_addr()? {
            std::net::SocketAddr::V4(a) => a,
            _ => return Err(std::io::Error::other("not IPv4")),
        };
        let pages_sent = Arc::new(AtomicU64::new(0));
        let bytes_sent = Arc::new(AtomicU64::new(0));
        let (p2, b2) = (pages_sent.clone(), bytes_sent.clone());
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                let (image, p, b) = (image.clone(), p2.clone(), b2.clone());
                std::thread::spawn(move || -> std::io::Result<()> {
                    let _ = c.set_nodelay(true);
                    loop {
                        let mut n = [0u8; 4];
                        c.read_exact(&mut n)?;
                        let n = u32::from_le_bytes(n).min(1024) as usize;
                        let mut raw = vec![0u8; 8 * n];
                        c.read_exact(&mut raw)?;
                        let mut out = Vec::with_capacity(n * 4097);
                        for a in raw.chunks_exact(8) {
                            let a = u64::from_le_bytes(a.try_into().expect("8 bytes"));
                            let page = image.page(a);
                            if page.iter().all(|&x| x == 0) {
                                out.push(0);
                            } else {
                                out.push(1);
                                out.extend_from_slice(&page);
                            }
                        }
                        p.fetch_add(n as u64, Ordering::Relaxed);
                        b.fetch_add(out.len() as u64, Ordering::Relaxed);
                        c.write_all(&out)?;
                    }
                });
            }
        });
        Ok(UnicastServer { addr, pages_sent, bytes_sent })
    }
}

/// Fetch from a [`UnicastServer`].
pub fn unicast_fetch(conn: &mut TcpStream, addrs: &[u64]) -> Result<Vec<Fetched>, McdistError> {
    let io = |e| McdistError::io("unicast fetch", e);
    let mut req = u32::try_from(addrs.len()).expect("a batch fits").to_le_bytes().to_vec();
    for a in addrs {
        req.extend_from_slice(&a.to_le_bytes());
    }
    conn.write_all(&req).map_err(io)?;
    let mut out = Vec::with_capacity(addrs.len());
    for _ in addrs {
        let mut tag = [0u8; 1];
        conn.read_exact(&mut tag).map_err(io)?;
        if tag[0] == 0 {
            out.push(Fetched::Zero);
        } else {
            let mut page = vec![0u8; starling_mcdist::wire::PAGE];
            conn.read_exact(&mut page).map_err(io)?;
            out.push(Fetched::Data(page));
        }
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dist {
    Unicast,
    Multicast,
    MulticastPush,
}

impl Dist {
    pub fn name(self) -> &'static str {
        match self {
            Dist::Unicast => "unicast",
            Dist::Multicast => "multicast",
            Dist::MulticastPush => "multicast+push",
        }
    }
}

/// Everything a scenario measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub dist: Dist,
    pub receivers: usize,
    /// Pages the receivers asked for (sum over receivers, including re-requests).
    pub pages_requested: u64,
    /// Pages the sender sent.
    pub pages_served: u64,
    /// Bytes the sender's interface transmitted (kernel counter).
    pub tx_bytes: u64,
    pub elapsed: Duration,
    /// Per receiver: the workload result or the error.
    pub results: Vec<Result<WorkResult, String>>,
    /// Per receiver: installed pages that differ from the image.
    pub mismatches: Vec<usize>,
    /// Per receiver: pages installed without being asked for.
    pub unsolicited: Vec<u64>,
    pub rerequests: u64,
    pub lockstep_suppressed: u64,
    pub queued_duplicates: u64,
    pub implicit_losses: u64,
    /// Pages the sender pushed (neighbours nobody had asked for yet).
    pub pages_pushed: u64,
    pub trace: Vec<RateSample>,
}

/// Run one distribution scenario on `lab`: a sender serving `image` in the
/// sender namespace, receiver i running `workloads[i]` in namespace i.
pub fn run_scenario(
    lab: &Lab,
    ticket: u64,
    image: &SyntheticImage,
    workloads: &[Vec<u64>],
    dist: Dist,
    tweak_sender: &dyn Fn(&mut SenderConfig),
    tweak_receiver: &dyn Fn(&mut ReceiverConfig),
) -> Result<Outcome, McdistError> {
    let n = workloads.len();
    assert!(n <= lab.receiver_ns.len());
    let group = starling_mcdist::group_for_ticket(ticket);
    let tx0 = lab.sender_tx_bytes().map_err(|e| McdistError::io("tx bytes", e))?;
    enum Server {
        Mc(Sender),
        Uni(UnicastServer),
    }
    let (sns, sip, img) = (lab.sender_ns.clone(), lab.sender_ip, image.clone());
    let key = starling_proto::SecretKey::random();
    let mut scfg = SenderConfig::new(ticket, key, group, sip);
    scfg.push = dist == Dist::MulticastPush;
    tweak_sender(&mut scfg);
    let server = std::thread::spawn(move || -> Result<Server, McdistError> {
        enter(&sns).map_err(|e| McdistError::io("enter sender netns", e))?;
        if dist == Dist::Unicast {
            UnicastServer::start(img, SocketAddrV4::new(sip, 0)).map(Server::Uni).map_err(|e| McdistError::io("unicast server", e))
        } else {
            Sender::start(scfg, Box::new(img)).map(Server::Mc)
        }
    })
    .join()
    .map_err(|_| McdistError::Stopped)??;
    let target = match &server {
        Server::Mc(s) => s.request_addr(),
        Server::Uni(u) => u.addr,
    };
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for (i, w) in workloads.iter().enumerate() {
        let (ns, rip, w, img) = (lab.receiver_ns[i].clone(), lab.receiver_ips[i], w.clone(), image.clone());
        let mut rcfg = ReceiverConfig::new(ticket, key, group, rip, target, u32::try_from(i).expect("a few receivers"));
        tweak_receiver(&mut rcfg);
        handles.push(std::thread::spawn(move || -> (Result<WorkResult, String>, usize, u64, u64, u64) {
            if let Err(e) = enter(&ns) {
                return (Err(format!("enter {ns}: {e}")), 0, 0, 0, 0);
            }
            let mem = new_clone();
            if dist == Dist::Unicast {
                let mut conn = match TcpStream::connect(target) {
                    Ok(c) => c,
                    Err(e) => return (Err(format!("connect: {e}")), 0, 0, 0, 0),
                };
                let _ = conn.set_nodelay(true);
                let mut requested = 0u64;
                let r = run_workload(
                    &mut |a: &[u64]| {
                        requested += a.len() as u64;
                        unicast_fetch(&mut conn, a)
                    },
                    &mem,
                    &img,
                    &w,
                    16,
                );
                let bad = mem.mismatches(&img).len();
                return (r.map_err(|e| e.to_string()), bad, requested, 0, 0);
            }
            let rx = match Receiver::start(rcfg, mem.clone()) {
                Ok(r) => r,
                Err(e) => return (Err(e.to_string()), 0, 0, 0, 0),
            };
            // As the fork's fault handler does: pages the sink installed meanwhile are not asked for.
            let r = run_workload(&mut |a: &[u64]| rx.fetch_unless(a, &|x| mem.has(x)), &mem, &img, &w, 16);
            let st = rx.stats();
            let out = (
                starling_mcdist::ReceiverStats::get(&st.pages_requested),
                starling_mcdist::ReceiverStats::get(&st.pages_installed_unsolicited),
                starling_mcdist::ReceiverStats::get(&st.rerequests),
            );
            drop(rx);
            let bad = mem.mismatches(&img).len();
            (r.map_err(|e| e.to_string()), bad, out.0, out.1, out.2)
        }));
    }
    let mut outcome = Outcome {
        dist,
        receivers: n,
        pages_requested: 0,
        pages_served: 0,
        tx_bytes: 0,
        elapsed: Duration::ZERO,
        results: vec![],
        mismatches: vec![],
        unsolicited: vec![],
        rerequests: 0,
        lockstep_suppressed: 0,
        queued_duplicates: 0,
        implicit_losses: 0,
        pages_pushed: 0,
        trace: vec![],
    };
    for h in handles {
        let (r, bad, req, unsol, rereq) = h.join().unwrap_or_else(|_| (Err("receiver panicked".into()), 0, 0, 0, 0));
        outcome.results.push(r);
        outcome.mismatches.push(bad);
        outcome.pages_requested += req;
        outcome.unsolicited.push(unsol);
        outcome.rerequests += rereq;
    }
    outcome.elapsed = t0.elapsed();
    match server {
        Server::Mc(mut s) => {
            let st = s.stats();
            outcome.pages_served = st.pages_sent.load(Ordering::Relaxed);
            outcome.lockstep_suppressed = st.lockstep_suppressed.load(Ordering::Relaxed);
            outcome.queued_duplicates = st.queued_duplicates.load(Ordering::Relaxed);
            outcome.implicit_losses = st.implicit_losses.load(Ordering::Relaxed);
            outcome.pages_pushed = st.pages_pushed.load(Ordering::Relaxed);
            outcome.trace = s.rate_trace();
            s.stop();
        }
        Server::Uni(u) => outcome.pages_served = u.pages_sent.load(Ordering::Relaxed),
    }
    // Let the last datagrams leave before reading the counter.
    std::thread::sleep(Duration::from_millis(20));
    outcome.tx_bytes = lab.sender_tx_bytes().map_err(|e| McdistError::io("tx bytes", e))?.saturating_sub(tx0);
    Ok(outcome)
}


/// A SHRiMP-like workload: every clone scans the same shared index pages
/// (in the same order, like clones running the same code), plus a few
/// pages of its own slice of the input.
pub fn shrimp_like(image: &SyntheticImage, clone: usize, shared_pages: usize, own_pages: usize) -> Vec<u64> {
    let all = image.pages();
    let shared = &all[..shared_pages.min(all.len())];
    let rest = &all[shared.len()..];
    let mut w: Vec<u64> = shared.to_vec();
    if !rest.is_empty() {
        let start = (clone * own_pages) % rest.len();
        w.extend(rest.iter().cycle().skip(start).take(own_pages.min(rest.len())));
    }
    w
}
