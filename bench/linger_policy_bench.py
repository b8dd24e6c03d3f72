#!/usr/bin/env python3
"""Issue 10 part 4 (policies, real run): the Linger-Longer policies on the embedded cluster.

    python3 bench/linger_policy_bench.py [--hosts 8] [--jobs 32] [--steps 24] [--compress 60]
                                         [--policies LF,LL,PM,IE] [--seed 1]

Root, a release build, cluster instance $STARLING_INSTANCE (2 if unset). For each policy:
`starling up --hosts 8 --policy P` (PM with STARLING_PM_PAUSE_S = 600 s / compress), then

* owners: every host's owner episodes come from bench/linger_sim.py's synthetic coarse trace (same
  seed, so the same for every policy), time-compressed (--compress 60: 30 min of trace = 30 s
  here) and replayed as keyboard state (`starling owner hN --active` / `--idle`). Keyboard only,
  no owner CPU: the emulated hosts share this machine's 2 cores, so an owner busy loop on one host
  would starve the (cpu.idle) guests of every host, not only its own. These are the seed's
  "keyboard-busy" episodes (CPU < 10% for most non-idle time), where lingering should pay.
* guests: `starling run -n JOBS --json -- sh -c STEP_LOOP`, each task STEPS steps of
  (`sleep 0.25` + a short shell counting loop): fixed work that needs a slot more than a core, so
  that running, suspended (PM), killed and rerun (IE) show in the wall time, not the 2 cores.
* owner delay: a fixed owner CPU probe (`starling owner h1 -- sh -c 'counting loop'`) that times
  its own loop (so the command's start and the agent's launch around it are not counted), alone
  before the run (median of 9) and every 0.5 s during it (median).
* migrations / reruns: `starling ps --json` polled every 0.5 s (a task seen on another host than
  before = a move; a task queued for a rerun, "(queued: rerun)", = an IE rerun, and where it
  starts again is not a move).

Throughput = JOBS × STEPS / makespan (steps per second); mean job time = finish − submit.

Guests run at cpu.idle: they get only CPU that no other program of this machine wants, so on a
machine kept busy by other work they barely run and the makespan measures that work, not the
policy. Before each policy the bench therefore waits (up to --quiet-wait s) for the 1-min load
average to fall below --quiet-load, and records the load average during each run (min, median,
max, sampled every 5 s) in the JSON; a policy whose guests do not finish within --deadline s is
stopped and recorded as not finished.
Writes a table to stdout and JSON (with provenance) to bench/out/linger_policy.json; stops its
cluster at the end. Figures are under load: the machine is shared with other work.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from provenance import provenance  # noqa: E402
import linger_sim  # noqa: E402

OUT = ROOT / "bench" / "out"
STARLING = str(ROOT / "target/release/starling")
# The owner's probe times its own counting loop (nanoseconds, printed): the `starling owner` command
# around it (CLI start, the agent's launch) is the emulation's overhead, not the owner's CPU delay.
PROBE = ("a=$(date +%s%N); i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; b=$(date +%s%N); "
         "echo $((b - a))")


def step_loop(steps):
    return (f"s=0; while [ $s -lt {steps} ]; do s=$((s+1)); sleep 0.25; "
            "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; done; echo done $STARLING_TASK")


def st(*a, check=True, timeout=180, env=None):
    r = subprocess.run([STARLING, *a], capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        sys.exit(f"starling {' '.join(a)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def schedule(hosts, seed, compress, horizon_s):
    """Per host, [(start_s, end_s)] active episodes in real seconds from linger_sim's trace."""
    import random
    rng = random.Random(seed)
    windows = int(horizon_s * compress / linger_sim.WINDOW) + 1
    out = {}
    for h in range(hosts):
        tr = linger_sim.node_trace(rng, windows)
        eps, start = [], None
        for w, (_, idle) in enumerate(tr):
            if not idle and start is None:
                start = w
            if idle and start is not None:
                eps.append((start * linger_sim.WINDOW / compress, w * linger_sim.WINDOW / compress))
                start = None
        if start is not None:
            eps.append((start * linger_sim.WINDOW / compress, horizon_s))
        out[f"h{h + 1}"] = eps
    return out


def timed_probe(host="h1"):
    """Seconds the owner's probe loop took, measured inside it."""
    r = st("owner", host, "--", "sh", "-c", PROBE)
    return int(r.stdout.split()[-1]) / 1e9


def loadavg():
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def wait_quiet(limit, patience):
    """Wait until the 1-min load average is below `limit` (at most `patience` s); the load then."""
    deadline = time.monotonic() + patience
    while loadavg() >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return loadavg()


def run_policy(policy, a, sched):
    load_at_start = wait_quiet(a.quiet_load, a.quiet_wait)
    env = dict(os.environ)
    if policy == "PM":
        env["STARLING_PM_PAUSE_S"] = str(max(1, round(600 / a.compress)))
    st("down", check=False)
    r = subprocess.run([STARLING, "up", "--hosts", str(a.hosts), "--policy", policy], capture_output=True,
                       text=True, timeout=300, env=env)
    if r.returncode != 0:
        sys.exit(f"starling up --policy {policy}: {r.stdout}{r.stderr}")
    try:
        for h in sched:
            st("owner", h, "--idle")
        base = statistics.median(timed_probe() for _ in range(9))
        stop = threading.Event()
        moves, reruns, seen, queued = {}, set(), {}, set()
        probes = []
        errors = []
        loads = []

        def owners(t0):
            events = sorted([(s, h, "--active") for h, eps in sched.items() for s, _ in eps] +
                            [(e, h, "--idle") for h, eps in sched.items() for _, e in eps])
            for when, h, what in events:
                while not stop.is_set() and time.monotonic() - t0 < when:
                    time.sleep(0.05)
                if stop.is_set():
                    return
                r = st("owner", h, what, check=False)
                if r.returncode != 0:
                    errors.append(r.stderr.strip())

        def poll():
            while not stop.is_set():
                r = st("ps", "--json", check=False)
                if r.returncode == 0:
                    for t in json.loads(r.stdout or "[]"):
                        k, host = str(t.get("task")), t["host"]
                        if "rerun" in str(t.get("state", "")) or "rerun" in host:
                            # IE: killed, queued ("(queued: rerun)") and started again elsewhere.
                            reruns.add(k)
                            queued.add(k)
                            continue
                        if k in seen and seen[k] != host and k not in queued:
                            moves[k] = moves.get(k, 0) + 1
                        queued.discard(k)
                        seen[k] = host
                time.sleep(0.5)

        def prober():
            while not stop.is_set():
                probes.append(timed_probe())
                time.sleep(0.5)

        def load_sampler():
            while not stop.is_set():
                loads.append(loadavg())
                stop.wait(5.0)

        t0 = time.monotonic()
        threads = [threading.Thread(target=f, args=x, daemon=True)
                   for f, x in ((owners, (t0,)), (poll, ()), (prober, ()), (load_sampler, ()))]
        for t in threads:
            t.start()
        g = subprocess.Popen([STARLING, "run", "-n", str(a.jobs), "--json", "--", "sh", "-c", step_loop(a.steps)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        timed_out = []

        def deadline():
            if not stop.wait(a.deadline) and g.poll() is None:
                timed_out.append(True)
                g.kill()
        threading.Thread(target=deadline, daemon=True).start()
        finish, outputs = {}, {}
        for line in g.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "finished":
                finish[ev["task"]] = time.monotonic() - t0
            elif ev.get("event") == "output":
                outputs[ev["task"]] = outputs.get(ev["task"], "") + ev.get("data", "")
        rc = g.wait()
        makespan = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(timeout=30)
        err = g.stderr.read()
        ok_out = sum(1 for i in range(a.jobs) if outputs.get(i, "") == f"done {i}\n")
        times = list(finish.values())
        return {"policy": policy, "exit": rc, "finished": len(finish), "outputs_ok": ok_out,
                "timed_out": bool(timed_out), "load_at_start": load_at_start,
                "load": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)} if loads else None,
                "makespan_s": makespan, "mean_job_s": statistics.mean(times) if times else None,
                # A run stopped at the deadline counts only the jobs that finished.
                "throughput_steps_per_s": len(finish) * a.steps / makespan,
                "moves": sum(moves.values()), "reruns": len(reruns),
                "owner_probe_alone_s": base, "owner_probe_during_s": statistics.median(probes) if probes else None,
                "owner_delay_pct": 100 * (statistics.median(probes) / base - 1) if probes else None,
                "probes": len(probes), "owner_errors": errors[:3], "stderr_tail": err[-300:]}
    finally:
        st("down", check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24, help="steps per job (each ~0.25 s sleep + a short loop)")
    ap.add_argument("--compress", type=float, default=60.0, help="trace seconds per real second")
    ap.add_argument("--policies", default="LF,LL,PM,IE")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--horizon", type=float, default=240.0, help="seconds of owner schedule to replay at most")
    ap.add_argument("--quiet-load", type=float, default=3.0, help="wait for a 1-min load average below this before each policy")
    ap.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait for it at most")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds a policy's guests may take before the run is stopped")
    a = ap.parse_args()
    os.environ.setdefault("STARLING_INSTANCE", "2")
    if os.geteuid() != 0:
        sys.exit("linger_policy_bench.py needs root (it starts an embedded cluster)")
    if not os.access(STARLING, os.X_OK):
        sys.exit(f"no {STARLING}: cargo build --release --workspace")
    sched = schedule(a.hosts, a.seed, a.compress, a.horizon)
    rows = []
    for p in a.policies.split(","):
        r = run_policy(p, a, sched)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
    base = {r["policy"]: r for r in rows}
    print(f"\n{'policy':<7}{'makespan s':>11}{'mean job s':>11}{'steps/s':>9}{'moves':>7}{'reruns':>7}"
          f"{'owner delay':>12}{'outputs ok':>11}")
    for r in rows:
        d = "-" if r["owner_delay_pct"] is None else f"{r['owner_delay_pct']:+.1f}%"
        print(f"{r['policy']:<7}{r['makespan_s']:>11.1f}{(r['mean_job_s'] or 0):>11.1f}{r['throughput_steps_per_s']:>9.2f}"
              f"{r['moves']:>7}{r['reruns']:>7}{d:>12}{r['outputs_ok']:>8}/{a.jobs}")
    complete = lambda p: p in base and not base[p]["timed_out"] and base[p]["finished"] == a.jobs
    ratio = (base["LL"]["throughput_steps_per_s"] / base["IE"]["throughput_steps_per_s"]
             if complete("LL") and complete("IE") else None)
    if ratio:
        print(f"LL / IE throughput = {ratio:.2f} (issue target >= 1.6)")
    active = sum(e - s for eps in sched.values() for s, e in eps if s < a.horizon)
    doc = {"bench": "linger_policy", "hosts": a.hosts, "jobs": a.jobs, "steps": a.steps, "compress": a.compress,
           "seed": a.seed, "pm_pause_s": max(1, round(600 / a.compress)),
           "owner_active_share": active / (a.hosts * a.horizon), "rows": rows, "ll_ie_ratio": ratio,
           "provenance": provenance()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linger_policy.json").write_text(json.dumps(doc, indent=2) + "\n")
    print("wrote", OUT / "linger_policy.json")


if __name__ == "__main__":
    main()
