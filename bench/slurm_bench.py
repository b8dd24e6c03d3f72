#!/usr/bin/env python3
"""Slurm pilot start-up benchmark (issue 13): how long from `starling up --slurm -N 4` until every
agent has registered with the head, and until a first task runs, against `starling up --hosts 4`
(the embedded cluster) on the same machine.

The Slurm cluster is a real Slurm 22.05 started by scripts/slurm-local.sh (4 slurmd nodes, each in
its own network namespace). Measured per mode (one run each unless --repeat):

* registered_s: from the start of `starling up` until `starling status` lists every host (polled
  every 20 ms in a thread; for Slurm this includes sbatch, scheduling and the step launch);
* up_s: until `starling up` returned (it returns once every agent registered);
* first_task_s: from the start of `starling up` until a first task runs (`starling exec -- date`
  started right after `up` returned; the task prints its own start time);
* Slurm only, from the logs: step_to_connected_s: from the earliest "launch task StepId=JOB.0" in
  the nodes' slurmd logs to the last agent's "connected to head" in the job output (target: <= 2 s).

Table on stdout, JSON in bench/out/slurm.json. Uses cluster instance 7 and leaves the Slurm
cluster down unless --keep.
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import threading
import time

from provenance import provenance
import tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
SCRIPT = str(ROOT / "scripts/slurm-local.sh")
OUT = ROOT / "bench/out"
INSTANCE = "7"
SLURM_DIR = pathlib.Path("/run/starling-slurm")
NODES = 4

ENV = dict(os.environ, STARLING_INSTANCE=INSTANCE, SLURM_CONF=str(SLURM_DIR / "slurm.conf"))


def sh(*args, check=True, timeout=600):
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=timeout, env=ENV)


def hosts_now():
    r = subprocess.run([STARLING, "status", "--json"], capture_output=True, text=True, env=ENV, timeout=30)
    if r.returncode != 0:
        return 0
    try:
        return len(json.loads(r.stdout)["hosts"])
    except (ValueError, KeyError):
        return 0


def measure_up(args, want):
    """Run `starling up ARGS`; times relative to its start (seconds)."""
    sh(STARLING, "down", check=False)
    seen = {}
    stop = threading.Event()
    t0 = time.time()

    def poll():
        while not stop.is_set():
            if hosts_now() >= want and "registered" not in seen:
                seen["registered"] = time.time() - t0
                return
            time.sleep(0.02)

    th = threading.Thread(target=poll)
    th.start()
    r = sh(STARLING, "up", *args, check=False, timeout=600)
    up_s = time.time() - t0
    if r.returncode != 0:
        stop.set()
        th.join()
        sys.exit(f"starling up {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    th.join(timeout=60)
    stop.set()
    e = sh(STARLING, "exec", "--", "date", "+%s.%N")
    first_task_s = float(e.stdout.strip()) - t0
    return {"registered_s": seen.get("registered", up_s), "up_s": up_s, "first_task_s": first_task_s, "t0": t0}


def parse_ts(s):
    """Slurm's and env_logger's timestamps (both UTC on this machine's clock)."""
    s = s.rstrip("Z")
    return datetime.datetime.fromisoformat(s).replace(tzinfo=datetime.timezone.utc).timestamp()


def step_to_connected(job):
    launches = []
    for log in SLURM_DIR.glob("log/slurmd-*.log"):
        for m in re.finditer(r"^\[([\d\-T:.]+)\] launch task StepId=" + re.escape(job) + r"\.0 ", log.read_text(), re.M):
            launches.append(parse_ts(m.group(1)))
    out = pathlib.Path(f"/var/lib/starling-{INSTANCE}/slurm/job-{job}.out").read_text()
    connected = [parse_ts(m.group(1)) for m in re.finditer(r"^\[([\d\-T:.]+Z) INFO\s+starling_agent\] connected to head", out, re.M)]
    if not launches or len(connected) < NODES:
        return None
    return max(connected) - min(launches)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode (medians are reported)")
    ap.add_argument("--keep", action="store_true", help="leave the Slurm cluster up")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (slurmd nodes and embedded hosts in network namespaces)")
    sh(SCRIPT, "up", str(NODES), timeout=300)
    runs = {"slurm": [], "embedded": []}
    try:
        for _ in range(a.repeat):
            m = measure_up(["--slurm", "-N", str(NODES)], NODES)
            st = json.loads(sh(STARLING, "status", "--json").stdout)
            m["step_to_connected_s"] = step_to_connected(st["slurm"]["job_id"])
            sh(STARLING, "down")
            runs["slurm"].append(m)
            m = measure_up(["--hosts", str(NODES)], NODES)
            sh(STARLING, "down")
            runs["embedded"].append(m)
    finally:
        sh(STARLING, "down", check=False)
        if not a.keep:
            sh(SCRIPT, "down", check=False)

    def median(rs, k):
        vals = [r[k] for r in rs if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for mode, label in [("slurm", f"up --slurm -N {NODES}"), ("embedded", f"up --hosts {NODES}")]:
        rs = runs[mode]
        rows.append({"mode": label, "hosts": NODES, "runs": len(rs),
                     **{k: median(rs, k) for k in ["registered_s", "up_s", "first_task_s", "step_to_connected_s"]}})
    doc = {"bench": "slurm", "provenance": provenance(), "nodes": NODES, "repeat": a.repeat, "rows": rows,
           "target": "agents registered <= 2 s after Slurm starts the step"}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "slurm.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(tables.render_slurm(doc))
    print(f"JSON: {OUT / 'slurm.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
