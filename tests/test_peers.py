"""Hosts fetch a file's chunks from each other (issue 17 part 2): the head sends each chunk about
once however many hosts read it, a peer's chunk whose bytes do not match its name is refused as
the head's would be, a peer that hangs (SIGSTOP) costs a reader a short stall, not its read, and a
peer that dies mid-transfer costs the others only a fetch from the head.

The head's egress is the kernel's count of bytes the head's network namespace sent into the
cluster's bridge (`/sys/class/net/stbrN/statistics/tx_bytes`: what leaves the root namespace for
the hosts; traffic between hosts is forwarded by the bridge and not counted there), never a
figure starling reports. What the head sent after a peer stopped or died is its relay's count of
chunk bytes sent to hosts (`/metrics`), which the hosts do not report. A transfer from a peer is
under way when the peer's kernel holds bytes of it unacknowledged (`ss` Send-Q > 0 on the peer
port): an idle connection left by an earlier read (connections between hosts are kept) is not one.
Expected digests are computed here with hashlib."""
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import urllib.request

import pytest

from conftest import STARLING, sh, status, up, wait_for
from test_data import read_everywhere

MIB = 1 << 20


def instance():
    return os.environ.get("STARLING_INSTANCE", "0")


def bridge_tx():
    """Bytes the head's side (the root namespace) has sent into the cluster's bridge."""
    return int(pathlib.Path(f"/sys/class/net/stbr{instance()}/statistics/tx_bytes").read_text())


def run_dir():
    i = instance()
    return pathlib.Path("/run/starling" if i == "0" else f"/run/starling-{i}")


def host_log(name):
    return (run_dir() / "logs" / f"{name}.log").read_text(errors="replace")


def new_file(d, name, size):
    data = os.urandom(size)
    p = d / name
    p.write_bytes(data)
    return p, hashlib.md5(data).hexdigest()


def exec_on(host, path, cwd):
    return subprocess.Popen([STARLING, "exec", "--host", host, "--", "md5sum", str(path)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p, host, want):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, f"{host}: exit {p.returncode}: {err[-3000:]}"
    got = out.split()[0] if out.split() else ""
    assert got == want, f"{host} read md5 {got}, the file's is {want}"


def test_a_file_read_on_every_host_leaves_the_head_about_once(cluster, workdir):
    size = 48 * MIB + 4321
    path, want = new_file(workdir, "shared.bin", size)
    hosts = len(cluster["hosts"])
    before = bridge_tx()
    seen, names = read_everywhere(path, workdir)
    egress = bridge_tx() - before
    assert {h for h, _ in seen.values()} == names, "a task on every host"
    wrong = {t: hd for t, hd in seen.items() if hd[1] != want}
    assert not wrong, f"expected md5 {want} everywhere; these tasks saw otherwise: {wrong}"
    # Without sharing the head sends the file to every host (hosts x size); with it, once,
    # plus what a host had to fetch again from the head, and the tasks' own traffic.
    print(f"head egress {egress} B for a {size} B file read on {hosts} hosts ({egress / size:.2f} x)")
    assert egress < 1.5 * size, f"the head sent {egress / size:.2f} x the file's size to {hosts} hosts"


def test_a_chunk_that_does_not_match_its_name_is_refused_from_a_peer(cluster, workdir):
    size = 8 * MIB + 99
    path, want = new_file(workdir, "lie.bin", size)
    finish(exec_on("h1", path, workdir), "h1", want)
    # h1's assembled copy of the file (what it serves its peers from), damaged in its first chunk.
    state = pathlib.Path(json.loads((run_dir() / "cluster.json").read_text())["state_dir"])
    files = [f for f in (state / "hosts/h1/state/cache/files").glob("*/*") if f.stat().st_size == size]
    assert files, f"no assembled file of {size} bytes in h1's cache"
    copy = max(files, key=lambda f: f.stat().st_mtime)
    with open(copy, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    before = host_log("h2")
    finish(exec_on("h2", path, workdir), "h2", want)
    said = host_log("h2")[len(before):]
    assert "chunk from peer" in said and "rejected" in said, "h2 did not refuse h1's damaged chunk:\n" + said[-3000:]


def host_ns(host):
    """The network namespace of emulated host `host` on this run's cluster."""
    return f"starling{instance()}-{host}" if instance() != "0" else f"starling-{host}"


def host_of(name):
    return next(h for h in status()["hosts"] if h["name"] == name)


def peer_port(host):
    return int(host["peer"].rsplit(":", 1)[1])


def sending_peer_connections(host, port):
    """Connections to `host`'s peer port with bytes in `host`'s send queue (sent or queued, not yet
    acknowledged by the reader): a transfer from `host` under way. Idle connections have none."""
    out = sh("ip", "netns", "exec", host_ns(host), "ss", "-Htn", "state", "established", f"( sport = :{port} )").stdout
    # With a state filter ss prints: Recv-Q Send-Q Local:Port Peer:Port.
    return [line for line in out.splitlines() if len(line.split()) >= 4 and int(line.split()[1]) > 0]


def peer_connections_from(host, port, other):
    """Established connections from host `other` to `host`'s peer port."""
    ip = host_of(other)["address"]
    out = sh("ip", "netns", "exec", host_ns(host), "ss", "-Htn", "state", "established", f"( sport = :{port} )").stdout
    return [line for line in out.splitlines() if len(line.split()) >= 4 and line.split()[3].rsplit(":", 1)[0] == ip]


def head_chunk_bytes_to_hosts():
    """The head relay's count of chunk bytes sent to hosts, from its Prometheus endpoint."""
    with urllib.request.urlopen(status()["network"]["metrics"], timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^starling_relay_bytes_total\{direction="to_hosts"\} (\S+)$', text, re.M)
    assert m, "the head's /metrics has no starling_relay_bytes_total{direction=\"to_hosts\"}"
    return int(float(m.group(1)))


def warm(hosts, workdir):
    """Run md5sum once on each of `hosts`, so that what they fetch later is the test's file only."""
    small, want = new_file(workdir, "warm.bin", 4321)
    for h, p in [(h, exec_on(h, small, workdir)) for h in hosts]:
        finish(p, h, want)


def test_a_peer_that_dies_mid_transfer_costs_the_others_a_fetch_from_the_head(cluster, workdir):
    readers = ("h2", "h3", "h4")
    warm(readers, workdir)
    size = 64 * MIB + 17
    path, want = new_file(workdir, "dies.bin", size)
    # h1 reads it first: every chunk's holder is h1, so h2..h4 are referred to it.
    finish(exec_on("h1", path, workdir), "h1", want)
    h1 = host_of("h1")
    port = peer_port(h1)
    # h1 sends slowly (a token bucket on its side of its veth: 40 Mbit/s, so serving 3 x 64 MiB
    # takes half a minute or more), so the transfers are still under way when they are seen below.
    ns = host_ns("h1")
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
       "rate", "40mbit", "burst", "64kb", "latency", "2s")
    try:
        idle = sh("ip", "netns", "exec", ns, "ss", "-Htn", "state", "established", f"( sport = :{port} )").stdout.splitlines()
        print(f"connections to h1's peer port before the readers start (idle, kept from earlier reads): {len(idle)}")
        procs = {h: exec_on(h, path, workdir) for h in readers}
        # Kill h1's agent while it is sending chunks to a reader (an event, not a time).
        wait_for(lambda: sending_peer_connections("h1", port), "h1 sending chunks to a reader", timeout=300, interval=0.02)
        at_kill = head_chunk_bytes_to_hosts()
        os.kill(h1["pid"], signal.SIGKILL)
        for h, p in procs.items():
            finish(p, h, want)
    finally:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    after_kill = head_chunk_bytes_to_hosts() - at_kill
    print(f"the head sent {after_kill} B of chunks after h1 died ({after_kill / size:.2f} x the file)")
    assert after_kill > 0, "the head sent no chunk after h1 died: the readers had the whole file before the kill"


def assembled_copies(host, size):
    """`host`'s assembled copies of a file of `size` bytes in its cache (what it serves peers from)."""
    state = pathlib.Path(json.loads((run_dir() / "cluster.json").read_text())["state_dir"])
    return [f for f in (state / f"hosts/{host}/state/cache/files").glob("*/*") if f.stat().st_size == size]


def test_hosts_that_lost_a_file_and_read_it_again_at_once_do_not_wait_on_each_other(cluster, workdir):
    """h1 read a file from the head, h2 from h1; both lose it (their caches wiped) and read it again,
    h2 while h1 is still fetching it. Neither may be referred to a host that is itself fetching the
    chunks from it: h1 (the first to have read it) gets it from the head, h2 from h1, and nobody
    falls back to the head for chunks a peer did not have (nor waits on the other for good)."""
    up(4)
    warm(["h1", "h2"], workdir)
    size = 24 * MIB + 11
    path, want = new_file(workdir, "lost.bin", size)
    for h in ("h1", "h2"):
        finish(exec_on(h, path, workdir), h, want)
    # A host serves peers also from the last 16 files it assembled, deleted or not (their
    # descriptors are kept: crates/store/src/located.rs): 20 newer files make it forget this one.
    others = [new_file(workdir, f"other{i}.bin", 64 * 1024 + i)[0] for i in range(20)]
    for h in ("h1", "h2"):
        p = subprocess.run([STARLING, "exec", "--host", h, "--", "md5sum"] + [str(o) for o in others],
                           cwd=workdir, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
    for h in ("h1", "h2"):
        copies = assembled_copies(h, size)
        assert copies, f"no assembled copy of the file in {h}'s cache"
        for c in copies:
            c.unlink()
    logs = {h: len(host_log(h)) for h in ("h1", "h2")}
    before = head_chunk_bytes_to_hosts()
    p1 = exec_on("h1", path, workdir)
    # h1 is fetching the file (the head has started sending chunks; every other file h1 needs
    # is in its cache) when h2 starts reading it.
    wait_for(lambda: head_chunk_bytes_to_hosts() > before or p1.poll() is not None, "h1 fetching the file", timeout=300, interval=0.01)
    p2 = exec_on("h2", path, workdir)
    finish(p1, "h1", want)
    finish(p2, "h2", want)
    sent = head_chunk_bytes_to_hosts() - before
    print(f"the head sent {sent} B of chunks for a {size} B file two hosts read again ({sent / size:.2f} x)")
    for h, at in logs.items():
        said = host_log(h)[at:]
        assert "not had from peers" not in said, f"{h} was referred to a peer without the chunks:\n" + said[-3000:]
    assert sent < 1.5 * size, f"the head sent {sent / size:.2f} x the file: h2 did not get it from h1"


@pytest.mark.parametrize("connected", [False, True], ids=["new-connection", "open-connection"])
def test_a_stopped_peer_costs_a_reader_a_stall_not_its_read(cluster, workdir, connected):
    # A cluster of its own: connections between hosts are kept, and a host that dropped a stalled
    # peer does not dial it again for a minute, so earlier reads (and the other variant) would
    # decide which path this takes.
    up(4)
    warm(["h2"], workdir)
    size = 8 * MIB + 5
    path, want = new_file(workdir, "hung.bin", size)
    # h1 reads it first: h2 is then referred to h1 for every chunk.
    finish(exec_on("h1", path, workdir), "h1", want)
    if connected:
        # h2 fetches another file from h1 first, so it holds an open connection to h1 (kept
        # between reads) when h1 stops: the stall is then in an answer, not in the greeting.
        other, other_md5 = new_file(workdir, "first.bin", 1 * MIB + 3)
        finish(exec_on("h1", other, workdir), "h1", other_md5)
        finish(exec_on("h2", other, workdir), "h2", other_md5)
        assert peer_connections_from("h1", peer_port(host_of("h1")), "h2"), "h2 kept no connection to h1"
    h1 = host_of("h1")
    before_log = host_log("h2")
    os.kill(h1["pid"], signal.SIGSTOP)
    try:
        before = head_chunk_bytes_to_hosts()
        # h1 accepts connections (its kernel does) but answers nothing: h2 must drop it after
        # agent.peer_stall_s without a byte and read the file from the head, in one piece.
        finish(exec_on("h2", path, workdir), "h2", want)
        sent = head_chunk_bytes_to_hosts() - before
    finally:
        os.kill(h1["pid"], signal.SIGCONT)
    said = host_log("h2")[len(before_log):]
    assert sent >= size, f"the head sent {sent} B of chunks while h1 was stopped; h2 needed all {size} B from it"
    why = "nothing received for" if connected else "no answer to the connection's greeting"
    assert why in said, f"h2 did not drop the stopped peer ({why!r}):\n" + said[-3000:]
