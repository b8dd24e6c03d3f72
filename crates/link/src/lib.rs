//! WAN link emulation in user space.
//!
//! UCop's finding is that the user's link to the cluster (high latency, low
//! bandwidth) decides everything, so every measurement must be made across
//! such a link. This kernel has no `netem`, so the link is a TCP relay that
//! sits between the client and the head and shapes each direction:
//!
//! - *delay*: every byte is released one-way-delay (RTT/2) after it entered;
//! - *bandwidth*: bytes leave no faster than the direction's rate
//!   (serialisation delay, like a modem's queue).
//!
//! It also counts what crosses: bytes each way and *flights*: a flight
//! upstream is a burst of client bytes sent after the client last heard
//! from the head, so the number of upstream flights on a launch's critical
//! path is the number of WAN round trips it paid.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A link profile: round-trip time and the rate of each direction.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub rtt_ms: f64,
    /// Client → cluster, kilobits per second (0 = unlimited).
    pub up_kbit: f64,
    /// Cluster → client, kilobits per second (0 = unlimited).
    pub down_kbit: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("unknown link profile {0:?}; expected {names}", names = Profile::NAMES)]
    UnknownProfile(String),
    #[error("{value:?} is not a number from 0 to 1e7 in link profile {profile:?}")]
    BadNumber { value: String, profile: String },
    #[error("link: cannot listen on {addr}: {source}")]
    Listen { addr: String, #[source] source: std::io::Error },
    #[error("link: accepting connections: {0}")]
    Accept(#[source] std::io::Error),
}

impl Profile {
    pub const NAMES: &'static str = "lan, cable-modem, coffee-shop, or RTT_MS,UP_KBIT,DOWN_KBIT";

    /// `lan` (no shaping), `cable-modem`, `coffee-shop` (UCop's profiles), or `RTT_MS,UP_KBIT,DOWN_KBIT`.
    pub fn parse(s: &str) -> Result<Profile, LinkError> {
        Ok(match s {
            "lan" => Profile { rtt_ms: 0.0, up_kbit: 0.0, down_kbit: 0.0 },
            "cable-modem" => Profile { rtt_ms: 70.0, up_kbit: 4096.0, down_kbit: 16384.0 },
            "coffee-shop" => Profile { rtt_ms: 160.0, up_kbit: 1400.0, down_kbit: 1500.0 },
            other => {
                let parts: Vec<&str> = other.split(',').collect();
                if parts.len() != 3 {
                    return Err(LinkError::UnknownProfile(other.to_string()));
                }
                let n = |p: &str| -> Result<f64, LinkError> {
                    p.trim()
                        .parse()
                        .ok()
                        .filter(|v: &f64| (0.0..=1e7).contains(v))
                        .ok_or_else(|| LinkError::BadNumber { value: p.to_string(), profile: other.to_string() })
                };
                Profile { rtt_ms: n(parts[0])?, up_kbit: n(parts[1])?, down_kbit: n(parts[2])? }
            }
        })
    }

    pub fn is_lan(&self) -> bool {
        self.rtt_ms == 0.0 && self.up_kbit == 0.0 && self.down_kbit == 0.0
    }

    pub fn describe(&self) -> String {
        if self.is_lan() {
            return "lan (no shaping)".into();
        }
        let rate = |k: f64| if k == 0.0 { "unlimited".to_string() } else { format!("{k} kbit/s") };
        format!("{} ms RTT, up {}, down {}", self.rtt_ms, rate(self.up_kbit), rate(self.down_kbit))
    }
}

/// What crossed the link since the relay started.
#[derive(Default, Debug)]
pub struct Counters {
    pub bytes_up: AtomicU64,
    pub bytes_down: AtomicU64,
    pub flights_up: AtomicU64,
    pub connections: AtomicU64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CounterSnapshot {
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub flights_up: u64,
    pub connections: u64,
}

impl Counters {
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            bytes_up: self.bytes_up.load(Ordering::Relaxed),
            bytes_down: self.bytes_down.load(Ordering::Relaxed),
            flights_up: self.flights_up.load(Ordering::Relaxed),
            connections: self.connections.load(Ordering::Relaxed),
        }
    }
}

/// Upstream silence that separates two flights.
const FLIGHT_GAP: Duration = Duration::from_millis(2);

/// One direction of the link: a delay line plus a rate limiter. The rate
/// is the link's, shared by every connection crossing it (`link_free`).
struct Direction {
    one_way: Duration,
    bytes_per_sec: f64,
    /// When the link finishes sending what is already queued on it.
    link_free: Arc<std::sync::Mutex<Instant>>,
}

impl Direction {
    /// Copy `from` → `to`, shaping. Each read segment is stamped with when
    /// its last bit would leave a serialising link, then released one-way
    /// delay later; segments stay in order.
    async fn pump(
        &self,
        mut from: impl AsyncRead + Unpin,
        mut to: impl AsyncWrite + Unpin + Send + 'static,
        on_bytes: impl Fn(usize, Duration) + Send + 'static,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let one_way = self.one_way;
        let writer = tokio::spawn(async move {
            while let Some((at, data)) = rx.recv().await {
                tokio::time::sleep_until(at).await;
                if to.write_all(&data).await.is_err() {
                    return;
                }
            }
            let _ = to.shutdown().await;
        });
        let mut buf = vec![0u8; 16 << 10];
        // The first segment always starts a flight.
        let mut ready = Instant::now().checked_sub(Duration::from_secs(1)).unwrap_or_else(Instant::now);
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // How long the sender kept us waiting (not counting our own back-pressure pauses).
            on_bytes(n, ready.elapsed());
            let ser = if self.bytes_per_sec > 0.0 { Duration::from_secs_f64(n as f64 / self.bytes_per_sec) } else { Duration::ZERO };
            let link_free = {
                let mut free = self.link_free.lock().unwrap();
                *free = (*free).max(Instant::now()) + ser;
                *free
            };
            if tx.send((link_free + one_way, buf[..n].to_vec())).is_err() {
                break;
            }
            // Back-pressure: don't read far ahead of what the link has sent.
            let backlog = link_free.saturating_duration_since(Instant::now());
            if backlog > Duration::from_millis(200) {
                tokio::time::sleep(backlog - Duration::from_millis(100)).await;
            }
            ready = Instant::now();
        }
        drop(tx);
        let _ = writer.await;
    }
}

/// Relay connections accepted on `listen` to `target` through a link shaped by `profile`.
pub async fn run_relay(listen: &str, target: &str, profile: Profile, counters: Arc<Counters>) -> Result<(), LinkError> {
    let l = TcpListener::bind(listen).await.map_err(|source| LinkError::Listen { addr: listen.to_string(), source })?;
    run_relay_on(l, target.to_string(), profile, counters).await
}

pub async fn run_relay_on(
    l: TcpListener,
    target: String,
    profile: Profile,
    counters: Arc<Counters>,
) -> Result<(), LinkError> {
    run_relay_with(l, None, target, profile, counters).await
}

/// With the cluster's relay credentials: local users connect to the relay's
/// Unix socket, where the kernel names them; the relay dials the head over
/// mutual TLS with its relay certificate and, before the user's bytes, tells
/// the head whom it speaks for (`Msg::OnBehalfOf`, a starling frame).
pub struct RelayAuth {
    /// The local users' socket (mode 0666).
    pub socket: tokio::net::UnixListener,
    /// The relay's credentials: read for each connection (a CA rotation replaces them).
    pub dir: starling_auth::AuthDir,
}

/// Relay connections accepted on `l` (as bytes: a client there speaks TLS to
/// the head itself, if the head wants it) and, with `auth`, on its Unix
/// socket (see [`RelayAuth`]), to `target` through a link shaped by `profile`.
/// The shaping applies to the user's bytes; the relay's own TLS handshake
/// with the head is not charged to the emulated link.
pub async fn run_relay_with(
    l: TcpListener,
    auth: Option<RelayAuth>,
    target: String,
    profile: Profile,
    counters: Arc<Counters>,
) -> Result<(), LinkError> {
    let shared = Arc::new(Shared {
        profile,
        counters,
        up_free: Arc::new(std::sync::Mutex::new(Instant::now())),
        down_free: Arc::new(std::sync::Mutex::new(Instant::now())),
    });
    if let Some(auth) = auth {
        let (shared, target) = (shared.clone(), target.clone());
        tokio::spawn(async move {
            loop {
                let client = match auth.socket.accept().await {
                    Ok((c, _)) => c,
                    Err(e) => {
                        log::warn!("link: accepting a local client: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let connector = match auth.dir.connector(starling_auth::Role::Relay) {
                    Ok(c) => c,
                    Err(e) => {
                        log::warn!("link: the relay's credentials: {e}");
                        continue;
                    }
                };
                let (shared, target) = (shared.clone(), target.clone());
                tokio::spawn(async move {
                    let cred = match starling_auth::unix_peer(&client) {
                        Ok(c) => c,
                        Err(e) => return log::warn!("link: a local client's credentials: {e}"),
                    };
                    let server = match TcpStream::connect(&target).await {
                        Ok(s) => s,
                        Err(e) => return log::warn!("link: cannot reach {target}: {e}"),
                    };
                    let _ = server.set_nodelay(true);
                    let mut server = match connector.connect(starling_auth::server_name(starling_auth::Role::Head), server).await {
                        Ok(s) => s,
                        Err(e) => return log::warn!("link: TLS to the head {target}: {e}"),
                    };
                    let who = starling_proto::Msg::OnBehalfOf { uid: cred.uid, gid: cred.gid, groups: cred.groups };
                    if let Err(e) = starling_proto::write_frame(&mut server, &who).await {
                        return log::warn!("link: {e}");
                    }
                    let (cr, cw) = tokio::io::split(client);
                    let (sr, sw) = tokio::io::split(server);
                    shared.relay(cr, cw, sr, sw).await;
                });
            }
        });
    }
    loop {
        let (client, _) = l.accept().await.map_err(LinkError::Accept)?;
        let target = target.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            let server = match TcpStream::connect(&target).await {
                Ok(s) => s,
                Err(e) => {
                    log::warn!("link: cannot reach {target}: {e}");
                    return;
                }
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            shared.relay(cr, cw, sr, sw).await;
        });
    }
}

/// What every connection crossing the link shares: its shape, its counters
/// and each direction's queue.
struct Shared {
    profile: Profile,
    counters: Arc<Counters>,
    up_free: Arc<std::sync::Mutex<Instant>>,
    down_free: Arc<std::sync::Mutex<Instant>>,
}

impl Shared {
    /// Pump one connection's two directions through the link until both end.
    async fn relay(
        &self,
        cr: impl AsyncRead + Unpin,
        cw: impl AsyncWrite + Unpin + Send + 'static,
        sr: impl AsyncRead + Unpin,
        sw: impl AsyncWrite + Unpin + Send + 'static,
    ) {
        let counters = &self.counters;
        let profile = self.profile;
        counters.connections.fetch_add(1, Ordering::Relaxed);
        let one_way = Duration::from_secs_f64(profile.rtt_ms / 2000.0);
        let up = Direction { one_way, bytes_per_sec: profile.up_kbit * 1000.0 / 8.0, link_free: self.up_free.clone() };
        let down = Direction { one_way, bytes_per_sec: profile.down_kbit * 1000.0 / 8.0, link_free: self.down_free.clone() };
        // Flight detection: an upstream segment that follows downstream traffic starts a new flight.
        let heard_back = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (c1, h1) = (counters.clone(), heard_back.clone());
        let (c2, h2) = (counters.clone(), heard_back.clone());
        let a = async move {
            up.pump(cr, sw, move |n, waited| {
                c1.bytes_up.fetch_add(n as u64, Ordering::Relaxed);
                // A new flight: the client spoke again after hearing from the head,
                // having been silent (not merely streaming).
                if h1.swap(false, Ordering::Relaxed) && waited >= FLIGHT_GAP {
                    c1.flights_up.fetch_add(1, Ordering::Relaxed);
                }
            })
            .await
        };
        let b = async move {
            down.pump(sr, cw, move |n, _| {
                c2.bytes_down.fetch_add(n as u64, Ordering::Relaxed);
                h2.store(true, Ordering::Relaxed);
            })
            .await
        };
        tokio::join!(a, b);
    }
}

/// Keep a JSON snapshot of the counters at `path`, refreshed every 100 ms
/// (read by `starling status` and the benchmarks).
pub async fn publish_counters(path: std::path::PathBuf, profile: Profile, counters: Arc<Counters>) {
    let mut last = None;
    loop {
        let snap = counters.snapshot();
        if last.as_ref() != Some(&snap) {
            let body = serde_json::json!({"profile": profile, "counters": snap});
            let tmp = path.with_extension("tmp");
            if std::fs::write(&tmp, body.to_string()).is_ok() {
                let _ = std::fs::rename(&tmp, &path);
            }
            last = Some(snap);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_parse() {
        assert!(Profile::parse("lan").unwrap().is_lan());
        let c = Profile::parse("coffee-shop").unwrap();
        assert_eq!((c.rtt_ms, c.up_kbit, c.down_kbit), (160.0, 1400.0, 1500.0));
        assert_eq!(Profile::parse("10,100,200").unwrap(), Profile { rtt_ms: 10.0, up_kbit: 100.0, down_kbit: 200.0 });
        assert!(Profile::parse("modem").is_err());
        assert!(Profile::parse("1,2").is_err());
        assert!(Profile::parse("-1,2,3").is_err());
    }

    /// Echo server behind the link: one exchange costs one RTT, and a bulk
    /// transfer is limited by the rate.
    #[tokio::test]
    async fn delay_and_rate_are_applied() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        let n = match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let link = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let link_addr = link.local_addr().unwrap().to_string();
        let counters = Arc::new(Counters::default());
        // 100 ms RTT; 800 kbit/s = 100 kB/s each way.
        let profile = Profile { rtt_ms: 100.0, up_kbit: 800.0, down_kbit: 800.0 };
        tokio::spawn(run_relay_on(link, echo_addr, profile, counters.clone()));
        let mut s = TcpStream::connect(&link_addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        let t0 = std::time::Instant::now();
        s.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
        let rtt = t0.elapsed();
        assert!(rtt >= Duration::from_millis(100), "one exchange took {rtt:?}");
        assert!(rtt < Duration::from_millis(400), "one exchange took {rtt:?}");
        // 50 kB each way at 100 kB/s: at least 0.5 s to get it all back.
        let data = vec![7u8; 50_000];
        let t0 = std::time::Instant::now();
        let (mut r, mut w) = s.into_split();
        let wr = tokio::spawn(async move { w.write_all(&data).await.unwrap() });
        let mut got = vec![0u8; 50_000];
        r.read_exact(&mut got).await.unwrap();
        wr.await.unwrap();
        let t = t0.elapsed();
        assert!(t >= Duration::from_millis(500), "50 kB at 100 kB/s took {t:?}");
        // Two connections share the link's rate: 2 × 25 kB each way takes as long as 50 kB.
        let mut a = TcpStream::connect(&link_addr).await.unwrap();
        let mut b = TcpStream::connect(&link_addr).await.unwrap();
        let t0 = std::time::Instant::now();
        let half = vec![1u8; 25_000];
        let (h1, h2) = (half.clone(), half.clone());
        let ja = tokio::spawn(async move {
            a.write_all(&h1).await.unwrap();
            let mut g = vec![0u8; 25_000];
            a.read_exact(&mut g).await.unwrap();
        });
        let jb = tokio::spawn(async move {
            b.write_all(&h2).await.unwrap();
            let mut g = vec![0u8; 25_000];
            b.read_exact(&mut g).await.unwrap();
        });
        ja.await.unwrap();
        jb.await.unwrap();
        let t = t0.elapsed();
        assert!(t >= Duration::from_millis(500), "two connections got more than the link's rate: {t:?}");
        let snap = counters.snapshot();
        assert_eq!(snap.bytes_up, 100_004);
        assert_eq!(snap.bytes_down, 100_004);
        assert_eq!(snap.flights_up, 4, "ping, the bulk send after hearing back, and one flight per new connection");
    }
}
