//! mcdist bench: unicast vs multicast vs multicast+push for N = 1..32
//! simulated clones on a netns bridge, with a SHRiMP-like workload (every
//! clone reads the same index pages in the same order, plus a few pages of
//! its own). Needs root and iproute2.
//!
//! ```sh
//! CARGO_TARGET_DIR=/work/target-mcdist cargo run --release -p starling-mcdist --example mcdist_bench -- /tmp/mcdist.json
//! ```
//! Prints a table and writes the measurements as JSON to the given path.

#[path = "../tests/lab/mod.rs"]
mod lab;

use lab::netlab::Lab;
use lab::sim::{self, Dist, SyntheticImage};
use starling_mcdist::{ReceiverConfig, SenderConfig};

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "mcdist_bench.json".into());
    let shared_pages: usize = std::env::var("BENCH_SHARED_PAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
    let own_pages: usize = std::env::var("BENCH_OWN_PAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let counts: Vec<usize> = std::env::var("BENCH_COUNTS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 4, 8, 16, 32]);
    let modes: Vec<Dist> = std::env::var("BENCH_MODES")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|m| match m.trim() {
                    "unicast" => Some(Dist::Unicast),
                    "multicast" => Some(Dist::Multicast),
                    "push" | "multicast+push" => Some(Dist::MulticastPush),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_else(|| vec![Dist::Unicast, Dist::Multicast, Dist::MulticastPush]);
    // Sender knobs (bytes/s): BENCH_LINK_RATE, BENCH_INITIAL_RATE.
    let env_f64 = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<f64>().ok());
    let (link_rate, initial_rate) = (env_f64("BENCH_LINK_RATE"), env_f64("BENCH_INITIAL_RATE"));
    let tweak = move |c: &mut SenderConfig| {
        if let Some(l) = link_rate {
            c.link_rate = l;
            c.increase_per_10ms = l / 100.0;
            c.initial_rate = c.initial_rate.min(l);
        }
        if let Some(i) = initial_rate {
            c.initial_rate = i;
        }
    };
    let max_n = counts.iter().copied().max().unwrap_or(1);
    let lab = Lab::new(&format!("bench{}", std::process::id() % 10_000), max_n).expect("build the netns lab (root, iproute2)");
    // 16 MiB shared index + 4 MiB of per-clone input.
    let image = SyntheticImage::new(vec![(0x1000_0000, 0x1100_0000), (0x2000_0000, 0x2040_0000)], 7);
    let mut rows = Vec::new();
    println!("{:<15} {:>3} {:>10} {:>10} {:>12} {:>9} {:>6} {:>9}", "mode", "N", "requested", "served", "wire bytes", "time ms", "ok", "lockstep");
    let mut ticket = 9000;
    for &dist in &modes {
        for &n in &counts {
            ticket += 1;
            let workloads: Vec<Vec<u64>> = (0..n)
                .map(|i| {
                    // Own pages come from the second region.
                    let mut w = sim::shrimp_like(&image, 0, shared_pages, 0);
                    let own: Vec<u64> = (0..own_pages).map(|k| 0x2000_0000 + ((i * own_pages + k) as u64 % 1024) * 4096).collect();
                    w.extend(own);
                    w
                })
                .collect();
            let o = sim::run_scenario(&lab, ticket, &image, &workloads, dist, &tweak, &|_: &mut ReceiverConfig| {})
                .expect("scenario");
            if std::env::var_os("BENCH_DEBUG").is_some() {
                // Where datagrams were dropped: UDP receive-buffer overflows in the receivers.
                let mut rcvbuf_errors = 0u64;
                for ns in &lab.receiver_ns[..n] {
                    let snmp = std::process::Command::new("ip").args(["netns", "exec", ns, "cat", "/proc/net/snmp"]).output();
                    if let Ok(o) = snmp {
                        let text = String::from_utf8_lossy(&o.stdout).into_owned();
                        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("Udp:")).collect();
                        if lines.len() == 2 {
                            let keys: Vec<&str> = lines[0].split_whitespace().collect();
                            let vals: Vec<&str> = lines[1].split_whitespace().collect();
                            if let Some(i) = keys.iter().position(|k| *k == "RcvbufErrors") {
                                rcvbuf_errors += vals.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                            }
                        }
                    }
                }
                eprintln!("  receivers' UDP RcvbufErrors so far: {rcvbuf_errors}; implicit losses {}, re-requests {}", o.implicit_losses, o.rerequests);
            }
            let ok = o.results.iter().enumerate().all(|(i, r)| {
                r.as_ref().is_ok_and(|r| r.checksum == sim::expected_checksum(&image, &workloads[i])) && o.mismatches[i] == 0
            });
            println!(
                "{:<15} {:>3} {:>10} {:>10} {:>12} {:>9.1} {:>6} {:>9}",
                dist.name(),
                n,
                o.pages_requested,
                o.pages_served,
                o.tx_bytes,
                o.elapsed.as_secs_f64() * 1e3,
                ok,
                o.lockstep_suppressed + o.queued_duplicates
            );
            rows.push(serde_json::json!({
                "mode": dist.name(),
                "receivers": n,
                "pages_requested": o.pages_requested,
                "pages_served": o.pages_served,
                "wire_bytes": o.tx_bytes,
                "completion_ms": o.elapsed.as_secs_f64() * 1e3,
                "all_pages_correct": ok,
                "lockstep_suppressed": o.lockstep_suppressed,
                "queued_duplicates": o.queued_duplicates,
                "implicit_losses": o.implicit_losses,
                "rerequests": o.rerequests,
                "rate_cuts": o.trace.iter().filter(|s| s.cut).count(),
            }));
        }
    }
    let bytes = |mode: &str, n: usize| {
        rows.iter()
            .find(|r| r["mode"] == mode && r["receivers"] == n)
            .and_then(|r| r["wire_bytes"].as_u64())
            .unwrap_or(0) as f64
    };
    let mut ratios = serde_json::Map::new();
    for mode in ["unicast", "multicast", "multicast+push"] {
        let (b1, b32) = (bytes(mode, 1), bytes(mode, 32));
        if b1 == 0.0 || b32 == 0.0 {
            continue;
        }
        let r = b32 / b1;
        println!("{mode}: wire bytes 32 clones / 1 clone = {r:.3}");
        ratios.insert(mode.into(), serde_json::json!(r));
    }
    let doc = serde_json::json!({
        "workload": { "shared_pages": shared_pages, "own_pages_per_clone": own_pages },
        "rows": rows,
        "wire_bytes_ratio_32_over_1": ratios,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&doc).expect("json")).expect("write JSON");
    println!("wrote {out}");
}
