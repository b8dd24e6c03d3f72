"""A fork ticket's own network on a mixed cluster (issue 12; docs/SECURITY.md, "A ticket's own network").

The session's embedded hosts can enforce a ticket's own network; a host `nc1` whose agent runs as root
without CAP_NET_ADMIN (as a unit with `CapabilityBoundingSet=~CAP_NET_ADMIN` would: `setpriv --bounding-set
-net_admin`) cannot, since its nftables rules are refused, and says so at its start. It joins the
session's cluster as any new host does, with a join token (`starling token create`, `starling agent
--join`), in this machine's network namespace (its address is the parent's). A rootless agent cannot
enforce it either (tests/test_rootless.py), but a move onto one failed in its restore when tried (the
restorer exited 125), so the host here is root.

The embedded hosts but the last are kept busy (`exec --host hN -- sleep`), so a ticket of as many clones
as the last host and nc1 have free cores needs both, and the hosts kept busy are outside it. Checked:

- `on` (the default): clones run on both granted hosts; the caller's stderr names nc1, once, and the
  C API's `sf_ticket_unisolated` lists exactly nc1 with its reason (tests/fork/mixednet.c); the clones
  on the enforcing host still cannot reach a listener on a host outside the ticket nor a chunk port,
  while they reach their own host; nc1's clones, with their host's whole network, reach that listener;
- `required`: the same ticket is refused naming nc1;
- `starling migrate` of an isolated ticket's clone (tests/fork/movednet.c): `--to auto` does not pick nc1
  (refused while nc1 is the only other host with a free core); `--to nc1` is refused naming nc1 when the
  ticket requires its network, and under `on` moves it and tells the caller it runs with nc1's whole
  network there;
- a clone launched on nc1 (the free embedded host kept busy too) reaches a listener outside its ticket;
  moved to the free host it gets its ticket's network there (`MigrateIn::network`), and that listener
  refuses it.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from conftest import STARLING, require_root, require_tool, sh, status, terminate, up, wait_for
from test_migrate import migrate, ps
from test_security import LISTENER, build_fork_program, clone_ready, in_hosts, run_dir

BASE = pathlib.Path(f"/var/tmp/starling-tests{os.environ.get('STARLING_INSTANCE', '')}/mixed")
PORT = 17396


def hosts_now():
    return {h["name"]: h for h in status()["hosts"]}


@pytest.fixture(scope="module")
def mixed(session_cluster):
    """The session's 4 embedded hosts plus nc1 (root without CAP_NET_ADMIN, enrolled with a join token);
    the embedded hosts but the last kept busy by sleeping exec tasks, and a listener on each."""
    require_root("an agent as root, namespaces")
    require_tool("nft", "nftables")
    require_tool("setpriv", "util-linux")
    if len(status()["hosts"]) != 4:
        up(4)
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(parents=True, mode=0o700)
    token = sh(STARLING, "token", "create").stdout.strip()
    head = json.loads((run_dir() / "cluster.json").read_text())["head_addr"]
    log = open(BASE / "nc1.log", "wb")
    # What a unit with CapabilityBoundingSet=~CAP_NET_ADMIN runs: root, every capability but that one.
    agent = subprocess.Popen(
        ["setpriv", "--bounding-set", "-net_admin", "env", "STARLING_LOG=info", STARLING, "agent", "--name", "nc1",
         "--join", head, "--token", token, "--auth", str(BASE / "creds"), "--state", str(BASE / "state"), "--cache-mib", "256"],
        stdout=log, stderr=subprocess.STDOUT)
    fillers, listeners = [], []
    try:
        wait_for(lambda: "nc1" in hosts_now() or agent.poll() is not None, "nc1 to enrol and register", timeout=120)
        assert agent.poll() is None, (BASE / "nc1.log").read_text(errors="replace")
        hosts = hosts_now()
        embedded = sorted((n for n in hosts if n != "nc1"), key=lambda n: int(n[1:]))
        free = embedded[-1]
        for name in embedded[:-1]:
            for _ in range(hosts[name]["cores"]):
                fillers.append(subprocess.Popen([STARLING, "exec", "--host", name, "--", "sleep", "3600"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/var/tmp"))
        want = sum(hosts[n]["cores"] for n in embedded[:-1])
        wait_for(lambda: sum(1 for r in ps() if r["command"] == "sleep 3600") == want, f"{want} sleeping tasks", timeout=180)
        listeners = in_hosts({n: hosts[n] for n in embedded}, LISTENER, lambda h: PORT)
        yield {"hosts": hosts, "free": free, "busy": embedded[:-1]}
    finally:
        for p in fillers + listeners:
            p.kill()
            p.wait()
        terminate(agent)
        shutil.rmtree(BASE, ignore_errors=True)


def env_with(isolate):
    env = {k: v for k, v in os.environ.items() if k not in ("STARLING_FORK_BACKEND", "STARLING_FORK_ISOLATE_NETWORK")}
    if isolate:
        env["STARLING_FORK_ISOLATE_NETWORK"] = isolate
    return env


def run_mixednet(workdir, n, targets, isolate=None):
    exe = build_fork_program("mixednet", workdir)
    return subprocess.run([str(exe), str(n), *targets], capture_output=True, text=True, timeout=600, env=env_with(isolate), cwd="/var/tmp")


def test_an_isolated_ticket_runs_on_every_granted_host_and_names_the_one_that_cannot_enforce(mixed, workdir):
    hosts, free = mixed["hosts"], mixed["free"]
    nc1 = hosts["nc1"]
    assert nc1["isolates_network"] is False and nc1["cannot_isolate"], nc1
    assert all(hosts[n]["isolates_network"] for n in hosts if n != "nc1"), hosts
    n = hosts[free]["cores"] + nc1["cores"]
    outside = hosts[mixed["busy"][0]]
    targets = [f"{outside['address']}:{PORT}", outside["peer"], f"{hosts[free]['address']}:{PORT}"]
    r = run_mixednet(workdir, n, targets)  # the default: on
    out = r.stdout + r.stderr
    assert r.returncode == 0 and all(f"STATUS {i} 0" in r.stdout for i in range(1, n + 1)), out

    # Named to the caller: one stderr line, and the C API lists nc1 with its reason, nothing else.
    notices = [line for line in r.stderr.splitlines() if "run with their host's whole network" in line]
    assert len(notices) == 1 and "clones on nc1 (" in notices[0] and free not in notices[0], r.stderr
    lines = r.stdout.splitlines()
    assert "UNISOLATED COUNT 1" in lines, out
    assert f"UNISOLATED 0 nc1\t{nc1['cannot_isolate']}" in lines, out
    assert "API null=-1 range=untouched cut=nc" in lines, out

    # Clones ran on both granted hosts: the free embedded one and nc1.
    selves = {line.split()[1]: line.split()[2] for line in lines if line.startswith("SELF ")}
    assert len(selves) == n and set(selves.values()) == {hosts[free]["address"], nc1["address"]}, out
    reach = {(line.split()[1], line.split()[2]): line.split()[3] for line in lines if line.startswith("REACH ")}
    for cid, addr in selves.items():
        got = {t: reach[(cid, t)] for t in targets}
        if addr == hosts[free]["address"]:
            # Fenced: a host outside the ticket and a chunk port refused, its own host reached.
            assert got[targets[0]] != "ok" and got[targets[1]] != "ok" and got[targets[2]] == "ok", f"clone {cid} on {free}: {got}"
        else:
            # nc1 cannot fence its clones: the host outside the ticket answers them (what the notice says).
            assert got[targets[0]] == "ok", f"clone {cid} on nc1: {got}"


def test_a_ticket_requiring_its_own_network_is_refused_naming_the_host_that_cannot(mixed, workdir):
    hosts, free = mixed["hosts"], mixed["free"]
    n = hosts[free]["cores"] + hosts["nc1"]["cores"]
    r = run_mixednet(workdir, n, [], isolate="required")
    assert r.returncode == 2 and r.stdout.startswith("TICKET "), r.stdout + r.stderr
    assert "`required`" in r.stdout and "nc1 (" in r.stdout and f"{free} (" not in r.stdout, r.stdout


class OneClone:
    """tests/fork/movednet.c: a one-clone ticket whose clone tries `targets` (`before`: {target: result}), waits
    for "go", tries them again (finish's {target: result}) and exits 0."""

    def __init__(self, workdir, isolate, targets=()):
        exe = build_fork_program("movednet", workdir)
        self.p = subprocess.Popen([str(exe), *targets], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env_with(isolate), cwd="/var/tmp")
        self.before = clone_ready(self.p)
        self.row = wait_for(lambda: next((r for r in ps() if "starling-clone" in r["command"]), None), "the clone in ps")

    def finish(self):
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        out, err = self.p.communicate(timeout=600)
        assert self.p.returncode == 0 and "STATUS 1 0" in out, out + err
        return dict(line.split()[1:3] for line in out.splitlines() if line.startswith("REACH "))

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.mark.parametrize("isolate", ["on", "required"])
def test_migrate_auto_never_picks_a_host_that_cannot_enforce_the_clones_network(mixed, workdir, isolate):
    """nc1 is the only other host with a free core: a move by the head's choice is refused, not made there."""
    c = OneClone(workdir, isolate)
    try:
        assert c.row["host"] == mixed["free"], c.row
        r = migrate(c.row["task"], "auto", check=False)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "no other host that can enforce its ticket's own network has a free core" in r.stderr, r.stderr
        assert next(x for x in ps() if x["task"] == c.row["task"])["host"] == mixed["free"]
        c.finish()
    finally:
        c.kill()


def test_migrate_to_a_host_that_cannot_enforce_is_refused_when_the_ticket_requires_it(mixed, workdir):
    c = OneClone(workdir, "required")
    try:
        r = migrate(c.row["task"], "nc1", check=False)
        assert r.returncode == 1, r.stdout + r.stderr
        assert re.search(r"requires its own network .* host nc1 cannot enforce one \(.+\)", r.stderr), r.stderr
        assert next(x for x in ps() if x["task"] == c.row["task"])["host"] == mixed["free"]
        c.finish()
    finally:
        c.kill()


def test_migrate_to_a_host_that_cannot_enforce_moves_an_on_tickets_clone_and_says_so(mixed, workdir):
    c = OneClone(workdir, "on")
    try:
        r = migrate(c.row["task"], "nc1", check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["to"] == "nc1" and report["unisolated"] == mixed["hosts"]["nc1"]["cannot_isolate"], report
        notices = [line for line in r.stderr.splitlines() if "whole network" in line]
        assert len(notices) == 1 and f"task t{c.row['task']} runs on nc1" in notices[0], r.stderr
        c.finish()
    finally:
        c.kill()


def test_a_clone_launched_unisolated_gets_its_tickets_network_when_moved_to_a_host_that_enforces_it(mixed, workdir):
    """The free embedded host kept busy too, a one-clone `on` ticket runs its clone on nc1, with nc1's whole
    network: it reaches a listener on a host outside the ticket. Moved to the free host (which can enforce
    the ticket's network), it joins the ticket's network there: the same listener refuses it, its new host's
    still answers, the move's report does not call it un-isolated, and it still reaches its parent."""
    hosts, free = mixed["hosts"], mixed["free"]
    outside, own = f"{hosts[mixed['busy'][0]]['address']}:{PORT}", f"{hosts[free]['address']}:{PORT}"
    cores = hosts[free]["cores"]
    fillers = [subprocess.Popen([STARLING, "exec", "--host", free, "--", "sleep", "3601"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/var/tmp") for _ in range(cores)]
    c = None
    try:
        busy_free = lambda: sum(1 for r in ps() if r["command"] == "sleep 3601" and r["host"] == free)  # noqa: E731
        wait_for(lambda: busy_free() == cores, f"{cores} sleeping tasks on {free}", timeout=180)
        c = OneClone(workdir, "on", [outside, own])
        assert c.row["host"] == "nc1", c.row
        assert c.before == {outside: "ok", own: "ok"}, c.before
        for f in fillers:
            terminate(f)  # (the client passes SIGTERM on to its task, which ends)
        wait_for(lambda: busy_free() == 0, f"{free}'s sleeping tasks to end", timeout=180)
        r = migrate(c.row["task"], free, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["to"] == free and not report.get("unisolated"), report
        assert "whole network" not in r.stderr, r.stderr
        after = c.finish()
        assert after[outside] != "ok" and after[own] == "ok", after
    finally:
        if c:
            c.kill()
        for f in fillers:
            f.kill()
            f.wait()
