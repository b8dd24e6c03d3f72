//! One receiver shared by several clones of a host (loopback): concurrent
//! fetches of the same pages each get them, a page its sink took for one
//! clone is still fetched for another, `present` pages are not asked for,
//! and the sender counts joined receivers by their request sockets.

mod common;
use common::{page_byte, Image};
use starling_mcdist::wire;
use starling_mcdist::{Fetched, PageSink, Receiver, ReceiverConfig, Sender, SenderConfig, SenderStats};
use starling_proto::SecretKey;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

const BASE: u64 = 0x7100_0000;
const PAGES: u64 = 8;
const PAGE: u64 = wire::PAGE as u64;

/// A clone that takes every page offered (says it installed it) and keeps it.
#[derive(Default)]
struct Taker(Mutex<Vec<u64>>);

impl PageSink for Taker {
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        self.0.lock().unwrap().extend(pages.iter().map(|p| p.0));
        vec![true; pages.len()]
    }
}

fn assert_image(addrs: &[u64], pages: &[Fetched]) {
    assert_eq!(addrs.len(), pages.len());
    for (a, p) in addrs.iter().zip(pages) {
        match p {
            Fetched::Data(d) => assert!(d.iter().all(|&b| b == page_byte(BASE, *a)), "page {a:#x} is not the image's"),
            other => panic!("page {a:#x}: {other:?}"),
        }
    }
}

fn setup(offset: u64) -> (Sender, ReceiverConfig) {
    let ticket = 9_000 + offset * 1000 + u64::from(std::process::id() % 1000);
    let group = starling_mcdist::group_for_ticket(ticket);
    let lo = Ipv4Addr::LOCALHOST;
    let key = SecretKey::random();
    let mut cfg = SenderConfig::new(ticket, key, group, lo);
    cfg.mtu = 65_535;
    let image = Image::new(BASE, PAGES);
    let sender = Sender::start(cfg, Box::new(image)).expect("sender on loopback");
    let rcfg = ReceiverConfig::new(ticket, key, group, lo, sender.request_addr(), 1);
    (sender, rcfg)
}

#[test]
fn clones_sharing_a_receiver_each_get_the_pages_they_wait_for() {
    let (sender, rcfg) = setup(0);
    let rx = Arc::new(Receiver::start(rcfg, Arc::new(Taker::default())).expect("receiver on loopback"));
    let addrs: Vec<u64> = (0..PAGES).map(|i| BASE + i * PAGE).collect();
    // Four clones fault on the same pages at once.
    let fetchers: Vec<_> = (0..4)
        .map(|_| {
            let (rx, addrs) = (rx.clone(), addrs.clone());
            std::thread::spawn(move || rx.fetch(&addrs).expect("fetch"))
        })
        .collect();
    for f in fetchers {
        assert_image(&addrs, &f.join().unwrap());
    }
    // The sender saw one receiver join, whatever number of clones fetch through it.
    assert_eq!(SenderStats::get(&sender.stats().receivers_joined), 1);
}

#[test]
fn a_page_the_sink_took_for_one_clone_is_still_fetched_for_another() {
    let (sender, rcfg) = setup(1);
    let taker = Arc::new(Taker::default());
    let shared = Receiver::start(rcfg.clone(), taker.clone()).expect("receiver on loopback");
    // Another host asks for page 0: the multicast reaches the shared receiver, whose sink takes it.
    let other = Receiver::start(ReceiverConfig { receiver_id: 2, ..rcfg }, Arc::new(Taker::default())).expect("second receiver");
    let first = [BASE];
    assert_image(&first, &other.fetch(&first).expect("fetch on the other host"));
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !taker.0.lock().unwrap().contains(&BASE) {
        assert!(std::time::Instant::now() < until, "the shared receiver's sink never got page 0");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // A clone that was not among those the sink installed into faults on it: it gets the data.
    assert_image(&first, &shared.fetch(&first).expect("fetch of a page the sink took"));
    assert_eq!(SenderStats::get(&sender.stats().receivers_joined), 2, "two request sockets said HELLO");
}

#[test]
fn pages_a_clone_has_are_answered_installed_and_not_asked_for() {
    let (sender, rcfg) = setup(2);
    let rx = Receiver::start(rcfg, Arc::new(Taker::default())).expect("receiver on loopback");
    let addrs: Vec<u64> = (0..4).map(|i| BASE + i * PAGE).collect();
    let present = |a: u64| a < BASE + 2 * PAGE;
    let got = rx.fetch_unless(&addrs, &present).expect("fetch");
    assert_eq!(got[..2], [Fetched::Installed, Fetched::Installed]);
    assert_image(&addrs[2..], &got[2..]);
    assert_eq!(SenderStats::get(&sender.stats().pages_requested), 2, "only the missing pages were asked for");
}
