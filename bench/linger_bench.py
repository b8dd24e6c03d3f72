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

A third owner workload is memory (issue 10 part 4, "Memory"): the owner touches a working set of
half the machine's memory (`--owner-mem-share`), page by page, `--mem-passes` times; its wall time
is the owner's time. It runs alone and while a starling guest (`starling exec --host h1`) holds
the rest of the free memory and keeps touching it. The row records whether the owner was killed,
what the guest became (still running / exit status), what the host's agent said it did (guest
memory cap, frozen) and the kernel's OOM kills during the run (`dmesg`). Before the first memory
round, one warm-up pass (not counted) touches all the free memory once: on a virtual machine the
first touch of a guest-physical page also costs the hypervisor's allocation, and without the warm-up
whichever round first reaches fresh pages pays it (two alone rounds differed by 64 %).

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
import threading
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


# Touches `size` bytes page by page, `passes` times; prints "held" after the first pass, then
# (with `forever`) keeps touching. A pass writes one byte per page, so the time is page faults and
# memory traffic, not Python's per-byte work.
TOUCH = """
import sys
size, passes, forever = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "forever"
buf = bytearray(size)
n = 0
while True:
    for i in range(0, size, 4096):
        buf[i] = (buf[i] + 1) & 0xff
    n += 1
    if n == 1:
        print("held", flush=True)
    if not forever and n >= passes:
        break
"""


def mem_available():
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    sys.exit("no MemAvailable in /proc/meminfo")


def oom_kills():
    """How many processes the kernel's OOM killer has killed since boot (dmesg)."""
    r = sh("dmesg")
    return sum(1 for line in r.stdout.splitlines() if "Killed process" in line) if r.returncode == 0 else None


def owner_memory(size, passes):
    """Wall seconds for the owner to touch `size` bytes `passes` times, and its exit status."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", TOUCH, str(size), str(passes), "once"], stdout=subprocess.DEVNULL)
    return time.monotonic() - t0, p.returncode


def host_owner():
    st = json.loads(sh(STARLING, "status", "--json", check=True).stdout)
    return st["hosts"][0].get("owner") or {}


def memory_round(with_guest, owner_size, passes, guest_size=None):
    """One owner memory run, alone or with a guest holding the rest of the free memory."""
    load, kills_before = loadavg(), oom_kills()
    guest, held = None, 0
    if with_guest:
        held = guest_size or max(mem_available() - owner_size, 0)
        guest = subprocess.Popen([STARLING, "exec", "--host", "h1", "--", "python3", "-c", TOUCH, str(held), "0", "forever"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if guest.stdout.readline().strip() != "held":
            sys.exit(f"the guest did not take its memory: {guest.stderr.read()[-2000:]}")
    # What the host's agent reports while the owner runs (its memory band acts on MemAvailable).
    seen, done = [], threading.Event()

    def watch():
        while not done.wait(0.5):
            o = host_owner()
            seen.append((o.get("guest_mem_cap"), o.get("guests_frozen"), o.get("doing")))

    watcher = threading.Thread(target=watch, daemon=True)
    if guest is not None:
        watcher.start()
    t, rc = owner_memory(owner_size, passes)
    done.set()
    row = {"owner_s": t, "owner_exit": rc, "owner_killed": rc < 0, "guest_bytes": held, "load_before": load}
    if guest is not None:
        watcher.join()
        row["guest_mem_cap_mib"] = min((c // 2**20 for c, _, _ in seen if c), default=None)
        row["guests_frozen"] = any(f for _, f, _ in seen)
        row["agent_doing"] = sorted({d for _, _, d in seen if d})
        row["guest_exit"] = guest.poll()
        for pid in (guest_dir() / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(guest.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        guest.wait()
    kills_after = oom_kills()
    row["oom_kills"] = None if kills_before is None or kills_after is None else kills_after - kills_before
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=int, default=20_000_000, help="owner loop count per process")
    ap.add_argument("--loops", type=int, default=5000, help="cyclictest wake-ups per thread")
    ap.add_argument("--owner-mem-share", type=float, default=0.5, help="the owner's working set, a share of the machine's memory")
    ap.add_argument("--mem-passes", type=int, default=4, help="times the owner touches its working set")
    ap.add_argument("--mem-rounds", type=int, default=3)
    ap.add_argument("--guest-mem-share", type=float, help="the guest's memory, a share of the machine's (default: all free memory the owner leaves)")
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
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        owner_size = int(total * a.owner_mem_share)
        mem_runs = {"alone": [], "guest holds the rest": []}
        if a.mem_rounds:
            warm = max(mem_available() - 2**30, 0)
            t, _ = owner_memory(warm, 1)
            print(f"memory warm-up: touched {warm / 2**30:.1f} GiB once in {t:.1f} s (not counted)", file=sys.stderr)
        for rnd in range(a.mem_rounds):
            for c, with_guest in (("alone", False), ("guest holds the rest", True)):
                row = memory_round(with_guest, owner_size, a.mem_passes, int(total * a.guest_mem_share) if a.guest_mem_share else None)
                mem_runs[c].append(row)
                print(f"round {rnd + 1} memory {c:20} owner {row['owner_s']:.3f} s exit {row['owner_exit']} "
                      f"guest {row.get('guest_exit')} cap {row.get('guest_mem_cap_mib')} MiB frozen {row.get('guests_frozen')} "
                      f"oom kills {row['oom_kills']} (load {row['load_before']:.2f})", file=sys.stderr)
    finally:
        sh(STARLING, "down")
    mem_base = statistics.median(x["owner_s"] for x in mem_runs["alone"])
    memory = []
    for c, rs in mem_runs.items():
        med = statistics.median(x["owner_s"] for x in rs)
        memory.append({
            "guests": c,
            "owner_s": med,
            "owner_delay_pct": 100 * (med / mem_base - 1),
            "owner_killed": any(x["owner_killed"] for x in rs),
            "oom_kills": sum(x["oom_kills"] or 0 for x in rs),
            "runs": rs,
        })
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
           "rows": rows, "owner_mem_bytes": owner_size, "mem_passes": a.mem_passes, "memory": memory, "provenance": ran_on}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linger.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'guests':10} {'owner s':>8} {'delay':>7} {'p50 us':>7} {'p99 us':>7} {'p99 +':>7} {'max us':>7}")
    for r in rows:
        print(f"{r['guests']:10} {r['owner_s']:8.3f} {r['owner_delay_pct']:6.1f}% {r['lat_p50_us']:7.0f} {r['lat_p99_us']:7.0f}"
              f" {r['p99_delay_pct']:6.1f}% {r['lat_max_us']:7.0f}")
    print(f"owner touching {owner_size / 2**30:.1f} GiB x {a.mem_passes}:")
    for r in memory:
        print(f"  {r['guests']:22} owner {r['owner_s']:7.3f} s {r['owner_delay_pct']:6.1f}%  owner killed {r['owner_killed']}"
              f"  OOM kills {r['oom_kills']}")


if __name__ == "__main__":
    main()
