"""Clones of one ticket on one host share its traffic (issue 16 parts 2 and 6), on a real embedded cluster.

A host's clones of a ticket — a hierarchical task's, or spread tasks placed on the same host — share
one descriptor fetch and one multicast receiver (crates/fork/src/host.rs, held by the agent). With
tests/fork/shared_host.c (every clone checksums each 1 MiB chunk of a page-distinct dataset built
before the fork; the parent prints its own checksums of the same memory) this checks:

* every clone sees the parent's memory, 2 or more clones on each host, spread and hierarchical;
* the descriptor is fetched once per host: with multicast off, the parent's page server sent the
  descriptor's pages exactly once per host (its own counter, not the agents' word);
* one multicast receiver per host: the parent's multicast sender counted one joined receiver (distinct
  request socket that said HELLO) per host, not one per clone;
* a clone SIGKILLed while its faults are in flight (two threads reading) leaves the other clones of
  its host correct and running to their end.

The number of clones is every core of the cluster (`starling status`), 2 per host or more; the test
fails with the reason if a host has a single core (nothing would be shared).
"""
import collections
import os
import pathlib
import subprocess

import pytest

from conftest import CloneReport, ROOT, SCRATCH, cores_by_host, require, running_tasks, wait_for

LIB = ROOT / "target/release/libstarling.a"
BIN = SCRATCH / "share-bin"
DATA_MIB = 32
MULTICAST, UNICAST = 1, 3  # sf_clone_stat(t, id, 6): SF_DIST_MULTICAST, SF_DIST_UNICAST
KILLED = 2  # sf_clone_state: SF_CLONE_KILLED


@pytest.fixture(scope="module")
def prog():
    require(LIB.exists(), "build it: cargo build --release -p starling-capi")
    BIN.mkdir(parents=True, exist_ok=True)
    exe = BIN / "shared_host"
    r = subprocess.run(["cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/shared_host.c"),
                        str(LIB), "-lpthread", "-ldl", "-lm", "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(exe)


def run(prog, n, hierarchical, victim, mcdist):
    # The grant must be every core: wait until the last test's clones have given theirs back.
    wait_for(lambda: running_tasks() == 0, "the cluster's cores to be free")
    env = dict(os.environ, STARLING_MCDIST=mcdist)
    env.pop("STARLING_FORK_BACKEND", None)
    r = subprocess.run([prog, str(n), str(int(hierarchical)), str(victim), str(DATA_MIB)], capture_output=True,
                       text=True, timeout=600, env=env, cwd="/var/tmp")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return CloneReport(r.stdout)


def clones_for(st):
    cores = cores_by_host(st)
    require(min(cores.values()) >= 2, f"sharing needs 2 clones on a host; the hosts have {cores} cores")
    return sum(cores.values())


@pytest.mark.parametrize("hierarchical,mcdist", [(False, "on"), (True, "on"), (False, "off")],
                         ids=["spread-multicast", "hierarchical-multicast", "spread-unicast"])
def test_clones_of_a_host_share_the_descriptor_and_receiver(cluster, prog, hierarchical, mcdist):
    n = clones_for(cluster)
    rep = run(prog, n, hierarchical, 0, mcdist)
    hosts, stats, wire = rep.hosts, rep.stats, rep.wire
    assert sorted(stats) == list(range(1, n + 1)), "every clone granted reported"
    assert all(s["status"] == 0 for s in stats.values()), stats
    rep.assert_memory_identical(DATA_MIB, stats)
    per_host = collections.Counter(hosts.values())
    assert len(per_host) == len(cluster["hosts"]) and min(per_host.values()) >= 2, per_host
    h = len(per_host)
    if mcdist == "on":
        assert {s["mode"] for s in stats.values()} == {MULTICAST}, stats
        # The sender's own count: one receiver joined per host, however many clones it runs.
        assert wire["mc_receivers"] == h, (wire, per_host)
        # Pages one clone asked for went into its host's other clones too.
        assert sum(s["unsolicited"] for s in stats.values()) > 0, stats
    else:
        assert {s["mode"] for s in stats.values()} == {UNICAST}, stats
        # Over TCP every fetch is sent in full: the descriptor's pages went out once per host.
        assert wire["descriptor_pages_sent"] == h * rep.descriptor_pages, (wire, rep.descriptor_pages, per_host)


def test_a_clone_killed_leaves_its_host_siblings_correct(cluster, prog):
    n = clones_for(cluster)
    victim = 1
    rep = run(prog, n, False, victim, "on")
    hosts, stats = rep.hosts, rep.stats
    siblings = [i for i, h in hosts.items() if h == hosts[victim] and i != victim]
    assert siblings, f"clone {victim} shared no host: {hosts}"
    assert stats[victim]["state"] == KILLED and stats[victim]["status"] == 128 + 9, stats[victim]
    others = [i for i in stats if i != victim]
    assert all(stats[i]["status"] == 0 for i in others), stats
    rep.assert_memory_identical(DATA_MIB, others)
    assert {stats[i]["mode"] for i in others} == {MULTICAST}, "the siblings kept the host's receiver"
