//! The page server: serves a frozen template's pages over TCP.
//!
//! Protocol (little-endian, one request in flight per connection). Every
//! connection starts with a mutual proof of the ticket's [`SecretKey`] (keyed
//! BLAKE3, see `starling_mcdist::seal`); nothing is read from the template,
//! and no request is parsed, before the client has proved it:
//!
//! ```text
//! client:   "SFPA" | client nonce [32] | wants encryption u8 (0 or 1)
//! server:   "SFPB" | server nonce [32] | encrypted u8 | MAC("SFP server", transcript) [32]
//! client:   "SFPC" | MAC("SFP client", transcript) [32]
//!           transcript = client nonce | wants | server nonce | encrypted
//! ```
//!
//! A client that fails closes; a server that gets a wrong proof closes
//! without a byte more. The connection is encrypted when either side's
//! `fork.encrypt` asks for it (the server answers `wants | its own`; a
//! client that wanted it refuses a 0): from here on its bytes are AES-GCM
//! records under keys of this connection alone ([`crate::stream`]), else
//! in clear. Then, in either:
//!
//! ```text
//! request:  "SFPQ" | count: u32 (1..=MAX_BATCH) | count × page address: u64
//! reply:    "SFPR" | count: u32 (same)          | count × (tag: u8 [| 4096 data bytes if tag = DATA])
//!           tag: 0 = ZERO (all-zero page), 1 = DATA, 2 = UNREADABLE
//! ```
//!
//! mcdist (`STARLING_MCDIST=off|on|push`, default on, but off for a one-clone
//! ticket unless set: nothing to share): the server also
//! starts a multicast [`starling_mcdist::Sender`] for the same template on
//! the same address, and answers one more request so clones can find it:
//!
//! ```text
//! request:  "SFPM"
//! reply:    "SFPN" | mode u8 (0 off, 1 on, 2 push; + 0x80: pages encrypted) | ticket u64 | group ip [4] | group port u16
//!                  | request ip [4] | request port u16
//! ```
//!
//! The encoded process descriptor is served the same way, as pseudo-pages
//! at [`DESCRIPTOR_BASE`] (an address in the kernel half, which no mapping
//! of the template can have): a clone host fetches it like any page — from
//! the ticket's multicast group when mcdist works, so one transmission
//! serves every host (lockstep suppression merges their requests), else
//! over TCP — and checks it against the hash in its launch message.
//!
//! Addresses must be page-aligned and inside a region the server was told
//! to serve (or the descriptor's pages); anything else closes the connection. Page data is read with
//! `process_vm_readv` from the template (its copy-on-write image stays
//! frozen while the parent goes on). All-zero pages are answered with the
//! one-byte ZERO tag.

use crate::stream::{Secrecy, StreamReader, StreamWriter};
use crate::{ForkError, PageProtocolError, Result, PAGE_SIZE};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use starling_mcdist::{Sender, SenderConfig, Switch};
use starling_proto::SecretKey;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub const MAX_BATCH: u32 = 1024;
const REQ_MAGIC: [u8; 4] = *b"SFPQ";
const MCDIST_MAGIC: [u8; 4] = *b"SFPM";
const MCDIST_REPLY_MAGIC: [u8; 4] = *b"SFPN";
const REPLY_MAGIC: [u8; 4] = *b"SFPR";
const TAG_ZERO: u8 = 0;
const TAG_DATA: u8 = 1;
const TAG_UNREADABLE: u8 = 2;
#[allow(clippy::cast_possible_truncation)] // 4096 fits in any usize
const PAGE: usize = PAGE_SIZE as usize;
/// A page's tag and bytes in a reply.
const SLOT: usize = 1 + PAGE;

/// Counters of a page server, shared with its threads.
#[derive(Default, Debug)]
pub struct ServerStats {
    pub requests: AtomicU64,
    /// Pages asked for over TCP (every address of every `SFPQ`).
    pub pages_requested: AtomicU64,
    pub pages_data: AtomicU64,
    pub pages_zero: AtomicU64,
    /// Bytes this server sent over TCP: reply bytes plus an estimate of
    /// the TCP/IP headers (one [`TCP_SEGMENT_OVERHEAD`] per started
    /// [`TCP_MSS`] of a flushed reply; ACK-only segments are not counted).
    pub bytes_wire: AtomicU64,
    /// Descriptor pseudo-pages sent, over TCP or multicast.
    pub descriptor_pages_sent: AtomicU64,
    /// Connections closed because their peer did not prove the key.
    pub refused: AtomicU64,
}

/// Payload of one TCP segment at MTU 1500 with timestamps (1500 − 20 − 32).
pub const TCP_MSS: u64 = 1448;
/// IPv4 + TCP header with the timestamp option.
pub const TCP_SEGMENT_OVERHEAD: u64 = 52;

/// What the parent's host sent to clones for one ticket, TCP page server
/// and multicast sender together (the "bytes on the wire" of the benches).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WireStats {
    /// TCP page-server bytes + multicast bytes (both with headers).
    pub bytes_wire: u64,
    pub bytes_tcp: u64,
    pub bytes_multicast: u64,
    /// Pages clones asked for (TCP + multicast requests).
    pub pages_requested: u64,
    /// Pages sent (TCP replies + multicast, pushed pages included).
    pub pages_served: u64,
    /// Multicast sender: rate cuts on implicit loss, implicit losses,
    /// requests not answered (lockstep), pages pushed.
    pub rate_cuts: u64,
    pub implicit_losses: u64,
    pub lockstep_suppressed: u64,
    pub pages_pushed: u64,
    /// Lowest rate limit in the sender's trace and the limit now, bytes/s
    /// (0 without multicast).
    pub rate_min: u64,
    pub rate_now: u64,
    /// Descriptor pages sent (TCP + multicast): its page count once per
    /// transmission, however many hosts it served.
    pub descriptor_pages_sent: u64,
    /// Multicast: pages sent with data and the datagrams they took (equal
    /// when a page fits the link's MTU), and the MTU the sender split to.
    pub multicast_data_pages: u64,
    pub multicast_data_datagrams: u64,
    pub multicast_mtu: u64,
    /// Multicast receivers that joined the ticket's group (distinct request
    /// sockets that said HELLO, counted by the sender): one per clone host,
    /// shared by that host's clones.
    pub multicast_receivers: u64,
}

impl WireStats {
    /// As a fixed array (the order of `sf_ticket_stat`'s `which`).
    pub fn to_array(&self) -> [u64; 16] {
        [
            self.bytes_wire,
            self.bytes_tcp,
            self.bytes_multicast,
            self.pages_requested,
            self.pages_served,
            self.rate_cuts,
            self.implicit_losses,
            self.lockstep_suppressed,
            self.pages_pushed,
            self.rate_min,
            self.rate_now,
            self.descriptor_pages_sent,
            self.multicast_data_pages,
            self.multicast_data_datagrams,
            self.multicast_mtu,
            self.multicast_receivers,
        ]
    }
}

/// Where and how a ticket's pages are multicast (told to clones by the page server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McdistInfo {
    pub push: bool,
    pub ticket: u64,
    pub group: SocketAddrV4,
    /// The sender's request socket.
    pub sender: SocketAddrV4,
    /// Page contents are encrypted (the sender's `fork.encrypt`).
    pub encrypted: bool,
}

/// Options of [`PageServer::start_with`].
#[derive(Debug, Clone)]
pub struct PageServerOptions {
    /// Multicast distribution: off, on, or on with push.
    pub mcdist: Switch,
    /// Ticket id (selects the multicast group); default: from PID and port.
    pub ticket: Option<u64>,
    /// The encoded descriptor, served at [`DESCRIPTOR_BASE`] (may be empty).
    pub descriptor: Vec<u8>,
    /// The ticket's key: TCP clients must prove it, multicast is sealed with it.
    pub key: SecretKey,
    /// Encrypt every connection and the multicast pages (`fork.encrypt`);
    /// off, a connection is still encrypted if its client asks.
    pub encrypt: bool,
}

/// The MTU assumed when the link's cannot be read (Ethernet's).
pub const DEFAULT_MTU: usize = 1500;

/// The MTU of the interface that holds `ip` (what multicast from `ip` goes
/// out on: the sender sets it as `IP_MULTICAST_IF`); None if no interface
/// of this network namespace holds it.
pub fn link_mtu(ip: Ipv4Addr) -> Option<usize> {
    let name = nix::ifaddrs::getifaddrs().ok()?.find_map(|ifa| {
        let addr = ifa.address?;
        let sin = addr.as_sockaddr_in()?;
        (sin.ip() == ip).then_some(ifa.interface_name)
    })?;
    // SIOCGIFMTU on a socket of this network namespace (sysfs may be another namespace's mount).
    let sock = std::net::UdpSocket::bind((ip, 0)).ok()?;
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return None;
    }
    for (dst, &b) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = b.cast_signed();
    }
    // SAFETY: SIOCGIFMTU reads ifr_name (NUL-terminated: the rest is zero) and
    // writes ifru_mtu within `req`, which outlives the call; the fd is open.
    let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&sock), libc::SIOCGIFMTU, &raw mut req) };
    if rc != 0 {
        return None;
    }
    // SAFETY: after a successful SIOCGIFMTU the union holds the MTU.
    usize::try_from(unsafe { req.ifr_ifru.ifru_mtu }).ok()
}

/// Where the descriptor's pseudo-pages start (see the module doc).
pub const DESCRIPTOR_BASE: u64 = 0xffff_f000_0000_0000;

/// The pseudo-page addresses of a descriptor of `len` bytes.
pub fn descriptor_pages(len: usize) -> Vec<u64> {
    (0..len.div_ceil(PAGE) as u64).map(|i| DESCRIPTOR_BASE + i * PAGE_SIZE).collect()
}

/// What a page server serves: the template's pages within `regions`, and
/// the descriptor's pseudo-pages.
#[derive(Clone)]
struct Image {
    pid: i32,
    /// Template regions, then the descriptor's range (sorted: it is above
    /// every user address).
    regions: Arc<Vec<(u64, u64)>>,
    descriptor: Arc<Vec<u8>>,
    stats: Arc<ServerStats>,
}

impl Image {
    fn new(pid: i32, mut regions: Vec<(u64, u64)>, descriptor: Vec<u8>, stats: Arc<ServerStats>) -> Image {
        if let Some(&last) = descriptor_pages(descriptor.len()).last() {
            regions.push((DESCRIPTOR_BASE, last + PAGE_SIZE));
        }
        Image { pid, regions: Arc::new(regions), descriptor: Arc::new(descriptor), stats }
    }

    fn serves(&self, addr: u64) -> bool {
        addr.is_multiple_of(PAGE_SIZE) && in_regions(&self.regions, addr)
    }

    /// Read `addrs` into `out` (one page each); per-page success.
    fn read(&self, addrs: &[u64], out: &mut [u8]) -> Vec<bool> {
        self.read_strided(addrs, out, 0, PAGE)
    }

    /// Read `addrs` into the slots of a reply (page i at `i * SLOT + 1`, after its tag's byte).
    fn read_slots(&self, addrs: &[u64], slots: &mut [u8]) -> Vec<bool> {
        self.read_strided(addrs, slots, 1, SLOT)
    }

    /// Read page i of `addrs` into `out[at + i * stride..][..PAGE]`; per-page success.
    fn read_strided(&self, addrs: &[u64], out: &mut [u8], at: usize, stride: usize) -> Vec<bool> {
        if addrs.iter().all(|&a| a < DESCRIPTOR_BASE) {
            return read_pages(self.pid, addrs, out, at, stride);
        }
        addrs
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                let page = &mut out[at + i * stride..at + i * stride + PAGE];
                if a < DESCRIPTOR_BASE {
                    return read_pages(self.pid, &[a], page, 0, PAGE)[0];
                }
                self.stats.descriptor_pages_sent.fetch_add(1, Ordering::Relaxed);
                let from = usize::try_from(a - DESCRIPTOR_BASE).unwrap_or(usize::MAX).min(self.descriptor.len());
                let bytes = &self.descriptor[from..(from + PAGE).min(self.descriptor.len())];
                page[..bytes.len()].copy_from_slice(bytes);
                page[bytes.len()..].fill(0);
                true
            })
            .collect()
    }
}

impl Default for PageServerOptions {
    /// Multicast on, no descriptor, a fresh random key, encrypted.
    fn default() -> PageServerOptions {
        PageServerOptions { mcdist: Switch::On, ticket: None, descriptor: Vec::new(), key: SecretKey::random(), encrypt: true }
    }
}

/// Reads pages of the frozen template (and the descriptor) for the multicast sender.
struct TemplateSource(Image);

impl starling_mcdist::PageSource for TemplateSource {
    fn regions(&self) -> &[(u64, u64)] {
        &self.0.regions
    }

    fn read(&mut self, addrs: &[u64]) -> Vec<starling_mcdist::SourcePage> {
        use starling_mcdist::SourcePage;
        let mut data = vec![0u8; addrs.len() * PAGE];
        let ok = self.0.read(addrs, &mut data);
        data.chunks_exact(PAGE)
            .zip(ok)
            .map(|(p, ok)| match ok {
                false => SourcePage::Unreadable,
                true if p.iter().all(|&b| b == 0) => SourcePage::Zero,
                true => SourcePage::Data(p.to_vec()),
            })
            .collect()
    }
}

pub struct PageServer {
    addr: SocketAddr,
    mcdist: Option<(McdistInfo, Sender)>,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
    accept_thread: Option<std::thread::JoinHandle<()>>,
}

impl PageServer {
    /// Serve pages of `pid` within `regions` ([start, end) pairs, sorted).
    pub fn start(pid: i32, regions: Vec<(u64, u64)>, bind: SocketAddr) -> Result<PageServer> {
        Self::start_with(pid, regions, bind, PageServerOptions::default())
    }

    /// As [`PageServer::start`], with explicit options. A multicast sender
    /// that cannot start (no IPv4, socket errors) only leaves the server
    /// unicast; clones find out through the `SFPM` request.
    pub fn start_with(pid: i32, regions: Vec<(u64, u64)>, bind: SocketAddr, opts: PageServerOptions) -> Result<PageServer> {
        let listener = TcpListener::bind(bind).map_err(|e| ForkError::io(format!("bind page server {bind}"), e))?;
        let addr = listener.local_addr().map_err(|e| ForkError::io("page server address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ServerStats::default());
        let image = Image::new(pid, regions, opts.descriptor, stats.clone());
        let mcdist = match (opts.mcdist, addr) {
            (Switch::Off, _) => None,
            (switch, SocketAddr::V4(a)) => {
                let ticket = opts.ticket.unwrap_or((i64::from(pid).cast_unsigned() << 16) ^ u64::from(a.port()));
                let group = starling_mcdist::group_for_ticket(ticket);
                let iface = if a.ip().is_unspecified() { Ipv4Addr::LOCALHOST } else { *a.ip() };
                let mut cfg = SenderConfig::new(ticket, opts.key, group, iface);
                cfg.push = switch == Switch::Push;
                cfg.encrypt = opts.encrypt;
                // The MTU of the link the group goes out on: a page is one datagram
                // when it fits (loopback, the embedded cluster's 9000-byte bridge),
                // else it is split; 1500 when the link is not found.
                cfg.mtu = link_mtu(iface).unwrap_or(DEFAULT_MTU);
                let source = TemplateSource(image.clone());
                match Sender::start(cfg, Box::new(source)) {
                    Ok(sender) => {
                        let info = McdistInfo { push: switch == Switch::Push, ticket, group, sender: sender.request_addr(), encrypted: opts.encrypt };
                        Some((info, sender))
                    }
                    Err(e) => {
                        log::warn!("page server {addr}: multicast sender not started ({e}); unicast only");
                        None
                    }
                }
            }
            (_, SocketAddr::V6(_)) => None,
        };
        let info = mcdist.as_ref().map(|(i, _)| *i);
        let (stop2, stats2, key, encrypt) = (stop.clone(), stats.clone(), opts.key, opts.encrypt);
        let accept_thread = std::thread::Builder::new()
            .name("sf-page-server".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (image, stats) = (image.clone(), stats2.clone());
                    let _ = std::thread::Builder::new().name("sf-page-conn".into()).spawn(move || {
                        // A protocol error only ends this connection.
                        let _ = serve_connection(&image, &stats, info, &key, encrypt, conn);
                    });
                }
            })
            .map_err(|e| ForkError::io("spawn page server", e))?;
        Ok(PageServer { addr, mcdist, stop, stats, accept_thread: Some(accept_thread) })
    }

    /// The multicast distribution of this server, if it runs.
    pub fn mcdist(&self) -> Option<McdistInfo> {
        self.mcdist.as_ref().map(|(i, _)| *i)
    }

    /// The multicast sender (stats, rate trace), if it runs.
    pub fn mcdist_sender(&self) -> Option<&Sender> {
        self.mcdist.as_ref().map(|(_, s)| s)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }

    /// Everything sent so far by this server and its multicast sender
    /// (still readable after [`PageServer::stop`]).
    pub fn wire_stats(&self) -> WireStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let st = &self.stats;
        let mut w = WireStats {
            bytes_tcp: g(&st.bytes_wire),
            pages_requested: g(&st.pages_requested),
            pages_served: g(&st.pages_data) + g(&st.pages_zero),
            descriptor_pages_sent: g(&st.descriptor_pages_sent),
            ..WireStats::default()
        };
        if let Some(s) = self.mcdist_sender() {
            let ms = s.stats();
            w.bytes_multicast = g(&ms.bytes_wire);
            w.pages_requested += g(&ms.pages_requested);
            w.pages_served += g(&ms.pages_sent);
            w.rate_cuts = g(&ms.rate_cuts);
            w.implicit_losses = g(&ms.implicit_losses);
            w.lockstep_suppressed = g(&ms.lockstep_suppressed);
            w.pages_pushed = g(&ms.pages_pushed);
            w.multicast_data_pages = g(&ms.data_pages);
            w.multicast_data_datagrams = g(&ms.data_datagrams);
            w.multicast_mtu = s.mtu() as u64;
            w.multicast_receivers = g(&ms.receivers_joined);
            // `as` from f64 saturates at the bounds and maps NaN to 0: whole bytes/s.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let whole = |rate: f64| rate as u64;
            w.rate_now = whole(s.rate());
            w.rate_min = s.rate_trace().iter().map(|t| whole(t.rate)).min().unwrap_or(w.rate_now).min(w.rate_now);
        }
        w.bytes_wire = w.bytes_tcp + w.bytes_multicast;
        w
    }

    /// Stop accepting (open connections end when their peers close).
    pub fn stop(&mut self) {
        if let Some(t) = self.accept_thread.take() {
            self.stop.store(true, Ordering::Release);
            let _ = TcpStream::connect(self.addr); // wake the accept loop
            let _ = t.join();
        }
        // Stopped but kept: its counters and rate trace stay readable.
        if let Some((_, s)) = self.mcdist.as_mut() {
            s.stop();
        }
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn in_regions(regions: &[(u64, u64)], addr: u64) -> bool {
    let i = regions.partition_point(|&(_, end)| end <= addr);
    regions.get(i).is_some_and(|&(start, end)| start <= addr && addr + PAGE_SIZE <= end)
}

fn encode_mcdist(info: Option<McdistInfo>) -> Vec<u8> {
    let mut out = MCDIST_REPLY_MAGIC.to_vec();
    let Some(i) = info else {
        out.extend_from_slice(&[0u8; 1 + 8 + 6 + 6]);
        return out;
    };
    out.push(if i.push { 2 } else { 1 } | if i.encrypted { ENCRYPTED_GROUP } else { 0 });
    out.extend_from_slice(&i.ticket.to_le_bytes());
    out.extend_from_slice(&i.group.ip().octets());
    out.extend_from_slice(&i.group.port().to_le_bytes());
    out.extend_from_slice(&i.sender.ip().octets());
    out.extend_from_slice(&i.sender.port().to_le_bytes());
    out
}

const HELLO_MAGIC: [u8; 4] = *b"SFPA";
const CHALLENGE_MAGIC: [u8; 4] = *b"SFPB";
const PROOF_MAGIC: [u8; 4] = *b"SFPC";
const NONCE: usize = 32;
/// The `SFPN` mode bit saying the group's pages are encrypted.
const ENCRYPTED_GROUP: u8 = 0x80;

/// Server side of the key proof (module doc), `encrypt`: this side's
/// `fork.encrypt`. Err closes the connection. Read unbuffered: nothing
/// after the proof is taken from `rd`.
pub fn prove_server(key: &SecretKey, encrypt: bool, rd: &mut impl Read, wr: &mut impl Write) -> Result<Secrecy> {
    let io = |e| ForkError::io("page server handshake", e);
    let mut hello = [0u8; 4 + NONCE + 1];
    rd.read_exact(&mut hello).map_err(io)?;
    let wants = hello[4 + NONCE];
    if hello[..4] != HELLO_MAGIC || wants > 1 {
        return Err(PageProtocolError::KeyProof.into());
    }
    let nonce_c = &hello[4..4 + NONCE];
    let nonce_s = SecretKey::random().0;
    let encrypted = wants | u8::from(encrypt);
    let transcript: [&[u8]; 4] = [nonce_c, &[wants], &nonce_s, &[encrypted]];
    let mac = starling_mcdist::seal::mac(key, b"SFP server", &transcript);
    wr.write_all(&CHALLENGE_MAGIC)
        .and_then(|_| wr.write_all(&nonce_s))
        .and_then(|_| wr.write_all(&[encrypted]))
        .and_then(|_| wr.write_all(&mac))
        .and_then(|_| wr.flush())
        .map_err(io)?;
    let mut proof = [0u8; 4 + starling_mcdist::seal::MAC_LEN];
    rd.read_exact(&mut proof).map_err(io)?;
    if proof[..4] != PROOF_MAGIC || !starling_mcdist::seal::verify(key, b"SFP client", &transcript, &proof[4..]) {
        return Err(PageProtocolError::KeyProof.into());
    }
    Ok(if encrypted == 1 { Secrecy::encrypted(key, nonce_c, &nonce_s, false) } else { Secrecy::clear() })
}

/// Client side of the key proof (module doc), `encrypt`: this side's
/// `fork.encrypt` (a server that would not encrypt is then refused).
pub fn prove_client(key: &SecretKey, encrypt: bool, rd: &mut impl Read, wr: &mut impl Write) -> Result<Secrecy> {
    let io = |e| ForkError::io("page server handshake", e);
    let nonce_c = SecretKey::random().0;
    let wants = u8::from(encrypt);
    wr.write_all(&HELLO_MAGIC).and_then(|_| wr.write_all(&nonce_c)).and_then(|_| wr.write_all(&[wants])).and_then(|_| wr.flush()).map_err(io)?;
    let mut ch = [0u8; 4 + NONCE + 1 + starling_mcdist::seal::MAC_LEN];
    rd.read_exact(&mut ch).map_err(io)?;
    let nonce_s = &ch[4..4 + NONCE];
    let encrypted = ch[4 + NONCE];
    let transcript: [&[u8]; 4] = [&nonce_c, &[wants], nonce_s, &[encrypted]];
    if ch[..4] != CHALLENGE_MAGIC || !starling_mcdist::seal::verify(key, b"SFP server", &transcript, &ch[4 + NONCE + 1..]) {
        return Err(PageProtocolError::KeyProof.into());
    }
    if encrypted > 1 || encrypted < wants {
        return Err(PageProtocolError::KeyProof.into());
    }
    let mac = starling_mcdist::seal::mac(key, b"SFP client", &transcript);
    wr.write_all(&PROOF_MAGIC).and_then(|_| wr.write_all(&mac)).and_then(|_| wr.flush()).map_err(io)?;
    Ok(if encrypted == 1 { Secrecy::encrypted(key, &nonce_c, nonce_s, true) } else { Secrecy::clear() })
}

/// A proven connection's two halves, encrypted or clear as its proof settled.
pub type Halves = (StreamReader<TcpStream>, StreamWriter<TcpStream>);

/// Split `conn` after its proof.
pub fn halves(conn: TcpStream, secrecy: Secrecy) -> Result<Halves> {
    let read = conn.try_clone().map_err(|e| ForkError::io("clone socket", e))?;
    Ok(secrecy.split(read, conn))
}

/// Dial `addr` and prove `key` as a client (`encrypt`: this side's `fork.encrypt`).
pub fn connect_proven(addr: SocketAddr, key: &SecretKey, encrypt: bool) -> Result<Halves> {
    let s = TcpStream::connect(addr).map_err(|e| ForkError::io(format!("connect page server {addr}"), e))?;
    let _ = s.set_nodelay(true);
    let secrecy = prove_client(key, encrypt, &mut &s, &mut &s)?;
    halves(s, secrecy)
}

/// One request of a page-server connection, as [`read_request`] parses it.
#[derive(Debug, PartialEq, Eq)]
pub enum PageRequest {
    /// Whether (and where) the server multicasts.
    McdistInfo,
    /// These pages (1..=`MAX_BATCH` addresses, not yet checked against the image).
    Pages(Vec<u64>),
}

/// Read the next request from a proven client; None at a clean end of the
/// connection. The parser of the bytes a clone host sends the user's
/// process (fuzz target `page_server`).
pub fn read_request(rd: &mut impl Read) -> Result<Option<PageRequest>> {
    let mut hdr = [0u8; 8];
    match rd.read_exact(&mut hdr) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(ForkError::io("read page request", e)),
    }
    if hdr[..4] == MCDIST_MAGIC {
        // 4 bytes of magic were enough; the other 4 are zero padding.
        return Ok(Some(PageRequest::McdistInfo));
    }
    if hdr[..4] != REQ_MAGIC {
        return Err(PageProtocolError::RequestMagic.into());
    }
    let count = u32::from_le_bytes(hdr[4..].try_into().expect("4 bytes"));
    if count == 0 || count > MAX_BATCH {
        return Err(PageProtocolError::BatchSize(count as usize).into());
    }
    let mut raw = vec![0u8; count as usize * 8];
    rd.read_exact(&mut raw).map_err(|e| ForkError::io("read page addresses", e))?;
    Ok(Some(PageRequest::Pages(raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())))
}

/// Read the answer to a request for `n` pages: the parser of the bytes the
/// user's process sends a clone host (fuzz target `page_server`).
pub fn read_reply(rd: &mut impl Read, n: usize) -> Result<Vec<PageReply>> {
    let io = |e| ForkError::io("page server", e);
    let mut hdr = [0u8; 8];
    rd.read_exact(&mut hdr).map_err(io)?;
    if hdr[..4] != REPLY_MAGIC || u32::from_le_bytes(hdr[4..].try_into().expect("4 bytes")) as usize != n {
        return Err(PageProtocolError::ReplyHeader.into());
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut tag = [0u8; 1];
        rd.read_exact(&mut tag).map_err(io)?;
        out.push(match tag[0] {
            TAG_ZERO => PageReply::Zero,
            TAG_DATA => {
                let mut page = vec![0u8; PAGE].into_boxed_slice();
                rd.read_exact(&mut page).map_err(io)?;
                PageReply::Data(page)
            }
            TAG_UNREADABLE => PageReply::Unreadable,
            t => return Err(PageProtocolError::PageTag(t).into()),
        });
    }
    Ok(out)
}

fn serve_connection(image: &Image, stats: &ServerStats, info: Option<McdistInfo>, key: &SecretKey, encrypt: bool, conn: TcpStream) -> Result<()> {
    let _ = conn.set_nodelay(true);
    let secrecy = match prove_server(key, encrypt, &mut &conn, &mut &conn) {
        Ok(s) => s,
        Err(e) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let (mut rd, mut wr) = halves(conn, secrecy)?;
    loop {
        let addrs = match read_request(&mut rd)? {
            None => return Ok(()),
            Some(PageRequest::McdistInfo) => {
                let reply = encode_mcdist(info);
                wr.write_all(&reply).and_then(|_| wr.flush()).map_err(|e| ForkError::io("write reply", e))?;
                stats.bytes_wire.fetch_add(tcp_wire_bytes(reply.len() as u64), Ordering::Relaxed);
                continue;
            }
            Some(PageRequest::Pages(addrs)) => addrs,
        };
        if let Some(bad) = addrs.iter().find(|&&a| !image.serves(a)) {
            return Err(PageProtocolError::NotServed(*bad).into());
        }
        stats.requests.fetch_add(1, Ordering::Relaxed);
        stats.pages_requested.fetch_add(addrs.len() as u64, Ordering::Relaxed);
        let count = u32::try_from(addrs.len()).expect("at most MAX_BATCH");
        wr.write_all(&REPLY_MAGIC).and_then(|_| wr.write_all(&count.to_le_bytes())).map_err(|e| ForkError::io("write reply", e))?;
        let mut reply_bytes = 8u64;
        // The pages are read from the template straight into the reply's
        // record, each in a slot after its tag, as many at a time as the
        // record has room for; zero and unreadable pages are then dropped
        // from it (their tag says it all) and the rest moved up.
        let mut left = &addrs[..];
        while !left.is_empty() {
            let fit = match wr.room() / SLOT {
                0 => crate::stream::RECORD / SLOT,
                n => n,
            };
            let (now, rest) = left.split_at(fit.min(left.len()));
            left = rest;
            let mut used = 0;
            wr.write_in_place(now.len() * SLOT, |slots| {
                let ok = image.read_slots(now, slots);
                for (i, ok) in ok.into_iter().enumerate() {
                    let page = i * SLOT + 1;
                    let tag = if !ok {
                        TAG_UNREADABLE
                    } else if slots[page..page + PAGE].iter().all(|&b| b == 0) {
                        stats.pages_zero.fetch_add(1, Ordering::Relaxed);
                        TAG_ZERO
                    } else {
                        stats.pages_data.fetch_add(1, Ordering::Relaxed);
                        TAG_DATA
                    };
                    // `used` <= i * SLOT: the tag lands before this page's bytes.
                    slots[used] = tag;
                    used += 1;
                    if tag == TAG_DATA {
                        if used != page {
                            slots.copy_within(page..page + PAGE, used);
                        }
                        used += PAGE;
                    }
                }
                used
            })
            .map_err(|e| ForkError::io("write reply", e))?;
            reply_bytes += used as u64;
        }
        wr.flush().map_err(|e| ForkError::io("write reply", e))?;
        stats.bytes_wire.fetch_add(tcp_wire_bytes(reply_bytes), Ordering::Relaxed);
    }
}

/// A reply of `payload` bytes as sent on the wire: payload plus one
/// TCP/IP header per started segment.
fn tcp_wire_bytes(payload: u64) -> u64 {
    payload + payload.div_ceil(TCP_MSS) * TCP_SEGMENT_OVERHEAD
}

/// Read `addrs` from `pid`, page i into `out[at + i * stride..][..PAGE]`, with
/// one `process_vm_readv`; returns per-page success.
fn read_pages(pid: i32, addrs: &[u64], out: &mut [u8], at: usize, stride: usize) -> Vec<bool> {
    assert!(stride >= PAGE && (addrs.is_empty() || at + (addrs.len() - 1) * stride + PAGE <= out.len()), "pages outside the buffer");
    let remote: Vec<libc::iovec> =
        addrs.iter().map(|&a| libc::iovec { iov_base: a as *mut libc::c_void, iov_len: PAGE }).collect();
    let local: Vec<libc::iovec> =
        (0..addrs.len()).map(|i| libc::iovec { iov_base: out[at + i * stride..].as_mut_ptr().cast(), iov_len: PAGE }).collect();
    // SAFETY: `local` covers disjoint pages of `out`, which we own mutably;
    // remote iovecs are addresses in the other process (the kernel checks them).
    let n = unsafe { libc::process_vm_readv(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0) };
    if usize::try_from(n).ok() == Some(addrs.len() * PAGE) {
        return vec![true; addrs.len()];
    }
    // Partial read: retry page by page to find out which are unreadable.
    local
        .iter()
        .zip(&remote)
        .map(|(l, r)| {
            // SAFETY: as above, one page.
            unsafe { libc::process_vm_readv(pid, l, 1, r, 1, 0) == PAGE.cast_signed() }
        })
        .collect()
}

/// Poll `socket` without sleeping until it is readable (or in error) or
/// `spin` has passed; whether it became readable.
fn spin_until_readable(socket: &TcpStream, spin: std::time::Duration) -> bool {
    use std::os::fd::AsRawFd;
    let started = std::time::Instant::now();
    loop {
        let mut p = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: polls one fd we hold, with a zero timeout.
        if unsafe { libc::poll(&raw mut p, 1, 0) } != 0 {
            return true;
        }
        if started.elapsed() >= spin {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// One page in a reply.
pub enum PageReply {
    Zero,
    Data(Box<[u8]>),
    Unreadable,
}

/// A page from the TCP server as the fault handler takes it from either path.
impl From<PageReply> for starling_mcdist::Fetched {
    fn from(r: PageReply) -> Self {
        match r {
            PageReply::Data(d) => starling_mcdist::Fetched::Data(d.into_vec()),
            PageReply::Zero => starling_mcdist::Fetched::Zero,
            PageReply::Unreadable => starling_mcdist::Fetched::Unreadable,
        }
    }
}

/// Client side of the protocol.
pub struct PageClient {
    rd: StreamReader<TcpStream>,
    wr: StreamWriter<TcpStream>,
    key: SecretKey,
    server: SocketAddr,
    encrypt: bool,
    /// Busy-poll for a reply this long before sleeping in `read`.
    reply_spin: std::time::Duration,
}

impl PageClient {
    /// Connect and prove `key` (the ticket's); fails if the server does not
    /// prove it back, or (`encrypt`: this host's `fork.encrypt`) would not encrypt.
    pub fn connect(addr: SocketAddr, key: &SecretKey, encrypt: bool) -> Result<PageClient> {
        let (rd, wr) = connect_proven(addr, key, encrypt)?;
        Ok(PageClient { rd, wr, key: *key, server: addr, encrypt, reply_spin: std::time::Duration::ZERO })
    }

    /// Busy-poll for each reply up to `spin` before sleeping in `read`
    /// (`fork.reply_spin_us`): a reply that comes meanwhile costs this
    /// thread no wake-up, one that does not costs `spin` of a core.
    pub fn set_reply_spin(&mut self, spin: std::time::Duration) {
        self.reply_spin = spin;
    }

    /// The ticket's key (multicast is sealed with it).
    pub fn key(&self) -> &SecretKey {
        &self.key
    }

    /// The page server's address (as dialled).
    pub fn peer_addr(&self) -> SocketAddr {
        self.server
    }

    /// Whether this side asked for encryption (another connection asks the same).
    pub fn wants_encryption(&self) -> bool {
        self.encrypt
    }

    /// Whether this connection is encrypted.
    pub fn is_encrypted(&self) -> bool {
        self.rd.is_encrypted()
    }

    /// Local address of the connection (the interface to join multicast on).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.wr.get_ref().local_addr().ok()
    }

    /// Ask the server whether (and where) it multicasts pages.
    pub fn mcdist_info(&mut self) -> Result<Option<McdistInfo>> {
        let io = |e| ForkError::io("page server", e);
        self.wr.write_all(&MCDIST_MAGIC).and_then(|_| self.wr.write_all(&[0u8; 4])).map_err(io)?;
        self.wr.flush().map_err(io)?;
        let mut r = [0u8; 4 + 1 + 8 + 6 + 6];
        self.rd.read_exact(&mut r).map_err(io)?;
        if r[..4] != MCDIST_REPLY_MAGIC {
            return Err(PageProtocolError::McdistReply.into());
        }
        let v4 = |o: usize| {
            SocketAddrV4::new(Ipv4Addr::new(r[o], r[o + 1], r[o + 2], r[o + 3]), u16::from_le_bytes([r[o + 4], r[o + 5]]))
        };
        let encrypted = r[4] & ENCRYPTED_GROUP != 0;
        Ok(match r[4] & !ENCRYPTED_GROUP {
            0 => None,
            m @ (1 | 2) => {
                let sender = v4(19);
                // A sender bound to 0.0.0.0 is reached at the page server's address.
                let sender = match (sender.ip().is_unspecified(), self.wr.get_ref().peer_addr()) {
                    (true, Ok(SocketAddr::V4(p))) => SocketAddrV4::new(*p.ip(), sender.port()),
                    _ => sender,
                };
                Some(McdistInfo {
                    push: m == 2,
                    ticket: u64::from_le_bytes(r[5..13].try_into().expect("8 bytes")),
                    group: v4(13),
                    sender,
                    encrypted,
                })
            }
            m => return Err(PageProtocolError::McdistMode(m).into()),
        })
    }

    /// Fetch a batch of page addresses (1..=MAX_BATCH).
    pub fn fetch(&mut self, addrs: &[u64]) -> Result<Vec<PageReply>> {
        if addrs.is_empty() || addrs.len() > MAX_BATCH as usize {
            return Err(PageProtocolError::BatchSize(addrs.len()).into());
        }
        let io = |e| ForkError::io("page server", e);
        self.wr.write_all(&REQ_MAGIC).map_err(io)?;
        self.wr.write_all(&u32::try_from(addrs.len()).expect("at most MAX_BATCH, checked above").to_le_bytes()).map_err(io)?;
        for a in addrs {
            self.wr.write_all(&a.to_le_bytes()).map_err(io)?;
        }
        self.wr.flush().map_err(io)?;
        if !self.reply_spin.is_zero() && !self.rd.has_buffered() {
            spin_until_readable(self.rd.get_ref(), self.reply_spin);
        }
        read_reply(&mut self.rd, addrs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_mtu_reads_the_interface_holding_the_address() {
        // What `ip` says loopback's MTU is (another reader than ours).
        let out = std::process::Command::new("ip").args(["-o", "link", "show", "dev", "lo"]).output().expect("ip");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let want: usize =
            text.split_whitespace().skip_while(|w| *w != "mtu").nth(1).and_then(|m| m.parse().ok()).expect("ip shows lo's mtu");
        assert_eq!(link_mtu(Ipv4Addr::LOCALHOST), Some(want));
        // An address no interface holds.
        assert_eq!(link_mtu(Ipv4Addr::new(192, 0, 2, 77)), None);
    }
}
