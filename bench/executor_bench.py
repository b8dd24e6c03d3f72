#!/usr/bin/env python3
"""starling.Executor against a local ProcessPoolExecutor and against shipping the data by pickle (issue 14).

The workload: a 512 MiB float64 table (2,097,152 rows × 32 columns, --mib to change) is built in
this interpreter BEFORE any pool; then a sweep of 64 ridge-regression fits (32 target columns × 2
regularisations), each on the most recent 10% of the rows (its Gram matrix: every task reads that
window, 51 MiB, and nothing else — each task touches ≤ 10% of the data). Three ways to run it,
with the same number of workers (--workers, default 4):

* starling: `starling.Executor`; a call passes `D[lo:hi]` (a view of the pre-pool table), which
  goes as a reference: the workers read the window from the memory they were cloned with,
  fetching its pages lazily from this machine (page server, multicast when they ask together).
* process-pool: `concurrent.futures.ProcessPoolExecutor` on this machine (fork start method: the
  workers inherit the table; a call passes only (lo, hi, target, lambda)). Moves nothing over a
  network; it is the local baseline for time.
* pickle-slice: the same cluster workers (a starling.Executor), but each call ships its window by
  value (`starling.by_value(D[lo:hi])`: pickled, 51 MiB per call) — what a pool that cannot share
  memory does when the caller knows exactly which slice a task needs.

And, counted but not run: ray/dask-put — the table pickled once to every worker (how Ray's
`ray.put` or Dask's `scatter(broadcast=True)` make data available to tasks that reference it):
workers × the pickle's size.

Per mode: time to first result and total time (from just before the pool is made), and bytes
moved: for the cluster modes the call and result pickles plus everything the page server sent
(`bytes_wire`: TCP + multicast, with headers; it includes the interpreter pages the workers touch).
The results of every mode are compared with a local run (max abs difference).

Runs on cluster instance $STARLING_INSTANCE (7 if unset), starts it with --hosts hosts and stops it
at the end unless --keep. Writes a table to stdout and JSON to bench/out/executor.json
(`python3 bench/tables.py` renders it into bench/README.md).
"""
import os

# One BLAS thread per process: the hosts share this machine's cores, and results must not depend
# on how a reduction was split among threads.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from provenance import provenance  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/out"
STARLING = ROOT / "target/release/starling"
os.environ.setdefault("STARLING_INSTANCE", "7")
os.environ.pop("STARLING_FORK_BACKEND", None)

D = None  # the table, built in main() before any pool


def ridge_gram(window, target, lam):
    """Ridge coefficients predicting column `target` of `window` from its other columns."""
    g = window.T @ window
    keep = [c for c in range(g.shape[0]) if c != target]
    a = g[np.ix_(keep, keep)] + lam * np.eye(len(keep))
    return np.linalg.solve(a, g[keep, target])


def ridge_rows(lo, hi, target, lam):
    return ridge_gram(D[lo:hi], target, lam)


def run_mode(name, make_pool, submit_all, workers):
    t0 = time.perf_counter()
    pool = make_pool()
    futures = submit_all(pool)
    first = None
    for f in cf.as_completed(futures):
        f.result()
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    results = [f.result() for f in futures]
    stats = pool.stats() if hasattr(pool, "stats") else None
    pool.shutdown(wait=True)
    row = {"mode": name, "workers": workers, "first_s": round(first, 3), "total_s": round(total, 3)}
    if stats is not None:
        row.update({
            "pickle_bytes": stats["bytes_sent"] + stats["bytes_received"],
            "page_server_bytes": stats["bytes_wire"],
            "bytes_moved": stats["bytes_sent"] + stats["bytes_received"] + stats["bytes_wire"],
            "pages_served": stats["pages_served"],
            "multicast_bytes": stats["bytes_multicast"],
            "hosts": stats["hosts"],
        })
        pages = [pool.clone_stats(i) for i in range(1, pool.max_workers + 1)]
        row["pages_fetched_by_workers"] = sum(p["pages_fetched"] for p in pages if p)
    else:
        row.update({"pickle_bytes": None, "page_server_bytes": None, "bytes_moved": 0})
    return row, results


def main():
    global D
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="table size in MiB (default 512)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    a = ap.parse_args()
    import starling

    subprocess.run([str(STARLING), "down"], capture_output=True)
    r = subprocess.run([str(STARLING), "up", "--hosts", str(a.hosts)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"starling up failed: {r.stderr}")
    try:
        cols = 32
        rows = a.mib * 1024 * 1024 // (8 * cols)
        t = time.perf_counter()
        D = np.random.default_rng(14).standard_normal((rows, cols))
        build_s = time.perf_counter() - t
        lo, hi = rows - rows // 10, rows
        window_bytes = D[lo:hi].nbytes
        tasks = [(target, lam) for lam in (0.1, 10.0) for target in range(cols)]
        local = [ridge_rows(lo, hi, tg, lam) for tg, lam in tasks]

        modes = {
            "starling": (lambda: starling.Executor(max_workers=a.workers),
                         lambda ex: [ex.submit(ridge_gram, D[lo:hi], tg, lam) for tg, lam in tasks]),
            "process-pool": (lambda: cf.ProcessPoolExecutor(max_workers=a.workers),
                             lambda ex: [ex.submit(ridge_rows, lo, hi, tg, lam) for tg, lam in tasks]),
            "pickle-slice": (lambda: starling.Executor(max_workers=a.workers),
                             lambda ex: [ex.submit(ridge_gram, starling.by_value(D[lo:hi]), tg, lam)
                                         for tg, lam in tasks]),
        }
        rowsout = []
        for name, (make, submit_all) in modes.items():
            row, results = run_mode(name, make, submit_all, a.workers)
            row["max_abs_diff_vs_local"] = float(max(np.max(np.abs(x - y)) for x, y in zip(results, local)))
            rowsout.append(row)
            print(f"{name}: {row}", file=sys.stderr, flush=True)
        table_pickle = len(pickle.dumps(D, protocol=pickle.HIGHEST_PROTOCOL))
        rowsout.append({"mode": "ray/dask-put (counted, not run)", "workers": a.workers, "first_s": None,
                        "total_s": None, "bytes_moved": a.workers * table_pickle,
                        "pickle_bytes": a.workers * table_pickle, "page_server_bytes": None})
        by = {r["mode"]: r for r in rowsout}
        s = by["starling"]["bytes_moved"]
        ratios = {
            "starling / pickle-slice": s / by["pickle-slice"]["bytes_moved"],
            "starling / ray/dask-put": s / by["ray/dask-put (counted, not run)"]["bytes_moved"],
        }
        doc = {
            "provenance": provenance(),
            "table_mib": a.mib, "rows": rows, "cols": cols, "build_s": round(build_s, 2),
            "window_rows": hi - lo, "window_bytes": window_bytes, "tasks": len(tasks),
            "workers": a.workers, "hosts": a.hosts,
            "modes": rowsout,
            "ratios": ratios,
            "target": "bytes moved by starling <= 10% of the pickle approach",
        }
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "executor.json").write_text(json.dumps(doc, indent=1) + "\n")
        sys.path.insert(0, str(ROOT / "bench"))
        import tables

        print(tables.render_executor(doc))
    finally:
        if not a.keep:
            subprocess.run([str(STARLING), "down"], capture_output=True)


if __name__ == "__main__":
    main()
