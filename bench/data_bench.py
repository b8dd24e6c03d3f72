#!/usr/bin/env python3
"""The file data path on the embedded cluster: how fast a file's bytes reach the hosts.

One run, two clusters of 16 emulated hosts (`starling up --hosts 16`): unshaped (`lan`), then with
every host behind its own 1 Gbit/s link (`--host-link 1gbit`, tbf on its veth pair). Each
measurement reads a NEW file of --mib MiB of random (incompressible) bytes, so nothing is cached
anywhere beforehand:

* cold single host: `starling exec --host h1 -- md5sum F` (the client hashes F, the head's relay
  cache fetches it from the client, h1 fetches it from the head);
* relay cache: the same F on h2 (served by the head's relay cache, the client sends nothing);
* warm: the same F on h1 again (in h1's cache: FUSE passthrough), ÷ a local `md5sum F`;
* fan-out: `starling run -n N -- md5sum F` with N = 1, 4, 16 (placement puts one task per host
  while hosts have free cores), its wall time, the bytes the head sent to the hosts (the bridge's
  own tx_bytes: what the root namespace, where the head runs, sent into it; frames the bridge
  forwards from host to host are not counted there) and the bytes delivered into the hosts from
  anywhere, the head or each other (the sum of the bridge-side veth ends' tx_bytes).

MB/s figures are MiB-of-file ÷ wall time of the whole `starling exec` (end to end, so they
include the exec's own overhead and md5sum's read); "data MB/s" subtracts the time of
`starling exec --host h1 -- true` and of the local md5sum, leaving the transfer. Every task's
digest is checked against hashlib's.

The machine's cores are shared by the emulated hosts, the head, the client and whatever else runs
(the load average before each step is recorded): 16 hosts on a 2-core machine measure the data
path's CPU cost more than its network. Tasks run as guests (cpu.idle): on a machine busy with
other work their wall time is mostly waiting for a core, so every step also records the CPU
seconds the data path spent (head + agents + client), which load does not inflate.

Writes a table, bench/out/data.json. Uses STARLING_INSTANCE from the environment; leaves its
cluster down.
"""
import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out"
MIB = 1 << 20


def sh(*a, check=True, **kw):
    r = subprocess.run(list(a), capture_output=True, text=True, **kw)
    if check and r.returncode:
        sys.exit(f"{' '.join(a)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def timed(*a, **kw):
    t = time.monotonic()
    r = sh(*a, **kw)
    return time.monotonic() - t, r


def proc_cpu(pid):
    """CPU seconds (user + system, all threads) process `pid` has used."""
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu():
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def load():
    return os.getloadavg()[0]


class Cluster:
    def __init__(self, hosts, host_link=None):
        self.hosts = hosts
        sh(STARLING, "down", check=False)
        args = [STARLING, "up", "--hosts", str(hosts)] + (["--host-link", host_link] if host_link else [])
        sh(*args, timeout=300)
        st = json.loads(sh(STARLING, "status", "--json").stdout)
        run_dir = pathlib.Path(f"/run/starling-{os.environ['STARLING_INSTANCE']}" if os.environ.get("STARLING_INSTANCE")
                               else "/run/starling")
        self.pids = [json.loads((run_dir / "cluster.json").read_text())["head_pid"]] + [h["pid"] for h in st["hosts"]]
        inst = os.environ.get("STARLING_INSTANCE", "")
        self.veths = [f"stv{inst}-{h['name']}" if inst else f"stv-{h['name']}" for h in st["hosts"]]
        self.bridge = f"stbr{inst or 0}"
        for v in self.veths:
            if not pathlib.Path(f"/sys/class/net/{v}").exists():
                sys.exit(f"no veth {v}: is STARLING_INSTANCE the same as the cluster's?")

    def cpu(self):
        """CPU seconds of the data path so far: the head, every agent (with its FUSE threads, not
        its tasks, which run in their own processes) and the client processes this bench ran."""
        return sum(proc_cpu(p) for p in self.pids) + children_cpu()

    def to_hosts(self):
        """Bytes sent into the hosts' veths (the bridge's side: traffic towards the hosts)."""
        return sum(int(pathlib.Path(f"/sys/class/net/{v}/statistics/tx_bytes").read_text()) for v in self.veths)

    def from_head(self):
        """Bytes the head's namespace sent into the bridge (towards the hosts)."""
        return int(pathlib.Path(f"/sys/class/net/{self.bridge}/statistics/tx_bytes").read_text())

    def down(self):
        sh(STARLING, "down", check=False, timeout=300)


def new_file(d, name, mib):
    p = d / name
    h = hashlib.md5()
    with open(p, "wb") as f:
        for _ in range(mib):
            b = os.urandom(MIB)
            h.update(b)
            f.write(b)
    return p, h.hexdigest()


def md5_of(out):
    return out.split()[0] if out.split() else ""


def single(c, d, mib, tag):
    """Cold, relay-cache and warm reads of one new file."""
    p, want = new_file(d, f"single-{tag}.bin", mib)
    res = {"load_before": load()}
    for what, host in (("cold", "h1"), ("relay", "h2"), ("warm", "h1")):
        before, cpu = c.to_hosts(), c.cpu()
        t, r = timed(STARLING, "exec", "--host", host, "--", "md5sum", str(p), cwd=d, timeout=1800)
        got = md5_of(r.stdout)
        if got != want:
            sys.exit(f"{what}: {host} read md5 {got}, the file's is {want}")
        res[what] = {"wall_s": t, "to_hosts_bytes": c.to_hosts() - before, "cpu_s": c.cpu() - cpu}
    p.unlink()
    return res


def fanout(c, d, mib, n, tag):
    p, want = new_file(d, f"fan-{tag}-{n}.bin", mib)
    lb = load()
    before, head_before, cpu = c.to_hosts(), c.from_head(), c.cpu()
    t, r = timed(STARLING, "run", "-n", str(n), "--json", "--", "md5sum", str(p), cwd=d, timeout=1800)
    egress, delivered = c.from_head() - head_before, c.to_hosts() - before
    events = [json.loads(line) for line in r.stdout.splitlines()]
    hosts = {e["host"] for e in events if e.get("event") == "started"}
    digests = {md5_of(e["data"]) for e in events if e.get("event") == "output" and e.get("stream") == "stdout"}
    if digests != {want}:
        sys.exit(f"fan-out {n}: tasks read {digests}, the file's md5 is {want}")
    p.unlink()
    return {"hosts": n, "distinct_hosts": len(hosts), "wall_s": t, "head_egress_bytes": egress, "to_hosts_bytes": delivered, "load_before": lb,
            "cpu_s": c.cpu() - cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="file size in MiB (default 256)")
    ap.add_argument("--hosts", type=int, default=16, help="cluster size, and the largest fan-out (default 16)")
    ap.add_argument("--host-link", default="1gbit", help="the shaped run's per-host rate (default 1gbit)")
    ap.add_argument("--note", default="", help="a remark recorded with the figures (e.g. the machine was shared)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (an embedded cluster)")
    d = pathlib.Path("/var/tmp/starling-data-bench")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    doc = {"provenance": provenance(), "mib": a.mib, "hosts": a.hosts, "host_link": a.host_link, "note": a.note,
           "runs": {}}

    # Local baseline (the file is in the page cache, as it is for the client).
    p, want = new_file(d, "local.bin", a.mib)
    t_local = min(timed("md5sum", str(p))[0] for _ in range(3))
    p.unlink()
    doc["local_md5_s"] = t_local

    fans = [n for n in (1, 4, 16) if n <= a.hosts]
    for tag, link in (("lan", None), (f"host-link {a.host_link}", a.host_link)):
        c = Cluster(a.hosts, link)
        try:
            t_true = min(timed(STARLING, "exec", "--host", "h1", "--", "true", cwd=d)[0] for _ in range(3))
            run = {"exec_true_s": t_true, "single": single(c, d, a.mib, tag.replace(" ", "-"))}
            run["fanout"] = [fanout(c, d, a.mib, n, tag.replace(" ", "-")) for n in fans]
            doc["runs"][tag] = run
        finally:
            c.down()
    shutil.rmtree(d, ignore_errors=True)

    OUT.mkdir(exist_ok=True)
    (OUT / "data.json").write_text(json.dumps(doc, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "bench"))
    import tables
    print(tables.render_data(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
