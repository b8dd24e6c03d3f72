//! What sealing costs, on this machine: per 4 KiB page, the MAC a clear
//! multicast page carries (keyed BLAKE3, against the plain BLAKE3 it
//! replaced) and the AES-256-GCM an encrypted one takes instead
//! (`fork.encrypt`); then page-server connections on loopback, clear and
//! encrypted: the connect with its key proof, one page fetched, and a batch
//! of 16 (the default `fork.prefetch`) fetched on an open connection.
//! Prints medians.
//!
//! `cargo run --release -p starling-fork --example seal_cost`

use starling_fork::page_server::{PageClient, PageServer, PageServerOptions};
use starling_mcdist::seal::{counter_nonce, Cipher, MULTICAST_PAGE};
use starling_proto::SecretKey;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let key = SecretKey::random();
    let page = vec![0x5au8; 4096];
    let n = 20_000;
    let time = |f: &mut dyn FnMut()| median((0..n).map(|_| { let t = Instant::now(); f(); t.elapsed() }).collect());
    let plain = time(&mut || { std::hint::black_box(blake3::hash(std::hint::black_box(&page))); });
    let keyed = time(&mut || { std::hint::black_box(starling_mcdist::seal::mac(&key, b"SFMC page", &[std::hint::black_box(&page), &7u64.to_le_bytes(), &0x1000u64.to_le_bytes()])); });
    let cipher = Cipher::derive(&key, MULTICAST_PAGE, &[&[1u8; 16]]);
    let mut buf = page.clone();
    let mut seq = 0u64;
    let mut tag = [0u8; 16];
    let sealed = time(&mut || { seq += 1; tag = cipher.seal(counter_nonce(seq), &[0u8; 16], std::hint::black_box(&mut buf)); });
    let mut ct = page.clone();
    let t = cipher.seal(counter_nonce(u64::MAX), &[0u8; 16], &mut ct);
    let opened = time(&mut || { let mut c = ct.clone(); assert!(cipher.open(counter_nonce(u64::MAX), &[0u8; 16], std::hint::black_box(&mut c), &t)); });
    let copy = time(&mut || { std::hint::black_box(ct.clone()); });
    println!(
        "per 4 KiB page: plain BLAKE3 {:.2} us, keyed MAC {:.2} us, AES-256-GCM seal {:.2} us, open {:.2} us (median of {n})",
        us(plain),
        us(keyed),
        us(sealed),
        us(opened.saturating_sub(copy))
    );

    // Pages of our own memory, served by a page server of this process.
    let mem = vec![0xabu8; 18 * 4096];
    let base = (mem.as_ptr() as u64).next_multiple_of(4096);
    let batch: Vec<u64> = (0..16).map(|i| base + i * 4096).collect();
    let m = 500;
    for encrypt in [false, true] {
        let opts = PageServerOptions { mcdist: starling_mcdist::Switch::Off, key, encrypt, ..PageServerOptions::default() };
        let server = PageServer::start_with(i32::try_from(std::process::id()).unwrap(), vec![(base, base + 16 * 4096)], "127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let proved: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); drop(PageClient::connect(server.addr(), &key, encrypt).unwrap()); t.elapsed() }).collect();
        let mut c = PageClient::connect(server.addr(), &key, encrypt).unwrap();
        assert_eq!(c.is_encrypted(), encrypt);
        let one: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); c.fetch(&[base]).unwrap(); t.elapsed() }).collect();
        let sixteen: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); c.fetch(&batch).unwrap(); t.elapsed() }).collect();
        println!(
            "loopback, {}: connect + key proof {:.0} us, one page {:.1} us, 16 pages {:.1} us (medians of {m})",
            if encrypt { "encrypted" } else { "clear" },
            us(median(proved)),
            us(median(one)),
            us(median(sixteen))
        );
    }
}
