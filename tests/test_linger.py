"""Linger-Longer on the embedded cluster (issue 10): guests at starvation priority in the agent's
guest cgroup, the owner monitor, the memory band, and the cgroups' life cycle.

CPU shares are read from the cgroups' cpuacct.usage over intervals that end at events (the owner
has used so much CPU), never over a fixed time; they are compared as ratios."""
import json
import os
import pathlib
import select
import signal
import subprocess
import time

import pytest

from conftest import STARLING, down, require_root, starling, status, terminate, up, wait_for

NS = 1_000_000_000


def v1_mounts():
    """{controller: mount point} of the cgroup v1 hierarchies, and every v1 mount point."""
    ctl, every = {}, []
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "cgroup":
            every.append(f[1])
            for o in f[3].split(","):
                ctl.setdefault(o, f[1])
    return ctl, every


def unified_mounts():
    """The cgroup2 mount point, as a list (empty if none)."""
    return [l.split()[1] for l in pathlib.Path("/proc/self/mounts").read_text().splitlines() if l.split()[2:3] == ["cgroup2"]][:1]


def host(name, st=None):
    return next(h for h in (st or status())["hosts"] if h["name"] == name)


def owner_report(name):
    o = host(name).get("owner")
    assert o is not None, f"host {name} reports no owner monitor (no guest cgroup?)"
    return o


def cg(controller, rel):
    ctl, _ = v1_mounts()
    assert controller in ctl, f"cgroup v1 {controller} controller not mounted"
    return pathlib.Path(ctl[controller]) / rel


def usage(controller_dir):
    return int((controller_dir / "cpuacct.usage").read_text())


def procs(d):
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def machine_idle_ns():
    f = pathlib.Path("/proc/stat").read_text().splitlines()[0].split()
    return int(f[4]) * NS // os.sysconf("SC_CLK_TCK")


def guest_wait(predicate, what, timeout=120.0):
    """wait_for for something only a guest's progress brings about. Guests run at starvation priority
    (cpu.idle): they get only the CPU no other process of this machine wants, so on a machine kept busy
    by something else (another test run, a build) they may not run at all. A timeout then says how idle
    the machine was meanwhile, so that failure is not mistaken for one of the product."""
    i0, t0 = machine_idle_ns(), time.monotonic()
    try:
        return wait_for(predicate, what, timeout=timeout)
    except pytest.fail.Exception as e:
        wall = (time.monotonic() - t0) * NS * os.cpu_count()
        idle = (machine_idle_ns() - i0) / wall if wall > 0 else 0.0
        pytest.fail(f"{e}; meanwhile this machine's CPUs were {idle:.0%} idle (guests at cpu.idle get only "
                    f"idle CPU: other work here starves them)")


def busy_loops(n):
    return " ".join(["(while :; do :; done) &"] * n) + " wait"


def spawn(*args, env=None):
    return subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def our_trees():
    """The embedded cluster's host cgroup dirs (starling/<netns prefix>*) in any v1 hierarchy."""
    _, every = v1_mounts()
    prefix = f"starling{os.environ.get('STARLING_INSTANCE', '')}-" if os.environ.get("STARLING_INSTANCE", "0") != "0" else "starling-"
    found = []
    for m in every:
        d = pathlib.Path(m) / "starling"
        if d.is_dir():
            found += [str(x) for x in d.iterdir() if x.is_dir() and x.name.startswith(prefix)]
    return found


@pytest.fixture(scope="module")
def lcluster():
    require_root("an embedded cluster and cgroups")
    st = up(2)
    yield st
    down()


def test_guest_starves_while_the_owner_runs_and_takes_idle_cpu_after(lcluster):
    o = owner_report("h1")
    assert o["priority"] == "cpu.idle", o
    cores = host("h1")["cores"]
    guest_dir = cg("cpuacct", o["guest_cgroup"])
    owner_dir = cg("cpuacct", o["owner_cgroup"])
    # The guest: a busy loop per core, in the guest cgroup of h1.
    g = spawn(STARLING, "exec", "--host", "h1", "--", "sh", "-c", busy_loops(cores))
    try:
        wait_for(lambda: len(procs(guest_dir)) >= cores + 1, "the guest's busy loops in the guest cgroup")
        assert procs(cg("cpu", o["guest_cgroup"])), "the guest is not in the cpu (cpu.idle) hierarchy's guest group"
        # The owner: the same number of busy loops, in h1's owner cgroup.
        own = spawn(STARLING, "owner", "h1", "--", "sh", "-c", busy_loops(cores))
        try:
            wait_for(lambda: len(procs(owner_dir)) >= cores + 1, "the owner's busy loops in the owner cgroup")
            assert not set(procs(owner_dir)) & set(procs(guest_dir)), "owner processes in the guest cgroup"
            g0, o0 = usage(guest_dir), usage(owner_dir)
            # The interval ends when the owner has had 2 CPU-seconds per core.
            wait_for(lambda: usage(owner_dir) - o0 >= 2 * cores * NS, "the owner to use 2 CPU-seconds per core", timeout=600)
            dg, do = usage(guest_dir) - g0, usage(owner_dir) - o0
            print(f"owner running: guest {dg / NS:.3f} CPU-s, owner {do / NS:.3f} CPU-s ({dg / do:.2%})")
            assert dg < 0.05 * do, f"guest got {dg / NS:.3f} CPU-s while the owner got {do / NS:.3f} (≥ 5%)"
            st = wait_for(lambda: (r := owner_report("h1"))["state"] != "idle" and r, "h1's owner seen active")
            assert "lingering" in st["doing"], st
        finally:
            kill_group(own)
        wait_for(lambda: not procs(owner_dir), "the owner workload to end")
        # Owner gone: the guest takes the CPU nobody else wants (other work on this machine may
        # still take some: compare the guest's time with the machine's idle time).
        g1, i1 = usage(guest_dir), machine_idle_ns()
        guest_wait(lambda: usage(guest_dir) - g1 >= 2 * cores * NS, "the guest to get 2 CPU-seconds per core", timeout=600)
        dg, di = usage(guest_dir) - g1, machine_idle_ns() - i1
        print(f"owner gone: guest {dg / NS:.3f} CPU-s, machine idle {di / NS:.3f} CPU-s")
        assert dg > 0.9 * (dg + di), f"guest took {dg / NS:.2f} CPU-s while {di / NS:.2f} CPU-s stayed idle"
    finally:
        for p in procs(guest_dir):
            os.kill(p, signal.SIGKILL)
        g.wait(timeout=120)
    wait_for(lambda: not procs(guest_dir), "the guest to end")


def up_one_host_with_its_band_below_free_memory():
    """A one-host cluster (h1) whose memory band sits just below today's free memory (thresholds as
    settings), so an owner that takes 3 GiB pushes free memory below it; today's free memory (MiB)."""
    avail = next(int(l.split()[1]) for l in pathlib.Path("/proc/meminfo").read_text().splitlines()
                 if l.startswith("MemAvailable:")) // 1024
    if avail < 8192:
        pytest.fail(f"needs 8 GiB free memory for its 3 GiB owner (MemAvailable {avail} MiB)")
    env = dict(os.environ, STARLING_LOW_WATER_MIB=str(avail - 1536), STARLING_HIGH_WATER_MIB=str(avail - 768))
    starling("down", check=False)
    r = subprocess.run([STARLING, "up", "--hosts", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return avail


def test_memory_band_caps_the_guest_when_free_memory_drops(lcluster):
    """Thresholds as settings: the band sits just below today's free memory, and an owner that
    takes 3 GiB pushes free memory below it."""
    up_one_host_with_its_band_below_free_memory()
    try:
        o = owner_report("h1")
        mem_dir = cg("memory", o["guest_cgroup"])
        g = spawn(STARLING, "exec", "--host", "h1", "--", "sh", "-c", "echo started; sleep 3600")
        try:
            wait_for(lambda: procs(mem_dir), "the guest in the memory guest group")
            # Its first line before the owner comes: the guest has run (its output is checked at the end).
            guest_wait(lambda: select.select([g.stdout], [], [], 0)[0], "the guest's first line")
            started = g.stdout.readline()
            assert owner_report("h1")["guest_mem_cap"] is None
            unlimited = int((mem_dir / "memory.limit_in_bytes").read_text())
            own = spawn(STARLING, "owner", "h1", "--", "python3", "-c",
                        "import time; b = b'x' * (3 << 30); print('held', flush=True); time.sleep(3600)")
            try:
                rep = wait_for(lambda: (r := owner_report("h1"))["guest_mem_cap"] is not None and r,
                               "the guest's memory to be capped", timeout=300)
                limit = int((mem_dir / "memory.limit_in_bytes").read_text())
                assert limit < unlimited, "memory.limit_in_bytes was not lowered"
                # Capped at what the guest used (a shell and a sleep: far below 256 MiB).
                assert limit <= 256 << 20, f"cap {limit} is not what the guest uses"
                assert "capped" in rep["doing"] or "frozen" in rep["doing"], rep
                assert g.poll() is None, "the guest was killed"
            finally:
                kill_group(own)
            wait_for(lambda: owner_report("h1")["guest_mem_cap"] is None, "the cap to be lifted", timeout=300)
            assert int((mem_dir / "memory.limit_in_bytes").read_text()) == unlimited
            assert (cg("freezer", o["guest_cgroup"]) / "freezer.state").read_text().strip() == "THAWED"
            assert g.poll() is None, "the guest did not survive the band"
        finally:
            for p in procs(mem_dir):
                os.kill(p, signal.SIGKILL)
            out, _ = g.communicate(timeout=120)
        assert started + out == "started\n"
    finally:
        starling("down", check=False)
        up(2)


# The memory-move guest: one process (a task that can move) printing a numbered line every 0.5 s, so
# it outlasts the owner's allocation, the band's reaction and the move however busy this machine is
# (at cpu.idle a CPU-bound guest may barely run here), for at least 90 s.
MEM_LINES = 180
MEM_GUEST = f"import time\nfor i in range(1, {MEM_LINES} + 1):\n    print(i, flush=True)\n    time.sleep(0.5)\nprint('memdone')"
MEM_EXPECTED = "".join(f"{i}\n" for i in range(1, MEM_LINES + 1)) + "memdone\n"


def oom_kills():
    """The machine's OOM kills so far (/proc/vmstat `oom_kill`)."""
    return next(int(l.split()[1]) for l in pathlib.Path("/proc/vmstat").read_text().splitlines() if l.startswith("oom_kill "))


def group_oom_kills(d):
    """OOM kills in one v1 memory group (`oom_kill` of memory.oom_control)."""
    f = dict(l.split() for l in (d / "memory.oom_control").read_text().splitlines())
    assert "oom_kill" in f, f"{d}/memory.oom_control counts no OOM kills on this kernel: {f}"
    return int(f["oom_kill"])


def test_memory_pressure_moves_an_ll_guest_to_a_host_with_room(lcluster, tmp_path):
    """Capping or freezing a guest gives no memory back (no swap): the head moves an LL guest of a host
    whose band capped it to a host with room, at once (no T_lingr), and says so. h1's band sits just below
    today's free memory (all emulated hosts share this machine's MemAvailable, so h1 is the cluster's only
    embedded host); a second host joins with a token and the default band (1/2 GiB) as the room. An owner
    on h1 takes 3 GiB; the guest's output is complete and in order, its exit status 0, nobody OOM-killed."""
    from test_security import run_dir
    require_root("an embedded cluster, an agent as root, cgroups")
    avail = up_one_host_with_its_band_below_free_memory()
    room = f"memroom{os.getpid()}"
    agent = g = own = None
    try:
        token = starling("token", "create").stdout.strip()
        head = json.loads((run_dir() / "cluster.json").read_text())["head_addr"]
        plain = {k: v for k, v in os.environ.items() if k not in ("STARLING_LOW_WATER_MIB", "STARLING_HIGH_WATER_MIB")}
        log = open(tmp_path / "room.log", "wb")
        # Its owner is emulated (its owner group, idle): not the rest of this machine, busy or not.
        agent = subprocess.Popen([STARLING, "agent", "--name", room, "--join", head, "--token", token, "--auth", str(tmp_path / "creds"),
                                  "--state", str(tmp_path / "state"), "--cache-mib", "256", "--owner", "emulated"],
                                 stdout=log, stderr=subprocess.STDOUT, env=dict(plain, STARLING_LOG="info"))
        wait_for(lambda: agent.poll() is not None or any(h["name"] == room for h in status()["hosts"]), f"{room} to join", timeout=120)
        assert agent.poll() is None, (tmp_path / "room.log").read_text(errors="replace")
        wait_for(lambda: (o := host(room).get("owner")) and o["state"] == "idle", f"{room}'s owner report")
        o = owner_report("h1")
        assert o["low_water"] == (avail - 1536) << 20 and o["high_water"] == (avail - 768) << 20, o
        mem_dir = cg("memory", o["guest_cgroup"])
        owner_mem = cg("memory", o["owner_cgroup"])
        kills, guest_kills, owner_kills = oom_kills(), group_oom_kills(mem_dir), group_oom_kills(owner_mem)
        g = spawn(STARLING, "exec", "--host", "h1", "--policy", "LL", "--", "python3", "-c", MEM_GUEST)
        wait_for(lambda: ps_host("memdone"), "the guest task")
        guest_wait(lambda: select.select([g.stdout], [], [], 0)[0], "the guest's first line")
        assert ps_host("memdone")["host"] == "h1"
        own = spawn(STARLING, "owner", "h1", "--", "python3", "-c",
                    "import time; b = b'x' * (3 << 30); print('held', flush=True); time.sleep(3600)")
        wait_for(lambda: owner_report("h1")["guest_mem_cap"] is not None or owner_report("h1")["guests_frozen"],
                 "h1's band to cap its guest", timeout=300)
        moved = wait_for(lambda: g.poll() is not None or ((t := ps_host("memdone")) and t["host"] == room and t),
                         f"the guest moved to {room}", timeout=300)
        assert g.poll() is None, f"the guest ended on h1 before it was moved (exit {g.returncode})"
        doing = owner_report("h1")["doing"]
        # "memory: moving tN (R MiB resident) to ROOM, free …" at the move, "…; moved tN …" after it.
        assert doing.startswith("memory: ") and f"t{moved['task']} (" in doing and f"to {room}" in doing, doing
        assert own.poll() is None, "the owner ended (killed?) while it held its memory"
        kill_group(own)
        own = None
        out, err = g.communicate(timeout=900)
        assert g.returncode == 0, err
        assert out == MEM_EXPECTED, f"output differs from the undisturbed one:\n{out!r}"
        assert oom_kills() == kills, "the kernel OOM-killed a process meanwhile"
        assert (group_oom_kills(mem_dir), group_oom_kills(owner_mem)) == (guest_kills, owner_kills)
        print(f"h1 said: {doing!r}")
    finally:
        for p in (own, g):
            if p is not None and p.poll() is None:
                kill_group(p)
        if agent is not None:
            terminate(agent)
        starling("down", check=False)
        up(2)


def test_cgroups_are_removed_by_down_and_after_kill_9(lcluster):
    st = status()
    o = owner_report("h1")
    assert all(cg(c, o["guest_cgroup"]).is_dir() for c in ("cpu", "cpuacct", "memory", "freezer"))
    assert our_trees(), "no host cgroups while the cluster runs"
    # kill -9 an agent: its cgroups stay behind (nobody ran its exit), `down` removes them.
    os.kill(host("h1", st)["pid"], signal.SIGKILL)
    wait_for(lambda: not pathlib.Path(f"/proc/{host('h1', st)['pid']}").exists(), "the agent to die")
    assert cg("cpuacct", o["guest_cgroup"]).is_dir()
    r = down()
    assert r.returncode == 0, r.stdout + r.stderr
    assert our_trees() == [], f"left behind: {our_trees()}"
    up(2)
    o2 = owner_report("h1")
    assert o2["guest_cgroup"] == o["guest_cgroup"] and procs(cg("cpuacct", o2["guest_cgroup"])) == []


def test_agent_removes_a_stale_guest_group_at_start_and_its_groups_at_sigterm(tmp_path):
    """A lone agent (no head needed: it makes its cgroups before dialling): a stale guest group of
    its name, with a process in it, is emptied and remade; SIGTERM removes the agent's groups."""
    require_root("cgroups")
    name = f"lingertest{os.getpid()}"
    rel = f"starling/{name}/guest"
    stale = cg("cpuacct", rel)
    stale.mkdir(parents=True)
    victim = subprocess.Popen(["sleep", "3600"])
    (stale / "cgroup.procs").write_text(str(victim.pid))
    agent = spawn(STARLING, "agent", "--head", "127.0.0.1:1", "--name", name, "--state", str(tmp_path / "state"))
    try:
        assert victim.wait(timeout=120) == -signal.SIGKILL, "the stale guest was not killed"
        wait_for(lambda: (cg("cpu", rel) / "cpu.idle").exists() and (cg("cpu", rel) / "cpu.idle").read_text().strip() == "1",
                 "the fresh guest group with cpu.idle = 1")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=120) == 0
        _, every = v1_mounts()
        left = [m for m in every if (pathlib.Path(m) / "starling" / name).exists()]
        assert left == [], f"agent left its cgroups in {left}"
    finally:
        if agent.poll() is None:
            kill_group(agent)
        if victim.poll() is None:
            victim.kill()
        _, every = v1_mounts()
        for m in every:
            for d in sorted((pathlib.Path(m) / "starling" / name).glob("**/"), key=lambda p: -len(p.parts)):
                d.rmdir()


# Policies: the guest prints a progress line per 500000 steps, from one shell process (a task that
# can move); its expected output is arithmetic, and a move must neither lose nor repeat a line.
STEPS = 2_000_000
GUEST = ("i=0; while [ $i -lt %d ]; do i=$((i+1)); [ $((i %% 500000)) -eq 0 ] && echo $i; done; echo done" % STEPS)
EXPECTED = "".join(f"{i}\n" for i in range(500_000, STEPS + 1, 500_000)) + "done\n"


def ps_host(task_cmd_fragment):
    tasks = json.loads(starling("ps", "--json").stdout)
    t = [t for t in tasks if task_cmd_fragment in t.get("command", "")]
    return t[0] if t else None


def policy_cluster(policy):
    starling("down", check=False)
    r = starling("up", "--hosts", "2", "--policy", policy, check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {h["owner"]["policy"] for h in status()["hosts"]} == {policy}


def owner_burning(cores):
    o = owner_report("h1")
    owner_dir = cg("cpuacct", o["owner_cgroup"])
    own = spawn(STARLING, "owner", "h1", "--", "sh", "-c", busy_loops(cores))
    wait_for(lambda: len(procs(owner_dir)) >= cores + 1, "the owner's busy loops")
    wait_for(lambda: owner_report("h1")["state"] != "idle", "h1's owner seen active")
    return own, owner_dir


def test_ll_lingers_then_moves_the_guest_to_an_idle_host(lcluster):
    policy_cluster("LL")
    try:
        cores = host("h1")["cores"]
        own, _ = owner_burning(cores)
        try:
            g = spawn(STARLING, "exec", "--host", "h1", "--", "sh", "-c", GUEST)
            wait_for(lambda: ps_host("echo done"), "the guest task")
            # First it lingers (the head counts down T_lingr), then it moves to the idle h2.
            # (The first report can come before the owner's first CPU sample: wait for the countdown.)
            seen = wait_for(lambda: "T_lingr" in (d := owner_report("h1")["doing"]) and d, "LL counting down T_lingr on h1")
            assert seen.startswith("LL: lingering"), seen
            guest_wait(lambda: (t := ps_host("echo done")) is None or t["host"] == "h2", "the guest moved to h2", timeout=300)
            moved = wait_for(lambda: (d := owner_report("h1")["doing"]).startswith(("LL: moving", "LL: owner active, no guests")) and d,
                             "h1's policy report after the move")
        finally:
            # Emulated hosts share this machine's cores: h1's owner would starve the guest on h2 too.
            kill_group(own)
        out, err = g.communicate(timeout=600)
        assert g.returncode == 0, err
        assert out == EXPECTED, f"output differs from the undisturbed one:\n{out!r}"
        print(f"before: {seen!r}; after: {moved!r}")
    finally:
        starling("down", check=False)
        up(2)


def test_lf_lingers_and_never_moves(lcluster):
    cores = host("h1")["cores"]
    assert host("h1")["owner"]["policy"] == "LF"
    own, owner_dir = owner_burning(cores)
    try:
        g = spawn(STARLING, "exec", "--host", "h1", "--", "sh", "-c", GUEST)
        t = wait_for(lambda: ps_host("echo done"), "the guest task")
        # Long past any T_lingr (T_migr is below a second here): the owner uses 5 CPU-s per core.
        o0 = usage(owner_dir)
        wait_for(lambda: usage(owner_dir) - o0 >= 5 * cores * NS, "the owner to use 5 CPU-seconds per core", timeout=600)
        assert ps_host("echo done")["host"] == "h1", "LF moved the guest"
        assert g.poll() is None, "the guest finished while the owner burned every core"
    finally:
        kill_group(own)
    out, err = g.communicate(timeout=600)
    assert g.returncode == 0, err
    assert out == EXPECTED
    assert t["host"] == "h1"


def test_pm_suspends_then_moves_after_the_pause(lcluster):
    """PM with a 3 s pause (a setting): the guest is frozen while h1's owner is active, then moved."""
    starling("down", check=False)
    env = dict(os.environ, STARLING_PM_PAUSE_S="3")
    r = subprocess.run([STARLING, "up", "--hosts", "2", "--policy", "PM"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        assert host("h1")["owner"]["policy"] == "PM" and host("h1")["owner"]["pause_s"] == 3
        # PM tasks freeze in their own group below the guest's.
        freezer = cg("freezer", owner_report("h1")["guest_cgroup"]) / "pm"
        cores = host("h1")["cores"]
        # The owner comes back while the guest runs (a task cannot start in a suspended group:
        # it is frozen before its program starts, and only a started task can move).
        steps = 20_000_000
        guest = GUEST.replace(str(STEPS), str(steps)).replace("500000", "5000000")
        expected = "".join(f"{i}\n" for i in range(5_000_000, steps + 1, 5_000_000)) + "done\n"
        g = spawn(STARLING, "exec", "--host", "h1", "--", "sh", "-c", guest)
        guest_wait(lambda: (t := ps_host("echo done")) and (t.get("cpu_seconds") or 0) > 0, "the guest running")
        own, _ = owner_burning(cores)
        try:
            wait_for(lambda: owner_report("h1")["suspended"], "h1's guests suspended")
            assert (freezer / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING")
            guest_wait(lambda: (t := ps_host("echo done")) is None or t["host"] == "h2", "the guest moved to h2", timeout=300)
        finally:
            kill_group(own)
        out, err = g.communicate(timeout=600)
        assert g.returncode == 0, err
        assert out == expected, f"output differs from the undisturbed one:\n{out!r}"
        wait_for(lambda: not owner_report("h1")["suspended"], "h1's guests resumed once the owner left")
        assert (freezer / "freezer.state").read_text().strip() == "THAWED"
    finally:
        starling("down", check=False)
        up(2)


# Tasks that mostly sleep: they need little CPU, so they finish even on a machine that starves
# guests. One process each (a shell would fork `sleep`, and a process with children does not move).
def sleepy(tag, n):
    return ["python3", "-c", f"import time\nfor i in range(1, {n} + 1):\n    print('{tag}', i, flush=True)\n    time.sleep(0.5)\nprint('{tag} done')"]


def sleepy_output(tag, n):
    return "".join(f"{tag} {i}\n" for i in range(1, n + 1)) + f"{tag} done\n"


def test_a_pm_task_is_suspended_and_moved_while_an_lf_task_beside_it_lingers(lcluster):
    """Per-task `--policy PM` on an LF cluster (pause 3 s): when h1's owner comes to the keyboard,
    only the PM task is frozen, then moved to h2; the LF task on the same host keeps running there."""
    import threading
    starling("down", check=False)
    env = dict(os.environ, STARLING_PM_PAUSE_S="3")
    r = subprocess.run([STARLING, "up", "--hosts", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    pm_task = lf_task = None
    try:
        assert {h["owner"]["policy"] for h in status()["hosts"]} == {"LF"}
        guest_freezer = cg("freezer", owner_report("h1")["guest_cgroup"])
        pm_freezer = guest_freezer / "pm"
        pm_task = spawn(STARLING, "exec", "--policy", "PM", "--host", "h1", "--", *sleepy("pm", 40))
        lf_task = spawn(STARLING, "exec", "--host", "h1", "--", *sleepy("lf", 60))
        pm_lines = []
        pm_reader = threading.Thread(target=lambda: pm_lines.extend(iter(pm_task.stdout.readline, "")), daemon=True)
        pm_reader.start()
        wait_for(lambda: procs(pm_freezer), "the PM task in the PM freezer group")
        wait_for(lambda: procs(guest_freezer), "the LF task in the guest's freezer group")
        assert not set(procs(pm_freezer)) & set(procs(guest_freezer))
        guest_wait(lambda: pm_lines, "the PM task's first line")
        lf_pids = procs(guest_freezer)

        starling("owner", "h1", "--active")
        wait_for(lambda: owner_report("h1")["suspended"], "h1's PM guests suspended")
        assert (pm_freezer / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING")
        assert (guest_freezer / "freezer.state").read_text().strip() == "THAWED", "the LF task was frozen too"
        assert set(lf_pids) & set(procs(guest_freezer)), "the LF task left the guest's freezer group"
        guest_wait(lambda: (t := ps_host("print('pm done')")) is None or t["host"] == "h2", "the PM task moved to h2", timeout=300)
        lf = ps_host("print('lf done')")
        assert lf is None or lf["host"] == "h1", f"the LF task moved: {lf}"
        starling("owner", "h1", "--idle")

        assert pm_task.wait(timeout=600) == 0, pm_task.stderr.read()
        pm_reader.join(timeout=60)  # it ends at the end of the output
        assert "".join(pm_lines) == sleepy_output("pm", 40), f"the PM task's output differs from the undisturbed one:\n{pm_lines!r}"
        out, err = lf_task.communicate(timeout=600)
        assert lf_task.returncode == 0, err
        assert out == sleepy_output("lf", 60), f"the LF task's output:\n{out!r}"
        wait_for(lambda: not owner_report("h1")["suspended"], "h1's PM group thawed once the owner left")
        assert (pm_freezer / "freezer.state").read_text().strip() == "THAWED"
    finally:
        starling("owner", "h1", "--idle", check=False)
        for p in (pm_task, lf_task):
            if p is not None and p.poll() is None:
                kill_group(p)
        starling("down", check=False)
        up(2)


def test_a_task_moved_to_a_host_whose_pm_guests_are_suspended_is_restored_then_suspended_there(lcluster):
    """The restore of a moved task is not guest work: it runs outside the target's guest CPU
    (cpu.idle) and freezer groups, and the restored process joins them as its last step, before its
    own code runs. Shown where guests cannot run at all: h2's owner is at the keyboard, so h2's PM
    guests are frozen. `starling migrate` to h2 completes (the restore's own steps finish; before,
    the restorer started inside the frozen group and the move waited for the owner to leave); the
    task then sits in h2's PM freezer and guest CPU groups, suspended like any PM guest there, and
    ends with its undisturbed output once the owner leaves."""
    import threading
    starling("down", check=False)
    # PM everywhere, with a pause long past this test: only the explicit move moves the task.
    env = dict(os.environ, STARLING_PM_PAUSE_S="3600")
    r = subprocess.run([STARLING, "up", "--hosts", "2", "--policy", "PM"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    task = None
    try:
        guest_rel = owner_report("h2")["guest_cgroup"]
        pm_freezer, cpu_group = cg("freezer", guest_rel) / "pm", cg("cpu", guest_rel)
        task = spawn(STARLING, "exec", "--host", "h1", "--", *sleepy("mv", 120))
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(iter(task.stdout.readline, "")), daemon=True)
        reader.start()
        guest_wait(lambda: lines, "the task's first line on h1")
        tid = ps_host("print('mv done')")["task"]

        starling("owner", "h2", "--active")
        wait_for(lambda: (pm_freezer / "freezer.state").read_text().strip() == "FROZEN", "h2's PM guests' group frozen")
        try:
            moved = subprocess.run([STARLING, "migrate", str(tid), "--to", "h2", "--json"], capture_output=True, text=True,
                                   timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the move to h2 did not complete in 300 s while h2's PM guests were frozen: its restore "
                        "waited in the frozen guest group")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        report = json.loads(moved.stdout)
        assert report["to"] == "h2" and report["pause_ms"] > 0, report
        assert ps_host("print('mv done')")["host"] == "h2"
        # The restored process is in h2's PM freezer group and its guest CPU group (it joined both
        # as its last step), and frozen there.
        joined = wait_for(lambda: (p := procs(pm_freezer)) and p, "the moved task in h2's PM freezer group")
        assert set(joined) <= set(procs(cpu_group)), (joined, procs(cpu_group))
        wait_for(lambda: (pm_freezer / "freezer.state").read_text().strip() == "FROZEN", "the moved task frozen on h2")
        assert task.poll() is None, "the task ended while h2's owner was active"

        starling("owner", "h2", "--idle")
        assert task.wait(timeout=600) == 0, task.stderr.read()
        reader.join(timeout=60)
        assert "".join(lines) == sleepy_output("mv", 120), f"output differs from the undisturbed one:\n{lines!r}"
    finally:
        starling("owner", "h2", "--idle", check=False)
        if task is not None and task.poll() is None:
            kill_group(task)
        starling("down", check=False)
        up(2)


# IE: the guest prints numbered lines slowly (deterministic output) and appends its host's name to a
# file; killed and rerun from the start, its output must still be every line once, and the file only
# the rerun's line (the killed run's uncommitted change is discarded).
IE_LINES = 30
IE_GUEST = ("uname -n >> where.txt; i=0; while [ $i -lt %d ]; do i=$((i+1)); echo line $i; sleep 0.2; done; exit 3"
            % IE_LINES)


def test_ie_kills_and_reruns_on_an_idle_host_with_output_once(lcluster, tmp_path):
    """Per-task `--policy IE` on an LF cluster: the owner of the guest's host becomes active
    (keyboard), the guest is evicted and rerun on the other host, whose owner is idle."""
    import threading
    assert {h["owner"]["policy"] for h in status()["hosts"]} == {"LF"}
    g = subprocess.Popen([STARLING, "exec", "--policy", "IE", "--", "sh", "-c", IE_GUEST], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(g.stdout.readline, b"")), daemon=True)
    reader.start()
    first = None
    try:
        guest_wait(lambda: len(lines) >= 3, "the guest's first lines", timeout=300)
        first = ps_host("where.txt")
        assert first is not None and first["host"] in ("h1", "h2"), first
        other = "h2" if first["host"] == "h1" else "h1"
        starling("owner", first["host"], "--active")
        rerun = guest_wait(lambda: (t := ps_host("where.txt")) and t["host"] == other and t, "the guest rerun on " + other,
                         timeout=300)
        assert "rerun" in rerun["state"], rerun
        assert "IE" in owner_report(first["host"])["doing"], owner_report(first["host"])
    finally:
        if first is not None:
            starling("owner", first["host"], "--idle", check=False)
    assert g.wait(timeout=600) == 3, g.stderr.read()
    reader.join(timeout=60)
    assert b"".join(lines).decode() == "".join(f"line {i}\n" for i in range(1, IE_LINES + 1))
    assert (tmp_path / "where.txt").read_text() == other + "\n", "the killed run's file change was committed"


def test_exec_names_the_policies_it_accepts():
    r = subprocess.run([STARLING, "exec", "--policy", "XX", "--", "true"], capture_output=True, text=True)
    assert r.returncode != 0 and "LF, LL, PM or IE" in r.stderr, r.stderr


# Rate windows (issue 10): the guests' disk and network bytes/s while the owner does disk I/O. The
# guests measure themselves: bytes over the time from their first byte to the last one on the disk
# (O_DIRECT + fsync) or acknowledged by the receiver (it closes only after reading everything).
WINDOW_BPS = 2 << 20
WINDOW_BYTES = 8 << 20
DISK_WRITER = """
import mmap, os, sys, time
path, total = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 1 << 20)
buf.write(b"x" * (1 << 20))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
t = time.monotonic()
n = 0
while n < total:
    n += os.write(fd, buf)
os.fsync(fd)
dt = time.monotonic() - t
os.close(fd)
os.unlink(path)
print(n / dt)
"""
NET_RECEIVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(4)
print("listening", flush=True)
for _ in range(int(sys.argv[2])):
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.close()
print("received", flush=True)
"""
NET_SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
b = b"x" * 65536
n, total = 0, int(sys.argv[3])
t = time.monotonic()
while n < total:
    s.sendall(b)
    n += len(b)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(n / (time.monotonic() - t))
"""
WINDOW_PORT = 7461
HTB = "5354:"
# The owner's disk I/O: O_DIRECT reads of a file on this machine's disk (an emulated host's own files
# are on tmpfs; v1 blkio charges direct I/O to the reader's group, and it is far above the 1 MiB/s that
# switches the windows on).
OWNER_IO = f"while :; do dd if={STARLING} of=/dev/null bs=1M iflag=direct status=none; done"


def guest_rate(host, code, *args):
    r = subprocess.run([STARLING, "exec", "--host", host, "--", "python3", "-c", code, *map(str, args)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


def in_netns(ns, *args):
    """A command in network namespace `ns` (nsenter, not `ip netns exec`: that remounts /sys)."""
    return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *args], capture_output=True, text=True, timeout=60)


def our_nft_tables(ns=None):
    r = in_netns(ns, "nft", "list", "tables") if ns else subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [l for l in r.stdout.splitlines() if " starling_" in l]


def window_tables(ns):
    """The network windows' tables in `ns` (not the owner's network counters, `starling_NAME_io`)."""
    return [t for t in our_nft_tables(ns) if not t.endswith("_io")]


def our_qdiscs(ns=None):
    r = in_netns(ns, "tc", "qdisc", "show") if ns else subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [l for l in r.stdout.splitlines() if f"htb {HTB}" in l]


def blkio_rules(guest_rel):
    d = cg("blkio", guest_rel)
    return [l for f in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device")
            if (d / f).exists() for l in (d / f).read_text().split("\n") if l.strip()]


def windows_cluster():
    starling("down", check=False)
    env = dict(os.environ, STARLING_GUEST_DISK_BPS=str(WINDOW_BPS), STARLING_GUEST_NET_BPS=str(WINDOW_BPS))
    r = subprocess.run([STARLING, "up", "--hosts", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rate_windows_limit_guests_while_the_owner_does_io_and_go_at_down(lcluster):
    """h1's guests write O_DIRECT and send over TCP to a guest on h2: at ≈ the window while h1's
    owner writes to disk, far above it once its I/O has stopped; an owner who is only at the
    keyboard does not switch them on; `down` leaves no rule."""
    import threading
    windows_cluster()
    receiver = owner = None
    try:
        # A new cluster's owners do no I/O: no window.
        o = wait_for(lambda: (r := owner_report("h1"))["rate_windows"] is None and r, "h1's windows off while its owner does no I/O")
        assert blkio_rules(o["guest_cgroup"]) == []
        h2_addr = host("h2")["address"].split(":")[0]
        receiver = spawn(STARLING, "exec", "--host", "h2", "--", "python3", "-c", NET_RECEIVER, str(WINDOW_PORT), "2")
        lines = []
        threading.Thread(target=lambda: lines.extend(iter(receiver.stdout.readline, "")), daemon=True).start()
        guest_wait(lambda: "listening\n" in lines, "the receiver on h2 listening", timeout=600)

        # At the keyboard only: the windows stay off. One report holds one sample: the keyboard the
        # agent saw and what its windows' step did with that sample.
        starling("owner", "h1", "--active")
        rep = wait_for(lambda: (r := owner_report("h1"))["keyboard"] == "active" and r, "h1's owner seen at the keyboard")
        assert rep["rate_windows"] is None, f"windows on for an owner who does no I/O: {rep}"
        starling("owner", "h1", "--idle")

        owner = spawn(STARLING, "owner", "h1", "--", "sh", "-c", OWNER_IO)
        rep = wait_for(lambda: (r := owner_report("h1"))["rate_windows"] and r, "h1's rate windows applied")
        assert "disk" in rep["rate_windows"] and "net" in rep["rate_windows"], rep
        assert "rate windows applied" in starling("status").stdout
        rules = blkio_rules(o["guest_cgroup"])
        assert rules and all(l.split()[1] == str(WINDOW_BPS) for l in rules), rules
        disk_slow = guest_rate("h1", DISK_WRITER, "/tmp/window-disk", WINDOW_BYTES)
        net_slow = guest_rate("h1", NET_SENDER, h2_addr, WINDOW_PORT, WINDOW_BYTES)
        print(f"owner doing I/O: disk {disk_slow / 2**20:.2f} MiB/s, net {net_slow / 2**20:.2f} MiB/s")
        assert disk_slow <= 1.5 * WINDOW_BPS, f"guest wrote at {disk_slow / 2**20:.2f} MiB/s with a 2 MiB/s window"
        assert net_slow <= 1.5 * WINDOW_BPS, f"guest sent at {net_slow / 2**20:.2f} MiB/s with a 2 MiB/s window"

        kill_group(owner)
        owner = None
        wait_for(lambda: owner_report("h1")["rate_windows"] is None, "h1's rate windows removed")
        assert blkio_rules(o["guest_cgroup"]) == []
        disk_fast = guest_rate("h1", DISK_WRITER, "/tmp/window-disk", WINDOW_BYTES)
        net_fast = guest_rate("h1", NET_SENDER, h2_addr, WINDOW_PORT, WINDOW_BYTES)
        print(f"owner I/O stopped: disk {disk_fast / 2**20:.2f} MiB/s, net {net_fast / 2**20:.2f} MiB/s")
        assert disk_fast > 3 * WINDOW_BPS, f"guest wrote at only {disk_fast / 2**20:.2f} MiB/s with the owner's I/O stopped"
        assert net_fast > 3 * WINDOW_BPS, f"guest sent at only {net_fast / 2**20:.2f} MiB/s with the owner's I/O stopped"
        guest_wait(lambda: "received\n" in lines, "the receiver to get both streams")

        # Applied again, then `down`: no blkio rule, nft table or htb of ours is left anywhere.
        owner = spawn(STARLING, "owner", "h1", "--", "sh", "-c", OWNER_IO)
        wait_for(lambda: owner_report("h1")["rate_windows"], "h1's rate windows applied again")
        assert blkio_rules(o["guest_cgroup"])
        kill_group(owner)
        owner = None
        r = down()
        assert r.returncode == 0, r.stdout + r.stderr
        assert not cg("blkio", o["guest_cgroup"]).exists(), "the guest's blkio group (and its rules) left behind"
        prefix = f"starling{os.environ['STARLING_INSTANCE']}-" if os.environ.get("STARLING_INSTANCE", "0") != "0" else "starling-"
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert prefix not in left, f"host namespaces (with their tables and qdiscs) left: {left}"
        assert [t for t in our_nft_tables() if prefix.replace("-", "_") in t] == [], our_nft_tables()
        assert our_qdiscs() == [], our_qdiscs()
    finally:
        for p in (receiver, owner):
            if p is not None:
                kill_group(p)
        starling("owner", "h1", "--idle", check=False)
        starling("down", check=False)
        up(2)


# The owner's network I/O: UDP datagrams to h2's discard port, paced at ≈ 4 MiB/s (above the 1 MiB/s
# that switches the windows on; no disk I/O: nothing is written, the program is in the page cache).
OWNER_NET = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
b = b"x" * 1400
print("sending", flush=True)
while True:
    for _ in range(64):
        s.sendto(b, (sys.argv[1], 9))
    time.sleep(0.02)
"""


def test_the_owners_network_io_switches_the_windows_on_and_their_quiet_off(lcluster):
    """h1's owner sends over the network (`starling owner h1 -- python3 ...`): h1's guests' windows
    go on (its report says so; the network window's nftables table and htb are in h1's namespace,
    its disk rules in the guest's blkio group), and go off once the owner has stopped."""
    windows_cluster()
    owner = None
    try:
        o = wait_for(lambda: (r := owner_report("h1"))["rate_windows"] is None and r, "h1's windows off while its owner does no I/O")
        ns = pathlib.PurePath(o["guest_cgroup"]).parts[1]
        window_table = "starling_" + "".join(c if c.isalnum() else "_" for c in ns)
        assert f"table inet {window_table}" not in our_nft_tables(ns) and our_qdiscs(ns) == []
        assert f"table inet {window_table}_io" in our_nft_tables(ns), "no owner network counters in h1's namespace"
        h2_addr = host("h2")["address"].split(":")[0]
        owner = spawn(STARLING, "owner", "h1", "--", "python3", "-c", OWNER_NET, h2_addr)
        assert owner.stdout.readline() == "sending\n", owner.stderr.read() if owner.poll() is not None else ""
        rep = wait_for(lambda: (r := owner_report("h1"))["rate_windows"] and r, "h1's rate windows applied by its owner's network I/O")
        assert "net" in rep["rate_windows"] and "disk" in rep["rate_windows"], rep
        assert f"table inet {window_table}" in our_nft_tables(ns) and our_qdiscs(ns), "the network window is not in h1's namespace"
        assert blkio_rules(o["guest_cgroup"]), "the disk window is not on h1's guest group"
        assert owner_report("h2")["rate_windows"] is None, "h2's windows went on for h1's owner"

        kill_group(owner)
        owner = None
        wait_for(lambda: owner_report("h1")["rate_windows"] is None, "h1's rate windows removed once its owner stopped sending")
        assert f"table inet {window_table}" not in our_nft_tables(ns) and our_qdiscs(ns) == []
        assert blkio_rules(o["guest_cgroup"]) == []
    finally:
        if owner is not None:
            kill_group(owner)
        starling("down", check=False)
        up(2)


def test_a_restarted_agent_removes_a_killed_ones_rate_windows(tmp_path):
    """A lone agent in a network namespace of its own whose (emulated) owner writes to disk applies
    its windows; killed -9 it leaves them; a new agent of the same name removes them at start; SIGTERM
    leaves nothing either."""
    require_root("network namespaces, nftables, tc and cgroups")
    name = f"lingerwin{os.getpid()}"
    rel = f"starling/{name}/guest"
    owner_blkio = cg("blkio", f"starling/{name}/owner")
    subprocess.run(["ip", "netns", "add", name], check=True)
    state = tmp_path / "state"
    state.mkdir()
    env = dict(os.environ, STARLING_GUEST_DISK_BPS=str(WINDOW_BPS), STARLING_GUEST_NET_BPS=str(WINDOW_BPS))

    def agent():
        return subprocess.Popen(["nsenter", f"--net=/run/netns/{name}", STARLING, "agent", "--head", "127.0.0.1:1",
                                 "--name", name, "--state", str(state), "--owner", "emulated"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)

    def owner_io():
        """The owner's disk writer, in the agent's owner blkio group (what `starling owner` does on a cluster)."""
        wait_for(lambda: (owner_blkio / "cgroup.procs").exists(), "the agent's owner group")
        return subprocess.Popen(["sh", "-c", f"echo $$ > {owner_blkio}/cgroup.procs && exec sh -c '{OWNER_IO}'"],
                                start_new_session=True)

    def applied():
        return window_tables(name) and our_qdiscs(name) and blkio_rules(rel)

    a = writer = None
    try:
        r = in_netns(name, "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        assert r.returncode == 0, r.stderr
        a = agent()
        writer = owner_io()
        wait_for(applied, "the windows of an agent whose owner writes to disk")
        assert len(our_qdiscs(name)) == 2, our_qdiscs(name)  # v0 and v1, not lo
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(timeout=60)
        kill_group(writer)
        writer = None
        assert window_tables(name) and our_qdiscs(name), "the killed agent's windows vanished by themselves"
        a = agent()
        wait_for(lambda: not window_tables(name) and not our_qdiscs(name), "the new agent to remove the stale table and qdiscs")
        wait_for(lambda: (cg("cpu", rel) / "cpu.idle").exists(), "the new agent's guest group")
        assert blkio_rules(rel) == [], "the stale guest group's disk rules survived"
        # The new agent applies its own when the owner's I/O comes back, and removes them at SIGTERM
        # (the writer leaves the owner group first, so that the agent can remove it).
        writer = owner_io()
        wait_for(applied, "the new agent's windows")
        kill_group(writer)
        writer = None
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=120) == 0
        assert our_nft_tables(name) == [] and our_qdiscs(name) == []
        _, every = v1_mounts()
        assert [m for m in every + unified_mounts() if (pathlib.Path(m) / "starling" / name).exists()] == []
    finally:
        if writer is not None:
            kill_group(writer)
        if a is not None and a.poll() is None:
            kill_group(a)
        subprocess.run(["ip", "netns", "del", name], check=False)
        for m in v1_mounts()[1] + unified_mounts():
            for d in sorted((pathlib.Path(m) / "starling" / name).glob("**/"), key=lambda p: -len(p.parts)):
                d.rmdir()
