//! Sealed multicast on loopback: datagrams not sealed with the ticket's key
//! never reach a clone, and a receiver without the key gets no page.

mod common;
use common::{page_byte, Image};
use starling_mcdist::wire::{self, DataHeader};
use starling_proto::SecretKey;
use starling_mcdist::{Fetched, McdistError, PageSink, Receiver, ReceiverConfig, Sender, SenderConfig};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BASE: u64 = 0x7000_0000;
const PAGES: u64 = 4;

/// Records every page the receiver offers the clone unasked.
#[derive(Default)]
struct Recorder(Mutex<Vec<(u64, Fetched)>>);

impl PageSink for Recorder {
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        self.0.lock().unwrap().extend(pages.iter().cloned());
        vec![false; pages.len()]
    }
}

/// Wait for `cond`, or fail after a bound far above any plausible delay (not a timing assertion).
fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(120);
    while !cond() {
        assert!(Instant::now() < until, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn forged_datagrams_are_dropped_and_a_receiver_without_the_key_gets_nothing() {
    let ticket = 7_000 + u64::from(std::process::id() % 1000);
    let group = starling_mcdist::group_for_ticket(ticket);
    let lo = Ipv4Addr::LOCALHOST;
    let key = SecretKey::random();
    let mut cfg = SenderConfig::new(ticket, key, group, lo);
    cfg.mtu = 65_535;
    let image = Image::new(BASE, PAGES);
    let mut sender = Sender::start(cfg, Box::new(image)).expect("sender on loopback");

    let sink = Arc::new(Recorder::default());
    let rcfg = ReceiverConfig::new(ticket, key, group, lo, sender.request_addr(), 1);
    let mut rx = Receiver::start(rcfg, sink.clone()).expect("a receiver with the key hears the probe");

    // A forger on the group: for every page, a ZERO and a whole-page
    // FRAGMENT of 0xEE sealed with another key, a FRAGMENT carrying the
    // page's plain BLAKE3 (what the unsealed protocol accepted), one
    // encrypted under another key, and one in clear with the right key's MAC
    // (the sender and receiver encrypt, `fork.encrypt`'s default: a clear
    // page is refused even when its MAC is right).
    let forger = UdpSocket::bind((lo, 0)).unwrap();
    socket2::SockRef::from(&forger).set_multicast_if_v4(&lo).unwrap();
    forger.set_multicast_loop_v4(true).unwrap();
    let other = SecretKey::random();
    let evil = vec![0xEEu8; wire::PAGE];
    let forged: Vec<Vec<u8>> = (0..PAGES)
        .flat_map(|i| {
            let addr = BASE + i * wire::PAGE as u64;
            let mut zero = DataHeader { kind: wire::KIND_ZERO, index: 0, count: 0, ticket, addr, seq: 1, mac: [0; 32] };
            zero.seal(&other, &[]);
            let mut frag = DataHeader { kind: wire::KIND_FRAGMENT, index: 0, count: 1, ticket, addr, seq: 2, mac: [0; 32] };
            frag.seal(&other, &evil);
            let plain = DataHeader { mac: *blake3::hash(&evil).as_bytes(), ..frag.clone() };
            let mut clear = frag.clone();
            clear.seal(&key, &evil);
            let mut encrypted = frag.clone();
            let mut sealed = evil.clone();
            let id = [9u8; 16];
            encrypted.seal_page(&starling_mcdist::seal::Cipher::derive(&other, starling_mcdist::seal::MULTICAST_PAGE, &[&id]), id, &mut sealed);
            [(zero, &evil[..0]), (frag, &evil[..]), (plain, &evil[..]), (clear, &evil[..]), (encrypted, &sealed[..])].map(|(h, payload)| {
                let mut d = vec![0u8; wire::DATA_HEADER + payload.len()];
                h.write(&mut d);
                d[wire::DATA_HEADER..].copy_from_slice(payload);
                d
            })
        })
        .collect();
    let to = SocketAddrV4::new(*group.ip(), group.port());
    let sent = forged.len() as u64;
    wait_for("the receiver saw every forged datagram", || {
        for d in &forged {
            forger.send_to(d, to).unwrap();
        }
        rx.stats().forged.load(Ordering::Relaxed) >= sent
    });
    assert!(sink.0.lock().unwrap().is_empty(), "a forged page reached the clone: {:?}", sink.0.lock().unwrap().len());

    // The real pages still arrive, and are the image's.
    let addrs: Vec<u64> = (0..PAGES).map(|i| BASE + i * wire::PAGE as u64).collect();
    let pages = rx.fetch(&addrs).expect("fetch");
    for (a, p) in addrs.iter().zip(pages) {
        match p {
            Fetched::Data(d) => assert!(d.iter().all(|&b| b == page_byte(BASE, *a)), "page {a:#x} is not the image's"),
            other => panic!("page {a:#x}: {other:?}"),
        }
    }
    rx.stop();

    // Without the key: the sender ignores the receiver's hellos (its probes
    // never come) and the receiver refuses the probes it overhears.
    let invalid_before = sender.stats().invalid.load(Ordering::Relaxed);
    let rcfg = ReceiverConfig::new(ticket, other, group, lo, sender.request_addr(), 2);
    match Receiver::start(rcfg, Arc::new(Recorder::default())) {
        Err(McdistError::NoMulticast(_)) => {}
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("a receiver without the key got the sender's probe"),
    }
    assert!(sender.stats().invalid.load(Ordering::Relaxed) > invalid_before, "the sender must have refused its hellos");
    sender.stop();
}
