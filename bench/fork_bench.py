#!/usr/bin/env python3
"""Remote-fork benchmark on the embedded cluster.

For 1, 2, 4, 8, 16, 32 clones (spread one per free core over --hosts hosts;
each emulated host has 2 cores, so 32 clones need 16 hosts — the default)
it runs bench/fork_bench.c and reports:

* clone time: from just before sf_clone in the parent until the LAST clone
  runs (clone clocks are this machine's: the hosts are namespaces), and the
  time sf_clone itself takes in the parent (template, dump, page server,
  one launch per clone over one session);
* descriptor bytes;
* pages fetched per clone vs the parent's resident footprint;
* page-fault service time (median, p99): first touches of heap pages 64
  pages apart, timed inside the clone — each is a userfault the agent's
  handler serves from the page server over TCP (the handler's own counters
  carry no timings, so this is measured where the fault is felt).

Writes a table to stdout, JSON to bench/out/fork.json and, if matplotlib is
importable, bench/out/fork.png. Leaves the cluster down unless --keep.
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out"


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def build():
    exe = OUT / "fork_bench"
    r = sh("cc", "-O2", "-I", str(ROOT / "include"), str(ROOT / "bench/fork_bench.c"),
           str(ROOT / "target/release/libstarling.a"), "-lpthread", "-ldl", "-lm", "-o", str(exe))
    if r.returncode:
        sys.exit(f"build failed (cargo build --release -p starling-capi first?):\n{r.stderr}")
    return str(exe)


def run_once(exe, n, heap_mib, probes):
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)
    r = sh(exe, str(n), str(heap_mib), str(probes), env=env, timeout=300, cwd="/var/tmp")
    if r.returncode:
        raise RuntimeError(f"{n} clones: rc={r.returncode}\n{r.stdout}\n{r.stderr}")
    p = dict(re.findall(r"(\w+)=(-?\d+)", re.search(r"^PARENT .*$", r.stdout, re.M).group(0)))
    clones = [dict(re.findall(r"(\w+)=(-?\d+)", l)) for l in re.findall(r"^CLONE .*$", r.stdout, re.M)]
    stats = [dict(re.findall(r"(\w+)=(-?\d+)", l)) for l in re.findall(r"^STAT .*$", r.stdout, re.M)]
    m = int(p["clones"])
    if m != n or len(clones) != m or any(s["status"] != "0" for s in stats):
        raise RuntimeError(f"{n} clones: granted {m}, {len(clones)} reported\n{r.stdout}\n{r.stderr}")
    start = [int(c["start_ns"]) for c in clones]
    med = [int(c["median_ns"]) for c in clones]
    p99 = [int(c["p99_ns"]) for c in clones]
    fetched = [int(s["fetched"]) for s in stats]
    return {
        "clones": m,
        "clone_time_ms": max(start) / 1e6,
        "first_clone_ms": min(start) / 1e6,
        "sf_clone_call_ms": int(p["clone_call_ns"]) / 1e6,
        "join_ms": int(p["join_ns"]) / 1e6,
        "descriptor_bytes": int(p["descriptor_bytes"]),
        "parent_rss_kib": int(p["rss_kib"]),
        "pages_fetched_mean": statistics.mean(fetched),
        "pages_fetched_max": max(fetched),
        "fault_median_us": statistics.median(med) / 1e3,
        "fault_p99_us": max(p99) / 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--counts", default="1,2,4,8,16,32")
    ap.add_argument("--heap-mib", type=int, default=256)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs per count (the median clone time is reported)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    exe = build()
    sh(STARLING, "down", timeout=120)
    r = sh(STARLING, "up", "--hosts", str(a.hosts), timeout=300)
    if r.returncode:
        sys.exit(f"starling up failed:\n{r.stdout}\n{r.stderr}")
    rows = []
    try:
        for n in [int(x) for x in a.counts.split(",")]:
            runs = [run_once(exe, n, a.heap_mib, a.probes) for _ in range(a.repeat)]
            runs.sort(key=lambda x: x["clone_time_ms"])
            rows.append(runs[len(runs) // 2])
    finally:
        if not a.keep:
            sh(STARLING, "down", timeout=120)
    hdr = f"{'clones':>6} {'clone ms':>9} {'first ms':>9} {'sf_clone ms':>11} {'desc B':>7} {'fetched/clone':>13} {'resident pg':>11} {'fault med us':>12} {'fault p99 us':>12}"
    print(hdr)
    for x in rows:
        print(f"{x['clones']:>6} {x['clone_time_ms']:>9.1f} {x['first_clone_ms']:>9.1f} {x['sf_clone_call_ms']:>11.1f} "
              f"{x['descriptor_bytes']:>7} {x['pages_fetched_mean']:>13.0f} {x['parent_rss_kib'] // 4:>11} "
              f"{x['fault_median_us']:>12.0f} {x['fault_p99_us']:>12.0f}")
    ratio = None
    by = {x["clones"]: x for x in rows}
    if 1 in by and 32 in by:
        ratio = by[32]["clone_time_ms"] / by[1]["clone_time_ms"]
        print(f"clone-time(32)/clone-time(1) = {ratio:.2f}")
    doc = {"hosts": a.hosts, "heap_mib": a.heap_mib, "probes": a.probes, "repeat": a.repeat, "rows": rows,
           "ratio_32_over_1": ratio}
    (OUT / "fork.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT / 'fork.json'}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: skipping bench/out/fork.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    xs = [x["clones"] for x in rows]
    ax[0].plot(xs, [x["clone_time_ms"] for x in rows], "o-", label="last clone running")
    ax[0].plot(xs, [x["sf_clone_call_ms"] for x in rows], "s--", label="sf_clone returns (parent)")
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("clones")
    ax[0].set_ylabel("ms")
    ax[0].set_title("clone time")
    ax[0].legend()
    ax[1].plot(xs, [x["fault_median_us"] for x in rows], "o-", label="median")
    ax[1].plot(xs, [x["fault_p99_us"] for x in rows], "s--", label="p99")
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("clones")
    ax[1].set_ylabel("µs")
    ax[1].set_title("page-fault service time (in the clone)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(OUT / "fork.png", dpi=100)
    print(f"wrote {OUT / 'fork.png'}")


if __name__ == "__main__":
    main()
