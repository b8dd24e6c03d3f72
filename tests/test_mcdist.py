"""mcdist on a real embedded cluster (instance 3: /run/starling-3, bridge stbr3).

Remote-fork clones get their pages by multicast (STARLING_MCDIST=on|push) from
the parent's page server. Checked here, with bench/c/mcdist_work.c in `verify`
mode (every clone checksums each 1 MiB chunk of the 64 MiB dataset it read and
a global array; the parent prints its own checksums of the same memory):

* no page installed in a clone differs from the parent's image (N = 8 clones,
  multicast and multicast+push);
* with 5 % of the multicast packets onto the bridge dropped (nftables `numgen
  random`), clones still finish with correct memory, the drops really
  happened (rule counter), and the sender backed off (rate cuts, lowest rate
  limit below the initial one — sender-side stats via sf_ticket_stat);
* with multicast blocked on the bridge, every clone detects it and falls back
  to unicast: reported per clone (sf_clone_stat mode), in `starling status`
  (page distribution per host) and in the agents' logs; memory still correct.

Needs root, iproute2 and `nft` (nftables; `.ci/run` installs it), and
target/release built (`cargo build --release --workspace`). The number of
clones is 8, or fewer if the 4 hosts have fewer cores (`starling status`).
"""
import json
import os
import pathlib
import re
import subprocess
import time

import pytest

from conftest import CloneReport, build_with_shared_libstarling, cores_by_host, instance_env, require, require_root, require_tool

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
INSTANCE = "3"
BRIDGE = f"stbr{INSTANCE}"
RUN_DIR = pathlib.Path(f"/run/starling-{INSTANCE}")
BIN = pathlib.Path(f"/var/tmp/starling-tests/mcdist-{INSTANCE}")
NFT_TABLE = f"sfmcd{INSTANCE}"
HOSTS = 4
CLONES = 8  # at most: fewer if the hosts have fewer cores
DATA_MIB = 64
# Mode numbers of sf_clone_stat(t, id, 6) (include/starling.h SF_DIST_*).
MULTICAST, MULTICAST_PUSH, UNICAST_FALLBACK = 1, 2, 4
# The multicast sender's initial rate limit (crates/mcdist SenderConfig::new: 1.25e9 / 25).
INITIAL_RATE = 1.25e9 / 25


def env(**extra):
    return instance_env(INSTANCE, **extra)


def starling(*args, timeout=180):
    return subprocess.run([STARLING, *args], capture_output=True, text=True, timeout=timeout, env=env())


def nft(script):
    r = subprocess.run(["nft", script], capture_output=True, text=True)
    assert r.returncode == 0, f"nft {script!r}: {r.stderr}"


def nft_clear():
    subprocess.run(["nft", f"delete table ip {NFT_TABLE}"], capture_output=True)


def nft_multicast_rule(rule):
    """One rule on every multicast packet the parent's side sends onto the
    cluster bridge (the page server and its multicast sender run in this
    namespace; a dropped packet is lost for every host)."""
    nft_clear()
    nft(f"add table ip {NFT_TABLE}")
    nft(f"add chain ip {NFT_TABLE} out {{ type filter hook output priority 0 ; }}")
    nft(f'add rule ip {NFT_TABLE} out oifname "{BRIDGE}" ip daddr 224.0.0.0/4 {rule}')


def nft_dropped():
    out = subprocess.run(["nft", "list", "table", "ip", NFT_TABLE], capture_output=True, text=True).stdout
    return sum(int(p) for p in re.findall(r"counter packets (\d+)", out))


@pytest.fixture(scope="module")
def cluster():
    """Instance 3 with 4 hosts; yields how many clones the tests ask for (8, or all cores if fewer)."""
    require_root("an embedded cluster")
    require_tool("nft", "nftables")
    require(pathlib.Path(STARLING).exists(), "build it: cargo build --release --workspace")
    starling("down")
    r = starling("up", "--hosts", str(HOSTS), timeout=300)
    assert r.returncode == 0, f"starling up failed:\n{r.stdout}\n{r.stderr}"
    st = json.loads(starling("status", "--json").stdout)
    clones = min(CLONES, sum(cores_by_host(st).values()))
    require(clones >= 2, f"multicast sharing needs 2 clones; the cluster has {clones} cores")
    yield clones
    nft_clear()
    starling("down")


@pytest.fixture(scope="module")
def clones(cluster):
    return cluster


@pytest.fixture(scope="module")
def work(cluster):
    return build_with_shared_libstarling(ROOT / "bench/c/mcdist_work.c", BIN, "mcdist_work")


def run_verify(exe, mcdist, n, timeout=600):
    """mcdist_work `verify` with n clones: every clone reported and saw the parent's memory."""
    r = subprocess.run([exe, "verify", str(n), str(DATA_MIB), "4"], capture_output=True, text=True, timeout=timeout,
                       env=env(STARLING_MCDIST=mcdist), cwd="/var/tmp")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = CloneReport(r.stdout)
    assert sorted(rep.sums) == list(range(1, n + 1)), "every clone reported"
    rep.assert_memory_identical(DATA_MIB, range(1, n + 1))
    return rep


@pytest.mark.parametrize("mcdist,mode", [("on", MULTICAST), ("push", MULTICAST_PUSH)])
def test_clone_memory_equals_parent_image(work, clones, mcdist, mode):
    n = clones
    nft_clear()
    rep = run_verify(work, mcdist, n)
    stats, wire = rep.stats, rep.wire
    # The descriptor went to the group too: the hosts' requests for it were
    # answered by fewer transmissions than one per clone (unicast needs one each).
    assert 0 < wire["descriptor_pages_sent"] < n * rep.descriptor_pages, wire
    assert all(s["status"] == 0 for s in stats.values()), stats
    assert {s["mode"] for s in stats.values()} == {mode}, "every clone used multicast"
    # Clones installed pages other clones asked for: the multicast really was shared.
    assert sum(s["unsolicited"] for s in stats.values()) > 0
    # n clones read 64 MiB each; the wire carried far less than n unicast copies.
    assert wire["bytes_multicast"] > 0 and wire["bytes_wire"] < 3 * (DATA_MIB << 20), wire


def test_loss_on_the_bridge_clones_correct_sender_backs_off(work, clones):
    n = clones
    nft_multicast_rule("numgen random mod 1000 < 50 counter drop")  # 5 % of multicast packets
    try:
        rep = run_verify(work, "on", n)
        dropped = nft_dropped()
    finally:
        nft_clear()
    assert dropped > 100, f"the loss rule dropped only {dropped} frames"
    stats, wire = rep.stats, rep.wire
    assert {s["mode"] for s in stats.values()} == {MULTICAST}, "loss must not push clones off multicast"
    assert wire["implicit_losses"] > 0 and wire["rate_cuts"] > 0, wire
    assert 0 < wire["rate_min"] < INITIAL_RATE, f"rate never backed off below the initial limit: {wire}"


def test_multicast_blocked_falls_back_to_unicast_and_says_so(work, clones):
    logs = RUN_DIR / "logs"
    marks = {p: p.stat().st_size for p in logs.glob("h*.log")}
    n = min(4, clones)  # over TCP: fewer clones keep it short
    nft_multicast_rule("counter drop")
    try:
        rep = run_verify(work, "on", n)
        dropped = nft_dropped()
    finally:
        nft_clear()
    assert dropped > 0, "multicast never reached the block"
    stats, wire = rep.stats, rep.wire
    assert {s["mode"] for s in stats.values()} == {UNICAST_FALLBACK}, stats
    assert wire["bytes_tcp"] > (DATA_MIB << 20) * n, "pages came over TCP"
    assert wire["descriptor_pages_sent"] == n * rep.descriptor_pages, "each host fetched the descriptor over TCP"
    # starling status: the hosts that ran clones say so (agents report every 2 s; wait for it).
    deadline = time.monotonic() + 120
    while True:
        st = json.loads(starling("status", "--json").stdout)
        fallen = [h["name"] for h in st["hosts"] if h.get("page_distribution") == "unicast (multicast unavailable)"]
        if len(fallen) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(fallen) >= 2, st["hosts"]
    text = starling("status").stdout
    assert "page distribution" in text and "unicast (multicast unavailable)" in text, text
    # ... and the agents' logs.
    new = "".join(p.read_text(errors="replace")[marks.get(p, 0):] for p in logs.glob("h*.log"))
    assert "falls back to unicast" in new or "falling back to unicast" in new, new[-2000:]
