"""The file data path end to end: a new file read at once by tasks on every host arrives
byte-identical everywhere, and a changed file is never read stale.

The expected digests are computed here with hashlib from the bytes this test wrote, never by
starling; each task reports `md5sum` of the file as it sees it."""
import hashlib
import json
import os
import subprocess

from conftest import STARLING, status

# Several GetChunks batches (64 chunks each, chunks average 64 KiB) and an odd tail.
SIZE = 9 * 1024 * 1024 + 12345


def read_everywhere(path, cwd):
    """`starling run -n N` with N = every core of the cluster, each task printing `md5sum` of
    `path`; returns {task: (host, digest)} and the hosts the cluster has."""
    st = status()
    hosts = {h["name"] for h in st["hosts"]}
    n = sum(max(1, h["cores"]) for h in st["hosts"])
    r = subprocess.run([STARLING, "run", "-n", str(n), "--json", "--", "md5sum", str(path)],
                       cwd=cwd, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stdout.decode()[-3000:] + r.stderr.decode()[-3000:]
    events = [json.loads(line) for line in r.stdout.decode().splitlines()]
    seen = {}
    for i in range(n):
        mine = [e for e in events if e.get("task") == i]
        started = [e for e in mine if e["event"] == "started"]
        assert len(started) == 1, mine
        out = "".join(e["data"] for e in mine if e["event"] == "output" and e["stream"] == "stdout")
        assert mine[-1]["event"] == "finished" and mine[-1]["exit"] == 0, mine
        seen[i] = (started[0]["host"], out.split()[0] if out.split() else "")
    return seen, hosts


def check_all(path, cwd, want):
    seen, hosts = read_everywhere(path, cwd)
    assert {h for h, _ in seen.values()} == hosts, f"tasks ran on {sorted({h for h, _ in seen.values()})}, not every host"
    wrong = {t: hd for t, hd in seen.items() if hd[1] != want}
    assert not wrong, f"expected md5 {want} everywhere; these tasks saw otherwise: {wrong}"


def test_new_file_read_at_once_everywhere_is_identical_and_never_stale(cluster, workdir):
    path = workdir / "data.bin"
    data = bytearray(os.urandom(SIZE))
    path.write_bytes(data)
    check_all(path, workdir, hashlib.md5(data).hexdigest())

    # Change bytes in the middle of one chunk, in place (same inode, same size): every host
    # must see the new content, not its cached file.
    mid = SIZE // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    with open(path, "r+b") as f:
        f.seek(mid)
        f.write(data[mid:mid + 16])
    check_all(path, workdir, hashlib.md5(data).hexdigest())

    # Replace it whole with new random content of the same size.
    data = bytearray(os.urandom(SIZE))
    path.write_bytes(data)
    check_all(path, workdir, hashlib.md5(data).hexdigest())


def instance():
    """The instance's part of interface names (instance 0 has none)."""
    i = os.environ.get("STARLING_INSTANCE", "")
    return "" if i in ("", "0") else i


def test_host_link_shapes_every_hosts_veth_both_ways(cluster):
    """`starling up --host-link RATE` puts a tbf of that rate on both ends of every host's veth
    (read back from the kernel with tc), `status` reports it, a delay is refused with the reason,
    and the 4-host cluster is left behind as it was (unshaped)."""
    from conftest import sh, starling, up
    bad = starling("up", "--hosts", "4", "--host-link", "1gbit,10ms", check=False)
    assert bad.returncode != 0 and "netem" in bad.stderr, bad.stderr
    starling("down", check=False)
    try:
        r = starling("up", "--hosts", "4", "--host-link", "40mbit", check=False, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status()
        assert st["network"]["host_link"] == "40 Mbit/s", st["network"]
        inst = instance()
        for h in st["hosts"]:
            veth = f"stv{inst}-{h['name']}"
            ns = f"starling{inst}-{h['name']}"
            for where in (sh("tc", "qdisc", "show", "dev", veth).stdout,
                          sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0").stdout):
                assert "tbf" in where and "rate 40Mbit" in where, (h["name"], where)
    finally:
        up(4)
    for h in status()["hosts"]:
        veth = f"stv{instance()}-{h['name']}"
        assert "tbf" not in sh("tc", "qdisc", "show", "dev", veth).stdout, "the plain cluster is unshaped"
