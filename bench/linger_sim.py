#!/usr/bin/env python3
"""Issue 10 part 4 (policies): a trace-driven simulator of the Linger-Longer seed's chapter 4.

    python3 bench/linger_sim.py [--seed 1] [--nodes 64] [--quick]

Pure Python, no cluster, deterministic for a given --seed. Prints a table like the seed's Table 1
(avg job time, variation, family time, throughput per policy and workload) and writes
bench/out/linger_sim.json (with provenance); `python3 bench/tables.py` renders it into
bench/README.md beside the seed's own Table 1 numbers.

Model (seed = Ryu, *Exploiting Idle Cycles in Networks of Workstations*, 2001, ch. 3.3, 4.2, App. A)
-----------------------------------------------------------------------------------------------
* 64 nodes, one guest job slot each, time advanced in the seed's 2 s coarse windows.
* Coarse owner trace (SYNTHETIC — the seed used 40 days of UC Berkeley NOW traces we do not have).
  Per node, alternating *idle periods* and *non-idle episodes* (NOW's definition: idle = CPU < 10%
  and no keyboard for 1 min). Assumptions, chosen to match the statistics the seed gives (§3.1):
  - idle fraction 54% (the seed: non-idle 46% of the time);
  - episode lengths are not given in the seed: non-idle episodes lognormal, mean 30 min (sigma 1.0),
    each ending with a 60 s low-CPU tail (the 1 min recruitment wait); idle periods lognormal with
    the mean that gives 54% idle (≈ 35 min, sigma 1.0). Long periods, because the seed's Workload-2
    jobs (1800 CPU-s) ran 97% of their time under every policy, so owners rarely came back mid-job;
    with 10-min episodes LL/LF still win Workload-1 by the same factor;
  - utilization levels are Table 9's 21 buckets (0, 5, ..., 100%). Idle periods: 0% (70%) or 5%
    (30%). Non-idle episodes: segments of exponential length (mean 20 s) whose level is low (0/5%)
    66% of the time, medium (10–75%, uniform over the buckets) 22%, high (80–100%) 12%. The seed's
    own figures are not mutually consistent (overall < 10% for 82% of the time, 10–80% for 13%,
    ≥ 80% for 7%, yet CPU < 10% for 76% of non-idle time); these shares give overall ≈ 84% / 10% / 6%.
  - every node starts at a random point of its own trace (stationary start), as the seed started
    each node at a random offset into a different machine's trace.
* Fine-grained owner bursts (Appendix A): run and idle burst lengths per utilization bucket from
  Table 9's means and variances, drawn from a two-stage hyper-exponential fitted by the method of
  moments with balanced means (as the seed did) when the squared coefficient of variation is ≥ 1,
  and from a gamma distribution with the same mean and variance when it is < 1. Because the owner's
  bursts do not depend on the guest, each bucket's 2 s windows are drawn from a pool of 96
  simulated windows per bucket (a pure-Python speed measure; the seed interpolated between buckets,
  here the trace only takes bucket values).
* Guest CPU in a window = sum over owner idle bursts of max(0, idle − c), c = the seed's effective
  context-switch time of 100 µs (§4.1, Mogul & Borg): every owner run burst that preempts a guest
  costs the owner c (owner delay) and shortens the guest's next idle burst by c. The guest runs at
  starvation priority on every node, idle or not (on an idle node the owner's rare bursts still win).
* Migration (eq. 3.5): T_migr = suspend + 8 MB / 3 Mbit/s + resume, suspend = resume = 0.5 s (the
  seed does not give them), ≈ 23.4 s; the job is suspended for the whole migration (as in the seed)
  and its destination slot is reserved.
* Policies, on the trace's idle flag of the job's node:
  - IE (Immediate-Eviction, NOW): when the node becomes non-idle the job stops at once and migrates
    to a free idle node (progress kept, as in the seed's ch. 3.3 "migrated as soon as"); if there is
    none it stays suspended and leaves as soon as one frees up, or resumes if its node is idle again.
  - IE-restart (starling's IE, issue 10 part 3): the job is killed and requeued at the head of the
    queue with its progress lost (no migration cost). Not in the seed; shown for comparison.
  - PM (Pause-and-Migrate, Condor): suspended while the node is non-idle; after a 10 min pause
    (Condor's default; the seed does not give its value) it migrates to a free idle node if any.
  - LL (Linger-Longer): keeps running at starvation priority; after lingering
    T_lingr = ((1−l)/(h−l))·T_migr (eq. 3.4) — h = mean utilization of its node since the episode
    began, l = that of the idle destination — migrates to a free idle node if any (never if h ≤ l).
  - LF (Linger-Forever): keeps running, never migrates.
  Placement: IE/PM (and IE-restart) start queued jobs only on free idle nodes; LL/LF on free idle
  nodes first, then on free non-idle nodes with the lowest current utilization. Queue FIFO, jobs
  waiting to leave a non-idle node are served before queued ones.
* Workload-1: 128 jobs × 600 CPU-s; Workload-2: 16 jobs × 1800 CPU-s, all submitted at t = 0.
  Avg job time = completion − submission; Variation = std. dev. of execution time (first start to
  completion) / its mean; Family time = completion of the last job; Throughput = guest CPU-s per
  second over one simulated hour (IE-restart: CPU of killed runs not counted) with the number of jobs in the system held constant (128 / 16; a
  finished job is replaced at once), as in the seed.
* Owner delay = owner time lost to guest context switches ÷ owner CPU time, over all nodes and
  windows of the throughput hour (the seed reports < 0.5%; its exact definition is per CPU request).
"""
import argparse
import json
import math
import pathlib
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "bench"))

WINDOW = 2.0  # s, the seed's coarse window
CS = 100e-6  # s, effective context-switch time (seed §4.1)
LEVELS = list(range(0, 101, 5))  # the 21 buckets of Table 9
# Table 9: util % -> (run mean s, run var s², idle mean s, idle var s²)
TABLE9 = {
    0: (0.000427, 0.000001, 0.030033, 0.000902), 5: (0.000974, 0.000019, 0.022065, 0.000493),
    10: (0.002147, 0.000107, 0.018916, 0.000439), 15: (0.004016, 0.000318, 0.021012, 0.000458),
    20: (0.004009, 0.000348, 0.016168, 0.000342), 25: (0.004402, 0.000301, 0.012858, 0.000243),
    30: (0.005140, 0.000512, 0.011972, 0.000223), 35: (0.005624, 0.000438, 0.010481, 0.000168),
    40: (0.006774, 0.000674, 0.010091, 0.000150), 45: (0.007988, 0.000725, 0.009778, 0.000130),
    50: (0.009149, 0.000996, 0.009279, 0.000110), 55: (0.010833, 0.001521, 0.008963, 0.000114),
    60: (0.019013, 0.003264, 0.012757, 0.000163), 65: (0.017979, 0.002477, 0.009690, 0.000101),
    70: (0.021870, 0.007030, 0.009414, 0.000108), 75: (0.026148, 0.010449, 0.008940, 0.000080),
    80: (0.031944, 0.006470, 0.007320, 0.000055), 85: (0.044013, 0.024730, 0.008147, 0.000069),
    90: (0.066808, 0.038747, 0.007450, 0.000056), 95: (0.105832, 0.083109, 0.005590, 0.000032),
    100: (0.652647, 0.556488, 0.005968, 0.000036),
}
# the seed's Table 1 (LL, LF, IE, PM)
SEED_TABLE1 = {
    "workload1": {"avg_job_time_s": [1044, 1026, 1531, 1531], "variation_pct": [13.7, 20.5, 27.7, 22.5],
                  "family_time_s": [1847, 1844, 2616, 2521], "throughput": [52.2, 55.5, 34.6, 34.6]},
    "workload2": {"avg_job_time_s": [1859, 1861, 1860, 1862], "variation_pct": [0.9, 1.3, 1.3, 1.6],
                  "family_time_s": [1896, 1925, 1925, 1956], "throughput": [15.0, 14.7, 14.5, 14.5]},
}
SEED_POLICIES = ["LL", "LF", "IE", "PM"]
POLICIES = ["LL", "LF", "IE", "PM", "IE-restart"]
WORKLOADS = {"workload1": (128, 600.0), "workload2": (16, 1800.0)}

JOB_MB = 8.0
BANDWIDTH_MBIT = 3.0
SUSPEND_S = RESUME_S = 0.5
PM_PAUSE_S = 600.0
IDLE_FRACTION = 0.54
EPISODE_MEAN_S = 1800.0
RECRUIT_S = 60.0
SEGMENT_MEAN_S = 20.0
POOL = 96


def t_migr(job_mb=JOB_MB, mbit_s=BANDWIDTH_MBIT):
    """Eq. 3.5: suspend(source) + process_size / bandwidth + resume(dest)."""
    return SUSPEND_S + job_mb * 8 * 1.048576 / mbit_s + RESUME_S


def t_lingr(h, l, tm):
    """Eq. 3.4: linger this long before migrating (inf if the destination is no better)."""
    return math.inf if h <= l else (1 - l) / (h - l) * tm


# ------------------------------------------------------------------ fine-grained bursts (App. A)

def burst_sampler(mean, var):
    """A sampler with this mean and variance: balanced-means H2 if cv² ≥ 1, else gamma."""
    cv2 = var / (mean * mean)
    if cv2 >= 1.0:
        p = 0.5 * (1 + math.sqrt((cv2 - 1) / (cv2 + 1)))
        r1, r2 = 2 * p / mean, 2 * (1 - p) / mean
        return lambda rng: rng.expovariate(r1) if rng.random() < p else rng.expovariate(r2)
    k, theta = 1 / cv2, mean * cv2
    return lambda rng: rng.gammavariate(k, theta)


def fine_window(rng, level, cs=CS, window=WINDOW):
    """One 2 s window of owner run/idle bursts at this bucket: (guest CPU s, owner CPU s, switches)."""
    rm, rv, im, iv = TABLE9[level]
    run, idle = burst_sampler(rm, rv), burst_sampler(im, iv)
    t = 0.0
    owner = guest = 0.0
    switches = 0
    running = rng.random() < rm / (rm + im)  # start in a run burst with its time share
    # start inside a burst: skip a uniform part of the first one (approximate residual life)
    first = True
    while t < window:
        d = run(rng) if running else idle(rng)
        if first:
            d *= rng.random()
            first = False
        d = min(d, window - t)
        if running:
            owner += d
        else:
            guest += max(0.0, d - cs)
            if d > cs and t + d < window:
                switches += 1  # the owner's next run burst preempts the guest
        t += d
        running = not running
    return guest, owner, switches


def burst_pools(rng, cs=CS):
    return {lv: [fine_window(rng, lv, cs) for _ in range(POOL)] for lv in LEVELS}


# ------------------------------------------------------------------ coarse synthetic trace

def lognormal(rng, mean, sigma=1.0):
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def node_trace(rng, windows, episode_mean=EPISODE_MEAN_S):
    """[(level, idle)] per 2 s window for one node (see the module docstring)."""
    idle_mean = episode_mean * IDLE_FRACTION / (1 - IDLE_FRACTION)
    out = []
    state_idle = rng.random() < IDLE_FRACTION
    first = True
    while len(out) < windows:
        if state_idle:
            n = max(1, round(lognormal(rng, idle_mean) / WINDOW))
            if first:
                n = max(1, int(n * rng.random()))
            lv = 0 if rng.random() < 0.7 else 5
            seg = 0
            for _ in range(n):
                if seg <= 0:  # idle periods change level each ~minute
                    lv, seg = (0 if rng.random() < 0.7 else 5), 30
                seg -= 1
                out.append((lv, True))
        else:
            total = max(RECRUIT_S, lognormal(rng, episode_mean))
            if first:
                total = max(RECRUIT_S, total * rng.random())
            busy = round((total - RECRUIT_S) / WINDOW)
            while busy > 0:
                seg = max(1, round(rng.expovariate(1 / SEGMENT_MEAN_S) / WINDOW))
                x = rng.random()
                if x < 0.66:
                    lv = 0 if rng.random() < 0.7 else 5
                elif x < 0.88:
                    lv = rng.choice(LEVELS[2:16])
                else:
                    lv = rng.choice(LEVELS[16:])
                for _ in range(min(seg, busy)):
                    out.append((lv, False))
                busy -= seg
            for _ in range(round(RECRUIT_S / WINDOW)):
                out.append((0 if rng.random() < 0.7 else 5, False))
        first = False
        state_idle = not state_idle
    return out[:windows]


class Cluster:
    """The owners' side, shared by every policy: per node and window the trace level, the idle flag
    and the fine-grained outcome (guest CPU available, owner CPU, context switches)."""

    def __init__(self, seed=1, nodes=64, windows=3600, traces=None, cs=CS, episode_mean=EPISODE_MEAN_S):
        rng = random.Random(seed)
        pools = burst_pools(random.Random(seed * 7919 + 1), cs)
        self.nodes = nodes
        self.traces = traces if traces is not None else [node_trace(rng, windows, episode_mean) for _ in range(nodes)]
        self.windows = min(len(t) for t in self.traces)
        self.level, self.idle, self.guest, self.owner, self.switches = [], [], [], [], []
        for tr in self.traces:
            lv = [x[0] for x in tr]
            picks = [pools[x][rng.randrange(POOL)] for x in lv]
            self.level.append(lv)
            self.idle.append([x[1] for x in tr])
            self.guest.append([p[0] for p in picks])
            self.owner.append([p[1] for p in picks])
            self.switches.append([p[2] for p in picks])

    def stats(self):
        n = self.nodes * self.windows
        idle = sum(sum(x) for x in self.idle) / n
        lv = [v for row in self.level for v in row]
        return {"idle_fraction": round(idle, 3),
                "util_lt_10": round(sum(v < 10 for v in lv) / n, 3),
                "util_10_80": round(sum(10 <= v < 80 for v in lv) / n, 3),
                "util_ge_80": round(sum(v >= 80 for v in lv) / n, 3),
                "guest_cpu_fraction_all_nodes": round(sum(sum(g) for g in self.guest) / (n * WINDOW), 3),
                "windows": self.windows, "nodes": self.nodes}


# ------------------------------------------------------------------ the policy simulation

class Job:
    __slots__ = ("id", "work", "left", "submit", "start", "end", "node", "state", "since", "dest", "until",
                 "migrations", "restarts", "linger_cpu", "cpu", "nodes_used", "ep_start", "ep_util")

    def __init__(self, jid, work, submit):
        self.id, self.work, self.left, self.submit = jid, work, work, submit
        self.start = self.end = self.node = self.dest = None
        self.state = "queued"  # queued | running | suspended | migrating | done
        self.since = self.until = 0.0
        self.migrations = self.restarts = 0
        self.linger_cpu = self.cpu = 0.0
        self.nodes_used = []
        self.ep_start = None
        self.ep_util = 0.0


def simulate(cluster, policy, jobs, work, constant=False, horizon_s=None, tm=None, pause=PM_PAUSE_S):
    """Run one policy. `constant`: keep `jobs` jobs in the system (a finished one is replaced) until
    `horizon_s`; else submit `jobs` at t = 0 and run until all are done (or the trace ends)."""
    assert policy in POLICIES, policy
    tm = t_migr() if tm is None else tm
    n = cluster.nodes
    slot = [None] * n  # job on (or reserved for) the node
    queue = [Job(i, work, 0.0) for i in range(jobs)]
    all_jobs = list(queue)
    wanting = []  # jobs suspended/lingering that want to leave their node
    owner_cpu = owner_lost = 0.0
    limit = cluster.windows if horizon_s is None else min(cluster.windows, int(horizon_s / WINDOW))
    w = 0
    guest_total = wasted = 0.0
    while w < limit:
        t = w * WINDOW
        idle = [cluster.idle[i][w] for i in range(n)]
        level = [cluster.level[i][w] for i in range(n)]
        # 1. arrivals of migrations
        for j in all_jobs:
            if j.state == "migrating" and j.until <= t:
                j.state, j.node, j.dest = "running", j.dest, None
                j.nodes_used.append(j.node)
                j.ep_start = None
        # 2. policy decisions for jobs on non-idle nodes
        free_idle = [i for i in range(n) if slot[i] is None and idle[i]]
        free_idle.sort(key=lambda i: level[i])
        wanting = []
        for j in all_jobs:
            if j.state not in ("running", "suspended"):
                continue
            i = j.node
            if idle[i]:
                j.state, j.ep_start = "running", None
                continue
            if j.ep_start is None:
                j.ep_start, j.ep_util = t, 0.0
            age = t - j.ep_start
            j.ep_util += level[i] / 100.0  # summed over the windows of this episode
            if policy == "IE-restart":
                slot[i] = None
                j.left, j.state, j.node, j.restarts = j.work, "queued", None, j.restarts + 1
                guest_total -= j.cpu  # the killed run's CPU was wasted: not throughput
                wasted += j.cpu
                j.cpu = 0.0
                queue.insert(0, j)
                continue
            if policy in ("IE", "PM"):
                j.state = "suspended"
                if policy == "IE" or age >= pause:
                    wanting.append(j)
            elif policy == "LL":
                h = j.ep_util / ((age / WINDOW) + 1)
                if free_idle and age >= t_lingr(h, level[free_idle[0]] / 100.0, tm):
                    wanting.append(j)
        for j in wanting:
            if not free_idle:
                break
            d = free_idle.pop(0)
            slot[j.node] = None
            slot[d] = j
            j.state, j.dest, j.until, j.node = "migrating", d, t + tm, None
            j.migrations += 1
        # 3. placement of queued jobs
        if queue:
            cand = [i for i in range(n) if slot[i] is None and idle[i]]
            cand.sort(key=lambda i: level[i])
            if policy in ("LL", "LF"):
                busy = [i for i in range(n) if slot[i] is None and not idle[i]]
                busy.sort(key=lambda i: level[i])
                cand += busy
            for i in cand:
                if not queue:
                    break
                j = queue.pop(0)
                slot[i] = j
                j.node, j.state, j.ep_start = i, "running", None
                if j.start is None:
                    j.start = t
                j.nodes_used.append(i)
        # 4. progress
        for i in range(n):
            oc = cluster.owner[i][w]
            owner_cpu += oc
            j = slot[i]
            if j is None or j.state != "running" or j.node != i:
                continue
            g = cluster.guest[i][w]
            owner_lost += cluster.switches[i][w] * CS
            if g <= 0:
                continue
            got = min(g, j.left)
            j.left -= got
            j.cpu += got
            guest_total += got
            if not idle[i]:
                j.linger_cpu += got
            if j.left <= 1e-9:
                j.left = 0.0
                j.end = t + WINDOW * got / g
                j.state = "done"
                slot[i] = None
                if constant:
                    nj = Job(len(all_jobs), work, j.end)
                    all_jobs.append(nj)
                    queue.append(nj)
        w += 1
        if not constant and all(j.state == "done" for j in all_jobs):
            break
    elapsed = w * WINDOW
    done = [j for j in all_jobs if j.state == "done"]
    res = {"policy": policy, "jobs": len(all_jobs), "done": len(done), "elapsed_s": elapsed,
           "guest_cpu_s": guest_total, "wasted_cpu_s": wasted, "throughput": guest_total / elapsed if elapsed else 0.0,
           "migrations": sum(j.migrations for j in all_jobs), "restarts": sum(j.restarts for j in all_jobs),
           "linger_cpu_s": sum(j.linger_cpu for j in all_jobs),
           "owner_delay_pct": 100.0 * owner_lost / owner_cpu if owner_cpu else 0.0,
           "job_cpu_s": [j.cpu for j in all_jobs], "job_nodes": [list(j.nodes_used) for j in all_jobs]}
    if done and not constant:
        times = [j.end - j.submit for j in done]
        execs = [j.end - j.start for j in done]
        res["avg_job_time_s"] = statistics.mean(times)
        res["variation_pct"] = 100.0 * statistics.pstdev(execs) / statistics.mean(execs)
        res["family_time_s"] = max(j.end for j in done)
        res["job_times_s"] = times
    return res


def run_all(seed=1, nodes=64, hour_s=3600.0, episode_mean=EPISODE_MEAN_S, policies=POLICIES):
    cluster = Cluster(seed=seed, nodes=nodes, windows=int(3 * hour_s / WINDOW), episode_mean=episode_mean)
    out = {}
    for wl, (jobs, work) in WORKLOADS.items():
        rows = {}
        for p in policies:
            fin = simulate(cluster, p, jobs, work)
            thr = simulate(cluster, p, jobs, work, constant=True, horizon_s=hour_s)
            rows[p] = {k: fin.get(k) for k in ("avg_job_time_s", "variation_pct", "family_time_s", "migrations",
                                                 "restarts", "done", "jobs")}
            rows[p]["linger_share_pct"] = 100.0 * fin["linger_cpu_s"] / fin["guest_cpu_s"] if fin["guest_cpu_s"] else 0
            rows[p]["throughput"] = thr["throughput"]
            rows[p]["owner_delay_pct"] = thr["owner_delay_pct"]
        out[wl] = rows
    return cluster, out


def verdicts_of(res):
    w1, w2 = res["workload1"], res["workload2"]
    ratio = min(w1["LL"]["throughput"], w1["LF"]["throughput"]) / max(w1["IE"]["throughput"], w1["PM"]["throughput"])
    tie = ("LL", "LF", "IE")  # PM idles through its 10-min pauses even when idle nodes are free
    spread2 = max(w2[p]["throughput"] for p in tie) / min(w2[p]["throughput"] for p in tie)
    return ratio, spread2


def sensitivity(nodes):
    """Workload-1 ratio and Workload-2 spread for other seeds and episode lengths (assumptions)."""
    out = []
    for seed, ep in [(2, EPISODE_MEAN_S), (3, EPISODE_MEAN_S), (1, 600.0), (1, 3600.0)]:
        c, res = run_all(seed, nodes, episode_mean=ep, policies=SEED_POLICIES)
        ratio, spread2 = verdicts_of(res)
        out.append({"seed": seed, "episode_mean_s": ep, "idle_fraction": c.stats()["idle_fraction"],
                    "w1_throughput": {p: round(r["throughput"], 1) for p, r in res["workload1"].items()},
                    "w1_ratio": ratio, "w2_spread": spread2})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="random seed of trace and bursts (default 1)")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--no-json", action="store_true", help="print only, do not write bench/out/linger_sim.json")
    a = ap.parse_args()
    t0 = time.time()
    cluster, res = run_all(a.seed, a.nodes)
    took = time.time() - t0
    print(f"trace: {cluster.stats()}; T_migr = {t_migr():.1f} s; simulated in {took:.1f} s")
    for wl, rows in res.items():
        print(f"\n{wl} ({WORKLOADS[wl][0]} jobs x {WORKLOADS[wl][1]:.0f} CPU-s)")
        print(f"{'policy':<11}{'avg job s':>10}{'var %':>7}{'family s':>10}{'thruput':>9}{'migr':>6}{'restart':>8}"
              f"{'linger %':>9}{'owner dly %':>12}")
        for p, r in rows.items():
            print(f"{p:<11}{r['avg_job_time_s']:>10.0f}{r['variation_pct']:>7.1f}{r['family_time_s']:>10.0f}"
                  f"{r['throughput']:>9.1f}{r['migrations']:>6}{r['restarts']:>8}{r['linger_share_pct']:>9.1f}"
                  f"{r['owner_delay_pct']:>12.2f}")
    ratio, spread2 = verdicts_of(res)
    verdicts = {"w1_linger_ge_1_5x_evict": ratio >= 1.5, "w2_ll_lf_ie_tie_within_5pct": spread2 <= 1.05}
    print(f"\nWorkload-1 min(LL,LF) / max(IE,PM) throughput = {ratio:.2f} (target >= 1.5: "
          f"{'met' if verdicts['w1_linger_ge_1_5x_evict'] else 'NOT met'}); Workload-2 LL/LF/IE max/min = {spread2:.3f} "
          f"(tie within 5%: {'met' if verdicts['w2_ll_lf_ie_tie_within_5pct'] else 'NOT met'})")
    sens = sensitivity(a.nodes)
    for x in sens:
        print(f"sensitivity: seed {x['seed']}, episodes {x['episode_mean_s']:.0f} s, idle {x['idle_fraction']:.3f}: "
              f"W1 ratio {x['w1_ratio']:.2f}, W2 spread {x['w2_spread']:.3f}, W1 throughput {x['w1_throughput']}")
    took = time.time() - t0
    if a.no_json:
        return
    from provenance import provenance
    doc = {"bench": "linger_sim", "seed": a.seed, "nodes": a.nodes, "t_migr_s": t_migr(), "pm_pause_s": PM_PAUSE_S,
           "cs_s": CS, "trace": cluster.stats(), "results": res, "seed_table1": SEED_TABLE1,
           "seed_policies": SEED_POLICIES, "w1_throughput_ratio": ratio, "w2_throughput_spread": spread2,
           "verdicts": verdicts, "sensitivity": sens, "runtime_s": took, "provenance": provenance()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linger_sim.json").write_text(json.dumps(doc, indent=2) + "\n")
    print("wrote", OUT / "linger_sim.json")


if __name__ == "__main__":
    main()
