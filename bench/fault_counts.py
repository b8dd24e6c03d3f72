#!/usr/bin/env python3
"""Per-fault counts of one clone's page-fault service (issue 16 part 4): syscalls, context switches
and CPU of the agent's fault-handler thread and of the parent's page-server connection thread.

Counts hold under other programs' load, wall-clock times do not: run it on a busy machine to compare
builds, on a quiet one for the times. It runs bench/fork_bench.c (1 clone, spread, PROBES first
touches of heap pages 64 pages apart) on the cluster of STARLING_INSTANCE (already up, started from
--starling-dir's binaries: `starling up --hosts 2`), attaches `perf stat -t` to the handler thread
(`fault-1`, in an agent) and to the parent's `sf-page-conn` threads while the clone sleeps before its
probes, and divides what they count by PROBES. The clone's own exit adds a few faults (< 1%).
With --switches it also records the threads' context switches (`perf record -e sched:sched_switch`)
and splits them into sleeps (S: waiting for a fault or a reply) and preemptions (R: a runnable thread
put off its core). The run is appended to bench/out/OUT.json (`bench/tables.py`, table faults_counts).

    STARLING_INSTANCE=5 python3 bench/fault_counts.py --build main --starling-dir /path/to/release
"""
import argparse
import collections
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"


def threads(name, pid="*"):
    out = []
    for comm in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            if pathlib.Path(comm).read_text().strip() == name:
                out.append(int(comm.split("/")[4]))
        except OSError:
            pass
    return out


def perf_counts(path):
    vals = {}
    for line in pathlib.Path(path).read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 3 and parts[0][:1].isdigit():
            vals[parts[2]] = float(parts[0])
    return vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="what the binaries are (a label for the table)")
    ap.add_argument("--starling-dir", default=str(ROOT / "target/release"))
    ap.add_argument("--probes", type=int, default=1000)
    ap.add_argument("--settle-ms", type=int, default=15000, help="the clone sleeps this long after sf_clone before probing")
    ap.add_argument("--reply-spin-us", type=int, default=0, help="the agents' fork.reply_spin_us (as the cluster was started)")
    ap.add_argument("--switches", action="store_true")
    ap.add_argument("--out", default="faults_counts")
    a = ap.parse_args()
    d = pathlib.Path(a.starling_dir).resolve()
    exe = f"/tmp/fault_counts-{os.getpid()}"
    subprocess.run(["cc", "-O2", "-I", str(ROOT / "include"), str(ROOT / "bench/fork_bench.c"), str(d / "libstarling.a"),
                    "-lpthread", "-ldl", "-lm", "-o", exe], check=True)
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)
    ran_on = provenance()
    ran_on["binaries"] = str(d)
    p = subprocess.Popen([exe, "1", "256", str(a.probes), str(a.settle_ms), "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd="/var/tmp")
    t0 = time.monotonic()
    handler, conns = [], []
    while time.monotonic() - t0 < a.settle_ms / 1000 - 2:
        # The handler's connection is made after the descriptor's, whose thread may still be there.
        handler, conns = threads("fault-1"), threads("sf-page-conn", p.pid)
        if handler and conns:
            time.sleep(0.5)
            handler, conns = threads("fault-1"), threads("sf-page-conn", p.pid)
            break
        time.sleep(0.05)
    if not handler or not conns:
        p.kill()
        sys.exit(f"no fault-1 thread (agent) or sf-page-conn thread (parent) within {a.settle_ms / 1000 - 2:.0f} s")
    tracers = []
    for role, tids in (("handler", handler), ("server", conns)):
        for tid in tids:
            stat = f"/tmp/fault_counts-{tid}.stat"
            tracers.append((role, tid, stat, subprocess.Popen(
                ["perf", "stat", "-x,", "-o", stat, "-e", "raw_syscalls:sys_enter,context-switches,task-clock", "-t", str(tid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            if a.switches:
                tracers.append((role + "-switches", tid, f"/tmp/fault_counts-{tid}.data", subprocess.Popen(
                    ["perf", "record", "-q", "-e", "sched:sched_switch", "-t", str(tid), "-o", f"/tmp/fault_counts-{tid}.data"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    out, err = p.communicate(timeout=300 + a.settle_ms / 1000)
    for *_, t in tracers:
        if t.poll() is None:
            t.send_signal(2)
        t.wait()
    clone = re.search(r"^CLONE .*$", out, re.M)
    if p.returncode or not clone:
        sys.exit(f"fork_bench failed (rc {p.returncode}):\n{out}\n{err}")
    c = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", clone.group(0))}
    run = {"build": a.build, "reply_spin_us": a.reply_spin_us, "probes": a.probes, "median_us": c["median_ns"] / 1e3,
           "p99_us": c["p99_ns"] / 1e3, "load": open("/proc/loadavg").read().split()[0], "provenance": ran_on}
    for role, tid, path, _ in tracers:
        if role.endswith("-switches"):
            script = subprocess.run(["perf", "script", "-i", path], capture_output=True, text=True).stdout
            states = collections.Counter(s.rstrip("+") for s in re.findall(rf"prev_pid={tid} .*?prev_state=(\S+)", script))
            part = run.get(role.split("-")[0])
            if part and part.get("tid") == tid:
                part["sleeps"] = states.get("S", 0) / a.probes
                part["preemptions"] = states.get("R", 0) / a.probes
            continue
        v = perf_counts(path)
        if v.get("raw_syscalls:sys_enter", 0) < a.probes / 2:
            continue  # a connection that served nothing meanwhile (the descriptor's)
        run[role] = {"tid": tid, "syscalls": v["raw_syscalls:sys_enter"] / a.probes,
                     "context_switches": v["context-switches"] / a.probes, "cpu_us": v["task-clock"] * 1e3 / a.probes}
    if "handler" not in run or "server" not in run:
        sys.exit(f"a thread counted nothing: {run}")
    print(json.dumps(run, indent=1))
    path = OUT / f"{a.out}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
    doc["method"] = ("bench/fault_counts.py: one clone (spread, 2 hosts), PROBES first touches of heap pages 64 apart, each a "
                     "userfault served over TCP (encrypted); `perf stat -t` on the agent's fault-handler thread and the "
                     "parent's page-server connection thread from before the probes to the clone's end, divided by PROBES. "
                     "Switches: context switches of the thread (sleep = waited for a fault or a reply; preempted = put off "
                     "its core while runnable), with --switches. Fault med/p99: the clone's own view, as in fork_bench.")
    doc["runs"].append(run)
    doc["provenance"] = ran_on
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
