"""Encrypted fork and migration traffic (`fork.encrypt`, docs/SECURITY.md section 4) on a real
embedded cluster, seen by a sniffer on its network.

A program holds 4 MiB of a known 64-byte pattern (tests/crypt/pattern.c: computed, not in its
binary). The sniffer is a raw packet socket (AF_PACKET) on the cluster's bridge and on every host's
veth port, so it sees what a tap on the cluster's switch would: the parent's page server and
multicast sender (root namespace ↔ hosts) and host-to-host migration streams.

* Remote fork: with `fork.encrypt` off at both ends (the agents started with it off, the parent
  run with it off) the pattern crosses in clear, by multicast and over TCP; with the parent's on it
  never does, while the sniffer saw at least the 4 MiB the clones had to fetch, and every clone
  read the pattern intact.
* Migration (`starling migrate`): agents off → the pattern crosses in clear; agents on (the
  default) → it never does, and the moved program still holds it intact.

Tampered ciphertext is refused in the unit tests (crates/fork/src/stream.rs, crates/fork/tests/
stages.rs: a relay flipping one bit of a page-server reply; crates/mcdist/tests/seal.rs).
Needs root and cc; takes about a minute (two `starling up`s of 2 hosts).
"""
import json
import os
import pathlib
import select
import socket
import subprocess
import threading

import pytest

from conftest import ROOT, SCRATCH, STARLING, down, require, require_root, require_tool, sh, status, wait_for

INSTANCE = os.environ.get("STARLING_INSTANCE", "").strip() or "0"
BRIDGE = f"stbr{INSTANCE}"
BIN = SCRATCH / "crypt-bin"
LIB = ROOT / "target/release/libstarling.a"
# One 64-byte unit of the program's pattern (tests/crypt/pattern.c `unit`).
UNIT = bytes(((j * 37 + 11) ^ 0x5A) & 0xFF for j in range(64))
PATTERN_BYTES = 4 << 20
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33


def env(**extra):
    e = dict(os.environ)
    e.pop("STARLING_FORK_BACKEND", None)
    e.pop("STARLING_CLUSTER", None)
    e.update(extra)
    return e


def up(agents_encrypt):
    """A 2-host cluster whose agents run with `fork.encrypt` = `agents_encrypt` (they take their
    configuration from `starling up`'s environment)."""
    subprocess.run([STARLING, "down"], capture_output=True, env=env(), timeout=120)
    r = subprocess.run([STARLING, "up", "--hosts", "2"], capture_output=True, text=True, timeout=180,
                       env=env(STARLING_FORK_ENCRYPT=agents_encrypt))
    assert r.returncode == 0, f"starling up failed:\n{r.stdout}\n{r.stderr}"
    return status()


class Sniffer:
    """Every frame on the cluster's bridge and its ports from start to `stop`: whether one held a
    unit of the pattern, and how many bytes went by."""

    def __init__(self):
        ports = sh("ip", "-o", "link", "show", "master", BRIDGE).stdout
        names = [BRIDGE] + [l.split(":")[1].strip().split("@")[0] for l in ports.splitlines() if l.strip()]
        assert len(names) >= 3, f"bridge {BRIDGE} and its host ports: {names}"
        self.socks = []
        for name in names:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
            s.bind((name, 0))
            s.setblocking(False)
            self.socks.append(s)
        self.seen = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _drain(self, s):
        while True:
            try:
                frame = s.recv(1 << 17)
            except BlockingIOError:
                return
            self.bytes += len(frame)
            if UNIT in frame:
                self.seen += 1

    def _run(self):
        while not self._stop.is_set():
            ready, _, _ = select.select(self.socks, [], [], 0.2)
            for s in ready:
                self._drain(s)

    def stop(self):
        """Stop and read what the sockets still hold (everything sent before this call)."""
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            self._drain(s)
            s.close()
        return self


@pytest.fixture(scope="module")
def pattern():
    require_root("an embedded cluster and a raw packet socket")
    require_tool("cc", "gcc")
    require(LIB.exists(), f"{LIB} missing: cargo build --release --workspace")
    BIN.mkdir(parents=True, exist_ok=True)
    out = BIN / "pattern"
    sh("cc", "-O1", "-I", str(ROOT / "include"), str(ROOT / "tests/crypt/pattern.c"), str(LIB),
       "-lpthread", "-ldl", "-lm", "-o", str(out))
    yield str(out)
    down()


def fork_sniffed(prog, **extra):
    sniffer = Sniffer()
    r = subprocess.run([prog, "fork", "2"], capture_output=True, text=True, timeout=300, env=env(**extra),
                       cwd="/var/tmp")
    sniffer.stop()
    assert r.returncode == 0 and "clones ok" in r.stdout, f"{extra}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    return sniffer


def test_fork_pages_cross_encrypted_unless_both_ends_turn_it_off(pattern):
    st = up("off")
    assert len(st["hosts"]) == 2
    for mcdist in ["on", "off"]:
        clear = fork_sniffed(pattern, STARLING_FORK_ENCRYPT="off", STARLING_MCDIST=mcdist)
        assert clear.seen > 0, f"mcdist {mcdist}, encryption off: the pattern never crossed in clear " \
                               f"({clear.bytes} bytes sniffed): the sniffer does not see the pages"
        sealed = fork_sniffed(pattern, STARLING_FORK_ENCRYPT="on", STARLING_MCDIST=mcdist)
        assert sealed.bytes >= PATTERN_BYTES, f"mcdist {mcdist}: only {sealed.bytes} bytes sniffed"
        assert sealed.seen == 0, f"mcdist {mcdist}, encryption on: {sealed.seen} frames held the pattern in clear"


def migrate_sniffed(prog):
    hosts = sorted(h["name"] for h in status()["hosts"])
    task = subprocess.Popen([STARLING, "exec", "--host", hosts[0], "--", prog, "hold"], cwd="/var/tmp", env=env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert task.stdout.readline() == "ready\n", task.stderr.read()
        rows = lambda: json.loads(sh(STARLING, "ps", "--json", env=env()).stdout)
        tid = wait_for(lambda: next((r["task"] for r in rows() if prog in r["command"]), None), "the task in ps")
        sniffer = Sniffer()
        r = sh(STARLING, "migrate", str(tid), "--to", hosts[1], "--json", check=False, env=env(), timeout=300)
        # The target drains the rest of the memory after the move: the program reads all of it first.
        out, err = task.communicate("go\n", timeout=300)
        sniffer.stop()
        assert r.returncode == 0, f"migrate failed:\n{r.stdout}\n{r.stderr}"
        assert task.returncode == 0 and out == "held ok\n", f"{task.returncode}: {out}\n{err}"
        return sniffer
    finally:
        if task.poll() is None:
            task.kill()


def test_migration_stream_is_encrypted_unless_the_agents_turn_it_off(pattern):
    up("off")
    clear = migrate_sniffed(pattern)
    assert clear.seen > 0, f"agents without encryption: the pattern never crossed in clear ({clear.bytes} bytes sniffed)"
    up("on")
    sealed = migrate_sniffed(pattern)
    assert sealed.bytes >= PATTERN_BYTES, f"only {sealed.bytes} bytes sniffed"
    assert sealed.seen == 0, f"agents with encryption: {sealed.seen} frames held the pattern in clear"
