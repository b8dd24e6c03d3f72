//! What sealing costs, on this machine: the MAC a multicast page carries
//! (keyed BLAKE3 of the page, against the plain BLAKE3 it replaced) and a
//! page-server connection with its key proof (against the old plain
//! connect), then one page fetch over each. Prints medians.
//!
//! `cargo run --release -p starling-fork --example seal_cost`

use starling_fork::page_server::{PageClient, PageServer, PageServerOptions};
use starling_proto::SecretKey;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let key = SecretKey::random();
    let page = vec![0x5au8; 4096];
    let n = 20_000;
    let time = |f: &dyn Fn()| median((0..n).map(|_| { let t = Instant::now(); f(); t.elapsed() }).collect());
    let plain = time(&|| { std::hint::black_box(blake3::hash(std::hint::black_box(&page))); });
    let keyed = time(&|| { std::hint::black_box(starling_mcdist::seal::mac(&key, b"SFMC page", &[std::hint::black_box(&page), &7u64.to_le_bytes(), &0x1000u64.to_le_bytes()])); });
    println!("per 4 KiB page: plain BLAKE3 {:.2} us, keyed MAC {:.2} us", plain.as_secs_f64() * 1e6, keyed.as_secs_f64() * 1e6);

    // A page of our own memory, served by a page server of this process.
    let buf = vec![0xabu8; 3 * 4096];
    let base = (buf.as_ptr() as u64).next_multiple_of(4096);
    let opts = PageServerOptions { mcdist: starling_mcdist::Switch::Off, key, ..PageServerOptions::default() };
    let server = PageServer::start_with(i32::try_from(std::process::id()).unwrap(), vec![(base, base + 4096)], "127.0.0.1:0".parse().unwrap(), opts).unwrap();
    let m = 500;
    let connects: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); drop(std::net::TcpStream::connect(server.addr()).unwrap()); t.elapsed() }).collect();
    let proved: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); drop(PageClient::connect(server.addr(), &key).unwrap()); t.elapsed() }).collect();
    let mut c = PageClient::connect(server.addr(), &key).unwrap();
    let fetches: Vec<Duration> = (0..m).map(|_| { let t = Instant::now(); c.fetch(&[base]).unwrap(); t.elapsed() }).collect();
    println!(
        "loopback: TCP connect {:.0} us, connect + key proof {:.0} us, one page fetched on an open connection {:.0} us (medians of {m})",
        median(connects).as_secs_f64() * 1e6,
        median(proved).as_secs_f64() * 1e6,
        median(fetches).as_secs_f64() * 1e6
    );
}
