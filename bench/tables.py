#!/usr/bin/env python3
"""Tables of benchmark figures, generated from bench/out/*.json (never typed by hand).

    python3 bench/tables.py           # rewrite every marked section of bench/README.md and README.md
    python3 bench/tables.py --check   # exit 1 if a section differs from what the JSON gives (CI)
    python3 bench/tables.py --print fork   # one table on stdout

A section is the text between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; NAME is one of
the renderers below (predict, exec, exec_breakdown, data, ucop, fork, faults_before, faults_after, faults_breakdown, faults_counts, mcdist, migrate, executor, slurm, linger, linger_sim, linger_policy, auth, roam, glx). Each starts with what the run was made on: the
commit and whether the tree was clean, the date and the machine (the `provenance` the benchmarks
record, see bench/provenance.py; JSON from before that shows "unknown").
"""
import argparse
import json
import pathlib
import re
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
DOCS = [ROOT / "bench" / "README.md", ROOT / "README.md"]


def load(name):
    return json.loads((OUT / f"{name}.json").read_text())


def fmt_bytes(n):
    if n is None:
        return "-"
    if n < 10 * 1024:
        return f"{n} B"
    if n < 10 * 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1048576:.1f} MiB"


def dash(v, fmt="{}"):
    return "-" if v is None else fmt.format(v)


def table(header, rows, align=None):
    """A Markdown table; `align` per column: 'l' or 'r' (default: first column left, rest right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---" if a == "l" else "--:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def provenance_line(doc):
    p = doc.get("provenance")
    if not p:
        return "Ran on: commit unknown, tree unknown, date unknown, machine unknown (JSON from before provenance was recorded)."
    commit = p.get("commit")
    commit = f"`{commit[:12]}`" if commit else "unknown"
    clean = {True: "clean tree", False: "uncommitted changes", None: "tree unknown"}[p.get("tree_clean")]
    m = p.get("machine") or {}
    machine = f"{dash(m.get('cores'))} cores, kernel {dash(m.get('kernel'))}"
    if m.get("cpu"):
        machine += f", {m['cpu']}"
    if m.get("mem_gib"):
        machine += f", {m['mem_gib']} GiB"
    return f"Ran on: commit {commit} ({clean}), {p.get('date') or 'date unknown'}, {machine}."


# ---------------------------------------------------------------- renderers

def render_exec(doc):
    rows = []
    for link, r in doc["exec_true"].items():
        for c in ("cold", "warm"):
            x = r[c]
            rows.append([link, c, f"{x['wall_s'] * 1000:.0f}", fmt_bytes(x["bytes_up"]), fmt_bytes(x["bytes_down"]),
                         dash(x.get("rt_per_launch_max")), dash(x.get("flights_up"))])
    out = [provenance_line(doc), "", "`starling exec -- true`:", "",
           table(["link", "cache", "wall ms", "WAN up", "WAN down", "crit RTs", "flights up"], rows, list("llrrrrr"))]
    b = doc["lua_build"]
    same = "byte-identical to local" if b.get("identical") else "NOT identical to local"
    out += ["", f"Lua 5.4 build, `make -j{doc['jobs']}`, {doc['hosts']} hosts, lan ({b['files']} output files, "
                f"cluster builds {same}):", ""]
    rows = []
    for k in ("local", "cold", "warm"):
        x = b[k]
        rts = f"{x['rt_per_launch_mean']:.2f}" if x.get("rt_per_launch_mean") else "-"
        rows.append([k, f"{x['wall_s']:.2f}", x["launches"] or "-", rts])
    dc = (doc.get("breakdown") or {}).get("distcc") or {}
    if dc.get("lua_build_s") is not None:
        rows.append(["distcc, warm", f"{dc['lua_build_s']:.2f}", "-", "-"])
    out.append(table(["build", "wall s", "launches", "RTs/launch"], rows))
    if doc.get("breakdown"):
        out += ["", render_breakdown(doc["breakdown"])]
    return "\n".join(out)


CLIENT_STAGES = [("setup", "main() to launch start: config, head address, argv/env capture, runtime"),
                 ("connect", "TCP + hello to the head"),
                 ("prepare", "profile, job record and shadow index loaded; paths bound; push planned"),
                 ("launch", "Launch sent until the head says where it started"),
                 ("run_commit", "until Finished arrived and its changes were committed here"),
                 ("learn", "profile and shadow index saved")]
AGENT_STAGES = [("view_mount", "FUSE view mounted (its request threads started)"),
                ("preload", "prethrown bindings and listings loaded into it"),
                ("overlay", "overlayfs mounted over it"),
                ("spawn", "sandbox's outer init started (an exec of the binary per task until issue 18's zygote; now forked by it)"),
                ("pumps_start", "stdin/stdout/stderr pumps started"),
                ("run", "namespaces, mounts, the program, until its exit"),
                ("pumps_join", "output pumps drained"),
                ("view_stats", "bindings and accessed paths taken from the view"),
                ("exit_scan", "upper dir scanned and chunked into changes"),
                ("send", "Finished queued to the head"),
                ("overlay_unmount", "overlay unmounted (before exit_scan until issue 18; now after send)")]


def render_breakdown(bd):
    """Issue 18: one warm `exec -- true` and one warm tiny `gcc -c`, stage by stage (medians)."""
    a, b = bd["exec_true"], bd["gcc_c"]
    rows = []
    for k, what in CLIENT_STAGES:
        rows.append(["client", k, what, dash(a["client_stages_ms"].get(k), "{:.2f}"), dash(b["client_stages_ms"].get(k), "{:.2f}")])
    proc = [None if x["client_since_main_ms"] is None else x["wall_ms"] - x["client_since_main_ms"] for x in (a, b)]
    rows.append(["client", "process", "exec of the binary before main() and exit after the stats line",
                 dash(proc[0], "{:.2f}"), dash(proc[1], "{:.2f}")])
    for k, what in AGENT_STAGES:
        rows.append(["agent", k, what, dash(a["agent_stages_ms"].get(k), "{:.2f}"), dash(b["agent_stages_ms"].get(k), "{:.2f}")])
    rows.append(["agent", "cleanup", "after the reply: FUSE view unmounted, task dir removed",
                 dash(a.get("agent_cleanup_ms"), "{:.2f}"), dash(b.get("agent_cleanup_ms"), "{:.2f}")])
    rows.append(["**all**", "**wall**", "median of the runs", f"**{a['wall_ms']:.1f}**", f"**{b['wall_ms']:.1f}**"])
    for k, what in (("client", "the starling process (rusage)"), ("head", "head process"),
                    ("agents", "agents and their sandboxes (/proc, children included)"), ("total", "machine CPU per run")):
        rows.append(["CPU", k, what, f"{a['cpu_ms'][k]:.1f}", f"{b['cpu_ms'][k]:.1f}"])
    idle = bd.get("idle_ms_per_s")
    if idle and "cpu_ms_less_idle" in a:
        rows.append(["CPU", "total, less idle", f"less the head's and agents' idle background for the run's wall time "
                     f"({idle['head']:.2f} and {idle['agents']:.2f} ms per s, measured over 30 s idle)",
                     f"{a['cpu_ms_less_idle']['total']:.1f}", f"{b['cpu_ms_less_idle']['total']:.1f}"])
    out = [f"Where a warm launch goes (issue 18), lan, {a['runs']} runs each (median wall per stage; CPU averaged "
           f"over the runs; load average at the start {bd.get('loadavg')}, the machine is shared):", "",
           table(["where", "stage", "what", "`exec -- true` ms", "tiny `gcc -c` ms"], rows, list("lllrr"))]
    dc = bd.get("distcc") or {}
    distcc = f"{dc['gcc_c_ms']:.1f} ms" if dc.get("gcc_c_ms") is not None else dc.get("skipped", "not measured")
    out += ["", f"Tiny `gcc -c`: local {dash(bd.get('gcc_c_local_ms'), '{:.1f}')} ms, distcc {distcc}, "
                f"starling {b['wall_ms']:.1f} ms. Targets: `exec -- true` ≤ 8 ms wall and ≤ 5 ms CPU "
                f"(now {a['wall_ms']:.1f} ms, {a['cpu_ms']['total']:.1f} ms); tiny `gcc -c` ≤ distcc."]
    return "\n".join(out)


UCOP_SCENARIOS = [("pov_unchanged", "POV-Ray, warm"), ("pov_changed", "POV-Ray, mesh edited"),
                  ("make_unchanged", "make, warm"), ("make_changed", "make, lvm.c edited")]


def render_ucop(doc):
    res, local = doc["results"], doc["local"]
    links = doc.get("links") or list(res)
    head = provenance_line(doc)
    resumed = doc.get("resumed_from_provenance")
    if resumed:
        kept = provenance_line({"provenance": resumed} if isinstance(resumed, dict) else {})
        head += " Resumed (`--from`): the rows kept from the earlier run — " + kept[0].lower() + kept[1:]
    out = [head, "",
           f"POV-Ray {doc['width']}x{doc['height']}, {doc['tiles']} tiles; Lua `make -j{doc['jobs']}`; "
           f"{doc['hosts']} hosts; {doc['repeat']} run(s) per cell."]
    for key, title in UCOP_SCENARIOS:
        rows = []
        for link in links:
            for c, r in res.get(link, {}).items():
                if "error" in r:
                    rows.append([link, c, "failed: " + r["error"].splitlines()[0][:60]] + [""] * 6)
                    continue
                x = r[key]
                rows.append([link, c, f"{x['wall_s']:.2f}", fmt_bytes(x["bytes_up"]), fmt_bytes(x["bytes_down"]),
                             dash(x.get("round_trips")), x.get("launches") or "-", dash(x.get("flights_up")),
                             fmt_bytes(x.get("pushed_bytes"))])
        rows.append(["(any)", "local (no starling)", f"{local[key]['wall_s']:.2f}"] + [""] * 6)
        out += ["", f"{title}:", "",
                table(["link", "config", "wall s", "WAN up", "WAN down", "RTs", "launches", "flights", "pushed"], rows,
                      list("llrrrrrrr"))]
    checks, verdicts = doc.get("checks", {}), doc.get("verdicts", {})
    met = lambda k: "met" if verdicts.get(k) else "NOT met"
    lines = []
    w = checks.get("warm_launch")
    if w:
        for name in ("exec_true", "pov"):
            x = w[name]
            budget = 16 * 1024 + x["args_env_bytes"]
            lines.append(f"* warm unchanged launch ({name}, {w['link']}): {x.get('round_trips')} round trip(s) (target 1: "
                         f"{met(name + '_round_trips_eq_1')}); WAN up {x['bytes_up']} B against 16 KiB + args/env "
                         f"({x['args_env_bytes']} B) = {budget} B: {met(name + '_bytes_up_le_16KiB_plus_args')}")
        if w.get("rtt_ms"):
            t = w["exec_true"]["wall_s"] * 1000
            lines.append(f"* `exec -- true`, warm, {w['link']}: median {t:.0f} ms against 1.5 × RTT = "
                         f"{1.5 * w['rtt_ms']:.0f} ms: {met('exec_true_under_1_5_rtt')} (runs, s: {w['exec_true'].get('wall_s_all')})")
    s = checks.get("second_host")
    if s and "h2" in s:
        lines.append(f"* a 16 MiB file read on h1 then h2: WAN up {fmt_bytes(s['h1']['bytes_up'])} then "
                     f"{fmt_bytes(s['h2']['bytes_up'])} (target ~0: only the launch): {met('second_host_zero_wan_bytes_up')}")
    if lines:
        out += ["", "Target checks:", ""] + lines
    return "\n".join(out)


def render_fork(doc):
    rows = []
    for x in doc["rows"]:
        rows.append([x["mode"], x["clones"], f"{x['clone_time_ms']:.1f}", f"{x['first_clone_ms']:.1f}",
                     f"{x['sf_clone_call_ms']:.1f}", f"{x['cpu_ms']:.0f}", f"{x['cpu_ms_per_clone']:.1f}",
                     f"{x['cpu_floor_ms']:.1f}", f"{x['background_cores']:.2f}", x.get("runs_late_clones", x.get("late_clones")),
                     x["descriptor_bytes"], f"{x['pages_fetched_mean']:.0f}", x["parent_rss_kib"] // 4,
                     f"{x['fault_median_us']:.0f}", f"{x['fault_p99_us']:.0f}"])
    out = [provenance_line(doc), "",
           f"{doc['hosts']} hosts, heap {doc['heap_mib']} MiB, {doc['probes']} probes per clone, settle "
           f"{doc['settle_ms']} ms, median of {doc['repeat']} per row, {doc['cores']} cores on the machine.", "",
           table(["mode", "clones", "clone ms", "first ms", "sf_clone ms", "cpu ms", "cpu/clone", "floor ms", "bg cores",
                  "late", "desc B", "fetched/clone", "resident pg", "fault med us", "fault p99 us"], rows,
                 ["l"] + ["r"] * 14), ""]
    for mode in doc["modes"]:
        by = {x["clones"]: x for x in doc["rows"] if x["mode"] == mode}
        if len(by) < 2:
            continue
        lo, hi = min(by), max(by)
        one, big = by[lo], by[hi]
        out.append(f"* {mode}: clone-time({hi}) / clone-time({lo}) = {big['clone_time_ms'] / one['clone_time_ms']:.2f} "
                   f"({big['clone_time_ms']:.1f} / {one['clone_time_ms']:.1f} ms); creating {hi} clones used "
                   f"{big['cpu_ms']:.0f} ms of machine CPU ({big['cpu_ms_per_clone']:.1f} ms/clone), which on "
                   f"{big['cores']} cores needs at least {big['cpu_floor_ms']:.0f} ms: a CPU-bound floor of "
                   f"{big['cpu_floor_ms'] / one['clone_time_ms']:.2f} for the ratio")
    return "\n".join(out)


def render_faults(doc):
    """A one-clone fork_bench run (--out faults_before / faults_after): the fork table, its note and load."""
    load = doc.get("loadavg_after")
    tail = [f"* note: {doc['note']}"] if doc.get("note") else []
    if load:
        tail.append(f"* load average just after the run (1, 5, 15 min): {', '.join(load)} on {doc['cores']} cores")
    return "\n".join([render_fork(doc)] + tail)


def render_faults_breakdown(doc):
    out = [provenance_line(doc), "", doc["method"], "", f"Load: {doc['load']}.", ""]
    for part in ("before", "after"):
        d = doc[part]
        out += [f"**{part}** ({d['note']}):", "",
                table(["stage", "median us", "p90 us", "n"],
                      [[s["stage"], f"{s['median_us']:.1f}", f"{s['p90_us']:.1f}", s["n"]] for s in d["stages"]]), ""]
    return "\n".join(out).rstrip()


def render_faults_counts(doc):
    """Per-fault counts of the fault path's two threads (perf stat -t), one row per run."""
    def switches(t):
        split = f" (sleep {t['sleeps']:.2f}, preempted {t['preemptions']:.2f})" if "sleeps" in t else ""
        return f"{t['context_switches']:.2f}{split}"
    rows = []
    for r in doc["runs"]:
        h, sv = r["handler"], r["server"]
        rows.append([r["build"], r["reply_spin_us"], f"{h['syscalls']:.2f}", switches(h),
                     f"{h['cpu_us']:.1f}", f"{sv['syscalls']:.2f}", switches(sv),
                     f"{sv['cpu_us']:.1f}", f"{r['median_us']:.1f}", f"{r['p99_us']:.0f}", r["load"]])
    out = [provenance_line(doc), "", doc["method"], "",
           table(["build", "spin us", "handler syscalls", "handler switches", "handler cpu us", "server syscalls",
                  "server switches", "server cpu us", "fault med us", "fault p99 us", "load 1 min"],
                 rows, ["l"] + ["r"] * 10)]
    out += [""] + [f"* {n}" for n in doc.get("notes", [])]
    return "\n".join(out).rstrip()


def render_mcdist(doc):
    rows = []
    for x in doc["rows"]:
        rows.append([x["workload"], "on" if x["heuristics"] else "off", x["mode"], x["clones"], f"{x['clone_time_ms']:.0f}",
                     f"{x['completion_s']:.2f}", x["pages_requested"], x["pages_served"], f"{x['bytes_wire'] / 1e6:.1f}",
                     f"{x['bridge_tx_bytes'] / 1e6:.1f}", x["rate_cuts"]])
    out = [provenance_line(doc), "",
           f"{doc['hosts']} hosts, {doc['data_mib']} MiB dataset, {doc['scratch_mib']} MiB scratch.", "",
           table(["workload", "heur", "mode", "N", "clone ms", "done s", "requested", "served", "wire MB", "bridge MB", "cuts"],
                 rows, list("lll") + ["r"] * 8), ""]
    for k, v in doc.get("ratios", {}).items():
        out.append(f"* {k}: bytes(32) / bytes(1) = {v['bytes_32_over_1']:.2f}, "
                   f"clone-time(32) / clone-time(1) = {v['clone_time_32_over_1']:.2f}")
    return "\n".join(out)


def render_executor(doc):
    rows = []
    for r in doc["modes"]:
        rows.append([r["mode"], r["workers"], dash(r.get("first_s"), "{:.2f}"), dash(r.get("total_s"), "{:.2f}"),
                     fmt_bytes(r.get("pickle_bytes")), fmt_bytes(r.get("page_server_bytes")),
                     fmt_bytes(r["bytes_moved"]), dash(r.get("max_abs_diff_vs_local"), "{:.1e}")])
    out = [provenance_line(doc), "",
           f"{doc['table_mib']} MiB table ({doc['rows']} × {doc['cols']} float64) built before the pools in "
           f"{doc['build_s']} s; {doc['tasks']} ridge fits, each reading the same {fmt_bytes(doc['window_bytes'])} "
           f"window ({doc['window_rows']} rows, 10% of the table); {doc['workers']} workers (cluster modes: on "
           f"{len(doc['modes'][0].get('hosts') or [])} of {doc['hosts']} emulated hosts, which share this machine's "
           f"cores; pages fetched by the starling workers: {doc['modes'][0].get('pages_fetched_by_workers')}, "
           f"sent once for several of them by multicast).", "",
           table(["mode", "workers", "first result s", "total s", "pickles", "page server", "bytes moved",
                  "max diff vs local"], rows, list("lr") + ["r"] * 6), ""]
    for k, v in doc["ratios"].items():
        verdict = "met" if v <= 0.10 else "NOT met"
        out.append(f"* bytes moved, {k}: {v * 100:.1f}% (target <= 10%: {verdict})")
    return "\n".join(out)


def render_migrate(doc):
    rows = []
    for x in doc["rows"]:
        rows.append([x["mode"], x["resident_mib"], x["write_mib_s"], f"{x['task_pause_ms']:.1f}", f"{x['source_pause_ms']:.1f}",
                     f"{x['total_ms']:.0f}", x["rounds"], f"{x['bytes_over_footprint']:.3f}", fmt_bytes(x["footprint_bytes"]),
                     x["precopy_pages"], x["freeze_pages"], x["postcopy_pages"], dash(x.get("postcopy_faults")),
                     dash(x.get("fault_p50_us"), "≤{}"), dash(x.get("fault_p99_us"), "≤{}")])
    t = doc.get("targets", {})
    ok = {True: "met", False: "NOT met", None: "not measured"}
    return "\n".join([provenance_line(doc), "",
                      f"{doc['hosts']} emulated hosts sharing {doc['cores']} cores; one move h1 -> h2 per row.", "",
                      table(["mode", "MiB", "writes MiB/s", "pause (task) ms", "pause (source) ms", "total ms", "rounds",
                             "bytes/footprint", "footprint", "pre-copy pg", "freeze pg", "post-copy pg", "faults after",
                             "fault p50 µs", "fault p99 µs"], rows,
                            ["l"] + ["r"] * 14), "",
                      f"* pause <= 100 ms at 10 MiB/s, every size: {ok[t.get('pause_le_100ms_at_10mib_s')]}",
                      f"* bytes moved <= 1.15 x footprint at 10 MiB/s: {ok[t.get('bytes_le_1_15_footprint_at_10mib_s')]}"])


def render_roam(doc):
    ok = {True: "met", False: "NOT met", None: "not measured"}
    f1 = lambda v: dash(v, "{:.1f}")
    rows = []
    for r in doc["rows"]:
        for ph in r["phases"]:
            inter = ph["kind"] == "interactive"
            moves = [m for m in r["moves"] if m["phase"] == f"{ph['kind']} {ph['cycle']}"]
            rows.append([r["link"], r["mode"], f"{ph['kind']} {ph['cycle'] + 1}", f"{ph['wall_s']:.2f}",
                         f1(ph.get("latency_p50_ms")) if inter else "", f1(ph.get("latency_p95_ms")) if inter else "",
                         "" if inter else f1(ph.get("longest_gap_ms")),
                         ", ".join(f"{m['from']}→{m['to']}" for m in moves),
                         ", ".join(f1(m["detect_s"]) for m in moves), ", ".join(dash(m["migrate_ms"], "{:.0f}") for m in moves),
                         ", ".join(f1(m["pause_ms"]) for m in moves)])
    totals = [[r["link"], r["mode"], f"{r['total_s']:.1f}", f"{r['crunch_s']:.1f}", dash(r.get("cpu_seconds"), "{:.1f}"),
               len(r["moves"])] for r in doc["rows"]]
    proj = [[p["link"], p["mode"], f"{p['cpu_per_crunch_s']:.1f}", f"{p['projected_crunch_s']:.1f}", f"{p['projected_total_s']:.1f}"]
            for p in doc.get("projected_own_cores", [])]
    prm = doc["params"]
    out = [provenance_line(doc), "",
           f"{doc['hosts']} emulated hosts; {prm['cycles']} cycles of {prm['keys']} keys ({prm['key_gap_s']} s apart) then a crunch "
           f"({prm['rounds']:,} rounds); home = this machine, cluster = h1 over the link, roam = the shortened generic profile.", "",
           table(["link", "run", "phase", "wall s", "key→echo p50 ms", "p95 ms", "longest gap ms", "moves", "detect s", "migrate ms",
                  "pause ms"], rows, list("lll") + ["r"] * 8), "",
           table(["link", "run", "total s", "crunch s", "CPU s", "moves"], totals, list("ll") + ["r"] * 4), ""]
    for link, t in doc.get("targets", {}).items():
        phases = t["roam_phase_within_10pct_of_best"]
        lat = t["latency_p50_within_10pct_of_home"]
        out += [f"* {link}: roaming phase within 10% of the best of home and cluster: {sum(phases)}/{len(phases)} phases; "
                f"total: {ok[t['roam_total_within_10pct_of_best']]}; key latency p50 within 10% of home: {sum(lat)}/{len(lat)} "
                f"interactive phases; pause <= 100 ms: {ok[t['pause_le_100ms']]}"]
    if proj:
        out += ["", f"Projected (not measured), for hosts with cores of their own {prm['speedup_assumed']}x as fast as home's: "
                "each crunch takes its measured CPU seconds / that speedup on the cluster (home: its CPU seconds), plus each "
                "move's measured pause; interactive phases as measured.", "",
                table(["link", "run", "CPU s per crunch", "crunch s", "total s"], proj, list("ll") + ["r"] * 3)]
    return "\n".join(out)


def render_glx(doc):
    rows = [[r["link"], r["mode"], dash(r["fps_median"], "{:.1f}"), ", ".join(f"{f:.1f}" for f in r["fps_reports"]),
             dash(r["colours"]), "yes" if r["painted"] else "NO"] for r in doc["rows"]]
    better = "; ".join(f"{link}: {mode or 'neither painted'}" for link, mode in doc["more_fps_painted"].items())
    prm = doc["params"]
    return "\n".join([provenance_line(doc), "",
                      f"glxgears {prm['size']}x{prm['size']} for {prm['seconds']} s per run; load average at the end "
                      f"{doc['load_at_end']:.1f} on {doc['cores']} cores. images = rendered where the program runs (Mesa "
                      "llvmpipe), sent as X images through the relay; indirect = GLX requests through the relay "
                      "(LIBGL_ALWAYS_INDIRECT=1). painted: more than two colours in the window while it ran.", "",
                      table(["link", "mode", "FPS (median)", "FPS reports", "colours", "painted"], rows,
                            list("ll") + ["r"] * 3 + ["l"]), "",
                      f"More frames per second among runs that painted: {better}."])


def render_slurm(doc):
    rows = [[r["mode"], r["hosts"], f"{r['registered_s']:.2f}", f"{r['up_s']:.2f}", f"{r['first_task_s']:.2f}",
             dash(r.get("step_to_connected_s"), "{:.2f}")] for r in doc["rows"]]
    out = [provenance_line(doc), "",
           f"{doc['nodes']} nodes, {doc['repeat']} run(s) per mode (medians); times from the start of `starling up`.", "",
           table(["mode", "hosts", "all registered s", "up returned s", "first task s", "step → agents connected s"], rows)]
    s = doc["rows"][0].get("step_to_connected_s")
    if s is not None:
        out += ["", f"* Slurm step start → all agents connected: {s:.2f} s (target ≤ 2 s: {'met' if s <= 2 else 'not met'})"]
    return "\n".join(out)



def render_linger(doc):
    rows = [
        [r["guests"], f"{r['owner_s']:.3f}", f"{r['owner_delay_pct']:+.1f}%", f"{r['lat_p50_us']:.0f}",
         f"{r['lat_p99_us']:.0f}", dash(r.get("p99_delay_pct"), "{:+.1f}%"), f"{r['lat_max_us']:.0f}"]
        for r in doc["rows"]
    ]
    head = ["guests on every core", "owner CPU-bound (s)", "owner delay", "wake-up p50 (µs)", "p99 (µs)", "p99 delay",
            "max (µs)"]
    note = (f"{doc['cores']} owner processes of fixed work and cyclictest (-t{doc['cores']} -i 1000 -l "
            f"{doc['cyclictest_loops']}); medians of {doc['rounds']} interleaved rounds; machine load before each "
            f"measurement (other programs) {min(x['load_before'] for r in doc['rows'] for x in r['runs']):.1f}–"
            f"{max(x['load_before'] for r in doc['rows'] for x in r['runs']):.1f}.")
    out = provenance_line(doc) + "\n\n" + note + "\n\n" + table(head, rows)
    if "memory" in doc:
        mem_rows = []
        for r in doc["memory"]:
            guest = [x for x in r["runs"] if "guest_exit" in x]
            caps = [x["guest_mem_cap_mib"] for x in guest if x.get("guest_mem_cap_mib")]
            mem_rows.append([
                r["guests"], f"{r['owner_s']:.3f}", f"{r['owner_delay_pct']:+.1f}%", "yes" if r["owner_killed"] else "no",
                f"{max(x['guest_bytes'] for x in guest) / 2**30:.1f} GiB" if guest else "—",
                (f"capped at {min(caps)} MiB" if caps else "not capped") + (", frozen" if any(x.get("guests_frozen") for x in guest) else "")
                if guest else "—",
                ", ".join(sorted({"running" if x["guest_exit"] is None else f"exit {x['guest_exit']}" for x in guest})) or "—",
                str(r["oom_kills"]),
            ])
        mem_head = ["memory: guest", "owner (s)", "owner delay", "owner killed", "guest held", "agent did", "guest after",
                    "OOM kills"]
        out += (f"\n\nThe owner touches {doc['owner_mem_bytes'] / 2**30:.1f} GiB (half the machine) page by page, "
                f"{doc['mem_passes']} times; medians of {len(doc['memory'][0]['runs'])} rounds.\n\n" + table(mem_head, mem_rows))
    return out


def render_linger_sim(doc):
    seed_pol = doc["seed_policies"]
    out = [provenance_line(doc), "",
           f"Simulated: {doc['nodes']} nodes, synthetic trace (seed {doc['seed']}: idle "
           f"{doc['trace']['idle_fraction'] * 100:.1f}% of the time; CPU < 10% {doc['trace']['util_lt_10'] * 100:.1f}%, "
           f"10–80% {doc['trace']['util_10_80'] * 100:.1f}%, ≥ 80% {doc['trace']['util_ge_80'] * 100:.1f}%), "
           f"T_migr {doc['t_migr_s']:.1f} s, PM pause {doc['pm_pause_s']:.0f} s, context switch "
           f"{doc['cs_s'] * 1e6:.0f} µs; simulated in {doc['runtime_s']:.1f} s. \"seed\" = the dissertation's Table 1. "
           "Throughput = guest CPU-s per second (of 64 nodes) over one hour with the job count held constant."]
    names = {"workload1": "Workload-1 (128 jobs × 600 CPU-s)", "workload2": "Workload-2 (16 jobs × 1800 CPU-s)"}
    for wl, rows in doc["results"].items():
        seed = doc["seed_table1"][wl]
        trs = []
        for p, r in rows.items():
            k = seed_pol.index(p) if p in seed_pol else None
            sv = (lambda m, f: f.format(seed[m][k]) if k is not None else "-")
            trs.append([p, f"{r['avg_job_time_s']:.0f}", sv("avg_job_time_s", "{}"),
                        f"{r['variation_pct']:.1f}%", sv("variation_pct", "{}%"),
                        f"{r['family_time_s']:.0f}", sv("family_time_s", "{}"),
                        f"{r['throughput']:.1f}", sv("throughput", "{}"),
                        r["migrations"], r["restarts"], f"{r['linger_share_pct']:.0f}%", f"{r['owner_delay_pct']:.2f}%"])
        out += ["", names.get(wl, wl) + ":", "",
                table(["policy", "avg job s", "seed", "variation", "seed", "family s", "seed", "throughput", "seed",
                       "migrations", "restarts", "CPU lingering", "owner delay"], trs)]
    v = doc["verdicts"]
    met = lambda k: "met" if v.get(k) else "NOT met"
    out += ["", f"* Workload-1: min(LL, LF) ÷ max(IE, PM) throughput = {doc['w1_throughput_ratio']:.2f} "
                f"(target ≥ 1.5: {met('w1_linger_ge_1_5x_evict')}; the seed's: {52.2 / 34.6:.2f})",
            f"* Workload-2: LL/LF/IE throughput max ÷ min = {doc['w2_throughput_spread']:.3f} (tie within 5%: "
            f"{met('w2_ll_lf_ie_tie_within_5pct')}; the seed's all-four spread: {15.0 / 14.5:.3f})"]
    sens = doc.get("sensitivity") or []
    if sens:
        rows = [[x["seed"], f"{x['episode_mean_s'] / 60:.0f}", f"{x['idle_fraction'] * 100:.1f}%"] +
                [f"{x['w1_throughput'][p]:.1f}" for p in seed_pol] + [f"{x['w1_ratio']:.2f}", f"{x['w2_spread']:.3f}"]
                for x in sens]
        out += ["", "The same with other trace seeds and non-idle episode means (the trace's assumptions):", "",
                table(["seed", "episode mean min", "idle"] + [f"W-1 {p}" for p in seed_pol] +
                      ["W-1 ratio", "W-2 LL/LF/IE spread"], rows)]
    return "\n".join(out)


def render_linger_policy(doc):
    rows = []
    for r in doc["rows"]:
        load = r.get("load")
        rows.append([r["policy"] + (" (stopped at the deadline)" if r.get("timed_out") else ""), f"{r['makespan_s']:.1f}",
                     dash(r.get("mean_job_s"), "{:.1f}"),
                     "-" if r.get("timed_out") else f"{r['throughput_steps_per_s']:.2f}", r["moves"], r["reruns"],
                     dash(r.get("owner_delay_pct"), "{:+.1f}%"), f"{r['outputs_ok']}/{doc['jobs']}", r["exit"],
                     f"{load['median']:.1f} ({load['min']:.1f}–{load['max']:.1f})" if load else "-"])
    note = (f"{doc['hosts']} emulated hosts; {doc['jobs']} guest jobs of {doc['steps']} steps (0.25 s sleep + a short "
            f"loop each); owners' keyboard episodes from linger_sim's synthetic trace (seed {doc['seed']}) compressed "
            f"{doc['compress']:.0f}× (owners active {doc['owner_active_share'] * 100:.0f}% of the replayed time); "
            f"PM pause {doc['pm_pause_s']} s. Owner delay: a fixed owner CPU probe during the run against alone "
            "(the machine's other load moves it by more than the guests do). Load = this machine's 1-min load average "
            "during the run, median (min–max): guests at cpu.idle get only the CPU other programs leave.")
    ratio = doc.get("ll_ie_ratio")
    tail = f"\n\n* LL ÷ IE throughput = {ratio:.2f} (issue target ≥ 1.6)" if ratio else ""
    return (provenance_line(doc) + "\n\n" + note + "\n\n" +
            table(["policy", "makespan s", "mean job s", "steps/s", "moves", "IE reruns", "owner delay", "outputs ok",
                   "exit", "load"], rows) + tail)


def render_auth(doc):
    rows = [[r["path"], f"{r['insecure_ms']:.1f}", f"{r['auth_ms']:.1f}", f"{r['delta_pct']:+.1f}%", r["runs"]]
            for r in doc["rows"]]
    note = (f"Warm `starling exec -- true`, {doc['hosts']} hosts, medians of {doc['rounds']} interleaved rounds × "
            f"{doc['runs_per_round']} runs; machine load (other programs) {doc['load_min']:.1f}–{doc['load_max']:.1f}. "
            "insecure: `up --insecure` (plain TCP, for this measurement only); auth: the default (client on the "
            "head's Unix socket or the relay's, mutual TLS between head, agents and relay).")
    out = [provenance_line(doc), "", note, "",
           table(["path", "insecure ms", "auth ms", "auth cost", "runs"], rows)]
    worst = max(r["delta_pct"] for r in doc["rows"])
    out += ["", f"* authenticated ≤ 5 % slower: {'met' if worst <= 5 else 'not met'} (worst {worst:+.1f}%)"]
    f = doc.get("faults")
    if f:
        dists = {1: "multicast", 2: "multicast push", 3: "unicast", 4: "unicast fallback"}
        frows = [[r["mode"], f"`{r['up']}`, fork.encrypt {r['fork_encrypt']}", f"{r['median_us']:.0f}", f"{r['p99_us']:.0f}",
                  f"{r['mean_us']:.0f}", f"{r['total_ms']:.1f}", r["probes"], r["faults"], r["pages_fetched"],
                  f"{r['median_ratio']:.2f}", f"{r['mean_ratio']:.2f}"] for r in f["rows"]]
        dist = sorted({dists.get(d, str(d)) for r in f["rows"] for d in r["dist"]})
        out += ["", f"Page-fault service: a one-clone remote fork ({', '.join(dist)}: from the parent's page server over "
                f"TCP) whose clone times its first touches of heap pages 64 pages apart, each a fault its host's handler "
                f"serves with one request; {f['probes_per_run']} touches per run, {f['rounds']} interleaved rounds (after "
                f"a discarded run per cluster); median and p99 are medians over the rounds, mean and total over every "
                f"touch; faults and pages: the clones' handler counters (`sf_clone_stat`), all rounds. Machine load "
                f"{f['load_min']:.1f}–{f['load_max']:.1f}: the hosts, the parent and its page server share this "
                f"machine's cores with other programs, so these are rough.", "",
                table(["mode", "cluster", "median µs", "p99 µs", "mean µs", "total ms", "touches", "faults",
                       "pages fetched", "median ÷ insecure", "mean ÷ insecure"], frows, list("llrrrrrrrrr"))]
        worst_fault = max(max(r["median_ratio"], r["mean_ratio"]) for r in f["rows"])
        out += ["", f"* page faults with authentication and encryption ≤ 5 % slower: "
                f"{'met' if worst_fault <= 1.05 else 'not met'} (worst ratio {worst_fault:.2f})"]
    return "\n".join(out)


def render_predict(doc):
    loc = doc["local"]
    names = {"build1": "first build (fresh client cache, warm cluster)", "build2": "second build", "build3": "third build",
             "edit": "lvm.c edited (one line)"}
    rows = []
    for k in ("build1", "build2", "build3", "edit"):
        r = doc["results"][k]
        cores = r["guest_cpu_s"] / r["wall_s"] if r.get("guest_cpu_s") is not None else None
        rows.append([names[k], f"{r['wall_s']:.2f}", dash(r.get("load")), dash(r.get("guest_cpu_s"), "{:.1f}"),
                     dash(cores, "{:.2f}"), dash(r["launches"]), dash(r["file_requests"]),
                     dash(r["requests_per_launch"], "{:.2f}"), fmt_bytes(r["bytes_up"]), fmt_bytes(r["pushed_bytes"]),
                     dash(r["prethrow_bytes_per_launch"], "{:.0f} B")])
    head = ["case", "wall s", "load", "hosts' CPU s", "hosts' cores", "launches", "file requests", "per launch", "WAN up", "pushed", "prediction sent per launch"]
    v = doc["verdicts"]
    yes = lambda k: "met" if v[k] else "NOT met"  # noqa: E731
    local = f"Local: build {loc['build_wall_s']:.2f} s, edit {loc['edit_wall_s']:.2f} s"
    if "build_cpu_s" in loc:
        local += f" (build {loc['build_cpu_s']:.1f} s CPU; load {loc['load']})"
    out = [provenance_line(doc), "",
           f"Lua, `make -j{doc['jobs']} CC='starling exec --job J gcc'`, {doc['link']}, `{doc['config']}`, {doc['hosts']} hosts "
           f"(emulated, sharing the machine's cores). load = 1-minute load average during the case; hosts' CPU = what "
           f"the emulated hosts' cgroups used (their tasks run at idle CPU priority: on a busy machine they get what "
           f"its other work leaves, and wall times measure that). {local}.", "",
           table(head, rows), "",
           f"* second build ≤ 1 file request per launch: {yes('second_build_le_1_request_per_launch')}",
           f"* second build ≤ 1.3 × local wall: {yes('second_build_le_1_3_local')}",
           f"* edit ≤ 1.5 × local wall: {yes('edit_le_1_5_local')}",
           f"* fresh client cache on a warm cluster pushes ≤ 1 MB: {yes('fresh_client_warm_cluster_pushes_le_1MB')}"]
    return "\n".join(out)


def render_exec_breakdown(doc):
    return provenance_line(doc) + "\n\n" + render_breakdown(doc)


def render_data(doc):
    mib = doc["mib"]
    mb = mib * (1 << 20) / 1e6

    def rate(t, minus=0.0):
        t = t - minus
        return f"{mb / t:.0f}" if t > 0 else "-"

    rows = []
    for tag, run in doc["runs"].items():
        s = run["single"]
        over = run["exec_true_s"] + doc["local_md5_s"]
        for what, label in (("cold", "cold, one host"), ("relay", "relay cache, another host"), ("warm", "warm (host cache)")):
            x = s[what]
            rows.append([tag, label, f"{x['wall_s']:.2f}", rate(x["wall_s"]),
                         rate(x["wall_s"], over) if what != "warm" else "-", fmt_bytes(x["to_hosts_bytes"]),
                         dash(x.get("cpu_s"), "{:.2f}")])
    single = table(["hosts' links", "read of a new file", "wall s", "MB/s end to end", "data MB/s", "to hosts",
                    "data-path CPU s"], rows, list("llrrrrr"))
    frows = []
    for tag, run in doc["runs"].items():
        one = next((f["wall_s"] for f in run["fanout"] if f["hosts"] == 1), None)
        for f in run["fanout"]:
            frows.append([tag, f["hosts"], f["distinct_hosts"], f"{f['wall_s']:.2f}",
                          dash(one and f["wall_s"] / one, "{:.2f}×"), fmt_bytes(f["head_egress_bytes"]),
                          f"{f['head_egress_bytes'] / (mib << 20):.2f}×", fmt_bytes(f["to_hosts_bytes"]) if "to_hosts_bytes" in f else "-",
                          dash(f.get("cpu_s"), "{:.2f}"), f"{f['load_before']:.1f}"])
    fan = table(["hosts' links", "tasks", "hosts", "wall s", "÷ one", "head egress", "÷ file", "into hosts",
                 "data-path CPU s", "load before"], frows, list("lrrrrrrrrr"))
    warm = [f"{tag}: warm exec {run['single']['warm']['wall_s']:.2f} s ÷ local {doc['local_md5_s']:.2f} s = "
            f"{run['single']['warm']['wall_s'] / doc['local_md5_s']:.2f} (`exec -- true` alone: {run['exec_true_s']:.2f} s)"
            for tag, run in doc["runs"].items()]
    note = (f"A new {mib} MiB file of random bytes per measurement, on a cluster of {doc['hosts']} emulated hosts "
            f"sharing this machine's {(doc.get('provenance') or {}).get('machine', {}).get('cores', '?')} cores with "
            f"the head, the client and other work. Local `md5sum`: {doc['local_md5_s']:.2f} s; "
            "\"data MB/s\" leaves out the exec's own time (`exec -- true`) and the local md5sum. "
            "Warm read ÷ local: " + "; ".join(warm) + ". "
            "Data-path CPU: seconds the head, the agents and the client used (tasks excluded)."
            + (f" {doc['note']}" if doc.get("note") else ""))
    return (provenance_line(doc) + "\n\n" + note + "\n\n" + single + "\n\n"
            + "`starling run -n N -- md5sum F` (one task per host), all at once:\n\n" + fan)


RENDERERS = {"predict": render_predict, "exec": render_exec, "exec_breakdown": render_exec_breakdown, "exec_breakdown_before": render_exec_breakdown,
             "data": render_data, "ucop": render_ucop, "fork": render_fork, "faults_before": render_faults,
             "faults_after": render_faults, "faults_breakdown": render_faults_breakdown,
             "faults_counts": render_faults_counts, "mcdist": render_mcdist, "migrate": render_migrate,
             "slurm": render_slurm, "executor": render_executor, "linger": render_linger, "auth": render_auth,
             "linger_sim": render_linger_sim, "linger_policy": render_linger_policy, "roam": render_roam,
             "glx": render_glx}

SECTION = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


def render(name):
    return RENDERERS[name](load(name))


def regenerate(text, where):
    def repl(m):
        name = m.group(2)
        if name not in RENDERERS:
            sys.exit(f"{where}: unknown table {name!r} (known: {', '.join(RENDERERS)})")
        return m.group(1) + render(name) + "\n" + m.group(4)
    return SECTION.sub(repl, text)


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `tables.py --print x | head` ends quietly
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a marked section is not what the JSON gives")
    ap.add_argument("--print", dest="print_name", choices=sorted(RENDERERS), help="print one table and exit")
    a = ap.parse_args()
    if a.print_name:
        print(render(a.print_name))
        return 0
    stale = []
    for doc in DOCS:
        if not doc.exists():
            continue
        text = doc.read_text()
        new = regenerate(text, doc)
        if new == text:
            continue
        rel = doc.relative_to(ROOT)
        if a.check:
            stale.append(str(rel))
        else:
            doc.write_text(new)
            print(f"rewrote the tables in {rel}")
    if stale:
        print(f"stale benchmark tables in {', '.join(stale)}: run python3 bench/tables.py (they come from bench/out/*.json)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
