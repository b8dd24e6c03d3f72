"""Real-host mode (README "Running an agent on a real host") across network namespaces: the head
in this machine's namespace, the agent in its own (`ip netns`, joined by a veth pair), both started
with the commands the README gives, in both directions:

* `starling head --listen H:P` + `starling agent --head H:P --name node1`;
* `starling agent --listen A:Q --name node2` + `starling head --listen H:P2 --agent A:Q`.

Both run with the cluster's credentials (`starling head --init --auth DIR`, then `--auth DIR` on head
and agent): every connection is mutual TLS, in both dial directions, and the client holds the client
certificate (STARLING_AUTH); a client without it is refused with one line.
Each direction is used by a client (`--cluster` / STARLING_CLUSTER): `status` names the host and its
address, `exec` runs in the agent's namespace (the task sees the agent's address, not ours) and its
files come home, and a C program forks 2 clones onto it."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess

import pytest

from conftest import netns_with_veth, ROOT, STARLING, require_root, require_tool, sh, wait_for

NETNS = "st-realhost"
VETH = "st-rh0"
HEAD_IP, AGENT_IP = "10.216.0.1", "10.216.0.2"
BASE = pathlib.Path("/var/tmp/starling-tests/realhost")
AUTH = BASE / "auth"


def cleanup_net():
    sh("ip", "netns", "del", NETNS, check=False)
    sh("ip", "link", "del", VETH, check=False)


@pytest.fixture(scope="module")
def net():
    require_root("network namespaces and an agent")
    require_tool("ip", "iproute2")
    cleanup_net()
    netns_with_veth(NETNS, VETH, HEAD_IP, AGENT_IP)
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(parents=True)
    r = subprocess.run([STARLING, "head", "--init", "--auth", str(AUTH)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    yield
    cleanup_net()
    shutil.rmtree(BASE, ignore_errors=True)


class Daemons:
    """The head and agent processes a test started; all stopped (by pid) at the end."""

    def __init__(self):
        self.procs = []

    def start(self, name, argv):
        log = open(BASE / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, STARLING_LOG="info"))
        self.procs.append((name, p))
        return p

    def stop(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self):
        return "\n".join(f"--- {n}:\n" + (BASE / f"{n}.log").read_text(errors="replace")[-3000:] for n, _ in self.procs)


@pytest.fixture
def daemons(net):
    d = Daemons()
    yield d
    d.stop()


def in_netns(*argv):
    return ["ip", "netns", "exec", NETNS, *argv]


def client(cluster, *args, cwd=None, timeout=300, auth=True):
    env = dict(os.environ, STARLING_CLUSTER=cluster)
    if auth:
        env["STARLING_AUTH"] = str(AUTH)
    env.pop("STARLING_INSTANCE", None)
    env.pop("STARLING_FORK_BACKEND", None)
    return subprocess.run([STARLING, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def host_listed(cluster, name):
    r = client(cluster, "status", "--json")
    if r.returncode != 0:
        return None
    hosts = {h["name"]: h for h in json.loads(r.stdout)["hosts"]}
    return hosts.get(name)


def check_cluster(cluster, name, daemons, tag):
    host = wait_for(lambda: host_listed(cluster, name), f"{name} in `starling status` of {cluster}", timeout=120)
    assert host["address"] == AGENT_IP, host
    r = client(cluster, "exec", "--", "true", auth=False)
    assert r.returncode != 0 and "mutual-TLS" in r.stderr, r.stderr
    work = BASE / f"work-{tag}"
    work.mkdir()
    (work / "input.txt").write_text("from the client\n")
    r = client(cluster, "exec", "--", "sh", "-c",
               "ip -4 -o addr show; cat input.txt; echo made-remotely > output.txt", cwd=work)
    assert r.returncode == 0, r.stderr + daemons.logs()
    assert f"inet {AGENT_IP}/" in r.stdout and f"inet {HEAD_IP}/" not in r.stdout, r.stdout
    assert "from the client\n" in r.stdout
    assert (work / "output.txt").read_text() == "made-remotely\n"
    # Remote fork onto the real host: clones write files that come home.
    lib = ROOT / "target/release/libstarling.a"
    exe = BASE / "files_home"
    if not exe.exists():
        sh("cc", "-O1", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/files_home.c"), str(lib),
           "-lpthread", "-ldl", "-lm", "-o", str(exe))
    clones = work / "clones"
    clones.mkdir()
    # The agents here run under `ip netns exec`, which mounts a fresh sysfs: no cgroup mount is
    # left under /sys/fs/cgroup, so a ticket's network cannot be enforced and its clones would be
    # refused. The clones go with the whole network (the job's opt-out); the ticket network is
    # tested on the embedded cluster (test_security.py).
    env = dict(os.environ, STARLING_CLUSTER=cluster, STARLING_AUTH=str(AUTH), STARLING_FORK_ISOLATE_NETWORK="off")
    env.pop("STARLING_FORK_BACKEND", None)
    r = subprocess.run([str(exe), "2", str(clones)], capture_output=True, text=True, env=env, timeout=300, cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr + daemons.logs()
    assert "clones=2 missing_or_failed=0" in r.stdout, r.stdout
    assert sorted(p.name for p in clones.iterdir()) == ["result-1.txt", "result-2.txt"]
    assert (clones / "result-2.txt").read_text() == "clone 2 of 2\n"


def test_agent_dials_the_head(daemons):
    head = f"{HEAD_IP}:17271"
    daemons.start("head-a", [STARLING, "head", "--listen", head, "--auth", str(AUTH), "--state", str(BASE / "head-a")])
    daemons.start("agent-a", in_netns(STARLING, "agent", "--head", head, "--auth", str(AUTH), "--name", "node1",
                                      "--state", str(BASE / "agent-a"), "--cache-mib", "256"))
    check_cluster(head, "node1", daemons, "a")


def test_head_dials_the_agent(daemons):
    agent = f"{AGENT_IP}:17278"
    head = f"{HEAD_IP}:17272"
    daemons.start("agent-b", in_netns(STARLING, "agent", "--listen", f"0.0.0.0:17278", "--auth", str(AUTH), "--name", "node2",
                                      "--state", str(BASE / "agent-b"), "--cache-mib", "256"))
    # The agent must be listening before the head dials it (the head may not retry).
    wait_for(lambda: re.search(r":17278\b", sh("ip", "netns", "exec", NETNS, "ss", "-ltn", check=False).stdout),
             "the agent to listen", timeout=120)
    daemons.start("head-b", [STARLING, "head", "--listen", head, "--auth", str(AUTH), "--agent", agent,
                             "--state", str(BASE / "head-b")])
    check_cluster(head, "node2", daemons, "b")
