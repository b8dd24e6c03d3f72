"""Faults and bad input: lost hosts, kill -9, no cluster, protocol garbage."""
import json
import os
import pathlib
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import SCRATCH, STARLING, down, recv_until_closed, sh, starling, status, up


# The instance these tests run on (STARLING_INSTANCE, as `starling` itself reads it): its names
# (crates/cluster LocalCluster::new), so that the tests never judge nor touch another instance.
INSTANCE = int(os.environ.get("STARLING_INSTANCE", "").strip() or "0")
SUFFIX = "" if INSTANCE == 0 else f"-{INSTANCE}"
RUN_DIR = f"/run/starling{SUFFIX}"
STATE_DIR = f"/var/lib/starling{SUFFIX}"
NETNS_PREFIX = "starling-" if INSTANCE == 0 else f"starling{INSTANCE}-"
BRIDGE = f"stbr{INSTANCE}"
SUBNET = f"10.213.{INSTANCE}.".encode()


def leftovers():
    """Everything `starling down` of this instance must remove, as a dict of non-empty findings
    (other instances are not ours to judge)."""
    found = {}
    netns = sh("ip", "netns", "list", check=False).stdout
    ns = [l.split()[0] for l in netns.splitlines() if l.startswith(NETNS_PREFIX)]
    if ns:
        found["netns"] = ns
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        found["bridge"] = BRIDGE
    mounts = [l for l in open("/proc/self/mountinfo") if f"{STATE_DIR}/" in l or f"{RUN_DIR}/" in l]
    if mounts:
        found["mounts"] = mounts
    procs = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # Agents of every instance use /var/lib/starling/state inside their own root, so
        # tell this instance's processes by its subnet or its head's state dir.
        ours = any(SUBNET in a or a.startswith(f"{STATE_DIR}/head".encode()) for a in cmd)
        if cmd and cmd[0].endswith(b"starling") and len(cmd) > 1 and cmd[1] in (b"agent", b"head", b"__host-boot", b"__sandbox-init", b"__link") and ours:
            procs.append((p.name, cmd[:2]))
    if procs:
        found["processes"] = procs
    return found


@pytest.fixture
def fresh_cluster():
    st = up(3)
    yield st
    # Leave a healthy 4-host cluster for whatever runs next.
    up(4)


def test_no_cluster_gives_one_clear_line():
    down()
    r = subprocess.run([STARLING, "exec", "--", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 255
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "starling up" in lines[0], r.stderr
    r = subprocess.run([STARLING, "status"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "starling up" in r.stderr
    up(4)


def test_host_lost_mid_task(fresh_cluster, tmp_path):
    work = SCRATCH / "lost"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "partial.txt"
    out.unlink(missing_ok=True)
    h2 = next(h for h in fresh_cluster["hosts"] if h["name"] == "h2")
    p = subprocess.Popen([STARLING, "exec", "--host", "h2", "--", "sh", "-c", "echo started; echo data > partial.txt; sleep 60"],
                         cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"started\n"
    os.kill(h2["pid"], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 255
    assert b"h2" in err and b"lost" in err, err
    assert not out.exists(), "no partial files on the client"
    assert not [p for p in work.iterdir() if ".starling-" in p.name]


def test_down_after_kill9_leaves_nothing(fresh_cluster):
    # Start a task so the host has live mounts, then kill -9 an agent and the head.
    p = subprocess.Popen([STARLING, "exec", "--host", "h1", "--", "sh", "-c", "echo started; exec sleep 600"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"started\n"
    st = status()
    h1 = next(h for h in st["hosts"] if h["name"] == "h1")
    os.kill(h1["pid"], signal.SIGKILL)
    state = json.load(open(f"{RUN_DIR}/cluster.json"))
    os.kill(state["head_pid"], signal.SIGKILL)
    p.wait(timeout=120)
    r = starling("down", check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    # Processes down killed may take a moment to be reaped: wait for that (bounded), then show what is left.
    deadline = time.monotonic() + 60
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == {}


def dial_head():
    """A raw connection to the head: its local socket (its TCP port speaks only TLS; test_auth checks that)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(f"{RUN_DIR}/head.sock")
    return s


def test_head_survives_garbage_and_wrong_version(fresh_cluster):
    # Garbage.
    s = dial_head()
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(60)  # the head closes at once; the deadline only bounds a hang
    try:
        recv_until_closed(s)
    except socket.timeout:
        pytest.fail("head kept a garbage connection open")
    s.close()
    # Another protocol version: told why, then closed.
    s = dial_head()
    s.sendall(b"STRL" + struct.pack("<HHI", 99, 0, 0))
    s.settimeout(60)
    reply = recv_until_closed(s)
    assert b"v99" in reply, reply
    # Truncated frame then close.
    s = dial_head()
    s.sendall(b"STRL" + struct.pack("<HHI", 2, 0, 1000) + b"abc")  # current version, truncated body
    s.close()
    # The head is unharmed.
    assert len(status()["hosts"]) == 3
    r = subprocess.run([STARLING, "exec", "--", "echo", "ok"], capture_output=True, timeout=60)
    assert r.stdout == b"ok\n"
