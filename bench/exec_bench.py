#!/usr/bin/env python3
"""Remote-exec benchmark (issue 2) on the embedded cluster.

Measures, on cluster instance 4 (or --instance N / STARLING_INSTANCE=N, so
it can run beside other clusters on this machine):

* `starling exec -- true`, cold (host, relay and client caches empty) and
  warm (median of --repeat runs), over
  - lan: no link emulation at all (wall time only: nothing counts bytes), and
  - coffee-shop (160 ms RTT, 1400/1500 Kib/s): wall time, bytes up/down
    crossing the emulated link (its counters in /run/starling-4/link.json),
    and round trips on the critical path = 1 + the file requests the
    client had to answer while the task ran (STARLING_STATS_FILE), with the
    link's upstream flights as a cross-check (an upper bound: it also counts
    the connection's own hello and the final commit acknowledgements);
* a parallel build of Lua 5.4 (tests/fixtures/fetch-lua.sh, 33 files)
  with `make -jN CC="starling exec --job NAME gcc"` on lan with 4 hosts,
  cold and warm, against the same `make -jN` done locally; the outputs are
  checked byte-identical;
* issue 18: where one warm `exec -- true` and one warm tiny `gcc -c` spend
  their time and CPU, stage by stage: the client's stages (the stats line
  it writes to STARLING_STATS_FILE: setup = process start to launch, connect,
  prepare = cache/profile loading and binding, launch, run_commit, learn),
  the agent's (the `stages_ms` line it logs per task: view_mount, preload,
  overlay, spawn, run, pumps, overlay_unmount, exit_scan, send; cleanup =
  FUSE unmount and removal, after the reply), and the CPU of each process
  (client rusage; head and agents from /proc/PID/stat, children included);
* distcc beside it (Debian's `distcc`; `distccd` started in each host's
  network namespace): the same tiny `gcc -c`, and the Lua build with
  `make -jN CC='distcc gcc'`. Skipped (and said so) if distcc is not
  installed: `apt-get install distcc`.

The emulated hosts share this machine's cores, so a cluster build can't be
faster than a local one here: the numbers show starling's overhead.

Table on stdout, JSON in bench/out/exec.json, bar chart bench/out/exec.png
(if matplotlib is importable). Leaves instance 4 down unless --keep.

The helpers here (cluster up/down, link counters, measuring one command)
are shared with bench/ucop_bench.py.
"""
import argparse
import hashlib
import json
import os
import pathlib
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from provenance import provenance
from tables import fmt_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out"
# The cluster instance every bench runs on: STARLING_INSTANCE if set, else 4.
INSTANCE = os.environ.get("STARLING_INSTANCE", "4")
RUN_DIR = pathlib.Path(f"/run/starling-{INSTANCE}")
STATE_DIR = pathlib.Path(f"/var/lib/starling-{INSTANCE}")


def set_instance(n):
    global INSTANCE, RUN_DIR, STATE_DIR
    INSTANCE = str(n)
    RUN_DIR = pathlib.Path(f"/run/starling-{INSTANCE}")
    STATE_DIR = pathlib.Path(f"/var/lib/starling-{INSTANCE}")
MEASURE_TIMEOUT_S = 600
LUA_MAKEFILE = ROOT / "tests/fixtures/lua/Makefile"
# Link profiles by name. `lan` is the real thing (no relay in the path, no
# counters); `lan+counters` passes through the link relay with no shaping, so
# that bytes and flights can be counted at (almost) lan speed.
LINKS = {"lan": "lan", "lan+counters": "0,0,0", "cable-modem": "cable-modem", "coffee-shop": "coffee-shop"}


def snapshot_binary(into):
    """Run the whole bench on a private copy of the starling binary: the
    shared target dir may be rebuilt meanwhile, and a head started from the
    old binary can't talk to a client from a new one."""
    global STARLING
    dst = pathlib.Path(into) / "starling"
    shutil.copy2(STARLING, dst)
    STARLING = str(dst)


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def starling_env(cache, **extra):
    """The environment of every starling command of the benchmarks: our own
    cluster instance and a private client cache (recipes, prethrow profiles,
    shadow index, job records)."""
    env = dict(os.environ)
    env.pop("STARLING_CLUSTER", None)
    env.pop("STARLING_STATS_FILE", None)
    env["STARLING_INSTANCE"] = INSTANCE
    env["STARLING_CACHE"] = str(cache)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cluster_down():
    sh(STARLING, "down", env=starling_env("/nonexistent"), timeout=120)


def cluster_up(link="lan", hosts=4, relay_cache=True, cold=False):
    """(Re)start instance 4 with this link profile. cold: also empty the host
    and relay caches, which otherwise persist in /var/lib/starling-4."""
    cluster_down()
    if cold:
        shutil.rmtree(STATE_DIR, ignore_errors=True)
    args = [STARLING, "up", "--hosts", str(hosts), "--link", LINKS.get(link, link)]
    if not relay_cache:
        args.append("--no-relay-cache")
    r = sh(*args, env=starling_env("/nonexistent"), timeout=300)
    if r.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")


def link_counters():
    try:
        return json.loads((RUN_DIR / "link.json").read_text())["counters"]
    except (OSError, ValueError, KeyError):
        return None


def settled_counters():
    """The link publishes its counters every 100 ms: wait until they stop moving."""
    if not (RUN_DIR / "link.json").exists() and link_counters() is None:
        time.sleep(0.3)
        return link_counters()
    time.sleep(0.25)
    last = link_counters()
    for _ in range(30):
        time.sleep(0.15)
        now = link_counters()
        if now == last:
            return now
        last = now
    return last


def guest_cpu_s():
    """CPU time (s) the instance's emulated hosts' cgroups have used (cpuacct; None without it)."""
    total = None
    for f in pathlib.Path("/sys/fs/cgroup/cpuacct/starling").glob(f"starling{INSTANCE}-h*/cpuacct.usage"):
        try:
            total = (total or 0) + int(f.read_text()) / 1e9
        except (OSError, ValueError):
            pass
    return total


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(cmd, env, cwd, timeout=None, check=True):
    """Run `cmd` once; return wall time, the link bytes/flights it caused and
    the client's per-launch stats (STARLING_STATS_FILE lines it appended)."""
    timeout = timeout or MEASURE_TIMEOUT_S
    stats = pathlib.Path(tempfile.mktemp(prefix="starling-stats-", dir="/tmp"))
    env = dict(env, STARLING_STATS_FILE=str(stats))
    before = settled_counters()
    cpu0, guest0 = children_cpu_s(), guest_cpu_s()
    t0 = time.monotonic()
    # Own session, so that on a timeout the whole tree we started (make, its
    # starling clients) can be stopped by its process group id.
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         shell=isinstance(cmd, str), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        p.communicate()
        raise RuntimeError(f"{cmd} timed out after {timeout} s")
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    wall = time.monotonic() - t0
    guest1 = guest_cpu_s()
    after = settled_counters()
    if check and r.returncode:
        raise RuntimeError(f"{cmd} failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    lines = []
    if stats.exists():
        bad = 0
        for l in stats.read_text().splitlines():
            try:
                lines.append(json.loads(l))
            except ValueError:
                bad += 1  # interleaved lines from an older client (fixed in client/exec.rs)
        if bad:
            print(f"  warning: {bad} unreadable STARLING_STATS_FILE lines", flush=True)
        stats.unlink()
    res = {"wall_s": wall, "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
           # CPU of what ran here (a local build's compiles; starling's clients), and of the cluster's tasks
           # and agents (the emulated hosts' cgroups), over the command.
           "local_cpu_s": children_cpu_s() - cpu0,
           "guest_cpu_s": None if guest0 is None or guest1 is None else guest1 - guest0}
    if before is not None and after is not None:
        for k in ("bytes_up", "bytes_down", "flights_up", "connections"):
            res[k] = after[k] - before[k]
    res["launches"] = len(lines)
    res["lines"] = lines
    res["tasks"] = sum(l.get("tasks", 1) for l in lines)
    if lines:
        res["file_requests"] = sum(l["file_requests"] for l in lines)
        # Every launch pays its own round trip; each file request is one more
        # on that launch's critical path (the worst launch is what a user waits for
        # in a single exec; for a build we report the mean per launch).
        per = [1 + l["file_requests"] for l in lines]
        res["rt_per_launch_max"] = max(per)
        res["rt_per_launch_mean"] = statistics.mean(per)
        res["prethrow_bindings"] = sum(l.get("prethrow_bindings", 0) for l in lines)
        res["pushed_bytes"] = sum(l.get("pushed_bytes", 0) for l in lines)
        res["prethrow_bytes"] = sum(l.get("prethrow_bytes", 0) for l in lines)
        res["job_predicted"] = sum(l.get("job_predicted", 0) for l in lines)
    return res


def median_run(runs, key="wall_s"):
    runs = sorted(runs, key=lambda x: x[key])
    return runs[len(runs) // 2]


def args_env_bytes(argv, env):
    """Raw size of what a launch must carry whatever the caching: argv and environment."""
    return sum(len(a.encode()) + 1 for a in argv) + sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())


def lua_sources():
    r = sh("bash", str(ROOT / "tests/fixtures/fetch-lua.sh"))
    if r.returncode:
        sys.exit(f"tests/fixtures/fetch-lua.sh failed:\n{r.stderr}")
    return pathlib.Path(r.stdout.strip())


def lua_make_cmd(src, jobs, cc):
    return f"make -s -f {LUA_MAKEFILE} LUA_SRC={src} -j{jobs} CC='{cc}'"


def tree_digest(d):
    """sha256 of every regular file under d (relative path → digest)."""
    d = pathlib.Path(d)
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and ".starling-conflict" not in p.name}


def clean_build_dir(d):
    d = pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)




# ---------------------------------------------------------------- the bench

def exec_true(link, repeat, work):
    """Cold then warm `starling exec -- true` over `link`."""
    cache = work / f"cache-true-{link}"
    shutil.rmtree(cache, ignore_errors=True)
    cluster_up(link, cold=True)
    env = starling_env(cache)
    cmd = [STARLING, "exec", "--", "true"]
    cold = measure(cmd, env, "/tmp")
    warm = [measure(cmd, env, "/tmp") for _ in range(repeat)]
    out = {}
    for name, r in (("cold", cold), ("warm", median_run(warm))):
        out[name] = {k: r.get(k) for k in ("wall_s", "bytes_up", "bytes_down", "flights_up", "file_requests",
                                            "rt_per_launch_max", "prethrow_bindings", "pushed_bytes")}
    out["warm"]["wall_s_all"] = [round(r["wall_s"], 4) for r in warm]
    return out


def lua_build(jobs, hosts, work):
    src = lua_sources()
    lua = work / "lua"
    shutil.rmtree(lua, ignore_errors=True)
    shutil.copytree(src, lua)
    cache = work / "cache-lua"
    shutil.rmtree(cache, ignore_errors=True)
    cluster_up("lan", hosts=hosts, cold=True)
    env = starling_env(cache)
    res = {}
    local = work / "build-local"
    clean_build_dir(local)
    res["local"] = measure(lua_make_cmd(lua, jobs, "gcc"), env, local)
    want = tree_digest(local)
    for i, name in enumerate(("cold", "warm")):
        d = work / f"build-{name}"
        clean_build_dir(d)
        res[name] = measure(lua_make_cmd(lua, jobs, f"{STARLING} exec --job lua-{name}-{os.getpid()} gcc"), env, d)
        got = tree_digest(d)
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            raise RuntimeError(f"cluster build ({name}) differs from the local build: {diff}")
    return {k: {kk: v.get(kk) for kk in ("wall_s", "launches", "file_requests", "rt_per_launch_mean")}
            for k, v in res.items()} | {"files": len(want), "identical": True}


# ------------------------------------------------ issue 18: per-stage breakdown

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_table():
    """pid -> (ppid, utime+stime+cutime+cstime in s) of every live process."""
    out = {}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the comm: state ppid ... utime(12th) stime cutime cstime
        out[int(d.name)] = (int(f[1]), sum(int(x) for x in f[11:15]) / CLK_TCK)
    return out


def tree_cpu(table, root):
    """CPU of `root` and its live descendants (each with its reaped children)."""
    kids = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo.extend(kids.get(pid, []))
    return total


def cluster_cpu():
    """CPU so far of the head and of each host's agent (its whole process tree)."""
    st = json.loads((RUN_DIR / "cluster.json").read_text())
    t = proc_table()
    return {"head": tree_cpu(t, st["head_pid"]), **{h["name"]: tree_cpu(t, h["boot_pid"]) for h in st["hosts"]}}


def idle_background(seconds):
    """CPU per second the head and the agents use while no task runs (timers, the owner monitor, file
    watches), counted as the runs' CPU is (`cluster_cpu`) over `seconds` of idleness: what each run's
    CPU includes for its wall time. (10 ms ticks: `seconds` long enough for a few per process.)"""
    before = cluster_cpu()
    time.sleep(seconds)
    after = cluster_cpu()
    agents = sum(after[h] - before[h] for h in after if h != "head")
    return {"head": round((after["head"] - before["head"]) * 1000 / seconds, 3), "agents": round(agents * 1000 / seconds, 3)}


def host_ips():
    st = json.loads((RUN_DIR / "cluster.json").read_text())
    return [(h["name"], h["netns"], h["ip"]) for h in st["hosts"]]


def log_sizes():
    d = RUN_DIR / "logs"
    return {p.name: p.stat().st_size for p in d.glob("*.log")}


def new_agent_stages(since):
    """The agents' per-task `stages_ms` and `cleanup_ms` lines logged after `since` (log sizes)."""
    stages, cleanup = [], []
    for p in (RUN_DIR / "logs").glob("*.log"):
        with open(p, "rb") as f:
            f.seek(since.get(p.name, 0))
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            if " stages_ms: " in line or " stages_ms:" in line:
                kv = line.split("stages_ms:", 1)[1].split()
                stages.append({k: float(v) for k, v in (x.split("=") for x in kv)})
            elif " cleanup_ms: " in line:
                cleanup.append(float(line.split("cleanup_ms: ", 1)[1].split()[0]))
    return stages, cleanup


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def run_batch(cmd, env, cwd, n, check_rc=0):
    """Run `cmd` n times one after another; per-run wall and client stats,
    the agents' stage lines, and CPU per run of client, head and agents."""
    stats = pathlib.Path(tempfile.mktemp(prefix="starling-stats-", dir="/tmp"))
    env = dict(env, STARLING_STATS_FILE=str(stats))
    logs = log_sizes()
    cpu0, ru0, t_start = cluster_cpu(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    walls = []
    for _ in range(n):
        t0 = time.monotonic()
        r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=MEASURE_TIMEOUT_S)
        walls.append(time.monotonic() - t0)
        if r.returncode != check_rc:
            raise RuntimeError(f"{cmd} exited {r.returncode}: {r.stderr.decode(errors='replace')[-2000:]}")
    span = time.monotonic() - t_start
    cpu1, ru1 = cluster_cpu(), resource.getrusage(resource.RUSAGE_CHILDREN)
    time.sleep(0.3)  # the agents log cleanup after replying
    agent, cleanup = new_agent_stages(logs)
    lines = [json.loads(l) for l in stats.read_text().splitlines()] if stats.exists() else []
    stats.unlink(missing_ok=True)
    client_cpu = ((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)) / n
    head_cpu = (cpu1["head"] - cpu0["head"]) / n
    agents_cpu = sum(cpu1[h] - cpu0[h] for h in cpu1 if h != "head") / n
    cstages = {}
    for l in lines:
        for k, v in (l.get("stages_ms") or {}).items():
            cstages.setdefault(k, []).append(v)
    astages = {}
    for a in agent:
        for k, v in a.items():
            astages.setdefault(k, []).append(v)
    return {
        "runs": n,
        "wall_ms": med([w * 1000 for w in walls]),
        "wall_ms_all": [round(w * 1000, 2) for w in walls],
        "client_stages_ms": {k: med(v) for k, v in cstages.items()},
        "client_since_main_ms": med([l.get("since_main_ms") for l in lines]),
        "client_cpu_ms_in_process": med([l.get("cpu_user_ms", 0) + l.get("cpu_sys_ms", 0) for l in lines]),
        "agent_stages_ms": {k: med(v) for k, v in astages.items()},
        "agent_cleanup_ms": med(cleanup),
        # CPU per run, averaged over the batch (the /proc tick is 10 ms).
        "cpu_ms": {"client": round(client_cpu * 1000, 2), "head": round(head_cpu * 1000, 2),
                   "agents": round(agents_cpu * 1000, 2),
                   "total": round((client_cpu + head_cpu + agents_cpu) * 1000, 2)},
        "machine_busy_ms_per_run": None,
        "span_s": round(span, 3),
    }


def less_idle(batch, idle):
    """The batch's CPU per run less what the head and the agents would have used idle for as long
    (`idle`: ms per second, from `idle_background`)."""
    per_run_s = batch["span_s"] / batch["runs"]
    head = batch["cpu_ms"]["head"] - idle["head"] * per_run_s
    agents = batch["cpu_ms"]["agents"] - idle["agents"] * per_run_s
    return {"head": round(head, 2), "agents": round(agents, 2), "total": round(batch["cpu_ms"]["client"] + head + agents, 2)}


TINY_C = "int tiny(int x) { return x * 3 + 1; }\n"


def breakdown(repeat, work):
    """Warm `exec -- true` and a warm tiny `gcc -c`, stage by stage, on a warm lan cluster."""
    cache = work / "cache-breakdown"
    shutil.rmtree(cache, ignore_errors=True)
    cluster_up("lan")
    env = starling_env(cache)
    d = work / "tiny"
    d.mkdir(exist_ok=True)
    (d / "tiny.c").write_text(TINY_C)
    load0 = os.getloadavg()
    out = {}
    for name, cmd in (("exec_true", [STARLING, "exec", "--", "true"]),
                      ("gcc_c", [STARLING, "exec", "--", "gcc", "-c", "tiny.c", "-o", "tiny.o"])):
        run_batch(cmd, env, d, 3)  # warm the caches and profiles
        out[name] = run_batch(cmd, env, d, repeat)
    out["idle_ms_per_s"] = idle = idle_background(30)
    for name in ("exec_true", "gcc_c"):
        out[name]["cpu_ms_less_idle"] = less_idle(out[name], idle)
    local = []
    for _ in range(repeat):
        t0 = time.monotonic()
        subprocess.run(["gcc", "-c", "tiny.c", "-o", "tiny-local.o"], cwd=d, check=True)
        local.append((time.monotonic() - t0) * 1000)
    out["gcc_c_local_ms"] = med(local)
    out["loadavg"] = [round(x, 2) for x in load0]
    return out


# ------------------------------------------------------------------ distcc

def distcc_available():
    return shutil.which("distcc") and shutil.which("distccd")


def distccd_start(work):
    """One distccd per host, in its network namespace, listening on its address."""
    pids = []
    for name, netns, ip in host_ips():
        pidfile = work / f"distccd-{name}.pid"
        r = sh("ip", "netns", "exec", netns, "distccd", "--daemon", "--user", "nobody", "--allow", "0.0.0.0/0",
               "--listen", ip, "--pid-file", str(pidfile), "--log-file", str(work / f"distccd-{name}.log"),
               "--jobs", "4", "--enable-tcp-insecure")
        if r.returncode:
            raise RuntimeError(f"distccd in {netns} failed: {r.stderr}")
        pids.append(pidfile)
    # wait until each listens
    import socket
    for name, _, ip in host_ips():
        for _ in range(100):
            try:
                socket.create_connection((ip, 3632), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
    return pids


def distccd_stop(pidfiles):
    for p in pidfiles:
        try:
            pid = int(p.read_text().strip())
        except (OSError, ValueError):
            continue
        # distccd's parent process: its children die with it (SIGTERM to the group it leads).
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass


def distcc_rows(repeat, jobs, work):
    """The tiny `gcc -c` and the warm Lua build through distcc on the running cluster's hosts."""
    if not distcc_available():
        return {"skipped": "distcc is not installed (apt-get install distcc)"}
    pidfiles = distccd_start(work)
    try:
        (work / "distcc-dir").mkdir(exist_ok=True)
        env = dict(os.environ, DISTCC_HOSTS=" ".join(f"{ip}/4" for _, _, ip in host_ips()),
                   DISTCC_DIR=str(work / "distcc-dir"), DISTCC_FALLBACK="0")
        d = work / "tiny"
        d.mkdir(exist_ok=True)
        (d / "tiny.c").write_text(TINY_C)
        walls = []
        for i in range(repeat + 2):
            t0 = time.monotonic()
            r = subprocess.run(["distcc", "gcc", "-c", "tiny.c", "-o", "tiny-distcc.o"], cwd=d, env=env,
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"distcc gcc -c failed: {r.stderr}")
            if i >= 2:
                walls.append((time.monotonic() - t0) * 1000)
        src = lua_sources()
        lua = work / "lua-distcc"
        shutil.rmtree(lua, ignore_errors=True)
        shutil.copytree(src, lua)
        local = work / "build-local-d"
        clean_build_dir(local)
        subprocess.run(lua_make_cmd(lua, jobs, "gcc"), shell=True, cwd=local, check=True, capture_output=True)
        want = tree_digest(local)
        builds = []
        for name in ("first", "warm"):
            b = work / f"build-distcc-{name}"
            clean_build_dir(b)
            t0 = time.monotonic()
            r = subprocess.run(lua_make_cmd(lua, jobs, "distcc gcc"), shell=True, cwd=b, env=env,
                               capture_output=True, text=True)
            builds.append(time.monotonic() - t0)
            if r.returncode:
                raise RuntimeError(f"distcc Lua build failed: {r.stderr[-2000:]}")
            if tree_digest(b) != want:
                raise RuntimeError("distcc Lua build differs from the local build")
        return {"gcc_c_ms": med(walls), "gcc_c_ms_all": [round(w, 2) for w in walls],
                "lua_build_s": round(builds[1], 3), "lua_build_first_s": round(builds[0], 3), "identical": True,
                "loadavg": [round(x, 2) for x in os.getloadavg()]}
    finally:
        distccd_stop(pidfiles)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="warm `exec -- true` runs (median reported)")
    ap.add_argument("--jobs", type=int, default=8, help="make -jN for the Lua build")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="leave the cluster instance up")
    ap.add_argument("--instance", help="cluster instance to use [default: $STARLING_INSTANCE or 4]")
    ap.add_argument("--breakdown-repeat", type=int, default=20,
                    help="runs of each command in the per-stage breakdown (CPU is averaged over them)")
    ap.add_argument("--only", choices=["breakdown"],
                    help="run only the per-stage breakdown (and distcc's tiny gcc -c); "
                         "writes bench/out/exec_breakdown.json (table exec_breakdown)")
    a = ap.parse_args()
    if a.instance:
        set_instance(a.instance)
    if os.geteuid() != 0:
        sys.exit("exec_bench: the embedded cluster needs root")
    if not os.path.exists(STARLING):
        sys.exit("exec_bench: build first: cargo build --release --workspace")
    OUT.mkdir(parents=True, exist_ok=True)
    ran_on = provenance()  # at the start: the tree the run measures
    work = pathlib.Path(tempfile.mkdtemp(prefix="starling-exec-bench-", dir="/var/tmp"))
    snapshot_binary(work)
    try:
        if a.only == "breakdown":
            bd = breakdown(a.breakdown_repeat, work)
            print(json.dumps(bd, indent=1), flush=True)
            bd["distcc"] = distcc_rows(a.breakdown_repeat, a.jobs, work)
            from tables import render_breakdown
            print(render_breakdown(bd))
            (OUT / "exec_breakdown.json").write_text(json.dumps({"provenance": ran_on, **bd}, indent=2) + "\n")
            return
        bd = breakdown(a.breakdown_repeat, work)
        bd["distcc"] = distcc_rows(a.breakdown_repeat, a.jobs, work)
        true_rows = {link: exec_true(link, a.repeat, work) for link in ("lan", "coffee-shop")}
        build = lua_build(a.jobs, a.hosts, work)
    finally:
        if not a.keep:
            cluster_down()
        shutil.rmtree(work, ignore_errors=True)

    print("starling exec -- true")
    print(f"{'link':<12} {'cache':<5} {'wall ms':>8} {'up':>10} {'down':>10} {'crit RTs':>8} {'flights up':>10}")
    for link, r in true_rows.items():
        for c in ("cold", "warm"):
            x = r[c]
            print(f"{link:<12} {c:<5} {x['wall_s'] * 1000:>8.0f} {fmt_bytes(x['bytes_up']):>10} "
                  f"{fmt_bytes(x['bytes_down']):>10} {x['rt_per_launch_max'] or '-':>8} {x['flights_up'] if x['flights_up'] is not None else '-':>10}")
    print()
    print(f"Lua 5.4 build, make -j{a.jobs}, {a.hosts} hosts, lan ({build['files']} output files, cluster builds byte-identical to local)")
    print(f"{'build':<8} {'wall s':>7} {'launches':>8} {'RTs/launch':>10}")
    for k in ("local", "cold", "warm"):
        x = build[k]
        rts = f"{x['rt_per_launch_mean']:.2f}" if x.get("rt_per_launch_mean") else "-"
        print(f"{k:<8} {x['wall_s']:>7.2f} {x['launches'] or '-':>8} {rts:>10}")
    print()
    from tables import render_breakdown
    print(render_breakdown(bd))
    doc = {"provenance": ran_on, "instance": INSTANCE, "hosts": a.hosts, "repeat": a.repeat, "jobs": a.jobs, "exec_true": true_rows,
           "lua_build": build, "breakdown": bd, "note": "emulated hosts share this machine's cores; lan = no link relay (no byte counters)"}
    (OUT / "exec.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT / 'exec.json'} (python3 bench/tables.py puts it into bench/README.md)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: skipping bench/out/exec.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    labels, vals = [], []
    for link, r in true_rows.items():
        for c in ("cold", "warm"):
            labels.append(f"{link}\n{c}")
            vals.append(r[c]["wall_s"] * 1000)
    ax[0].bar(labels, vals, color=["#c66", "#6a6", "#c66", "#6a6"])
    ax[0].axhline(240, ls="--", color="gray", label="1.5 × coffee-shop RTT")
    ax[0].set_ylabel("ms")
    ax[0].set_title("starling exec -- true")
    ax[0].legend()
    ks = ("local", "cold", "warm")
    ax[1].bar(ks, [build[k]["wall_s"] for k in ks], color=["#888", "#c66", "#6a6"])
    ax[1].set_ylabel("s")
    ax[1].set_title(f"Lua build, make -j{a.jobs}, {a.hosts} hosts (lan)")
    fig.tight_layout()
    fig.savefig(OUT / "exec.png", dpi=100)
    print(f"wrote {OUT / 'exec.png'}")


if __name__ == "__main__":
    main()
