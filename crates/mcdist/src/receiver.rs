//! The receiver: joins the ticket's group, reassembles and verifies pages,
//! and hands them to whoever needs them.
//!
//! A background thread reads the group socket. Completed pages are
//! dispatched in batches (everything that is already queued in the socket,
//! up to 1024 pages): a page faulting threads are waiting for goes to each
//! of them (which install it at the clone address they faulted on); any
//! other page is offered to the [`PageSink`], which installs it into the
//! clones that have not got it yet — so pages requested by any clone reach
//! all clones, and a faulting thread only ever waits for its own pages.
//!
//! One receiver serves every clone of its ticket on a host (the fork crate's
//! `HostTicket`): its fetches may come from several clones' fault handlers at
//! once, and its sink installs into all of them. So it remembers nothing per
//! clone: a fetch is told which pages its clone already has (`present`), and
//! a page that arrives again is offered again (a clone that started late may
//! want it).
//!
//! [`Receiver::fetch`] sends a request and waits; on timeout it re-requests
//! what is still missing, doubling the timeout up to `max_timeout`, and gives
//! up after `give_up` (the caller then fetches by unicast).

use crate::sender::{force_buffer, wait_readable};
use crate::wire::{self, DataHeader, Request};
use crate::{McdistError, Result};
use std::os::fd::AsRawFd;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A page as handed to a waiter or a sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// Verified page contents (4096 bytes).
    Data(Vec<u8>),
    /// The page is all zero.
    Zero,
    /// The template could not read it.
    Unreadable,
    /// The clone has it already (the `present` of [`Receiver::fetch_unless`]
    /// said so): nothing to do.
    Installed,
}

/// Installs pages nobody waits for (called from the receive thread).
pub trait PageSink: Send + Sync + 'static {
    /// Offer a batch of (template address, page) — `Data` or `Zero` only,
    /// sorted by address. Returns, per page, whether it went into a clone
    /// (now or before); only counted. A fetch that started waiting for one of
    /// them meanwhile gets the page too.
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool>;
}

#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    pub ticket: u64,
    /// The ticket's key: datagrams not sealed with it are dropped.
    pub key: starling_proto::SecretKey,
    /// Pages are encrypted (the sender's `fork.encrypt`): a page that does
    /// not open is dropped, and so is any page in clear (and the reverse).
    pub encrypted: bool,
    pub group: SocketAddrV4,
    /// Address of the local interface to join the group on.
    pub interface: Ipv4Addr,
    /// The sender's request socket.
    pub sender: SocketAddrV4,
    /// Identifies this receiver's rate reports.
    pub receiver_id: u32,
    /// How long to wait for a PROBE before declaring multicast unavailable.
    pub probe_timeout: Duration,
    /// First re-request timeout (raised to 4 × the measured request→arrival
    /// time); above the sender's lockstep floor, so a re-request is answered.
    pub min_timeout: Duration,
    pub max_timeout: Duration,
    /// Total wait for one page before `fetch` fails.
    pub give_up: Duration,
    /// User-space loss injection (per mille of data datagrams dropped on
    /// receipt) for tests on kernels without nftables; 0 in production.
    pub drop_permille: u32,
}

impl ReceiverConfig {
    pub fn new(ticket: u64, key: starling_proto::SecretKey, group: SocketAddrV4, interface: Ipv4Addr, sender: SocketAddrV4, receiver_id: u32) -> Self {
        ReceiverConfig {
            ticket,
            key,
            encrypted: true,
            group,
            interface,
            sender,
            receiver_id,
            probe_timeout: Duration::from_millis(500),
            min_timeout: Duration::from_millis(20),
            max_timeout: Duration::from_millis(400),
            give_up: Duration::from_secs(10),
            drop_permille: 0,
        }
    }
}

#[derive(Default, Debug)]
pub struct ReceiverStats {
    pub datagrams: AtomicU64,
    pub bytes: AtomicU64,
    pub malformed: AtomicU64,
    /// Datagrams and reassembled pages whose MAC did not verify (dropped).
    pub forged: AtomicU64,
    pub dropped_injected: AtomicU64,
    pub pages_complete: AtomicU64,
    pub pages_corrupt: AtomicU64,
    pub pages_to_waiters: AtomicU64,
    pub pages_installed_unsolicited: AtomicU64,
    pub pages_declined: AtomicU64,
    pub requests: AtomicU64,
    pub pages_requested: AtomicU64,
    pub rerequests: AtomicU64,
    pub batches: AtomicU64,
}

impl ReceiverStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// A page fetches are waiting for.
#[derive(Default)]
struct Waiting {
    /// How many fetches wait for it (several clones may fault on one page).
    fetchers: u32,
    /// What arrived, until the last of them took it.
    page: Option<Fetched>,
}

#[derive(Default)]
struct Inner {
    /// Pages fetches are waiting for, by template address.
    waiters: HashMap<u64, Waiting>,
}

impl Inner {
    /// One fetch stops waiting for `addr`: returns what arrived (if it did),
    /// and forgets the page once no fetch waits for it any more.
    fn leave(&mut self, addr: u64) -> Option<Fetched> {
        let w = self.waiters.get_mut(&addr)?;
        w.fetchers = w.fetchers.saturating_sub(1);
        let page = w.page.clone();
        if w.fetchers == 0 {
            self.waiters.remove(&addr);
        }
        page
    }

    /// Whether a fetch waits for `addr` and has not got it yet.
    fn awaited(&self, addr: u64) -> bool {
        self.waiters.get(&addr).is_some_and(|w| w.page.is_none())
    }
}

struct Shared {
    inner: Mutex<Inner>,
    arrived: Condvar,
    stop: AtomicBool,
    probe_heard: AtomicBool,
    stats: ReceiverStats,
    /// Smoothed receive rate while receiving, bytes/s.
    rate: AtomicU64,
    /// Smoothed request→arrival time, µs (0: no sample yet).
    srtt_us: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicking holder cannot leave Inner inconsistent in a way that
        // matters more than stopping the clone would: keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct Receiver {
    cfg: ReceiverConfig,
    shared: Arc<Shared>,
    requests: UdpSocket,
    /// The receive thread's data socket (a duplicate), to wake its poll on stop.
    wake: UdpSocket,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Receiver {
    /// Join the group, start the receive thread, and check that multicast
    /// from the sender reaches us (HELLO → PROBE). Fails with
    /// [`McdistError::NoMulticast`] if it does not.
    pub fn start(cfg: ReceiverConfig, sink: Arc<dyn PageSink>) -> Result<Receiver> {
        let data = group_socket(&cfg)?;
        let wake = data.try_clone().map_err(|e| McdistError::io("dup data socket", e))?;
        let requests = UdpSocket::bind(SocketAddrV4::new(cfg.interface, 0)).map_err(|e| McdistError::io("bind request socket", e))?;
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            arrived: Condvar::new(),
            stop: AtomicBool::new(false),
            probe_heard: AtomicBool::new(false),
            stats: ReceiverStats::default(),
            rate: AtomicU64::new(0),
            srtt_us: AtomicU64::new(0),
        });
        let (shared2, cfg2) = (shared.clone(), cfg.clone());
        let thread = std::thread::Builder::new()
            .name(format!("mcdist-rx-{}", cfg.receiver_id))
            .spawn(move || RxLoop::new(cfg2, shared2, sink).run(&data))
            .map_err(|e| McdistError::io("spawn receive thread", e))?;
        let mut r = Receiver { cfg, shared, requests, wake, thread: Some(thread) };
        r.probe()?;
        Ok(r)
    }

    fn probe(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.cfg.probe_timeout;
        let hello = Request { kind: wire::REQ_HELLO, ticket: self.cfg.ticket, receiver: self.cfg.receiver_id, rate: 0, rtt_us: 0, addrs: vec![] };
        while Instant::now() < deadline {
            let _ = self.requests.send_to(&hello.encode_sealed(&self.cfg.key), self.cfg.sender);
            let g = self.shared.lock();
            // The probe may have come back already: its notification only
            // reaches a waiter, so look before waiting (under the lock the
            // receive thread takes to notify).
            if self.shared.probe_heard.load(Ordering::Acquire) {
                return Ok(());
            }
            let wait = (deadline - Instant::now().min(deadline)).min(Duration::from_millis(50));
            let _g = self.shared.arrived.wait_timeout(g, wait);
            if self.shared.probe_heard.load(Ordering::Acquire) {
                return Ok(());
            }
        }
        self.stop();
        Err(McdistError::NoMulticast(self.cfg.probe_timeout))
    }

    pub fn stats(&self) -> &ReceiverStats {
        &self.shared.stats
    }

    /// Smoothed receive rate, bytes/s.
    pub fn rate(&self) -> u64 {
        self.shared.rate.load(Ordering::Relaxed)
    }

    fn send_request(&self, addrs: &[u64]) {
        for chunk in addrs.chunks(wire::MAX_REQ_PAGES) {
            let q = Request {
                kind: wire::REQ_PAGES,
                ticket: self.cfg.ticket,
                receiver: self.cfg.receiver_id,
                rate: self.shared.rate.load(Ordering::Relaxed),
                rtt_us: u32::try_from(self.shared.srtt_us.load(Ordering::Relaxed)).unwrap_or(u32::MAX),
                addrs: chunk.to_vec(),
            };
            self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
            // A failed send is a lost request: the timeout re-sends it.
            let _ = self.requests.send_to(&q.encode_sealed(&self.cfg.key), self.cfg.sender);
        }
    }

    /// Get the pages at `addrs` (template addresses): request them, wait,
    /// re-request on timeout. One result per address, in order.
    pub fn fetch(&self, addrs: &[u64]) -> Result<Vec<Fetched>> {
        self.fetch_unless(addrs, &|_| false)
    }

    /// As [`Receiver::fetch`], for a clone that has the pages for which
    /// `present` says so (answered [`Fetched::Installed`], not requested).
    /// `present` is asked with the receive thread held off from handing
    /// pages to fetches: a page the sink installs into the clone before that
    /// is seen present, one it installs after is also handed to this fetch.
    pub fn fetch_unless(&self, addrs: &[u64], present: &dyn Fn(u64) -> bool) -> Result<Vec<Fetched>> {
        let mut out: Vec<Option<Fetched>> = vec![None; addrs.len()];
        let mut missing: Vec<u64> = Vec::new();
        // Pages no other fetch of this receiver (another clone of the host) has asked for already.
        let mut ask: Vec<u64> = Vec::new();
        {
            let mut g = self.shared.lock();
            for (i, &a) in addrs.iter().enumerate() {
                if present(a) {
                    out[i] = Some(Fetched::Installed);
                } else if !missing.contains(&a) {
                    let w = g.waiters.entry(a).or_default();
                    w.fetchers += 1;
                    if w.fetchers == 1 {
                        ask.push(a);
                    }
                    missing.push(a);
                }
            }
        }
        if missing.is_empty() {
            return Ok(out.into_iter().map(|f| f.unwrap_or(Fetched::Installed)).collect());
        }
        self.shared.stats.pages_requested.fetch_add(ask.len() as u64, Ordering::Relaxed);
        let t0 = Instant::now();
        let srtt = Duration::from_micros(self.shared.srtt_us.load(Ordering::Relaxed));
        let mut timeout = (srtt * 4).clamp(self.cfg.min_timeout, self.cfg.max_timeout);
        let mut deadline = t0 + timeout;
        let mut retried = false;
        // Only a fetch that asked for all it waits for times a request.
        let asked_all = ask.len() == missing.len();
        if !ask.is_empty() {
            self.send_request(&ask);
        }
        let mut g = self.shared.lock();
        loop {
            // Collect what arrived.
            missing.retain(|&a| {
                if g.awaited(a) {
                    return true;
                }
                let f = g.leave(a);
                for (i, &x) in addrs.iter().enumerate() {
                    if x == a && out[i].is_none() {
                        out[i] = f.clone();
                    }
                }
                false
            });
            if missing.is_empty() {
                break;
            }
            if self.shared.stop.load(Ordering::Acquire) {
                for &a in &missing {
                    g.leave(a);
                }
                return Err(McdistError::Stopped);
            }
            let now = Instant::now();
            if now - t0 >= self.cfg.give_up {
                for &a in &missing {
                    g.leave(a);
                }
                return Err(McdistError::Timeout { addr: missing[0], waited: now - t0 });
            }
            if now >= deadline {
                retried = true;
                self.shared.stats.rerequests.fetch_add(1, Ordering::Relaxed);
                timeout = (timeout * 2).min(self.cfg.max_timeout);
                deadline = now + timeout;
                drop(g);
                self.send_request(&missing);
                g = self.shared.lock();
                continue;
            }
            g = self.shared.arrived.wait_timeout(g, deadline - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
        drop(g);
        if !retried && asked_all {
            // Karn: only unambiguous samples update the estimate.
            let sample = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
            let old = self.shared.srtt_us.load(Ordering::Relaxed);
            let new = if old == 0 { sample } else { (old * 7 + sample) / 8 };
            self.shared.srtt_us.store(new.max(1), Ordering::Relaxed);
        }
        Ok(out.into_iter().map(|f| f.unwrap_or(Fetched::Installed)).collect())
    }

    pub fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shared.stop.store(true, Ordering::Release);
            self.shared.arrived.notify_all();
            // Wake the receive thread's poll now rather than at its timeout
            // (20 ms, which every clone's setup and end used to wait out):
            // on Linux, shutdown of even an unconnected UDP socket wakes its
            // pollers (and reports ENOTCONN, which is expected here).
            // SAFETY: shutdown on a socket we own; no memory is involved.
            unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RD) };
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

fn group_socket(cfg: &ReceiverConfig) -> Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |what: &str| {
        let what = what.to_string();
        move |e| McdistError::io(what, e)
    };
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).map_err(io("group socket"))?;
    // Several clones on one host each get their own copy of every datagram.
    s.set_reuse_address(true).map_err(io("SO_REUSEADDR"))?;
    // Bound to the group address: datagrams of other groups on the same port stay out.
    s.bind(&cfg.group.into()).map_err(io("bind group socket"))?;
    s.join_multicast_v4(cfg.group.ip(), &cfg.interface).map_err(io("IP_ADD_MEMBERSHIP"))?;
    s.set_nonblocking(true).map_err(io("nonblocking group socket"))?;
    let s: UdpSocket = s.into();
    force_buffer(&s, libc::SO_RCVBUFFORCE, 8 << 20);
    Ok(s)
}

struct Partial {
    mac: [u8; 32],
    count: u8,
    got: u8,
    mask: u8,
    data: Vec<u8>,
    since: Instant,
}

/// Largest number of pages per dispatch batch.
const BATCH: usize = 1024;
const RATE_INTERVAL: Duration = Duration::from_millis(100);

struct RxLoop {
    cfg: ReceiverConfig,
    shared: Arc<Shared>,
    sink: Arc<dyn PageSink>,
    partial: HashMap<u64, Partial>,
    interval_start: Instant,
    interval_bytes: u64,
    last_sweep: Instant,
    rng: u64,
    /// The page key of the last sender id seen (encrypted pages).
    cipher: Option<([u8; 16], crate::seal::Cipher)>,
}

impl RxLoop {
    fn new(cfg: ReceiverConfig, shared: Arc<Shared>, sink: Arc<dyn PageSink>) -> RxLoop {
        let now = Instant::now();
        let rng = 0x9e37_79b9_7f4a_7c15 ^ (u64::from(cfg.receiver_id) + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        RxLoop { cfg, shared, sink, partial: HashMap::new(), interval_start: now, interval_bytes: 0, last_sweep: now, rng, cipher: None }
    }

    fn inject_drop(&mut self) -> bool {
        if self.cfg.drop_permille == 0 {
            return false;
        }
        // xorshift64: cheap, deterministic per receiver.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 1000) < u64::from(self.cfg.drop_permille)
    }

    fn run(mut self, sock: &UdpSocket) {
        let mut buf = vec![0u8; 65536];
        let mut batch: Vec<(u64, Fetched)> = Vec::new();
        while !self.shared.stop.load(Ordering::Acquire) {
            wait_readable(sock, Duration::from_millis(20));
            loop {
                match sock.recv(&mut buf) {
                    Ok(n) => {
                        if let Some(page) = self.on_datagram(&buf[..n]) {
                            batch.push(page);
                            if batch.len() >= BATCH {
                                break;
                            }
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break, // WouldBlock: the socket is drained
                }
            }
            if !batch.is_empty() {
                self.dispatch(std::mem::take(&mut batch));
            }
            self.housekeeping();
        }
    }

    fn housekeeping(&mut self) {
        let now = Instant::now();
        let dt = now - self.interval_start;
        if dt >= RATE_INTERVAL {
            // Only intervals with traffic count: the rate is what we can absorb.
            if self.interval_bytes > 0 {
                let inst = self.interval_bytes as f64 / dt.as_secs_f64();
                let old = self.shared.rate.load(Ordering::Relaxed) as f64;
                let new = if old == 0.0 { inst } else { 0.7 * old + 0.3 * inst };
                self.shared.rate.store(crate::rate_to_u64(new), Ordering::Relaxed);
            }
            self.interval_start = now;
            self.interval_bytes = 0;
        }
        if now - self.last_sweep >= Duration::from_secs(1) {
            self.last_sweep = now;
            self.partial.retain(|_, p| now - p.since < Duration::from_secs(2));
        }
    }

    /// Account, parse and reassemble one datagram; a completed page is returned.
    fn on_datagram(&mut self, d: &[u8]) -> Option<(u64, Fetched)> {
        let shared = self.shared.clone();
        let st = &shared.stats;
        st.datagrams.fetch_add(1, Ordering::Relaxed);
        st.bytes.fetch_add((d.len() + wire::IP_UDP_OVERHEAD) as u64, Ordering::Relaxed);
        self.interval_bytes += (d.len() + wire::IP_UDP_OVERHEAD) as u64;
        let Some((h, payload)) = DataHeader::parse(d) else {
            st.malformed.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if h.ticket != self.cfg.ticket {
            st.malformed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if h.kind != wire::KIND_FRAGMENT && !h.verify(&self.cfg.key, &[]) {
            st.forged.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if h.kind == wire::KIND_PROBE {
            self.shared.probe_heard.store(true, Ordering::Release);
            let _g = self.shared.lock();
            self.shared.arrived.notify_all();
            return None;
        }
        if self.inject_drop() {
            st.dropped_injected.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        match h.kind {
            wire::KIND_ZERO => {
                st.pages_complete.fetch_add(1, Ordering::Relaxed);
                Some((h.addr, Fetched::Zero))
            }
            wire::KIND_UNREADABLE => Some((h.addr, Fetched::Unreadable)),
            _ => {
                let range = wire::fragment_range(h.index, h.count)?;
                let p = self.partial.entry(h.addr).or_insert_with(|| Partial {
                    mac: h.mac,
                    count: h.count,
                    got: 0,
                    mask: 0,
                    data: vec![0u8; wire::PAGE],
                    since: Instant::now(),
                });
                if p.mac != h.mac || p.count != h.count {
                    // A different version of the page (should not happen with
                    // a frozen template): start over with this one.
                    *p = Partial { mac: h.mac, count: h.count, got: 0, mask: 0, data: vec![0u8; wire::PAGE], since: Instant::now() };
                }
                if p.mask & (1 << h.index) == 0 {
                    p.mask |= 1 << h.index;
                    p.got += 1;
                    p.data[range].copy_from_slice(payload);
                }
                if p.got < p.count {
                    return None;
                }
                let mut p = self.partial.remove(&h.addr)?;
                let whole = DataHeader { mac: p.mac, ..h };
                let authentic = if self.cfg.encrypted {
                    let id = whole.sender_id();
                    if self.cipher.as_ref().is_none_or(|(known, _)| *known != id) {
                        self.cipher = Some((id, crate::seal::Cipher::derive(&self.cfg.key, crate::seal::MULTICAST_PAGE, &[&id])));
                    }
                    let (_, cipher) = self.cipher.as_ref().expect("set above");
                    whole.open_page(cipher, &mut p.data)
                } else {
                    whole.verify(&self.cfg.key, &p.data)
                };
                if !authentic {
                    // Corrupted on the way, or forged: asked for again.
                    st.pages_corrupt.fetch_add(1, Ordering::Relaxed);
                    st.forged.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                st.pages_complete.fetch_add(1, Ordering::Relaxed);
                Some((h.addr, Fetched::Data(p.data)))
            }
        }
    }

    /// Hand a batch to waiters and the sink.
    fn dispatch(&mut self, mut batch: Vec<(u64, Fetched)>) {
        let st = &self.shared.stats;
        st.batches.fetch_add(1, Ordering::Relaxed);
        batch.sort_by_key(|(a, _)| *a);
        batch.dedup_by_key(|(a, _)| *a);
        let mut to_sink = Vec::with_capacity(batch.len());
        let mut woke = false;
        {
            let mut g = self.shared.lock();
            for (addr, page) in batch {
                match g.waiters.get_mut(&addr) {
                    Some(w) if w.page.is_none() => {
                        w.page = Some(page);
                        st.pages_to_waiters.fetch_add(1, Ordering::Relaxed);
                        woke = true;
                    }
                    Some(_) => {}
                    None if matches!(page, Fetched::Unreadable) => {}
                    None => to_sink.push((addr, page)),
                }
            }
        }
        if woke {
            self.shared.arrived.notify_all();
        }
        if to_sink.is_empty() {
            return;
        }
        let installed = self.sink.offer(&to_sink);
        let mut g = self.shared.lock();
        for (i, (addr, page)) in to_sink.into_iter().enumerate() {
            let ok = installed.get(i).copied().unwrap_or(false);
            if ok {
                st.pages_installed_unsolicited.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(w) = g.waiters.get_mut(&addr).filter(|w| w.page.is_none()) {
                // A fetch started waiting while the sink looked at it (its
                // clone may be one the sink did not install into, or its
                // `present` may have looked before the sink did).
                w.page = Some(page);
                woke = true;
            } else if !ok {
                st.pages_declined.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(g);
        if woke {
            self.shared.arrived.notify_all();
        }
    }
}
