#!/usr/bin/env python3
"""Remote-fork benchmark on the embedded cluster (issue 4).

For 1, 2, 4, 8, 16, 32 clones (one per free core over --hosts hosts; each
emulated host has 2 cores, so 32 clones need 16 hosts — the default), in each
placement mode (spread: sf_request_ticket(n, false); hierarchical:
sf_request_ticket(n, true)), it runs bench/fork_bench.c and reports:

* clone time: from just before sf_clone in the parent until the LAST clone
  runs (clone clocks are this machine's: the hosts are namespaces), the first
  clone, and the time sf_clone itself takes in the parent;
* the CPU the machine spent creating the clones: busy jiffies of /proc/stat
  from just before sf_clone until the last clone started (machine-wide, so
  other programs on this machine count too: their load, measured just before
  each run, is reported next to it), per clone, and the CPU-bound floor
  cpu_ms / cores: how long that creation takes on this machine's cores even
  with perfect parallelism (every emulated host shares them);
* descriptor bytes; pages fetched per clone vs the parent's resident footprint;
* page-fault service time (median, p99): first touches of heap pages 64
  pages apart, timed inside the clone — each is a userfault the agent's
  handler serves from the page server over TCP;
* the critical path (issue 16): each clone's stage stamps (sf_clone_stat
  SF_CLONE_STAMP_*: parent, head, agent and fault handler, one clock here) as
  a stage table (median per stage), which stages are serial at the parent or
  head and which run in parallel on the hosts, and a projected time for 32
  clones on 32 hosts with CPUs of their own: one clone's time + 31 × the
  serial part per launch (the spacing of the head's placements in the
  largest run) + the fan-out (head → agent hop), beside the measured one.

Creation and work are kept apart: every clone sleeps until t0 + --settle-ms
before probing, so the probes of early clones don't steal the CPU that later
clones' creation needs (SnowFlock's clone time measures creation, not work).
A clone that starts after that deadline is counted as late (raise --settle-ms).

Runs on cluster instance 6 (STARLING_INSTANCE=6 unless already set) so it can
run beside other clusters; starts its own cluster (`starling up --hosts`) and
stops it at the end unless --keep. The starling binary and libstarling.a are
taken from --starling-dir (default $STARLING_BUILD_DIR or target/release).

Writes a table to stdout, JSON to bench/out/fork.json and, if matplotlib is
importable, bench/out/fork.png.
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"
INSTANCE = "6"
MODES = {"spread": 0, "hierarchical": 1}
# Critical-path stages: (name, from stamp, to stamp, where). "t0" is the parent
# just before sf_clone, "running" the clone's first instruction after it.
# serial: paid at the parent or head in sequence (once per ticket, or once per
# launch); parallel: on each host, alongside the other hosts.
STAGES = [
    ("template fork", "t0", "template", "serial: parent, once per ticket"),
    ("descriptor + page server", "template", "descriptor", "serial: parent, once per ticket"),
    ("launch -> head placement", "descriptor", "placed", "serial: parent + head, per launch"),
    ("head -> agent (fan-out)", "placed", "launch_received", "parallel: network"),
    ("view mounted", "launch_received", "view_mounted", "parallel: host"),
    ("descriptor fetch + sandbox", "view_mounted", "sandbox_ready", "parallel: host"),
    ("restorer maps the clone", "sandbox_ready", "restorer_running", "parallel: host"),
    ("clone running", "restorer_running", "running", "parallel: host"),
]
STAMP_NAMES = ["ticket", "template", "descriptor", "placed", "launch_received", "view_mounted", "sandbox_ready",
               "restorer_running", "first_page"]


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def fields(line):
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", line)}


def build(build_dir):
    exe = OUT / "fork_bench"
    lib = build_dir / "libstarling.a"
    r = sh("cc", "-O2", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "bench/fork_bench.c"), str(lib),
           "-lpthread", "-ldl", "-lm", "-o", str(exe))
    if r.returncode:
        sys.exit(f"build failed against {lib} (cargo build --release -p starling-capi first?):\n{r.stderr}")
    return str(exe)


def busy_ticks():
    """Machine-wide busy clock ticks, as fork_bench.c counts them."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system (idle iowait) irq softirq


def wait_quiet(max_cores, timeout_s):
    """Wait (up to timeout_s) until the machine's load over 0.5 s is below
    max_cores: the previous run's teardown (agents unmapping 32 clones) or
    other programs would otherwise count in this run's machine-wide cpu ms.
    Returns the last load seen."""
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = busy_ticks(), time.monotonic()
        time.sleep(0.5)
        load = (busy_ticks() - b0) * tick_s / (time.monotonic() - t0)
        if load <= max_cores or time.monotonic() >= deadline:
            return load


def run_once(exe, n, mode, heap_mib, probes, settle_ms, quiet=(0.3, 10.0)):
    wait_quiet(*quiet)
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)
    r = sh(exe, str(n), str(heap_mib), str(probes), str(settle_ms), str(MODES[mode]), env=env,
           timeout=300 + settle_ms / 1000, cwd="/var/tmp")
    parent = re.search(r"^PARENT .*$", r.stdout, re.M)
    if r.returncode or not parent:
        raise RuntimeError(f"{mode} {n} clones: rc={r.returncode}\n{r.stdout}\n{r.stderr}")
    p = fields(parent.group(0))
    clones = [fields(l) for l in re.findall(r"^CLONE .*$", r.stdout, re.M)]
    stats = [fields(l) for l in re.findall(r"^STAT .*$", r.stdout, re.M)]
    stamps = {f["id"]: f for f in (fields(l) for l in re.findall(r"^STAMPS .*$", r.stdout, re.M))}
    cpu = [fields(l) for l in re.findall(r"^CPU .*$", r.stdout, re.M)]
    m = p["clones"]
    if m != n or len(clones) != m or any(s["status"] != 0 for s in stats) or not cpu:
        raise RuntimeError(f"{mode} {n} clones: granted {m}, {len(clones)} reported\n{r.stdout}\n{r.stderr}")
    start = [c["start_ns"] for c in clones]
    last = max(start)
    # CPU over the creation window: t0 .. first sample at/after the last clone
    # started (samples run every 5 ms until the settle deadline).
    after = [s for s in cpu if s["t_ns"] >= last]
    end = after[0] if after else cpu[-1]
    tick_ms = 1000 / p["clk_tck"]
    cpu_ms = (end["busy"] - p["busy0"]) * tick_ms
    window_ms = end["t_ns"] / 1e6
    bg_cores = p["bg_ticks"] * tick_ms / (p["bg_ns"] / 1e6)  # cores busy before the run
    cores = p["cores"]
    fetched = [s["fetched"] for s in stats]
    path = critical_path(p["t0_real_ns"], clones, stamps)
    return {
        "mode": mode,
        "clones": m,
        "settle_ms": settle_ms,
        "clone_time_ms": last / 1e6,
        "first_clone_ms": min(start) / 1e6,
        "sf_clone_call_ms": p["clone_call_ns"] / 1e6,
        "join_ms": p["join_ns"] / 1e6,
        "descriptor_bytes": p["descriptor_bytes"],
        "parent_rss_kib": p["rss_kib"],
        "pages_fetched_mean": statistics.mean(fetched),
        "pages_fetched_max": max(fetched),
        "fault_median_us": statistics.median(c["median_ns"] for c in clones) / 1e3,
        "fault_p99_us": max(c["p99_ns"] for c in clones) / 1e3,
        "late_clones": sum(c["late"] for c in clones),
        "cpu_window_ms": window_ms,
        "cpu_window_complete": bool(after),
        "cpu_ms": cpu_ms,
        "cpu_ms_per_clone": cpu_ms / m,
        "cores": cores,
        "cpu_floor_ms": cpu_ms / cores,
        "background_cores": bg_cores,
        "cpu_background_ms": bg_cores * window_ms,
        "cpu_settle_ms": (cpu[-1]["busy"] - p["busy0"]) * tick_ms,
        **path,
    }


def critical_path(t0, clones, stamps):
    """Per-stage medians (ms) over the clones, the serial part per launch and
    the fan-out hop, from the clones' stamps (CLOCK_REALTIME ns) and t0."""
    per_stage = {name: [] for name, *_ in STAGES}
    first_page = []
    for c in clones:
        st = stamps.get(c["id"])
        if not st or any(st.get(k, 0) <= 0 for k in STAMP_NAMES):
            continue  # a stage not recorded (should not happen on a cluster)
        at = {k: st[k] for k in STAMP_NAMES}
        at["t0"], at["running"] = t0, t0 + c["start_ns"]
        for name, a, b, _ in STAGES:
            per_stage[name].append((at[b] - at[a]) / 1e6)
        first_page.append((at["first_page"] - at["restorer_running"]) / 1e6)
    if not first_page:
        return {"stages_ms": None}
    # Launches: clones of one launch (a hierarchical host's) share its placement stamp.
    placed = sorted({stamps[c["id"]]["placed"] for c in clones if c["id"] in stamps})
    spacing = (placed[-1] - placed[0]) / 1e6 / (len(placed) - 1) if len(placed) > 1 else None
    return {
        "stages_ms": {name: statistics.median(v) for name, v in per_stage.items()},
        "first_page_after_restorer_ms": statistics.median(first_page),
        "launches": len(placed),
        "placement_spacing_ms": spacing,
        "fanout_ms": statistics.median(per_stage["head -> agent (fan-out)"]),
    }


def projection(rows, mode, target=32):
    """One clone's time + (target - 1) × serial part per launch + fan-out, from
    the 1-clone row and the largest row of `mode` (serial part: the spacing of
    the head's placements there — parent and head work per launch, which on
    this machine also pays for the CPU the hosts take from them, so it is an
    upper bound; with only one clone measured, the launch -> placement stage)."""
    by = {x["clones"]: x for x in rows if x["mode"] == mode and x.get("stages_ms")}
    if 1 not in by:
        return None
    one, big = by[1], by[max(by)]
    serial = big["placement_spacing_ms"] if big["placement_spacing_ms"] is not None else \
        one["stages_ms"]["launch -> head placement"]
    fanout = big["fanout_ms"]
    projected = one["clone_time_ms"] + (target - 1) * serial + fanout
    measured = by[target]["clone_time_ms"] if target in by else None
    return {"mode": mode, "one_clone_ms": one["clone_time_ms"], "serial_per_launch_ms": serial,
            "serial_from": f"{big['clones']} clones ({big['launches']} launches)" if big["placement_spacing_ms"] is not None
            else "1 clone: launch -> head placement",
            "fanout_ms": fanout, "projected_ms": projected, "projected_ratio": projected / one["clone_time_ms"],
            "measured_ms": measured, "measured_ratio": measured / one["clone_time_ms"] if measured else None,
            "target": target}


def print_path(rows, modes):
    for mode in modes:
        rs = [x for x in rows if x["mode"] == mode and x.get("stages_ms")]
        if not rs:
            print(f"{mode}: no critical-path stamps recorded")
            continue
        print(f"\ncritical path, {mode} (median per stage over the clones, ms; serial = at the parent/head "
              f"in sequence, parallel = on each host):")
        print(f"{'stage':<28} {'where':<34} " + " ".join(f"{str(x['clones']) + ' cl':>8}" for x in rs))
        for name, _, _, where in STAGES:
            print(f"{name:<28} {where:<34} " + " ".join(f"{x['stages_ms'][name]:>8.2f}" for x in rs))
        print(f"{'(first page after restorer)':<28} {'parallel: host':<34} "
              + " ".join(f"{x['first_page_after_restorer_ms']:>8.2f}" for x in rs))
        print(f"{'placement spacing / launch':<28} {'serial: parent + head':<34} "
              + " ".join(f"{x['placement_spacing_ms']:>8.2f}" if x["placement_spacing_ms"] is not None else f"{'-':>8}"
                         for x in rs))


def median_run(runs):
    runs = sorted(runs, key=lambda x: x["clone_time_ms"])
    row = dict(runs[len(runs) // 2])
    row["runs_clone_time_ms"] = [x["clone_time_ms"] for x in runs]
    row["runs_late_clones"] = sum(x["late_clones"] for x in runs)
    return row


def main():
    os.environ.setdefault("STARLING_INSTANCE", INSTANCE)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--counts", default="1,2,4,8,16,32")
    ap.add_argument("--heap-mib", type=int, default=256)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs per (mode, count): the median clone time is reported")
    ap.add_argument("--settle-ms", type=int, default=3000,
                    help="clones wait until t0 + this before probing, so creation and work don't overlap")
    ap.add_argument("--modes", default="spread,hierarchical",
                    help="comma-separated placement modes: spread (hierarchical=false), hierarchical (=true)")
    ap.add_argument("--hierarchical", action="store_true", help="shorthand for --modes hierarchical")
    ap.add_argument("--starling-dir", default=os.environ.get("STARLING_BUILD_DIR", str(ROOT / "target/release")),
                    help="directory holding the starling binary and libstarling.a (env STARLING_BUILD_DIR)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="discarded runs per mode, of one clone per core of every host, before measuring "
                         "(a host's first clone after `starling up` pays one-off costs)")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each run wait (up to --quiet-timeout s) until the machine's load is below this")
    ap.add_argument("--quiet-timeout", type=float, default=10.0)
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--out", default="fork",
                    help="results go to bench/out/OUT.json and OUT.png (e.g. --out faults_after for a one-clone "
                         "fault-service run that must not replace the full table's fork.json)")
    ap.add_argument("--note", default="",
                    help="recorded with the results, e.g. 'machine shared with other builds: not a clean figure'")
    a = ap.parse_args()
    quiet = (a.quiet_cores, a.quiet_timeout)
    modes = ["hierarchical"] if a.hierarchical else [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        sys.exit(f"--modes: expected a list of {', '.join(MODES)}, got {a.modes!r}")
    counts = [int(x) for x in a.counts.split(",")]
    build_dir = pathlib.Path(a.starling_dir).resolve()
    starling = str(build_dir / "starling")
    OUT.mkdir(parents=True, exist_ok=True)
    ran_on = provenance()  # at the start: the tree the run measures
    ran_on["binaries"] = str(build_dir)
    exe = build(build_dir)
    print(f"instance {os.environ['STARLING_INSTANCE']}, {a.hosts} hosts, binaries from {build_dir}", flush=True)
    sh(starling, "down", timeout=120)
    r = sh(starling, "up", "--hosts", str(a.hosts), timeout=300)
    if r.returncode:
        sys.exit(f"starling up failed:\n{r.stdout}\n{r.stderr}")
    rows, warmups = [], []
    try:
        for mode in modes:
            for _ in range(a.warmup):
                for n in dict.fromkeys([2 * a.hosts, max(counts)]):  # all cores; else the largest count
                    try:
                        w = run_once(exe, n, mode, a.heap_mib, a.probes, a.settle_ms, quiet)
                    except RuntimeError as e:
                        print(f"  warm-up {mode} {n} failed ({str(e).strip().splitlines()[-1]}), trying fewer", flush=True)
                        continue
                    warmups.append(w)
                    print(f"  warm-up {mode} {n}: clone {w['clone_time_ms']:.1f} ms (discarded)", flush=True)
                    break
        for n in counts:
            for mode in modes:  # modes interleaved per count: drift hits both alike
                runs = [run_once(exe, n, mode, a.heap_mib, a.probes, a.settle_ms, quiet) for _ in range(a.repeat)]
                row = median_run(runs)
                rows.append(row)
                print(f"  {mode} {n}: clone {row['clone_time_ms']:.1f} ms (runs "
                      f"{', '.join(f'{x:.1f}' for x in row['runs_clone_time_ms'])})", flush=True)
    finally:
        if not a.keep:
            sh(starling, "down", timeout=120)

    print(f"\nheap {a.heap_mib} MiB, {a.probes} probes per clone, settle {a.settle_ms} ms, "
          f"median of {a.repeat} per row, {rows[0]['cores']} cores on this machine")
    hdr = (f"{'mode':<12} {'clones':>6} {'clone ms':>9} {'first ms':>9} {'sf_clone ms':>11} {'cpu ms':>7} "
           f"{'cpu/clone':>9} {'floor ms':>8} {'bg cores':>8} {'late':>4} {'desc B':>7} {'fetched/clone':>13} "
           f"{'resident pg':>11} {'fault med us':>12} {'fault p99 us':>12}")
    print(hdr)
    for x in rows:
        print(f"{x['mode']:<12} {x['clones']:>6} {x['clone_time_ms']:>9.1f} {x['first_clone_ms']:>9.1f} "
              f"{x['sf_clone_call_ms']:>11.1f} {x['cpu_ms']:>7.0f} {x['cpu_ms_per_clone']:>9.1f} "
              f"{x['cpu_floor_ms']:>8.1f} {x['background_cores']:>8.2f} {x['runs_late_clones']:>4} "
              f"{x['descriptor_bytes']:>7} {x['pages_fetched_mean']:>13.0f} {x['parent_rss_kib'] // 4:>11} "
              f"{x['fault_median_us']:>12.0f} {x['fault_p99_us']:>12.0f}")

    late = sum(x["runs_late_clones"] for x in rows)
    if late:
        print(f"WARNING: {late} clone(s) started after the settle deadline: creation and probing overlapped; "
              f"raise --settle-ms (now {a.settle_ms})")
    busy = [f"{x['mode']} {x['clones']}" for x in rows if x["background_cores"] > a.quiet_cores]
    if busy:
        print(f"WARNING: the machine was busy (> {a.quiet_cores} cores) just before: {', '.join(busy)}; "
              f"their cpu ms include other programs' load")
    if any(not x["cpu_window_complete"] for x in rows):
        print("WARNING: a creation window outlasted the settle window: its cpu ms is cut at the deadline")

    print_path(rows, modes)
    projections = {}
    for mode in modes:
        pr = projection(rows, mode)
        if pr is None:
            continue
        projections[mode] = pr
        measured = (f"measured {pr['measured_ms']:.1f} ms (ratio {pr['measured_ratio']:.2f})" if pr["measured_ms"]
                    else "not measured here")
        print(f"{mode}: projected {pr['target']} clones on {pr['target']} hosts = {pr['one_clone_ms']:.1f} ms (one clone) "
              f"+ {pr['target'] - 1} x {pr['serial_per_launch_ms']:.2f} ms (serial per launch, from "
              f"{pr['serial_from']}) + {pr['fanout_ms']:.2f} ms (fan-out) = {pr['projected_ms']:.1f} ms "
              f"(ratio {pr['projected_ratio']:.2f}); {measured}")
    if a.note:
        print(f"NOTE: {a.note}")

    ratios = {}
    for mode in modes:
        by = {x["clones"]: x for x in rows if x["mode"] == mode}
        lo, hi = min(by), max(by)
        if lo == hi:
            continue
        one, big = by[lo], by[hi]
        ratio = big["clone_time_ms"] / one["clone_time_ms"]
        if (lo, hi) == (1, 32):
            ratios[mode] = ratio
        print(f"{mode}: clone-time({hi})/clone-time({lo}) = {ratio:.2f} (measured: "
              f"{big['clone_time_ms']:.1f} / {one['clone_time_ms']:.1f} ms)")
        net = max(big["cpu_ms"] - big["cpu_background_ms"], 0.0)
        print(f"  explained: creating {hi} clones used {big['cpu_ms']:.0f} ms of machine CPU "
              f"({big['cpu_ms_per_clone']:.1f} ms/clone; ~{big['cpu_background_ms']:.0f} ms of it is the "
              f"background load measured before the run); on this machine's {big['cores']} cores that needs "
              f">= {big['cpu_floor_ms']:.0f} ms ({net / big['cores']:.0f} ms without the background) even with "
              f"perfect parallelism, i.e. a CPU-bound ratio floor of "
              f"{big['cpu_floor_ms'] / one['clone_time_ms']:.2f} ({net / big['cores'] / one['clone_time_ms']:.2f} "
              f"without the background) against clone-time({lo})")

    doc = {"provenance": ran_on, "instance": os.environ["STARLING_INSTANCE"], "hosts": a.hosts, "heap_mib": a.heap_mib, "probes": a.probes,
           "repeat": a.repeat, "warmup": a.warmup, "settle_ms": a.settle_ms, "modes": modes, "cores": rows[0]["cores"], "rows": rows,
           "warmup_runs": warmups,
           "ratio_32_over_1": ratios.get("spread", next(iter(ratios.values()), None)),
           "ratio_32_over_1_by_mode": ratios,
           "critical_path_stages": [{"stage": n, "from": f, "to": t, "where": w} for n, f, t, w in STAGES],
           "projection_32": projections, "note": a.note,
           "loadavg_after": pathlib.Path("/proc/loadavg").read_text().split()[:3]}
    (OUT / f"{a.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT / f'{a.out}.json'} (python3 bench/tables.py puts it into bench/README.md)")
    plot(rows, modes, a)


def plot(rows, modes, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: skipping bench/out/fork.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, mode in enumerate(modes):
        rs = [x for x in rows if x["mode"] == mode]
        xs = [x["clones"] for x in rs]
        c = f"C{i}"
        ax[0].plot(xs, [x["clone_time_ms"] for x in rs], "o-", color=c, label=f"{mode}: last clone running")
        ax[0].plot(xs, [x["sf_clone_call_ms"] for x in rs], "s--", color=c, alpha=0.6,
                   label=f"{mode}: sf_clone returns (parent)")
        ax[0].plot(xs, [x["cpu_floor_ms"] for x in rs], ":", color=c, marker="^",
                   label=f"{mode}: CPU floor (cpu ms / {rs[0]['cores']} cores)")
        ax[1].plot(xs, [x["fault_median_us"] for x in rs], "o-", color=c, label=f"{mode}: median")
        ax[1].plot(xs, [x["fault_p99_us"] for x in rs], "s--", color=c, alpha=0.6, label=f"{mode}: p99")
    for x in ax:
        x.set_xscale("log", base=2)
        x.set_xlabel("clones")
        x.legend(fontsize=7)
    ax[0].set_ylabel("ms")
    ax[0].set_title(f"clone time ({a.hosts} emulated hosts, settle {a.settle_ms} ms)")
    ax[1].set_ylabel("µs")
    ax[1].set_title("page-fault service time (in the clone, after settle)")
    fig.tight_layout()
    fig.savefig(OUT / f"{a.out}.png", dpi=100)
    print(f"wrote {OUT / f'{a.out}.png'}")


if __name__ == "__main__":
    main()
