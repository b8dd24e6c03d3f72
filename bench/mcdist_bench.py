#!/usr/bin/env python3
"""mcdist benchmark on the embedded cluster: SnowFlock §5's figures on starling.

Runs bench/c/mcdist_work.c (linked against target/release/libstarling.so) on a
real embedded cluster (`starling up --hosts H`; every emulated host has 2 cores,
so 32 clones need 16 hosts) and measures, per page distribution
(STARLING_MCDIST=off → unicast TCP, on → multicast, push → multicast+push):

(a) clone time vs N: from just before sf_clone in the parent until the LAST
    clone runs (CLOCK_REALTIME; the hosts are namespaces of this machine);
(b) SHRiMP-like: every clone scans the whole DATA_MIB dataset (built before the
    fork) in the same order and fills a SCRATCH_MIB table the parent allocated
    but never touched — with the avoidance heuristics on and off
    (STARLING_FORK_HEURISTICS=off classifies every readable page Fetch);
(c) BLAST-like (heuristic-adverse): clone i reads only slice i of m (disjoint).

Per run: pages requested and served, bytes on the wire, completion (join) time.

Where "bytes on the wire" comes from: the parent's sender-side counters,
sf_ticket_stat(t, SF_STAT_BYTES_WIRE) = TCP page-server reply bytes (+ one
52-byte TCP/IP header per started 1448-byte segment) + multicast datagram bytes
(+ 28-byte IP/UDP header each), counted in crates/fork/src/page_server.rs and
crates/mcdist/src/sender.rs. "pages requested" = page addresses clones asked
for (TCP SFPQ + multicast requests, re-requests included); "pages served" =
pages the parent's host sent (pushed included). As a cross-check the bench
also records the bridge's tx_bytes delta (everything the parent's side sent
into the cluster during the run: also head/file-view traffic).

Writes a table, bench/out/mcdist.json and bench/out/mcdist_*.png (matplotlib).
Leaves the cluster down unless --keep. Uses STARLING_INSTANCE from the
environment (e.g. STARLING_INSTANCE=3 → bridge stbr3).
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

from provenance import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out"
MODES = {"unicast": "off", "multicast": "on", "multicast+push": "push"}


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def bridge():
    inst = os.environ.get("STARLING_INSTANCE", "")
    return f"stbr{inst or 0}"


def build(bindir):
    """Compile the workload against a private copy of libstarling.so (a rebuild
    of target/release during the run must not change the file clones map)."""
    bindir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "target/release/libstarling.so", bindir / "libstarling.so")
    exe = bindir / "mcdist_work"
    r = sh("cc", "-O2", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "bench/c/mcdist_work.c"),
           "-L", str(bindir), "-lstarling", f"-Wl,-rpath,{bindir}", "-o", str(exe))
    if r.returncode:
        sys.exit(f"build failed (cargo build --release --workspace first?):\n{r.stderr}")
    return str(exe)


def kv(line):
    return {k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in re.findall(r"(\w+)=(\S+)", line)}


def parse(out):
    p = kv(re.search(r"^PARENT .*$", out, re.M).group(0))
    wire = kv(re.search(r"^WIRE .*$", out, re.M).group(0))
    clones = [kv(l) for l in re.findall(r"^CLONE .*$", out, re.M)]
    stats = [kv(l) for l in re.findall(r"^STAT .*$", out, re.M)]
    return p, wire, clones, stats


def tx_bytes():
    try:
        return int(pathlib.Path(f"/sys/class/net/{bridge()}/statistics/tx_bytes").read_text())
    except OSError:
        return -1


def run_once(exe, workload, n, mode, heuristics, data_mib, scratch_mib, timeout=900):
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)
    env["STARLING_MCDIST"] = MODES[mode]
    env["STARLING_FORK_HEURISTICS"] = "on" if heuristics else "off"
    tx0 = tx_bytes()
    t0 = time.time()
    r = sh(exe, workload, str(n), str(data_mib), str(scratch_mib), env=env, timeout=timeout, cwd="/var/tmp")
    wall = time.time() - t0
    tx = tx_bytes() - tx0 if tx0 >= 0 else -1
    if r.returncode:
        raise RuntimeError(f"{workload} {mode} n={n}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    p, wire, clones, stats = parse(r.stdout)
    m = p["clones"]
    if m != n or len(clones) != m or any(s["status"] != 0 for s in stats):
        raise RuntimeError(f"{workload} {mode} n={n}: granted {m}, {len(clones)} clones reported\n{r.stdout[-3000:]}")
    hashes = {c["hash"] for c in clones}
    if workload == "shrimp" and len(hashes) != 1:
        raise RuntimeError(f"clones disagree on the dataset hash: {hashes}")
    return {
        "workload": workload, "mode": mode, "heuristics": heuristics, "clones": m,
        "data_mib": data_mib, "scratch_mib": scratch_mib,
        "clone_time_ms": max(c["start_ns"] for c in clones) / 1e6,
        "first_clone_ms": min(c["start_ns"] for c in clones) / 1e6,
        "sf_clone_call_ms": p["clone_call_ns"] / 1e6,
        "completion_s": p["join_ns"] / 1e9,
        "slowest_clone_work_s": max(c["end_ns"] - c["start_ns"] for c in clones) / 1e9,
        "wall_s": wall,
        "bytes_wire": wire["bytes_wire"], "bytes_tcp": wire["bytes_tcp"], "bytes_multicast": wire["bytes_multicast"],
        "pages_requested": wire["pages_requested"], "pages_served": wire["pages_served"],
        "rate_cuts": wire["rate_cuts"], "implicit_losses": wire["implicit_losses"],
        "lockstep_suppressed": wire["lockstep_suppressed"], "pages_pushed": wire["pages_pushed"],
        "rate_min": wire["rate_min"],
        "bridge_tx_bytes": tx,
        "clone_modes": sorted({s["mode"] for s in stats}),
        "pages_fetched_per_clone": sum(s["fetched"] for s in stats) / m,
        "faults_per_clone": sum(s["faults"] for s in stats) / m,
        "zero_per_clone": sum(s["zero"] for s in stats) / m,
        "descriptor_bytes": p["descriptor_bytes"],
    }


def table(rows):
    hdr = (f"{'workload':<8} {'heur':<4} {'mode':<15} {'N':>3} {'clone ms':>9} {'done s':>7} {'requested':>10} "
           f"{'served':>9} {'wire MB':>9} {'bridge MB':>9} {'cuts':>6}")
    lines = [hdr]
    for x in rows:
        lines.append(f"{x['workload']:<8} {'on' if x['heuristics'] else 'off':<4} {x['mode']:<15} {x['clones']:>3} "
                     f"{x['clone_time_ms']:>9.0f} {x['completion_s']:>7.2f} {x['pages_requested']:>10} "
                     f"{x['pages_served']:>9} {x['bytes_wire'] / 1e6:>9.1f} {x['bridge_tx_bytes'] / 1e6:>9.1f} "
                     f"{x['rate_cuts']:>6}")
    return "\n".join(lines)


def ratios(rows):
    def pick(workload, mode, heur, n):
        return next((x for x in rows if (x["workload"], x["mode"], x["heuristics"], x["clones"]) == (workload, mode, heur, n)), None)
    out = {}
    for mode in MODES:
        for heur in (True, False):
            a, b = pick("shrimp", mode, heur, 1), pick("shrimp", mode, heur, 32)
            if a and b:
                key = f"shrimp/{mode}/heuristics={'on' if heur else 'off'}"
                out[key] = {"bytes_32_over_1": b["bytes_wire"] / a["bytes_wire"],
                            "clone_time_32_over_1": b["clone_time_ms"] / a["clone_time_ms"]}
    return out


def plots(doc):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no PNGs (pip install matplotlib)")
        return
    rows = doc["rows"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    for mode in MODES:
        sel = sorted((x for x in rows if x["workload"] == "shrimp" and x["heuristics"] and x["mode"] == mode),
                     key=lambda x: x["clones"])
        if not sel:
            continue
        xs = [x["clones"] for x in sel]
        ax[0][0].plot(xs, [x["clone_time_ms"] for x in sel], "o-", label=mode)
        ax[0][1].plot(xs, [x["bytes_wire"] / 1e6 for x in sel], "o-", label=mode)
        ax[1][0].plot(xs, [x["pages_requested"] for x in sel], "o-", label=f"{mode} requested")
        ax[1][0].plot(xs, [x["pages_served"] for x in sel], "s--", label=f"{mode} served")
        ax[1][1].plot(xs, [x["completion_s"] for x in sel], "o-", label=f"SHRiMP-like {mode}")
        sb = sorted((x for x in rows if x["workload"] == "blast" and x["mode"] == mode), key=lambda x: x["clones"])
        if sb:
            ax[1][1].plot([x["clones"] for x in sb], [x["completion_s"] for x in sb], "s--", label=f"BLAST-like {mode}")
    titles = [("clone time (last clone running)", "ms"), ("bytes on the wire (SHRiMP-like)", "MB"),
              ("pages requested / served (SHRiMP-like)", "pages"), ("completion time", "s")]
    for a, (t, u) in zip([ax[0][0], ax[0][1], ax[1][0], ax[1][1]], titles):
        a.set_xscale("log", base=2)
        a.set_xlabel("clones")
        a.set_ylabel(u)
        a.set_title(t)
        a.legend(fontsize=7)
    ax[1][0].set_yscale("log")
    fig.suptitle(f"starling mcdist, {doc['data_mib']} MiB dataset, {doc['hosts']} hosts × 2 cores")
    fig.tight_layout()
    fig.savefig(OUT / "mcdist.png", dpi=100)
    # Heuristics on/off (SnowFlock: "no heuristics: tenfold more requests").
    sel = [x for x in rows if x["workload"] == "shrimp"]
    labels, on, off = [], [], []
    for mode in MODES:
        for n in sorted({x["clones"] for x in sel}):
            a = next((x for x in sel if x["mode"] == mode and x["clones"] == n and x["heuristics"]), None)
            b = next((x for x in sel if x["mode"] == mode and x["clones"] == n and not x["heuristics"]), None)
            if a and b:
                labels.append(f"{mode}\nN={n}")
                on.append(a["pages_requested"])
                off.append(b["pages_requested"])
    if labels:
        fig, a = plt.subplots(figsize=(max(6, len(labels) * 1.2), 4))
        idx = range(len(labels))
        a.bar([i - 0.2 for i in idx], on, 0.4, label="heuristics on")
        a.bar([i + 0.2 for i in idx], off, 0.4, label="heuristics off")
        a.set_xticks(list(idx))
        a.set_xticklabels(labels, fontsize=7)
        a.set_ylabel("pages requested")
        a.set_yscale("log")
        a.set_title("SHRiMP-like: avoidance heuristics")
        a.legend()
        fig.tight_layout()
        fig.savefig(OUT / "mcdist_heuristics.png", dpi=100)
    print(f"wrote {OUT / 'mcdist.png'}" + (f", {OUT / 'mcdist_heuristics.png'}" if labels else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--counts", default="1,2,4,8,16,32", help="N for the SHRiMP-like sweep, heuristics on")
    ap.add_argument("--heuristics-off-counts", default="1,32", help="N for the SHRiMP-like runs with heuristics off")
    ap.add_argument("--blast-counts", default="1,8,32")
    ap.add_argument("--modes", default="unicast,multicast,multicast+push")
    ap.add_argument("--data-mib", type=int, default=256,
                    help="dataset size (SnowFlock used 512 MiB; 32 clones each materialise it, so 512 needs ~18 GiB free)")
    ap.add_argument("--scratch-mib", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="leave the cluster up (and reuse a running one)")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    ran_on = provenance()  # at the start: the tree the run measures
    exe = build(pathlib.Path("/var/tmp/starling-bench") / f"mcdist-{os.environ.get('STARLING_INSTANCE', '0')}")
    if not (a.keep and sh(STARLING, "status").returncode == 0):
        sh(STARLING, "down", timeout=120)
        r = sh(STARLING, "up", "--hosts", str(a.hosts), timeout=300)
        if r.returncode:
            sys.exit(f"starling up failed:\n{r.stdout}\n{r.stderr}")
    modes = [m for m in a.modes.split(",") if m]
    plan = []
    for n in map(int, a.counts.split(",")):
        plan += [("shrimp", n, m, True) for m in modes]
    for n in map(int, filter(None, a.heuristics_off_counts.split(","))):
        plan += [("shrimp", n, m, False) for m in modes]
    for n in map(int, filter(None, a.blast_counts.split(","))):
        plan += [("blast", n, m, True) for m in modes]
    # Warm-up: the hosts' file caches get the program and libstarling.so once,
    # so the first measured run does not pay for it.
    run_once(exe, "shrimp", 1, "unicast", True, 8, 1)
    rows = []
    try:
        for workload, n, mode, heur in plan:
            x = run_once(exe, workload, n, mode, heur, a.data_mib, a.scratch_mib)
            rows.append(x)
            print(table([x]).splitlines()[1], flush=True)
    finally:
        if not a.keep:
            sh(STARLING, "down", timeout=120)
    print(table(rows))
    rat = ratios(rows)
    for k, v in rat.items():
        print(f"{k}: bytes(32)/bytes(1) = {v['bytes_32_over_1']:.2f}   clone-time(32)/clone-time(1) = {v['clone_time_32_over_1']:.2f}")
    doc = {"provenance": ran_on, "hosts": a.hosts, "data_mib": a.data_mib, "scratch_mib": a.scratch_mib, "bridge": bridge(),
           "bytes_on_the_wire": "sender-side: TCP page-server reply bytes + est. TCP/IP headers, plus multicast "
                                "datagram bytes + IP/UDP headers (sf_ticket_stat SF_STAT_BYTES_WIRE); "
                                "bridge_tx_bytes = tx_bytes delta of the cluster bridge (includes head traffic)",
           "rows": rows, "ratios": rat}
    (OUT / "mcdist.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT / 'mcdist.json'} (python3 bench/tables.py puts it into bench/README.md)")
    plots(doc)


if __name__ == "__main__":
    main()
