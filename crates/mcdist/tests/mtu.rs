//! A page is one datagram when the link's MTU fits it, and is split (and
//! still arrives whole) when it does not.

use starling_mcdist::wire;
use starling_proto::SecretKey;
use starling_mcdist::{Fetched, PageSink, PageSource, Receiver, ReceiverConfig, Sender, SenderConfig, SourcePage};
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const BASE: u64 = 0x7100_0000;
const PAGES: u64 = 8;

/// Page i: byte k is (i * 31 + k) mod 251, so every fragment differs.
struct Image {
    regions: Vec<(u64, u64)>,
}

fn page(addr: u64) -> Vec<u8> {
    let i = (addr - BASE) / wire::PAGE as u64;
    (0..wire::PAGE as u64).map(|k| u8::try_from((i * 31 + k) % 251).expect("< 251")).collect()
}

impl PageSource for Image {
    fn regions(&self) -> &[(u64, u64)] {
        &self.regions
    }

    fn read(&mut self, addrs: &[u64]) -> Vec<SourcePage> {
        addrs.iter().map(|&a| SourcePage::Data(page(a))).collect()
    }
}

struct Refuse;

impl PageSink for Refuse {
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        vec![false; pages.len()]
    }
}

/// Fetch every page over loopback multicast with the sender split to `mtu`:
/// the data datagrams it took.
fn data_datagrams_at(mtu: usize, ticket: u64) -> (u64, u64) {
    let group = starling_mcdist::group_for_ticket(ticket);
    let lo = Ipv4Addr::LOCALHOST;
    let key = SecretKey::random();
    let mut cfg = SenderConfig::new(ticket, key, group, lo);
    cfg.mtu = mtu;
    let image = Image { regions: vec![(BASE, BASE + PAGES * wire::PAGE as u64)] };
    let mut sender = Sender::start(cfg, Box::new(image)).expect("sender on loopback");
    assert_eq!(sender.mtu(), mtu);
    let rcfg = ReceiverConfig::new(ticket, key, group, lo, sender.request_addr(), 1);
    let mut rx = Receiver::start(rcfg, Arc::new(Refuse)).expect("receiver on loopback");
    let addrs: Vec<u64> = (0..PAGES).map(|i| BASE + i * wire::PAGE as u64).collect();
    let pages = rx.fetch(&addrs).expect("fetch");
    for (a, p) in addrs.iter().zip(pages) {
        match p {
            Fetched::Data(d) => assert!(d.iter().eq(page(*a).iter()), "page {a:#x} at MTU {mtu} is not the image's"),
            other => panic!("page {a:#x} at MTU {mtu}: {other:?}"),
        }
    }
    rx.stop();
    let s = sender.stats();
    let counts = (s.data_pages.load(Ordering::Relaxed), s.data_datagrams.load(Ordering::Relaxed));
    sender.stop();
    counts
}

#[test]
fn a_page_is_one_datagram_at_mtu_9000_and_three_at_1500() {
    let base = 9_000 + u64::from(std::process::id() % 1000) * 2;
    let (pages, datagrams) = data_datagrams_at(9000, base);
    assert!(pages >= PAGES, "{pages} data pages sent for {PAGES}");
    assert_eq!(datagrams, pages, "MTU 9000: one datagram per page");
    let (pages, datagrams) = data_datagrams_at(1500, base + 1);
    assert!(pages >= PAGES, "{pages} data pages sent for {PAGES}");
    // 4096 bytes + headers in 1500-byte IP packets: 3 fragments each.
    assert_eq!(datagrams, 3 * pages, "MTU 1500: a page is split");
}
