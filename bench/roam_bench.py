#!/usr/bin/env python3
"""Roaming benchmark on the embedded cluster (issue 11 part 5): Snowbird's Table 3.3 for processes.

A bimodal program (bench/c/roam_work.c) alternates interactive phases — keystrokes typed at a steady
pace, each echoed by the program as an editor draws what you type — and crunch phases (a fixed amount
of CPU work). It runs on a terminal through `starling exec -t`, three ways:

* home:    `exec --roam` with a profile of one state at home: never moves (the user's machine);
* cluster: `exec --host h1`: always on the cluster, over the emulated link;
* roam:    `exec --roam` with the generic profile shortened (3 s averaging instead of 10 s, 0.5 s
  samples, 5 s dwell, the input thresholds scaled to the window: 15 per 10 s -> 5 per 3 s, 3 per
  10 s -> 1 per 3 s; cpu >= 0.8; speedup 2, C = 30 s): the manager moves it out when it crunches
  and home when keys resume.

The benchmark is the terminal: it holds the pty master `starling exec` runs on, so a keystroke's
latency is exact (the key written to the master -> its echo read back from it), with no screen
polling. Per phase it reports: wall time (interactive: first key -> last echo; crunch: the program's
own CRUNCH -> DONE stamps), key -> echo p50/p95, the longest gap the crunch loop saw (a move's pause
lands there); per run: total wall time, the task's CPU seconds (from `starling ps`, summed over the
sites it ran on), moves with detect time (phase start -> the manager's decision), migrate time and
pause (the head's report of each move).

Over `lan` and (unless --links says otherwise) `coffee-shop`, each with a fresh `starling up
--hosts 2 --link L`; the home site is this machine (no link). Targets (issue): roaming total within
10% of the best of home and cluster for every phase, key latency within 10% of home, pause <= 100 ms.
On this machine the emulated hosts share its cores with home, the head, the agents and the client:
crunching on the cluster is not faster here. The JSON also gives, clearly labelled as projected,
what a cluster whose hosts have their own cores would show: each crunch phase's measured CPU seconds
(the work's need at one core) run at home at 1x and on the cluster at the profile's speedup (2x;
roaming: at home until its move out, the rest on the cluster), plus each move's pause and the
interactive phases as measured.

Runs on instance 9 (STARLING_INSTANCE=9 unless set). Writes a table to stdout and JSON to
bench/out/roam.json. About 6-10 minutes.
"""
import argparse
import json
import os
import pathlib
import pty
import re
import statistics
import subprocess
import sys
import termios
import threading
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"
INSTANCE = "9"
HOME_ONLY = 'initial = "home"\n[states.home]\nsite = "home"\n'
SPEEDUP = 2.0
SHORTENED = f"""
# The generic profile (crates/client/src/roam.rs) with a 3 s window instead of 10 s.
window_s = 3
sample_ms = 500
min_dwell_s = 5
speedup = {SPEEDUP}
crunch_s = 30
move_cost_s = 1
initial = "cognitive"

[states.cognitive]
site = "home"

[states.crunch]
site = "cluster"

[[rules]]
from = "cognitive"
to = "crunch"
cpu_min = 0.8
inputs_max = 5

[[rules]]
from = "crunch"
to = "cognitive"
inputs_min = 5

[[rules]]
from = "crunch"
to = "cognitive"
inputs_min = 1
latency_min_ms = 50
"""


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Terminal:
    """`starling exec` on a pty whose master we hold; everything it prints, with arrival times."""

    def __init__(self, argv):
        self.master, slave = pty.openpty()
        termios.tcsetwinsize(slave, (30, 100))
        self.p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, cwd="/var/tmp")
        os.close(slave)
        self.buf = bytearray()
        self.cv = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                b = os.read(self.master, 65536)
            except OSError:
                b = b""
            with self.cv:
                if not b:
                    self.closed = True
                else:
                    self.buf += b
                self.cv.notify_all()
            if not b:
                return

    def wait(self, pattern, start=0, timeout=600):
        """The first match of `pattern` (bytes regex) at or after offset `start`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                m = rx.search(self.buf, start)
                if m:
                    return m
                if self.closed or time.monotonic() > deadline:
                    raise SystemExit(f"no {pattern!r} from the task; it printed: {bytes(self.buf[-2000:])!r}")
                self.cv.wait(0.5)

    def mark(self):
        with self.cv:
            return len(self.buf)

    def key(self, c):
        """Type `c`; its latency (s) once its echo is back."""
        start = self.mark()
        t0 = time.monotonic()
        os.write(self.master, c)
        self.wait(re.escape(c), start)
        return time.monotonic() - t0


def task_row(starling, marker):
    for _ in range(600):
        rows = json.loads(sh(starling, "ps", "--json").stdout or "[]")
        r = next((r for r in rows if marker in r["command"]), None)
        if r:
            return r
        time.sleep(0.1)
    raise SystemExit(f"no task running {marker}")


def run_one(starling, work, mode, link, profile_dir, cycles, keys, key_gap, rounds):
    marker = f"{work} {rounds}"
    argv = [starling, "exec", "-t"]
    if mode == "home":
        argv += ["--roam", "--profile", str(profile_dir / "home.toml")]
    elif mode == "roam":
        argv += ["--roam", "--profile", str(profile_dir / "roam.toml")]
    else:
        argv += ["--host", "h1"]
    argv += ["--", work, str(rounds)]
    t_start = time.monotonic()
    term = Terminal(argv)
    term.wait(rb"READY\r\n")
    task = task_row(starling, marker)["task"]
    phases = []
    letters = b"abcdefghijklmnopqrstuvwxyz"
    for cycle in range(cycles):
        lat = []
        start_ms = time.time() * 1000
        t0 = time.monotonic()
        for k in range(keys):
            slot = t0 + k * key_gap
            time.sleep(max(0.0, slot - time.monotonic()))
            lat.append(term.key(letters[k % 26:k % 26 + 1]) * 1000)
        phases.append({"cycle": cycle, "kind": "interactive", "start_ms": start_ms, "wall_s": time.monotonic() - t0,
                       "keys": keys, "latency_p50_ms": pct(lat, 0.5), "latency_p95_ms": pct(lat, 0.95),
                       "latency_ms": [round(x, 2) for x in lat]})
        at = term.mark()
        os.write(term.master, b"C")
        m = term.wait(rb"CRUNCH (\d+)\r\n", at)
        d = term.wait(rb"DONE (\d+) ([\d.]+) (\d+)\r\n", m.end())
        c0, c1 = int(m.group(1)), int(d.group(1))
        phases.append({"cycle": cycle, "kind": "crunch", "start_ms": c0, "wall_s": (c1 - c0) / 1000,
                       "longest_gap_ms": float(d.group(2))})
    r = task_row(starling, marker)
    cpu = r.get("cpu_seconds")
    decisions = (r.get("roam") or {}).get("decisions") or []
    at = term.mark()
    os.write(term.master, b"Q")
    term.wait(rb"BYE\r\n", at)
    rc = term.p.wait(timeout=600)
    total = time.monotonic() - t_start
    moves = []
    for dcs in decisions:
        if dcs.get("action") != "moved":
            continue
        # The phase the decision answered: the latest one that began before it.
        ph = max((p for p in phases if p["start_ms"] <= dcs["at_ms"]), key=lambda p: p["start_ms"], default=None)
        pause = re.search(r"pause ([\d.]+) ms", dcs.get("reason", ""))
        total_ms = re.search(r"total ([\d.]+) ms", dcs.get("reason", ""))
        moves.append({"from": dcs["from_site"], "to": dcs["to_site"], "at_ms": dcs["at_ms"],
                      "phase": f"{ph['kind']} {ph['cycle']}" if ph else None,
                      "detect_s": (dcs["at_ms"] - ph["start_ms"]) / 1000 if ph else None,
                      "pause_ms": float(pause.group(1)) if pause else None,
                      "migrate_ms": float(total_ms.group(1)) if total_ms else None,
                      "reason": dcs.get("reason")})
    return {"link": link, "mode": mode, "task": task, "exit": rc, "total_s": total, "cpu_seconds": cpu,
            "crunch_s": sum(p["wall_s"] for p in phases if p["kind"] == "crunch"),
            "phases": phases, "moves": moves, "decisions": decisions}


def check_targets(rows):
    """The issue's targets per link, from the measured rows."""
    out = {}
    for link in sorted({r["link"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["link"] == link}
        if not all(m in by for m in ("home", "cluster", "roam")):
            continue
        per_phase = []
        for i, ph in enumerate(by["roam"]["phases"]):
            best = min(by["home"]["phases"][i]["wall_s"], by["cluster"]["phases"][i]["wall_s"])
            per_phase.append(ph["wall_s"] <= 1.1 * best)
        home_p50 = [p["latency_p50_ms"] for p in by["home"]["phases"] if p["kind"] == "interactive"]
        roam_p50 = [p["latency_p50_ms"] for p in by["roam"]["phases"] if p["kind"] == "interactive"]
        pauses = [m["pause_ms"] for m in by["roam"]["moves"] if m["pause_ms"] is not None]
        out[link] = {
            "roam_phase_within_10pct_of_best": per_phase,
            "roam_total_within_10pct_of_best": by["roam"]["total_s"] <= 1.1 * min(by["home"]["total_s"], by["cluster"]["total_s"]),
            "latency_p50_within_10pct_of_home": [r <= 1.1 * h for r, h in zip(roam_p50, home_p50)],
            "pause_le_100ms": all(p <= 100 for p in pauses) if pauses else None,
        }
    return out


def projected(rows):
    """Labelled projection: hosts with cores of their own, `SPEEDUP` x home's per core."""
    out = []
    for r in rows:
        crunches = [p for p in r["phases"] if p["kind"] == "crunch"]
        if not crunches or r["cpu_seconds"] is None:
            continue
        cpu_per_crunch = r["cpu_seconds"] / len(crunches)  # the interactive phases use next to none
        inter = sum(p["wall_s"] for p in r["phases"] if p["kind"] == "interactive")
        pauses = sum((m["pause_ms"] or 0) / 1000 for m in r["moves"])
        if r["mode"] == "home":
            crunch = cpu_per_crunch * len(crunches)
        elif r["mode"] == "cluster":
            crunch = cpu_per_crunch * len(crunches) / SPEEDUP
        else:
            # Roaming: each crunch runs at home until its move out (detect), the rest on the cluster.
            crunch = 0.0
            for p in crunches:
                out_at = next((m["detect_s"] for m in r["moves"] if m["phase"] == f"crunch {p['cycle']}" and m["to"] != "home"), None)
                home_part = min(out_at, cpu_per_crunch) if out_at is not None else cpu_per_crunch
                crunch += home_part + (cpu_per_crunch - home_part) / SPEEDUP
        out.append({"link": r["link"], "mode": r["mode"], "cpu_per_crunch_s": cpu_per_crunch,
                    "projected_crunch_s": crunch, "projected_total_s": inter + crunch + pauses})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="lan,coffee-shop")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--keys", type=int, default=30, help="keystrokes per interactive phase")
    ap.add_argument("--key-gap", type=float, default=0.15, help="seconds between keystrokes")
    ap.add_argument("--rounds", type=int, default=7_000_000_000,
                    help="crunch work per phase (LCG rounds; the default, ~14 s here, outlasts the profile's 3 s window and 5 s dwell: a crunch shorter than them is never moved)")
    ap.add_argument("--modes", default="home,cluster,roam")
    ap.add_argument("--starling-dir", default=os.environ.get("STARLING_BUILD_DIR", str(ROOT / "target/release")))
    ap.add_argument("--out", default=str(OUT / "roam.json"))
    a = ap.parse_args()
    os.environ.setdefault("STARLING_INSTANCE", INSTANCE)
    starling = str(pathlib.Path(a.starling_dir) / "starling")
    work = "/var/tmp/starling-bench-roam_work"
    r = sh("cc", "-O2", "-o", work, str(ROOT / "bench/c/roam_work.c"))
    if r.returncode:
        raise SystemExit(r.stderr)
    profiles = pathlib.Path("/var/tmp/starling-bench-roam")
    profiles.mkdir(exist_ok=True)
    (profiles / "home.toml").write_text(HOME_ONLY)
    (profiles / "roam.toml").write_text(SHORTENED)
    rows = []
    try:
        for link in a.links.split(","):
            sh(starling, "down")
            r = sh(starling, "up", "--hosts", "2", "--link", link)
            if r.returncode:
                raise SystemExit(f"starling up --link {link}: {r.stdout}{r.stderr}")
            # Warm: the program and its libraries in the hosts' caches, the home site started.
            for host in ("h1", "h2"):
                sh(starling, "exec", "-T", "--host", host, "--", work, "0", stdin=subprocess.DEVNULL)
            for mode in a.modes.split(","):
                row = run_one(starling, work, mode, link, profiles, a.cycles, a.keys, a.key_gap, a.rounds)
                rows.append(row)
                print(f"{link:>11} {mode:>7}: total {row['total_s']:6.1f} s, crunch {row['crunch_s']:6.1f} s, "
                      f"cpu {row['cpu_seconds'] or 0:6.1f} s, moves {len(row['moves'])}", flush=True)
    finally:
        sh(starling, "down")
    doc = {
        "provenance": provenance(),
        "hosts": 2,
        "params": {"cycles": a.cycles, "keys": a.keys, "key_gap_s": a.key_gap, "rounds": a.rounds,
                   "roam_profile": SHORTENED, "speedup_assumed": SPEEDUP},
        "rows": rows,
        "targets": check_targets(rows),
        "projected_own_cores": projected(rows),
    }
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    import tables
    print(tables.render_roam(doc))


if __name__ == "__main__":
    main()
