#!/usr/bin/env python3
"""Authentication's cost (issue 12): warm `starling exec -- true` on an embedded cluster with
authentication (the default: the client on the head's Unix socket, named by the kernel; head and
agents on mutual TLS) against the same cluster started with `up --insecure` (plain TCP everywhere,
the head believing any uid: a mode for this measurement only), directly and through the link relay
with no shaping (`--link 0,0,0`: with authentication the relay takes the client on its Unix socket
and speaks TLS with its relay certificate to the head).

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instance", default=os.environ.get("STARLING_INSTANCE", "7"))
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each brings every mode up once")
    ap.add_argument("--runs", type=int, default=20, help="warm runs per mode and round")
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
    run(env, "down", timeout=120)
    rows = []
    for path in ("direct", "relay"):
        ins = statistics.median(samples[f"insecure/{path}"])
        auth = statistics.median(samples[f"auth/{path}"])
        rows.append({"path": path, "insecure_ms": ins * 1000, "auth_ms": auth * 1000,
                     "delta_pct": (auth - ins) / ins * 100, "runs": len(samples[f"auth/{path}"])})
    doc = {"provenance": provenance(), "hosts": a.hosts, "rounds": a.rounds, "runs_per_round": a.runs,
           "load_min": min(loads), "load_max": max(loads), "rows": rows,
           "samples_ms": {k: [x * 1000 for x in v] for k, v in samples.items()}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "auth.json").write_text(json.dumps(doc, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    import tables
    print(tables.render_auth(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
