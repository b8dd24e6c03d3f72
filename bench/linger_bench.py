#!/usr/bin/env python3
"""Owner delay under Linger-Longer guests (issue 10, benchmark part 1).

The owner is this machine (everything outside starling's guest cgroups). Two owner workloads:

* CPU-bound: one busy process per core doing a fixed amount of work (a counting loop in
  python3); its wall time is the owner's time;
* wake-up latency: `cyclictest` (Debian rt-tests) with one thread per core, a 1 ms interval, its
  latency histogram -> p50 and p99 (and max).

Each is measured alone and with CPU-bound guests on every core, three ways:

* `cpu.idle`: the guests are a real starling task (`starling exec --host h1`, busy loops on
  every core) on an embedded cluster: they run in the agent's guest cgroup (cpu.idle = 1);
* `nice 19`: the same busy loops started here with `nice -n 19`;
* `normal`: the same busy loops at normal priority.

The configurations are interleaved for --rounds rounds (this VM's own jitter and other
programs on the machine move the figures between runs: see ../shared/PLATFORM.md); the table
gives the median over rounds of each figure, and the owner delay against `alone`. All rows
come from one run. Machine load before each measurement is recorded.

Runs on cluster instance 6 (STARLING_INSTANCE=6 unless already set): starts its own 1-host
cluster and stops it at the end. Writes a table to stdout and JSON to bench/out/linger.json.
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"
STARLING = str(ROOT / "target/release/starling")
CONFIGS = ["alone", "cpu.idle", "nice 19", "normal"]
BUSY = "while :; do :; done"


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def loadavg():
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def guest_dir():
    st = json.loads(sh(STARLING, "status", "--json", check=True).stdout)
    o = st["hosts"][0]["owner"]
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if f[2] == "cgroup" and "cpuacct" in f[3].split(","):
            return pathlib.Path(f[1]) / o["guest_cgroup"]
    sys.exit("no cpuacct hierarchy")


class Guests:
    """CPU-bound guests on every core, started the way `config` says."""

    def __init__(self, config, cores):
        self.config, self.cores, self.procs = config, cores, []

    def __enter__(self):
        loops = " ".join([f"({BUSY}) &"] * self.cores) + " wait"
        if self.config == "cpu.idle":
            p = subprocess.Popen([STARLING, "exec", "--host", "h1", "--", "sh", "-c", loops],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.procs.append(p)
            gd = guest_dir()
            deadline = time.monotonic() + 120
            while len((gd / "cgroup.procs").read_text().split()) < self.cores + 1:
                if time.monotonic() > deadline:
                    sys.exit("the starling guest did not start")
                time.sleep(0.05)
            self.gd = gd
        elif self.config in ("nice 19", "normal"):
            pre = ["nice", "-n", "19"] if self.config == "nice 19" else []
            for _ in range(self.cores):
                self.procs.append(subprocess.Popen(pre + ["sh", "-c", BUSY], start_new_session=True))
        return self

    def __exit__(self, *exc):
        if self.config == "cpu.idle":
            for pid in (self.gd / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def owner_cpu(cores, work):
    """Wall seconds for `cores` owner processes each counting to `work`."""
    code = f"n = 0\nfor i in range({work}): n += i\n"
    t0 = time.monotonic()
    ps = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(cores)]
    for p in ps:
        if p.wait():
            sys.exit("owner workload failed")
    return time.monotonic() - t0


def owner_latency(cores, loops):
    """cyclictest with a thread per core: p50, p99 and max wake-up latency (us) over all threads."""
    r = sh("cyclictest", "-q", "-t", str(cores), "-i", "1000", "-l", str(loops), "-h", "20000", "-m")
    if r.returncode:
        sys.exit(f"cyclictest failed: {r.stderr}")
    hist, overflow, mx = {}, 0, 0
    for line in r.stdout.splitlines():
        if line.startswith("#"):
            if line.startswith("# Histogram Overflows:"):
                overflow += sum(int(x) for x in line.split(":")[1].split())
            if line.startswith("# Max Latencies:"):
                mx = max(int(x) for x in line.split(":")[1].split())
            continue
        f = line.split()
        if len(f) >= 2 and f[0].isdigit():
            hist[int(f[0])] = hist.get(int(f[0]), 0) + sum(int(x) for x in f[1:])
    total = sum(hist.values()) + overflow
    if total == 0:
        sys.exit("cyclictest reported no samples")

    def pct(p):
        want, seen = p * total, 0
        for us in sorted(hist):
            seen += hist[us]
            if seen >= want:
                return us
        return mx

    return pct(0.50), pct(0.99), mx


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=int, default=20_000_000, help="owner loop count per process")
    ap.add_argument("--loops", type=int, default=5000, help="cyclictest wake-ups per thread")
    a = ap.parse_args()
    os.environ.setdefault("STARLING_INSTANCE", "6")
    if not shutil.which("cyclictest"):
        sys.exit("cyclictest not found: apt-get install -y rt-tests")
    ran_on = provenance()
    sh(STARLING, "down")
    r = sh(STARLING, "up", "--hosts", "1")
    if r.returncode:
        sys.exit(f"starling up failed: {r.stderr}")
    try:
        cores = json.loads(sh(STARLING, "status", "--json", check=True).stdout)["hosts"][0]["cores"]
        runs = {c: [] for c in CONFIGS}
        for rnd in range(a.rounds):
            for c in CONFIGS:
                load = loadavg()
                with Guests(c, cores):
                    t = owner_cpu(cores, a.work)
                    p50, p99, mx = owner_latency(cores, a.loops)
                runs[c].append({"owner_s": t, "lat_p50_us": p50, "lat_p99_us": p99, "lat_max_us": mx, "load_before": load})
                print(f"round {rnd + 1} {c:9} owner {t:.3f} s  latency p50 {p50} us p99 {p99} us max {mx} us (load {load:.2f})",
                      file=sys.stderr)
    finally:
        sh(STARLING, "down")
    rows = []
    base = {k: statistics.median(x[k] for x in runs["alone"]) for k in ("owner_s", "lat_p50_us", "lat_p99_us")}
    for c in CONFIGS:
        med = {k: statistics.median(x[k] for x in runs[c]) for k in ("owner_s", "lat_p50_us", "lat_p99_us", "lat_max_us")}
        rows.append({
            "guests": c,
            **med,
            "owner_delay_pct": 100 * (med["owner_s"] / base["owner_s"] - 1),
            "p99_delay_pct": 100 * (med["lat_p99_us"] / base["lat_p99_us"] - 1) if base["lat_p99_us"] else None,
            "runs": runs[c],
        })
    doc = {"benchmark": "linger", "cores": cores, "rounds": a.rounds, "work": a.work, "cyclictest_loops": a.loops,
           "rows": rows, "provenance": ran_on}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linger.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'guests':10} {'owner s':>8} {'delay':>7} {'p50 us':>7} {'p99 us':>7} {'p99 +':>7} {'max us':>7}")
    for r in rows:
        print(f"{r['guests']:10} {r['owner_s']:8.3f} {r['owner_delay_pct']:6.1f}% {r['lat_p50_us']:7.0f} {r['lat_p99_us']:7.0f}"
              f" {r['p99_delay_pct']:6.1f}% {r['lat_max_us']:7.0f}")


if __name__ == "__main__":
    main()
