#!/usr/bin/env python3
"""Live-migration benchmark on the embedded cluster (issue 9).

For resident sizes (default 64, 512, 2048 MiB) and write rates (0, 10, 100 MiB/s) it starts
bench/c/migrate_work.c on one host with `starling exec`, waits until its memory is resident, and
moves it to another host with `starling migrate --json`: once live (pre-copy with write-protect
dirty tracking, freeze, post-copy of the rest) and once with `--stop-and-copy` (freeze, send
everything, resume: Snowbird's way), in the same run. It reports:

* pause as the task saw it: the longest gap between two passes of its loop (CLOCK_MONOTONIC, one
  clock for every emulated host of this machine), and the pause as the source measured it
  (freeze -> running on the target);
* total time (request -> the source holds nothing), pre-copy rounds;
* bytes moved for memory / the resident footprint at the start (target <= 1.15 at 10 MiB/s),
  pages sent while it ran, at the freeze, and after the switch;
* post-copy faults the target served (pre-copied pages from its staging, the rest from the frozen
  source's page server) and their service time: median and p99, as the upper bounds of their
  power-of-two microsecond buckets.

Targets: pause <= 100 ms for every size at 10 MiB/s; bytes <= 1.15 x footprint at 10 MiB/s.
The emulated hosts share this machine's cores (and the copy is a veth on one kernel): the figures
are bytes and serial pauses, not a network's throughput.

Runs on cluster instance 8 (STARLING_INSTANCE=8 unless set), starts its own 2-host cluster and
stops it at the end unless --keep. Writes a table to stdout and JSON to bench/out/migrate.json.
"""
import argparse
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"
INSTANCE = "8"


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def run_one(starling, work, size, rate, stop_and_copy, seconds):
    """One move of a task holding `size` MiB and writing `rate` MiB/s; returns its row."""
    p = subprocess.Popen([starling, "exec", "--host", "h1", "--", work, str(size), str(rate), str(seconds)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/var/tmp")
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in p.stdout] + [lines.put(None)], daemon=True).start()
    first = lines.get(timeout=600)
    if first is None or not first.startswith("ready"):
        raise SystemExit(f"migrate_work did not start: {first!r} {p.stderr.read()}")
    task = None
    for _ in range(200):
        rows = json.loads(sh(starling, "ps", "--json").stdout)
        task = next((r["task"] for r in rows if "migrate_work" in r["command"]), None)
        if task is not None:
            break
        time.sleep(0.05)
    time.sleep(1.0)  # let it write at its rate for a while before the move
    args = [starling, "migrate", str(task), "--to", "h2", "--json"] + (["--stop-and-copy"] if stop_and_copy else [])
    r = sh(*args)
    if r.returncode != 0:
        p.kill()
        raise SystemExit(f"migrate failed ({size} MiB, {rate} MiB/s): {r.stdout} {r.stderr}")
    report = json.loads(r.stdout)
    p.send_signal(15)  # the move is complete (the source holds nothing): the task ends and reports
    rest = []
    while (l := lines.get(timeout=600)) is not None:
        rest.append(l)
    p.wait(timeout=600)
    m = re.search(r"pause_ms=([\d.]+) gaps_over_5ms=(\d+)", "".join(rest))
    if not m:
        raise SystemExit(f"migrate_work printed no result: {rest} {p.stderr.read()}")
    footprint = report["footprint_pages"] * 4096
    return {
        "mode": "stop-and-copy" if stop_and_copy else "live",
        "resident_mib": size,
        "write_mib_s": rate,
        "task_pause_ms": float(m.group(1)),
        "gaps_over_5ms": int(m.group(2)),
        "source_pause_ms": report["pause_ms"],
        "total_ms": report["total_ms"],
        "rounds": report["rounds"],
        "footprint_bytes": footprint,
        "memory_bytes": report["memory_bytes"],
        "bytes_over_footprint": report["memory_bytes"] / footprint if footprint else None,
        "precopy_pages": report["precopy_pages"],
        "freeze_pages": report["freeze_pages"],
        "postcopy_pages": report["postcopy_pages"],
        "discarded_pages": report.get("discarded_pages"),
        "postcopy_faults": report.get("postcopy_faults"),
        "fault_p50_us": report.get("fault_p50_us"),
        "fault_p99_us": report.get("fault_p99_us"),
        "state_bytes": report["state_bytes"],
        "phases_ms": report.get("phases_ms"),
        "exit": p.returncode,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512,2048", help="resident MiB, comma-separated")
    ap.add_argument("--rates", default="0,10,100", help="MiB/s written by the task, comma-separated")
    ap.add_argument("--starling-dir", default=os.environ.get("STARLING_BUILD_DIR", str(ROOT / "target/release")))
    ap.add_argument("--modes", default="live,stop-and-copy", help="live and/or stop-and-copy, comma-separated")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--out", default=str(OUT / "migrate.json"))
    a = ap.parse_args()
    os.environ.setdefault("STARLING_INSTANCE", INSTANCE)
    starling = str(pathlib.Path(a.starling_dir) / "starling")
    work = "/var/tmp/starling-bench-migrate_work"
    r = sh("cc", "-O2", "-o", work, str(ROOT / "bench/c/migrate_work.c"))
    if r.returncode:
        raise SystemExit(r.stderr)
    sh(starling, "down")
    r = sh(starling, "up", "--hosts", "2")
    if r.returncode:
        raise SystemExit(f"starling up: {r.stdout}{r.stderr}")
    rows = []
    try:
        for size in map(int, a.sizes.split(",")):
            seconds = 3600  # ended by SIGTERM once the move is complete
            for rate in map(int, a.rates.split(",")):
                for sc in [m == "stop-and-copy" for m in a.modes.split(",")]:
                    row = run_one(starling, work, size, rate, sc, seconds)
                    rows.append(row)
                    print(f"{row['mode']:>13} {size:>5} MiB {rate:>4} MiB/s: task pause {row['task_pause_ms']:8.1f} ms, "
                          f"total {row['total_ms']:8.0f} ms, bytes/footprint {row['bytes_over_footprint']:.3f}, "
                          f"rounds {row['rounds']}, after switch {row['postcopy_pages']} pages", flush=True)
    finally:
        if not a.keep:
            sh(starling, "down")
    at10 = [x for x in rows if x["mode"] == "live" and x["write_mib_s"] == 10]
    doc = {
        "provenance": provenance(),
        "hosts": 2,
        "cores": os.cpu_count(),
        "rows": rows,
        "targets": {
            "pause_le_100ms_at_10mib_s": all(x["task_pause_ms"] <= 100 for x in at10) if at10 else None,
            "bytes_le_1_15_footprint_at_10mib_s": all(x["bytes_over_footprint"] <= 1.15 for x in at10) if at10 else None,
        },
    }
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    import tables
    print(tables.render_migrate(doc))


if __name__ == "__main__":
    main()
