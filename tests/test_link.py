"""Issue 3: correctness over emulated WAN links, prethrow freshness, caches evicted mid-job.

Runs on its own embedded cluster (STARLING_INSTANCE=2) with its own client cache, so it
never disturbs the default cluster the other tests use."""
import hashlib
import json
import os
import pathlib
import select
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import SCRATCH, STARLING, wait_for

INSTANCE = "2"
STATE = pathlib.Path("/var/lib/starling-2")


def env(tmp_cache, **extra):
    e = dict(os.environ, STARLING_INSTANCE=INSTANCE, STARLING_CACHE=str(tmp_cache))
    e.pop("STARLING_CLUSTER", None)
    e.update(extra)
    return e


def st(args, e, **kw):
    return subprocess.run([STARLING] + args, env=e, capture_output=True, timeout=kw.pop("timeout", 600), **kw)


@pytest.fixture(scope="module")
def client_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("client-cache")


@pytest.fixture(scope="module")
def work():
    d = SCRATCH / "link"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    # A small multi-file C project.
    (d / "a.c").write_text('#include <stdio.h>\nint b(int);\nint main(void){printf("%d\\n", b(20)+1);return 0;}\n')
    (d / "b.c").write_text('#include <math.h>\nint c(int);\nint b(int x){return c(x)*2;}\n')
    (d / "c.c").write_text('#include <string.h>\nint c(int x){return x + (int)strlen("starling");}\n')
    (d / "Makefile").write_text("prog: a.o b.o c.o\n\t$(CC) -o $@ $^\n%.o: %.c\n\t$(CC) -O2 -c $< -o $@\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def up(link, e, hosts=2):
    st(["down"], e)
    r = st(["up", "--hosts", str(hosts), "--link", link], e, timeout=120)
    assert r.returncode == 0, r.stderr.decode()


def build(d, e, cc):
    subprocess.run(["make", "-s", "clean"], cwd=d, capture_output=True)
    for f in d.glob("*.o"):
        f.unlink()
    (d / "prog").unlink(missing_ok=True)
    r = subprocess.run(["make", "-s", "-j4", f"CC={cc}"], cwd=d, env=e, capture_output=True, timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".o" or p.name == "prog"}


@pytest.fixture(scope="module", autouse=True)
def teardown_cluster(client_cache):
    yield
    st(["down"], env(client_cache))


@pytest.mark.parametrize("link", ["lan", "cable-modem", "coffee-shop"])
def test_outputs_identical_to_local_under_every_profile(link, work, client_cache):
    e = env(client_cache)
    up(link, e)
    status = json.loads(st(["status", "--json"], e).stdout)
    assert status["network"]["link"] == link
    local = build(work, dict(os.environ), "gcc")
    remote = build(work, e, f"{STARLING} exec --job link-test gcc")
    assert sorted(local) == sorted(remote) == ["a.o", "b.o", "c.o", "prog"]
    assert [k for k in local if local[k] != remote[k]] == []
    r = st(["run", "-n", "3", "--quiet", "--", "sh", "-c", 'echo "$STARLING_TASK/$STARLING_TASKS $(./prog)"'], e, cwd=work)
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(r.stdout.decode().split("\n")[:3]) == ["0/3 57", "1/3 57", "2/3 57"]


def test_warm_launch_needs_no_round_trip_beyond_the_launch(work, client_cache, tmp_path):
    """With a learned profile, a warm launch answers no file request: one round trip."""
    e = env(client_cache)
    up("coffee-shop", e)
    stats = tmp_path / "stats.jsonl"
    for _ in range(4):
        r = st(["exec", "--", "true"], dict(e, STARLING_STATS_FILE=str(stats)), cwd=work)
        assert r.returncode == 0, r.stderr.decode()
    runs = [json.loads(l) for l in stats.read_text().splitlines()]
    assert runs[-1]["file_requests"] == 0, runs[-1]
    assert runs[-1]["prethrow_bindings"] > 10


@pytest.mark.parametrize("job", [False, True])
def test_changed_file_is_never_seen_stale(job, work, client_cache):
    e = env(client_cache)
    up("lan", e)
    f = work / "input.txt"
    f.write_text("AAAA\n")
    extra = ["--job", "stale-test"] if job else []
    for _ in range(3):  # teach the profile that input.txt is always read
        r = st(["exec"] + extra + ["--", "cat", "input.txt"], e, cwd=work)
        assert r.stdout == b"AAAA\n"
    before = f.stat()
    f.write_text("BBBB\n")  # same size...
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # ...same mtime: only ctime changed
    r = st(["exec"] + extra + ["--", "cat", "input.txt"], e, cwd=work)
    assert r.stdout == b"BBBB\n", "a prethrown binding must reflect the file at launch"


def test_cache_evicted_mid_job(work, client_cache):
    """Every cache (head relay, hosts) is wiped while a job runs: task 0 read the file before, the
    other tasks read it after (each waits, connected to this test, until the wipe is done)."""
    e = env(client_cache)
    up("lan", e)
    big = work / "big.bin"
    data = os.urandom(6 << 20)
    big.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    # Warm every cache with it first.
    assert st(["exec", "--", "sha256sum", "big.bin"], e, cwd=work).stdout.decode().split()[0] == want
    head_ip = json.loads(st(["status", "--json"], e).stdout)["head"].rsplit(":", 1)[0]
    gate = socket.create_server((head_ip, 0))
    port = gate.getsockname()[1]
    wait = f"import socket; s = socket.create_connection(('{head_ip}', {port}), timeout=600); s.settimeout(600); s.recv(1)"
    p = subprocess.Popen(
        [STARLING, "run", "-n", "6", "--quiet", "--", "sh", "-c",
         f'[ "$STARLING_TASK" = 0 ] || {sys.executable} -c "{wait}"; sha256sum big.bin'],
        cwd=work, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waiting = []
    try:
        gate.settimeout(300)
        waiting.append(gate.accept()[0])  # a task of the job is running and has not read the file yet
        ready, _, _ = select.select([p.stdout], [], [], 300)
        assert ready, "task 0 never printed its sum"
        first = p.stdout.readline().decode()
        assert first.split()[0] == want, first
        wiped = 0
        for cache in [STATE / "head" / "cache"] + sorted((STATE / "hosts").glob("h*/state/cache")):
            for sub in ["chunks", "files", "recipes"]:
                for f in (cache / sub).rglob("*"):
                    if f.is_file():
                        f.unlink()
                        wiped += 1
        assert wiped > 0, "the caches held the file"
        # Release the tasks waiting now and every one that starts later.
        gate.settimeout(5)
        while p.poll() is None:
            for c in waiting:
                c.sendall(b"g")
                c.close()
            waiting = []
            try:
                waiting.append(gate.accept()[0])
            except socket.timeout:
                pass
        out, err = p.communicate(timeout=300)
    finally:
        for c in waiting:
            c.close()
        gate.close()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err.decode()
    sums = [first.split()[0]] + [l.split()[0] for l in out.decode().splitlines()]
    assert sums == [want] * 6


def link_counters():
    return json.loads((pathlib.Path(f"/run/starling-{INSTANCE}") / "link.json").read_text())["counters"]


def test_custom_link_profile_is_applied(work, client_cache):
    """`starling up --link RTT_MS,UP_KBIT,DOWN_KBIT` with values no preset has: a launch takes at
    least one RTT, an upload and a download take at least their size over the given rate (up and
    down differ, so swapping them fails), and the link's own counters saw the bytes. Lower bounds
    only: a slower machine makes every time longer, never shorter."""
    rtt_ms, up_kbit, down_kbit = 50, 2400, 4800
    e = env(client_cache)
    up(f"{rtt_ms},{up_kbit},{down_kbit}", e)
    assert json.loads(st(["status", "--json"], e).stdout)["network"]["link"] == f"{rtt_ms},{up_kbit},{down_kbit}"
    t0 = time.monotonic()
    assert st(["exec", "--", "true"], e, cwd=work).returncode == 0
    assert time.monotonic() - t0 >= rtt_ms / 1000, "a launch took less than one round trip"

    payload = os.urandom(300_000)  # incompressible, in no cache yet
    (work / "upload.bin").write_bytes(payload)
    before = link_counters()
    t0 = time.monotonic()
    r = st(["exec", "--", "wc", "-c", "upload.bin"], e, cwd=work)
    took = time.monotonic() - t0
    assert r.stdout == b"300000 upload.bin\n", r.stderr.decode()
    assert took >= len(payload) * 8 / (up_kbit * 1000), f"300 kB went up in {took:.2f} s: faster than {up_kbit} kbit/s"
    # The relay writes its counters periodically: wait for them to show the bytes.
    wait_for(lambda: link_counters()["bytes_up"] - before["bytes_up"] >= len(payload), "the link to count 300 kB up")

    before = link_counters()
    t0 = time.monotonic()
    r = st(["exec", "--", "head", "-c", "600000", "/dev/urandom"], e, cwd=work)
    took = time.monotonic() - t0
    assert len(r.stdout) == 600_000, r.stderr.decode()
    assert took >= 600_000 * 8 / (down_kbit * 1000), f"600 kB came down in {took:.2f} s: faster than {down_kbit} kbit/s"
    wait_for(lambda: link_counters()["bytes_down"] - before["bytes_down"] >= 600_000, "the link to count 600 kB down")
