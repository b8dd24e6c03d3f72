"""Pages on the wire at the link's MTU (issue 16 part 3), on instance 6
(/run/starling-6, bridge stbr6, namespaces starling6-hN, veths stv6-hN).

* `starling up` puts the bridge, every host's veth end and its `eth0` at MTU
  9000, and the parent's multicast sender reads that MTU: every multicast
  page with data is one datagram (sender counters via sf_ticket_stat:
  SF_STAT_MC_DATA_PAGES / _DATAGRAMS / _MTU), and clones' memory is the
  parent's (bench/c/mcdist_work.c in `verify` mode, as tests/test_mcdist.py).
* `starling up --mtu 1500`: the links report 1500, the sender splits each
  page (more datagrams than pages), and remote fork still gives every clone
  the parent's memory.

Needs root and iproute2, and target/release built (`cargo build --release`).
"""
import json
import os
import pathlib
import re
import subprocess

import pytest

from conftest import CloneReport, build_with_shared_libstarling, cores_by_host, instance_env, require, require_root

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
INSTANCE = "6"
BRIDGE = f"stbr{INSTANCE}"
NETNS_PREFIX = f"starling{INSTANCE}-"
VETH_PREFIX = f"stv{INSTANCE}-"
BIN = pathlib.Path(f"/var/tmp/starling-tests/mcdist-mtu-{INSTANCE}")
HOSTS = 2
DATA_MIB = 16
MULTICAST = 1  # sf_clone_stat(t, id, 6): SF_DIST_MULTICAST


def env(**extra):
    return instance_env(INSTANCE, **extra)


def starling(*args, timeout=300):
    return subprocess.run([STARLING, *args], capture_output=True, text=True, timeout=timeout, env=env())


def link_mtu(*ip_args):
    out = subprocess.run(["ip", *ip_args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    m = re.search(r" mtu (\d+) ", out.stdout)
    assert m, out.stdout
    return int(m.group(1))


def cluster_links():
    """MTU of the bridge, each host's bridge-side veth end and each host's eth0, by name."""
    links = {BRIDGE: link_mtu("-o", "link", "show", "dev", BRIDGE)}
    for i in range(1, HOSTS + 1):
        links[f"{VETH_PREFIX}h{i}"] = link_mtu("-o", "link", "show", "dev", f"{VETH_PREFIX}h{i}")
        links[f"{NETNS_PREFIX}h{i}:eth0"] = link_mtu("-n", f"{NETNS_PREFIX}h{i}", "-o", "link", "show", "dev", "eth0")
    return links


@pytest.fixture(scope="module")
def work():
    require_root("an embedded cluster")
    require(pathlib.Path(STARLING).exists(), "build it: cargo build --release")
    yield build_with_shared_libstarling(ROOT / "bench/c/mcdist_work.c", BIN, "mcdist_work")
    starling("down")


def up(*extra):
    starling("down")
    r = starling("up", "--hosts", str(HOSTS), *extra)
    assert r.returncode == 0, f"starling up failed:\n{r.stdout}\n{r.stderr}"
    st = json.loads(starling("status", "--json").stdout)
    clones = min(4, sum(cores_by_host(st).values()))
    require(clones >= 2, f"multicast needs 2 clones; the cluster has {clones} cores")
    return clones


def run_verify(exe, n):
    """mcdist_work `verify` with n clones over multicast: every clone saw the parent's memory and ended well."""
    r = subprocess.run([exe, "verify", str(n), str(DATA_MIB), "1"], capture_output=True, text=True, timeout=600,
                       env=env(STARLING_MCDIST="on"), cwd="/var/tmp")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = CloneReport(r.stdout)
    assert sorted(rep.sums) == list(range(1, n + 1)), r.stdout[-2000:]
    rep.assert_memory_identical(DATA_MIB, range(1, n + 1))
    assert all(s["status"] == 0 for s in rep.stats.values()), rep.stats
    return rep.stats, rep.wire


def test_links_at_mtu_9000_carry_a_page_per_datagram(work):
    n = up()
    assert set(cluster_links().values()) == {9000}, cluster_links()
    stats, wire = run_verify(work, n)
    assert {s["mode"] for s in stats.values()} == {MULTICAST}, stats
    assert wire["mc_mtu"] == 9000, wire
    # 16 MiB of data read by every clone: thousands of data pages multicast, each in one datagram.
    assert wire["mc_data_pages"] > 1000, wire
    assert wire["mc_data_datagrams"] == wire["mc_data_pages"], wire


def test_mtu_1500_splits_pages_and_clones_stay_correct(work):
    n = up("--mtu", "1500")
    assert set(cluster_links().values()) == {1500}, cluster_links()
    stats, wire = run_verify(work, n)
    assert wire["mc_mtu"] == 1500, wire
    assert {s["mode"] for s in stats.values()} == {MULTICAST}, stats
    assert wire["mc_data_pages"] > 1000, wire
    # A 4 KiB page does not fit 1500 bytes: every multicast data page took 3 datagrams.
    assert wire["mc_data_datagrams"] == 3 * wire["mc_data_pages"], wire
