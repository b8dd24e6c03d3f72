"""`starling up --slurm` against a real Slurm 22.05 (Debian's slurmctld, slurmd and munge), started by
the project's own scripts/slurm-local.sh: every node (sn1, sn2...) is a slurmd in its own network and
UTS namespace, so an agent Slurm starts there is a separate host with its own address and name.

Covered: the script's up (idempotent) and down (nothing left); `up --slurm -N 2` (status names the job
Slurm lists and its nodes), exec and a `run -n 8` job on the nodes, a remote fork whose clones run
on two nodes, `down` cancels the job and leaves no process; inside an existing allocation (salloc) the
allocation is used; Slurm's refusals (no such partition, more nodes than the partition has, munge
down) come back as one line and leave nothing; a node killed mid-task is reported lost, the task
fails with 255 and `down` still ends the job."""
import json
import os
import pathlib
import re
import signal
import subprocess

import pytest

from conftest import ROOT, STARLING, device_granted, local_account, require_root, require_tool, sh, starling, status, up, wait_for

SCRIPT = str(ROOT / "scripts" / "slurm-local.sh")
CONF = "/run/starling-slurm/slurm.conf"
NODES = 3
WORK = pathlib.Path("/var/tmp/starling-tests/slurm")
LIB = ROOT / "target/release/libstarling.a"


def instance_state_dir():
    n = os.environ.get("STARLING_INSTANCE", "").strip()
    return pathlib.Path("/var/lib/starling" + (f"-{n}" if n and n != "0" else ""))


def our_processes():
    """Processes of this instance's Slurm cluster: the head and agents name its state dir."""
    needle = str(instance_state_dir() / "slurm")
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(needle.encode() in a for a in argv) and b"pytest" not in argv[0]:
            out.append((int(p.name), b" ".join(argv).decode(errors="replace")))
    return out


def active_jobs():
    return [l for l in sh("squeue", "-h", "-o", "%i|%T").stdout.splitlines() if l.strip()]


def local_up(n=NODES):
    r = sh(SCRIPT, "up", str(n), check=False, timeout=180)
    assert r.returncode == 0, f"slurm-local.sh up failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def slurm():
    require_root("slurmd nodes in network namespaces")
    for tool, pkg in [("sbatch", "slurm-client"), ("salloc", "slurm-client"), ("slurmctld", "slurmctld"),
                      ("slurmd", "slurmd"), ("munged", "munge"), ("ip", "iproute2")]:
        require_tool(tool, pkg)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = CONF
    starling("down", check=False)
    local_up()
    WORK.mkdir(parents=True, exist_ok=True)
    yield
    starling("down", check=False)
    r = sh(SCRIPT, "down", check=False)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    # Leave a healthy 4-host embedded cluster for the modules that share the session's
    # (conftest.cluster): this module took it down.
    up(4)
    assert r.returncode == 0, r.stderr


def up_slurm(*args, timeout=240):
    starling("down", check=False)
    r = starling("up", "--slurm", *args, check=False, timeout=timeout)
    assert r.returncode == 0, f"starling up --slurm failed:\n{r.stdout}\n{r.stderr}"
    return status()


def down_leaves_nothing(job):
    r = starling("down", "-v", timeout=180)
    assert f"cancelled Slurm job {job}" in r.stdout or f"agents' step of Slurm job {job}" in r.stdout, r.stdout
    assert not [l for l in active_jobs() if l.split("|")[0] == job], active_jobs()
    wait_for(lambda: not our_processes(), "the head and agents to be gone", timeout=60)
    r = subprocess.run([STARLING, "status"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "starling up" in r.stderr, (r.stdout, r.stderr)


def test_local_slurm_is_up_with_one_host_per_node_and_up_again_changes_nothing(slurm):
    pids = sh("pgrep", "-f", f"slurmd -f {CONF}").stdout.split()
    r = local_up()
    assert "already up" in r.stdout, r.stdout
    assert sh("pgrep", "-f", f"slurmd -f {CONF}").stdout.split() == pids, "a second up restarted slurmd"
    states = sh("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
    assert sorted(l.split()[0] for l in states if l) == [f"sn{i}" for i in range(1, NODES + 1)], states
    # Each node is its own host: its own name and address.
    out = sh("srun", f"-N{NODES}", "sh", "-c", "echo $(uname -n) $(ip -4 -o addr show eth0 | awk '{print $4}')").stdout
    rows = sorted(l.split() for l in out.splitlines())
    assert [r[0] for r in rows] == [f"sn{i}" for i in range(1, NODES + 1)], out
    assert len({r[1] for r in rows}) == NODES, out


def test_up_slurm_runs_exec_run_and_fork_on_the_nodes_and_down_cancels(slurm):
    st = up_slurm("-N", "2")
    job = st["slurm"]["job_id"]
    # The job Slurm lists is the one status names, running on the nodes status names.
    listed = dict(l.split("|") for l in active_jobs())
    assert listed.get(job) == "RUNNING", listed
    nodes = sh("scontrol", "show", "hostnames", sh("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()).stdout.split()
    assert len(nodes) == 2 and set(nodes) <= {f"sn{i}" for i in range(1, NODES + 1)}
    assert sorted(st["slurm"]["nodes"]) == sorted(nodes)
    assert sorted(h["name"] for h in st["hosts"]) == sorted(nodes)
    text = starling("status").stdout
    assert f"slurm job {job} on " in text, text

    r = starling("exec", "--", "uname", "-n", cwd=WORK)
    assert r.stdout.strip() in nodes, r.stdout

    r = starling("run", "-n", "8", "--quiet", "--", "sh", "-c", "echo task $STARLING_TASK on $(uname -n)", cwd=WORK)
    rows = re.findall(r"task (\d+) on (\S+)", r.stdout)
    assert sorted(int(t) for t, _ in rows) == list(range(8)), r.stdout
    assert {h for _, h in rows} <= set(nodes), r.stdout

    # A remote fork: two clones, spread over the two nodes (each checks it runs on another host).
    assert LIB.exists(), "build it: cargo build --release -p starling-capi"
    prog = WORK / "heap"
    c = ROOT / "crates/fork/tests/c"
    sh("cc", "-O1", "-g", "-I", str(ROOT / "include"), "-I", str(c), "-include", str(ROOT / "tests/fork/on_other_host.h"),
       str(c / "heap.c"), str(LIB), "-lpthread", "-ldl", "-lm", "-o", str(prog))
    env = dict(os.environ, SFT_HIERARCHICAL="0")
    env.pop("STARLING_FORK_BACKEND", None)
    r = subprocess.run([str(prog)], capture_output=True, text=True, timeout=180, env=env, cwd=WORK)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "PASS heap" in out, out
    hosts = re.findall(r"clone \d+ on host (\S+)", out)
    assert sorted(hosts) == sorted(nodes), out

    down_leaves_nothing(job)


def test_up_inside_an_allocation_uses_it(slurm):
    starling("down", check=False)
    script = f"""set -e
{STARLING} up --slurm >/dev/null
echo JOB=$SLURM_JOB_ID
{STARLING} status --json > {WORK}/alloc-status.json
{STARLING} exec -- uname -n
{STARLING} down -v
"""
    r = sh("salloc", "-N", "2", "sh", "-c", script, check=False, timeout=300, cwd=WORK)
    assert r.returncode == 0, (r.stdout, r.stderr)
    job = re.search(r"JOB=(\d+)", r.stdout).group(1)
    st = json.loads((WORK / "alloc-status.json").read_text())
    assert st["slurm"]["job_id"] == job and st["slurm"]["submitted"] is False, st
    assert len(st["hosts"]) == 2 and sorted(h["name"] for h in st["hosts"]) == sorted(st["slurm"]["nodes"])
    assert re.search(r"^sn\d+$", r.stdout, re.M), r.stdout
    assert f"agents' step of Slurm job {job}" in r.stdout, r.stdout
    # No new job was submitted for it, and nothing is left once salloc released the allocation.
    assert "Submitted" not in r.stderr
    wait_for(lambda: not active_jobs(), "the allocation to end", timeout=120)
    wait_for(lambda: not our_processes(), "the head and agents to be gone", timeout=60)


def one_error_line(r):
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 255, (r.stdout, r.stderr)
    return lines[-1]


def test_slurm_refusals_come_back_as_one_line_and_leave_nothing(slurm):
    starling("down", check=False)
    r = starling("up", "--slurm", "-N", "1", "--partition", "nosuchpartition", check=False, timeout=120)
    line = one_error_line(r)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert line.startswith("starling: sbatch: ") and "Invalid partition name specified" in line, line
    assert not our_processes() and not active_jobs()

    r = starling("up", "--slurm", "-N", str(NODES + 5), check=False, timeout=300)
    line = one_error_line(r)
    assert "will not start" in line and "PartitionConfig" in line, r.stderr
    assert not our_processes() and not active_jobs(), active_jobs()

    # munge down: Slurm cannot authenticate us.
    pid = int(pathlib.Path("/run/munge/munged.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not pathlib.Path(f"/proc/{pid}").exists(), "munged to stop", timeout=30)
    try:
        r = starling("up", "--slurm", "-N", "1", check=False, timeout=120)
        line = one_error_line(r)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Munge encode failed" in line or "munge" in line.lower(), line
        assert not our_processes()
    finally:
        local_up()  # restarts munged and the cluster


def test_node_killed_mid_task_is_lost_and_down_still_ends_the_job(slurm):
    st = up_slurm("-N", "2")
    job = st["slurm"]["job_id"]
    victim = st["slurm"]["nodes"][1]
    p = subprocess.Popen([STARLING, "exec", "--host", victim, "--", "sh", "-c", "echo started; sleep 120"], cwd=WORK,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"started\n"
        # The node dies: everything in its namespace (slurmd, slurmstepd, the agent, the task).
        ns = f"stslurm-{victim}"
        for _ in range(5):
            pids = sh("ip", "netns", "pids", ns).stdout.split()
            if not pids:
                break
            sh("kill", "-9", *pids, check=False)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 255, err
    assert victim.encode() in err and b"lost" in err, err
    alive = wait_for(lambda: [h["name"] for h in status()["hosts"]] if len(status()["hosts"]) == 1 else None,
                     "the head to drop the lost node", timeout=60)
    assert alive == [n for n in st["slurm"]["nodes"] if n != victim]
    # The survivor still runs tasks.
    r = starling("exec", "--", "uname", "-n", cwd=WORK)
    assert r.stdout.strip() == alive[0]
    down_leaves_nothing(job)
    # The script brings the dead node back (a fresh cluster) and down removes it all.
    local_up()


SLURM_USER = "starling-su"


def test_an_ordinary_user_starts_their_own_slurm_cluster(slurm):
    """`up --slurm` run by a non-root user (as on a login node): the head and agents run as that user (the
    agents without root, in user namespaces), the cluster's files live in the user's own directories, the
    user's commands find it, root's commands do not see it, files come home owned by the user, and the
    user's `down` cancels the job."""
    starling("down", check=False)
    with local_account(SLURM_USER) as (pw, home), device_granted(SLURM_USER):
        state = pathlib.Path(home) / "state"

        def user(*argv, timeout=240):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LC_ALL": "C", "SLURM_CONF": CONF,
                   "XDG_STATE_HOME": str(state)}
            if "STARLING_INSTANCE" in os.environ:
                env["STARLING_INSTANCE"] = os.environ["STARLING_INSTANCE"]
            return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", STARLING, *argv],
                                  cwd=home, env=env, capture_output=True, text=True, timeout=timeout)

        r = user("up", "--slurm", "-N", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        job = None
        try:
            n = os.environ.get("STARLING_INSTANCE", "").strip()
            mine = state / ("starling" + (f"-{n}" if n and n != "0" else ""))
            assert (mine / "slurm").is_dir(), f"the user's state dir {mine} was not used"
            st = json.loads(user("status", "--json").stdout)
            job = st["slurm"]["job_id"]
            assert len(st["hosts"]) == 2, st
            # The job is the user's, in Slurm's own books.
            owner = sh("squeue", "-h", "-j", job, "-o", "%u").stdout.strip()
            assert owner == SLURM_USER, owner
            # Root has no cluster of this instance running: the user's is theirs alone.
            r_root = subprocess.run([STARLING, "status"], capture_output=True, text=True, timeout=30)
            assert r_root.returncode != 0 and "starling up" in r_root.stderr, (r_root.stdout, r_root.stderr)
            # Tasks run on Slurm's nodes; what they write comes home owned by the user.
            r = user("run", "-n", "4", "--quiet", "--", "sh", "-c", "uname -n > out.$STARLING_TASK")
            assert r.returncode == 0, r.stdout + r.stderr
            nodes = set(st["slurm"]["nodes"])
            for i in range(4):
                f = pathlib.Path(home) / f"out.{i}"
                assert f.read_text().strip() in nodes, f.read_text()
                assert f.stat().st_uid == pw.pw_uid, (f, f.stat().st_uid)
            # The head and agents run as the user.
            pids = [int(p) for p in sh("pgrep", "-u", str(pw.pw_uid), "-f", "starling (head|agent)", check=False).stdout.split()]
            assert pids, "no head or agent of the user's runs"
            assert not [p for p in sh("pgrep", "-u", "0", "-f", f"starling (head|agent).*{home}", check=False).stdout.split()]
        finally:
            r = user("down", "-v")
        assert r.returncode == 0 and f"cancelled Slurm job {job}" in r.stdout, r.stdout + r.stderr
        assert not [l for l in active_jobs() if l.split("|")[0] == job], active_jobs()
