//! The sender: answers page requests by multicasting to the ticket's group.
//!
//! One thread owns all state (no locks on the hot path): it waits on the
//! request socket with a timeout computed from the token bucket, drains
//! requests, applies lockstep suppression / implicit-loss detection, and
//! sends queued pages (requested ones first, pushed ones when nothing is
//! requested) as long as the bucket holds tokens. See the crate docs for the
//! flow-control rules.

use crate::wire::{self, DataHeader, Request};
use crate::{McdistError, Result};
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One page as the source sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourcePage {
    Zero,
    Data(Vec<u8>),
    Unreadable,
}

/// Where the sender reads pages from (the frozen template, or a synthetic
/// image in tests).
pub trait PageSource: Send + 'static {
    /// Served regions, [start, end) page-aligned, sorted, disjoint.
    fn regions(&self) -> &[(u64, u64)];
    /// Read the pages at `addrs` (aligned, inside `regions`), one result each.
    fn read(&mut self, addrs: &[u64]) -> Vec<SourcePage>;
}

#[derive(Debug, Clone)]
pub struct SenderConfig {
    pub ticket: u64,
    /// The ticket's key: every datagram is sealed with it, requests must be.
    pub key: starling_proto::SecretKey,
    /// Encrypt page contents (`fork.encrypt`; see [`crate::wire`]).
    pub encrypt: bool,
    /// The ticket's multicast group and port.
    pub group: SocketAddrV4,
    /// Address of the interface to send on (IP_MULTICAST_IF).
    pub interface: Ipv4Addr,
    /// Where to receive requests (port 0: any).
    pub request_bind: SocketAddrV4,
    /// IP MTU of the link (pages are split to fit).
    pub mtu: usize,
    /// Line rate in bytes/s: the ceiling, and the scale of the linear increase.
    pub link_rate: f64,
    /// Rate limit at start, bytes/s.
    pub initial_rate: f64,
    /// Floor of the rate limit, bytes/s.
    pub min_rate: f64,
    /// Increase step per 10 ms, bytes/s (default `link_rate / 100`).
    pub increase_per_10ms: f64,
    /// Push mode: also queue the next `push_pages` pages of a requested page's region.
    pub push: bool,
    pub push_pages: usize,
    /// Bounds of the lockstep window (2 × reported request→arrival time).
    /// The floor (10 ms) covers scheduling delays on loaded hosts: a clone
    /// whose request crossed the multicast copy must not look like a loss.
    pub lockstep_min: Duration,
    pub lockstep_max: Duration,
    pub ttl: u32,
}

impl SenderConfig {
    /// Defaults for a 10 GbE-class bridge.
    pub fn new(ticket: u64, key: starling_proto::SecretKey, group: SocketAddrV4, interface: Ipv4Addr) -> SenderConfig {
        let link_rate = 1.25e9;
        SenderConfig {
            ticket,
            key,
            encrypt: true,
            group,
            interface,
            request_bind: SocketAddrV4::new(interface, 0),
            mtu: 1500,
            link_rate,
            // Start low (50 MB/s on 10 GbE) and let the linear increase find
            // the rate: a burst at line rate to many receivers is lost wholesale.
            initial_rate: link_rate / 25.0,
            min_rate: 1e6,
            increase_per_10ms: link_rate / 100.0,
            push: false,
            push_pages: 16,
            lockstep_min: Duration::from_millis(10),
            lockstep_max: Duration::from_millis(100),
            ttl: 1,
        }
    }
}

/// Counters of a sender.
#[derive(Default, Debug)]
pub struct SenderStats {
    pub requests: AtomicU64,
    pub hellos: AtomicU64,
    /// Receivers that joined: distinct request sockets (source address and
    /// port) that said HELLO. One per clone host when its clones share a
    /// receiver; counted here, from what arrived, not from what they claim.
    pub receivers_joined: AtomicU64,
    pub pages_requested: AtomicU64,
    /// Pages multicast (data + zero + unreadable), including pushed ones.
    pub pages_sent: AtomicU64,
    pub pages_pushed: AtomicU64,
    pub datagrams: AtomicU64,
    /// Pages multicast with data (not zero or unreadable), and the datagrams
    /// they took: one each when the MTU fits a page, else its fragments.
    pub data_pages: AtomicU64,
    pub data_datagrams: AtomicU64,
    /// Bytes on the wire: datagrams + IP/UDP headers.
    pub bytes_wire: AtomicU64,
    /// Requests for a page sent within the lockstep window (not answered).
    pub lockstep_suppressed: AtomicU64,
    /// Requests for a page already queued (not answered twice).
    pub queued_duplicates: AtomicU64,
    /// Requests for a page sent before the lockstep window (re-sent).
    pub implicit_losses: AtomicU64,
    pub rate_cuts: AtomicU64,
    pub invalid: AtomicU64,
    pub send_errors: AtomicU64,
}

impl SenderStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// A point of the rate-limit trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateSample {
    /// Since the sender started.
    pub at: Duration,
    /// Rate limit after the change, bytes/s.
    pub rate: f64,
    /// True for a cut on implicit loss, false for the linear increase.
    pub cut: bool,
    /// Mean reported receiver rate at that moment (bytes/s, 0 if none).
    pub mean_receiver_rate: f64,
}

pub struct Sender {
    request_addr: SocketAddrV4,
    mtu: usize,
    stop: Arc<AtomicBool>,
    stats: Arc<SenderStats>,
    trace: Arc<Mutex<Vec<RateSample>>>,
    rate_now: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sender {
    pub fn start(cfg: SenderConfig, source: Box<dyn PageSource>) -> Result<Sender> {
        let requests = UdpSocket::bind(cfg.request_bind).map_err(|e| McdistError::io("bind request socket", e))?;
        let request_addr = match requests.local_addr() {
            Ok(std::net::SocketAddr::V4(a)) => a,
            Ok(other) => return Err(McdistError::io("request socket", std::io::Error::other(format!("not IPv4: {other}")))),
            Err(e) => return Err(McdistError::io("request socket address", e)),
        };
        requests.set_nonblocking(true).map_err(|e| McdistError::io("nonblocking request socket", e))?;
        force_buffer(&requests, libc::SO_RCVBUFFORCE, 4 << 20);
        let out = multicast_out_socket(&cfg)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(SenderStats::default());
        let trace = Arc::new(Mutex::new(Vec::new()));
        let rate_now = Arc::new(AtomicU64::new(crate::rate_to_u64(cfg.initial_rate)));
        let mtu = cfg.mtu;
        let mut core = SenderCore::new(cfg, source, out, stats.clone(), trace.clone(), rate_now.clone());
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mcdist-sender".into())
            .spawn(move || core.run(&requests, &stop2))
            .map_err(|e| McdistError::io("spawn sender", e))?;
        Ok(Sender { request_addr, mtu, stop, stats, trace, rate_now, thread: Some(thread) })
    }

    /// Where receivers send requests.
    pub fn request_addr(&self) -> SocketAddrV4 {
        self.request_addr
    }

    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// The IP MTU pages are split to (`SenderConfig::mtu`).
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// Current rate limit, bytes/s.
    pub fn rate(&self) -> f64 {
        self.rate_now.load(Ordering::Relaxed) as f64
    }

    /// The rate-limit trace so far (cuts, and the increase sampled every ≥ 5 ms).
    pub fn rate_trace(&self) -> Vec<RateSample> {
        self.trace.lock().map(|t| t.clone()).unwrap_or_default()
    }

    pub fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::Release);
            let _ = t.join();
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Best effort: bigger socket buffers absorb bursts (root may exceed rmem_max).
pub(crate) fn force_buffer(sock: &impl AsRawFd, opt: libc::c_int, bytes: libc::c_int) {
    // SAFETY: setsockopt reads one c_int from a live local.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&bytes as *const libc::c_int).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).expect("an int's size fits"),
        );
    }
}

fn multicast_out_socket(cfg: &SenderConfig) -> Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |what: &str| {
        let what = what.to_string();
        move |e| McdistError::io(what, e)
    };
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).map_err(io("multicast socket"))?;
    s.bind(&SocketAddrV4::new(cfg.interface, 0).into()).map_err(io("bind multicast socket"))?;
    s.set_multicast_if_v4(&cfg.interface).map_err(io("IP_MULTICAST_IF"))?;
    s.set_multicast_ttl_v4(cfg.ttl).map_err(io("IP_MULTICAST_TTL"))?;
    // Receivers on this very host (the local backend) hear the loopback copy.
    s.set_multicast_loop_v4(true).map_err(io("IP_MULTICAST_LOOP"))?;
    let s: UdpSocket = s.into();
    force_buffer(&s, libc::SO_SNDBUFFORCE, 4 << 20);
    Ok(s)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Prio {
    High,
    Low,
}

struct ReceiverReport {
    rate: f64,
    rtt: Duration,
    at: Instant,
}

struct SenderCore {
    cfg: SenderConfig,
    source: Box<dyn PageSource>,
    out: UdpSocket,
    stats: Arc<SenderStats>,
    trace: Arc<Mutex<Vec<RateSample>>>,
    rate_now: Arc<AtomicU64>,
    start: Instant,
    fragments: u8,
    last_sent: HashMap<u64, Instant>,
    queued: HashMap<u64, Prio>,
    high: VecDeque<u64>,
    low: VecDeque<u64>,
    receivers: HashMap<u32, ReceiverReport>,
    /// Request sockets that said HELLO (see [`SenderStats::receivers_joined`]).
    joined: std::collections::HashSet<std::net::SocketAddr>,
    rate: f64,
    tokens: f64,
    last_refill: Instant,
    last_increase: Instant,
    last_trace: Instant,
    /// Grows by one per datagram that is not a fragment and per page
    /// transmission (its fragments share it): the nonce of an encrypted page.
    seq: u64,
    buf: Vec<u8>,
    /// With encryption: this sender's page key and the random id it is salted with.
    cipher: Option<(crate::seal::Cipher, [u8; 16])>,
    /// The page being encrypted (a copy: the source's stays as read).
    sealed: Vec<u8>,
}

const TRACE_LIMIT: usize = 200_000;
/// Most request sockets remembered for [`SenderStats::receivers_joined`] (a
/// bound on what sealed HELLOs can make the sender hold).
const MAX_JOINED: usize = 65_536;
const INCREASE_TICK: Duration = Duration::from_millis(10);
/// Pages read from the source per round.
const SEND_BATCH: usize = 32;

impl SenderCore {
    fn new(
        cfg: SenderConfig,
        source: Box<dyn PageSource>,
        out: UdpSocket,
        stats: Arc<SenderStats>,
        trace: Arc<Mutex<Vec<RateSample>>>,
        rate_now: Arc<AtomicU64>,
    ) -> SenderCore {
        let now = Instant::now();
        let fragments = wire::fragments_for_mtu(cfg.mtu);
        let rate = cfg.initial_rate.clamp(cfg.min_rate, cfg.link_rate);
        SenderCore {
            source,
            out,
            stats,
            trace,
            rate_now,
            start: now,
            fragments,
            last_sent: HashMap::new(),
            queued: HashMap::new(),
            high: VecDeque::new(),
            low: VecDeque::new(),
            receivers: HashMap::new(),
            joined: std::collections::HashSet::new(),
            rate,
            tokens: 0.0,
            last_refill: now,
            last_increase: now,
            last_trace: now,
            seq: 0,
            buf: vec![0u8; 65536],
            cipher: cfg.encrypt.then(|| {
                let id: [u8; 16] = starling_proto::SecretKey::random().0[..16].try_into().expect("16 of 32 bytes");
                (crate::seal::Cipher::derive(&cfg.key, crate::seal::MULTICAST_PAGE, &[&id]), id)
            }),
            sealed: vec![0u8; wire::PAGE],
            cfg,
        }
    }

    fn page_cost(&self) -> f64 {
        (wire::PAGE + self.fragments as usize * (wire::DATA_HEADER + wire::IP_UDP_OVERHEAD)) as f64
    }

    fn burst(&self) -> f64 {
        (self.rate * 0.002).max(16.0 * self.page_cost())
    }

    fn run(&mut self, requests: &UdpSocket, stop: &AtomicBool) {
        let mut rbuf = vec![0u8; 65536];
        while !stop.load(Ordering::Acquire) {
            let wait = if self.high.is_empty() && self.low.is_empty() {
                Duration::from_millis(20)
            } else if self.tokens > 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64((-self.tokens + 1.0) / self.rate).min(Duration::from_millis(20))
            };
            wait_readable(requests, wait);
            for _ in 0..512 {
                match requests.recv_from(&mut rbuf) {
                    Ok((n, from)) => self.on_request(&rbuf[..n], from),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            self.tick();
            while self.tokens > 0.0 && !(self.high.is_empty() && self.low.is_empty()) {
                self.send_some();
            }
        }
    }

    /// Refill the bucket and apply the linear increase.
    fn tick(&mut self) {
        let now = Instant::now();
        let ticks = (now - self.last_increase).as_nanos() / INCREASE_TICK.as_nanos();
        if ticks > 0 {
            self.last_increase += INCREASE_TICK * u32::try_from(ticks).unwrap_or(u32::MAX);
            let new = (self.rate + self.cfg.increase_per_10ms * ticks as f64).min(self.cfg.link_rate);
            if new != self.rate {
                self.rate = new;
                self.rate_now.store(crate::rate_to_u64(new), Ordering::Relaxed);
                if now - self.last_trace >= Duration::from_millis(5) {
                    self.record(false);
                }
            }
        }
        let dt = (now - self.last_refill).as_secs_f64();
        self.last_refill = now;
        self.tokens = (self.tokens + self.rate * dt).min(self.burst());
    }

    fn record(&mut self, cut: bool) {
        let now = Instant::now();
        self.last_trace = now;
        let sample = RateSample {
            at: now - self.start,
            rate: self.rate,
            cut,
            mean_receiver_rate: self.mean_receiver_rate().unwrap_or(0.0),
        };
        if let Ok(mut t) = self.trace.lock() {
            if t.len() < TRACE_LIMIT {
                t.push(sample);
            }
        }
    }

    /// Mean of the rates receivers reported in the last two seconds.
    fn mean_receiver_rate(&self) -> Option<f64> {
        let now = Instant::now();
        let recent: Vec<f64> = self
            .receivers
            .values()
            .filter(|r| now - r.at < Duration::from_secs(2) && r.rate > 0.0)
            .map(|r| r.rate)
            .collect();
        (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64)
    }

    /// 2 × the mean request→arrival time receivers report, clamped.
    fn lockstep_window(&self) -> Duration {
        let now = Instant::now();
        let rtts: Vec<Duration> = self
            .receivers
            .values()
            .filter(|r| now - r.at < Duration::from_secs(2) && !r.rtt.is_zero())
            .map(|r| r.rtt)
            .collect();
        let mean = if rtts.is_empty() { Duration::ZERO } else { rtts.iter().sum::<Duration>() / u32::try_from(rtts.len()).unwrap_or(u32::MAX) };
        (mean * 2).clamp(self.cfg.lockstep_min, self.cfg.lockstep_max)
    }

    fn valid(&self, addr: u64) -> bool {
        let regions = self.source.regions();
        let i = regions.partition_point(|&(_, end)| end <= addr);
        addr.is_multiple_of(wire::PAGE as u64)
            && regions.get(i).is_some_and(|&(s, e)| s <= addr && addr + wire::PAGE as u64 <= e)
    }

    fn on_request(&mut self, d: &[u8], from: std::net::SocketAddr) {
        let Some(req) = Request::parse_sealed(d, &self.cfg.key) else {
            self.stats.invalid.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if req.ticket != self.cfg.ticket {
            self.stats.invalid.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let now = Instant::now();
        if req.rate > 0 || req.rtt_us > 0 {
            let prev = self.receivers.get(&req.receiver);
            let rate = if req.rate > 0 { req.rate as f64 } else { prev.map_or(0.0, |p| p.rate) };
            let rtt = if req.rtt_us > 0 { Duration::from_micros(u64::from(req.rtt_us)) } else { prev.map_or(Duration::ZERO, |p| p.rtt) };
            self.receivers.insert(req.receiver, ReceiverReport { rate, rtt, at: now });
        }
        if req.kind == wire::REQ_HELLO {
            self.stats.hellos.fetch_add(1, Ordering::Relaxed);
            if self.joined.len() < MAX_JOINED && self.joined.insert(from) {
                self.stats.receivers_joined.fetch_add(1, Ordering::Relaxed);
            }
            self.send_probe();
            return;
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let window = self.lockstep_window();
        for &addr in &req.addrs {
            if !self.valid(addr) {
                self.stats.invalid.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.stats.pages_requested.fetch_add(1, Ordering::Relaxed);
            match self.queued.get(&addr) {
                Some(Prio::High) => {
                    self.stats.queued_duplicates.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Some(Prio::Low) => {
                    // Wanted now: promote (the Low entry is skipped lazily).
                    self.stats.queued_duplicates.fetch_add(1, Ordering::Relaxed);
                    self.queued.insert(addr, Prio::High);
                    self.high.push_back(addr);
                    continue;
                }
                None => {}
            }
            if let Some(&sent) = self.last_sent.get(&addr) {
                if now - sent < window {
                    self.stats.lockstep_suppressed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                self.stats.implicit_losses.fetch_add(1, Ordering::Relaxed);
                self.cut_rate();
            }
            self.queued.insert(addr, Prio::High);
            self.high.push_back(addr);
            if self.cfg.push {
                self.queue_push(addr);
            }
        }
    }

    /// Implicit loss: drop to 3/4 of the mean receiver rate.
    fn cut_rate(&mut self) {
        let base = self.mean_receiver_rate().unwrap_or(self.rate);
        let new = (0.75 * base).clamp(self.cfg.min_rate, self.cfg.link_rate);
        self.stats.rate_cuts.fetch_add(1, Ordering::Relaxed);
        // Only ever a cut: a receiver rate above the limit is no reason to speed up.
        if new < self.rate {
            self.rate = new;
            self.tokens = self.tokens.min(self.burst());
            self.rate_now.store(crate::rate_to_u64(new), Ordering::Relaxed);
        }
        self.record(true);
    }

    fn queue_push(&mut self, addr: u64) {
        let regions = self.source.regions();
        let i = regions.partition_point(|&(_, end)| end <= addr);
        let Some(&(_, end)) = regions.get(i) else { return };
        let mut next = addr + wire::PAGE as u64;
        let mut n = 0;
        while n < self.cfg.push_pages && next < end {
            if !self.last_sent.contains_key(&next) && !self.queued.contains_key(&next) {
                self.queued.insert(next, Prio::Low);
                self.low.push_back(next);
            }
            n += 1;
            next += wire::PAGE as u64;
        }
    }

    fn send_probe(&mut self) {
        self.seq += 1;
        let mut h = DataHeader { kind: wire::KIND_PROBE, index: 0, count: 0, ticket: self.cfg.ticket, addr: 0, seq: self.seq, mac: [0; 32] };
        h.seal(&self.cfg.key, &[]);
        let mut d = [0u8; wire::DATA_HEADER];
        h.write(&mut d);
        self.emit(&d);
    }

    fn emit(&mut self, d: &[u8]) {
        match self.out.send_to(d, self.cfg.group) {
            Ok(_) => {
                self.stats.datagrams.fetch_add(1, Ordering::Relaxed);
                self.stats.bytes_wire.fetch_add((d.len() + wire::IP_UDP_OVERHEAD) as u64, Ordering::Relaxed);
                self.tokens -= (d.len() + wire::IP_UDP_OVERHEAD) as f64;
            }
            Err(_) => {
                // ENOBUFS & co: the page is lost like on the wire; the
                // receiver's re-request turns it into an implicit loss.
                self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Send up to SEND_BATCH queued pages (requested first).
    fn send_some(&mut self) {
        let mut batch = Vec::with_capacity(SEND_BATCH);
        let mut pushed = 0u64;
        while batch.len() < SEND_BATCH {
            let (addr, prio) = if let Some(a) = self.high.pop_front() {
                (a, Prio::High)
            } else if let Some(a) = self.low.pop_front() {
                (a, Prio::Low)
            } else {
                break;
            };
            // Lazy deletion: promoted or already sent entries are skipped.
            if self.queued.get(&addr) != Some(&prio) {
                continue;
            }
            self.queued.remove(&addr);
            if prio == Prio::Low {
                pushed += 1;
            }
            batch.push(addr);
            if self.tokens - (batch.len() as f64 * self.page_cost()) <= 0.0 {
                break;
            }
        }
        if batch.is_empty() {
            return;
        }
        let pages = self.source.read(&batch);
        self.stats.pages_pushed.fetch_add(pushed, Ordering::Relaxed);
        for (&addr, page) in batch.iter().zip(pages.iter()) {
            self.send_page(addr, page);
            self.last_sent.insert(addr, Instant::now());
        }
        self.stats.pages_sent.fetch_add(batch.len() as u64, Ordering::Relaxed);
    }

    fn send_page(&mut self, addr: u64, page: &SourcePage) {
        let mut h = DataHeader { kind: wire::KIND_ZERO, index: 0, count: 0, ticket: self.cfg.ticket, addr, seq: 0, mac: [0; 32] };
        let data = match page {
            SourcePage::Data(d) if d.len() == wire::PAGE && d.iter().any(|&b| b != 0) => d,
            SourcePage::Data(_) | SourcePage::Zero => {
                self.seq += 1;
                h.seq = self.seq;
                h.seal(&self.cfg.key, &[]);
                let mut d = [0u8; wire::DATA_HEADER];
                h.write(&mut d);
                return self.emit(&d);
            }
            SourcePage::Unreadable => {
                self.seq += 1;
                h.kind = wire::KIND_UNREADABLE;
                h.seq = self.seq;
                h.seal(&self.cfg.key, &[]);
                let mut d = [0u8; wire::DATA_HEADER];
                h.write(&mut d);
                return self.emit(&d);
            }
        };
        h.kind = wire::KIND_FRAGMENT;
        h.count = self.fragments;
        self.seq += 1;
        h.seq = self.seq;
        let mut sealed = std::mem::take(&mut self.sealed);
        let data = match &self.cipher {
            Some((cipher, id)) => {
                sealed.copy_from_slice(data);
                h.seal_page(cipher, *id, &mut sealed);
                &sealed
            }
            None => {
                h.seal(&self.cfg.key, data);
                data
            }
        };
        let mut buf = std::mem::take(&mut self.buf);
        for i in 0..self.fragments {
            let Some(r) = wire::fragment_range(i, self.fragments) else { break };
            h.index = i;
            h.write(&mut buf[..wire::DATA_HEADER]);
            let len = wire::DATA_HEADER + r.len();
            buf[wire::DATA_HEADER..len].copy_from_slice(&data[r]);
            self.emit(&buf[..len]);
            self.stats.data_datagrams.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.data_pages.fetch_add(1, Ordering::Relaxed);
        self.buf = buf;
        self.sealed = sealed;
    }
}

/// Wait until `sock` is readable or `timeout` passes (µs precision).
pub(crate) fn wait_readable(sock: &impl AsRawFd, timeout: Duration) {
    let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: polls one fd we hold; pfd and ts are live locals.
    unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
}
