#!/usr/bin/env python3
"""Authentication's cost (issue 12): warm `starling exec -- true` on an embedded cluster with
authentication (the default: the client on the head's Unix socket, named by the kernel; head and
agents on mutual TLS) against the same cluster started with `up --insecure` (plain TCP everywhere,
the head believing any uid: a mode for this measurement only), directly and through the link relay
with no shaping (`--link 0,0,0`: with authentication the relay takes the client on its Unix socket
and speaks TLS with its relay certificate to the head).

Page-fault service with and without authentication and encryption: a one-clone remote fork
(bench/fork_bench.c, unicast: a one-clone ticket's pages come from the parent's page server over
TCP) whose clone first-touches --fault-probes heap pages 64 pages apart, so that each touch is a
userfault its host's handler serves with one request (prefetch never covers the next probe); the
clone times each touch (its service time as the program sees it: fault, request, reply, page in
place) and the clone's handler counters (`sf_clone_stat`) say how many faults it served and pages
it fetched. Three clusters: `up --insecure` with `fork.encrypt` off (plain TCP everywhere, pages in
clear), the default authentication with `fork.encrypt` off, and the default (authentication and
encryption), each for the cluster's agents and the forking parent alike.

Runs on cluster instance 7 by default (STARLING_INSTANCE); the modes are interleaved round by round
so that the load of other programs on this shared machine falls on all of them alike. Table on
stdout, JSON in bench/out/auth.json (with provenance). Target: authenticated ≤ 5 % slower.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from fork_bench import build as build_fork_bench, fields
from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out"

MODES = [  # (name, path, up arguments)
    ("insecure", "direct", ["--insecure"]),
    ("auth", "direct", []),
    ("insecure", "relay", ["--insecure", "--link", "0,0,0"]),
    ("auth", "relay", ["--link", "0,0,0"]),
]

FAULT_MODES = [  # (name, up arguments, fork.encrypt of the agents and the parent)
    ("insecure", ["--insecure"], "off"),
    ("auth", [], "off"),
    ("auth+encrypt", [], "on"),
]


def run(env, *args, timeout=300):
    return subprocess.run([STARLING, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd="/tmp")


def measure(env, n):
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        r = run(env, "exec", "--", "true")
        walls.append(time.perf_counter() - t)
        if r.returncode != 0:
            sys.exit(f"exec failed: {r.stderr}")
    return walls


def fault_run(exe, env, probes):
    """One one-clone fork whose clone times `probes` first touches: its CLONE and STAT fields."""
    heap_mib = -(-probes * 64 * 4096 // (1 << 20)) + 1  # room for every probe 64 pages apart
    r = subprocess.run([exe, "1", str(heap_mib), str(probes), "200", "0"], env=env, capture_output=True, text=True,
                       timeout=300, cwd="/var/tmp")
    clone = [fields(l) for l in r.stdout.splitlines() if l.startswith("CLONE ")]
    stat = [fields(l) for l in r.stdout.splitlines() if l.startswith("STAT ")]
    if r.returncode or len(clone) != 1 or len(stat) != 1 or stat[0]["status"] != 0:
        sys.exit(f"fork_bench failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    c, st = clone[0], stat[0]
    if st["faults"] < probes:
        sys.exit(f"the clone's handler served {st['faults']} faults for {probes} probes: the probes were not all faults")
    return {"median_us": c["median_ns"] / 1e3, "p99_us": c["p99_ns"] / 1e3, "total_ms": c["total_ns"] / 1e6,
            "probes": probes, "faults": st["faults"], "pages_fetched": st["fetched"], "requests": st["requests"],
            "dist": st["dist"]}


def measure_faults(env, a):
    """Page-fault service per FAULT_MODES, interleaved over --fault-rounds rounds."""
    exe = build_fork_bench(ROOT / "target/release")
    runs = {m: [] for m, _, _ in FAULT_MODES}
    loads = []
    for rnd in range(a.fault_rounds):
        for mode, args, encrypt in FAULT_MODES:
            e = dict(env, STARLING_FORK_ENCRYPT=encrypt)
            e.pop("STARLING_FORK_BACKEND", None)
            run(e, "down", timeout=120)
            r = run(e, "up", "--hosts", str(a.hosts), *args, timeout=300)
            if r.returncode != 0:
                sys.exit(f"up {' '.join(args)} failed: {r.stderr}")
            fault_run(exe, e, a.fault_probes)  # a host's first clone pays one-off costs
            loads.append(os.getloadavg()[0])
            runs[mode].append(fault_run(exe, e, a.fault_probes))
            print(f"fault round {rnd + 1}: {mode} done", file=sys.stderr)
    rows = []
    base = None
    for mode, args, encrypt in FAULT_MODES:
        rs = runs[mode]
        probes = sum(x["probes"] for x in rs)
        total_ms = sum(x["total_ms"] for x in rs)
        row = {"mode": mode, "up": " ".join(["up", *args]), "fork_encrypt": encrypt,
               "median_us": statistics.median(x["median_us"] for x in rs),
               "p99_us": statistics.median(x["p99_us"] for x in rs),
               "probes": probes, "total_ms": total_ms, "mean_us": total_ms * 1000 / probes,
               "faults": sum(x["faults"] for x in rs), "pages_fetched": sum(x["pages_fetched"] for x in rs),
               "requests": sum(x["requests"] for x in rs), "dist": sorted({x["dist"] for x in rs}), "runs": rs}
        base = base or row
        row["median_ratio"] = row["median_us"] / base["median_us"]
        row["mean_ratio"] = row["mean_us"] / base["mean_us"]
        rows.append(row)
    return {"rounds": a.fault_rounds, "probes_per_run": a.fault_probes, "load_min": min(loads), "load_max": max(loads),
            "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instance", default=os.environ.get("STARLING_INSTANCE", "7"))
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each brings every mode up once")
    ap.add_argument("--runs", type=int, default=20, help="warm runs per mode and round")
    ap.add_argument("--fault-rounds", type=int, default=3,
                    help="rounds of the page-fault measurement; each brings every fault mode up once (0: skip it)")
    ap.add_argument("--fault-probes", type=int, default=300, help="faults timed per clone and round")
    a = ap.parse_args()
    env = dict(os.environ, STARLING_INSTANCE=str(a.instance))
    samples = {f"{m}/{p}": [] for m, p, _ in MODES}
    loads = []
    for rnd in range(a.rounds):
        for mode, path, args in MODES:
            run(env, "down", timeout=120)
            r = run(env, "up", "--hosts", str(a.hosts), *args, timeout=300)
            if r.returncode != 0:
                sys.exit(f"up {' '.join(args)} failed: {r.stderr}")
            measure(env, 3)  # warm the caches
            loads.append(os.getloadavg()[0])
            samples[f"{mode}/{path}"] += measure(env, a.runs)
            print(f"round {rnd + 1}: {mode}/{path} done", file=sys.stderr)
    faults = measure_faults(env, a) if a.fault_rounds else None
    run(env, "down", timeout=120)
    rows = []
    for path in ("direct", "relay"):
        ins = statistics.median(samples[f"insecure/{path}"])
        auth = statistics.median(samples[f"auth/{path}"])
        rows.append({"path": path, "insecure_ms": ins * 1000, "auth_ms": auth * 1000,
                     "delta_pct": (auth - ins) / ins * 100, "runs": len(samples[f"auth/{path}"])})
    doc = {"provenance": provenance(), "hosts": a.hosts, "rounds": a.rounds, "runs_per_round": a.runs,
           "load_min": min(loads), "load_max": max(loads), "rows": rows,
           "samples_ms": {k: [x * 1000 for x in v] for k, v in samples.items()}, "faults": faults}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "auth.json").write_text(json.dumps(doc, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    import tables
    print(tables.render_auth(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
