"""Issue 19: a job's tasks are bound what the job's earlier tasks of the same program used.

A small multi-file C project with headers is built with `make CC='starling exec --job J gcc'`
on the default (lan) cluster, with a private client cache. File requests the client answered
are counted through STARLING_STATS_FILE (one JSON line per launch)."""
import json
import os
import pathlib
import shutil
import subprocess

from conftest import ROOT, STARLING

N_SOURCES = 6

MAKEFILE = """\
SRCS := $(wildcard src/*.c)
OBJS := $(SRCS:src/%.c=obj/%.o)
all: $(OBJS)
obj/%.o: src/%.c
\t@mkdir -p obj
\t$(CC) -O1 -Iinclude -Iinclude/sub -c $< -o $@
"""


def write_project(d):
    (d / "src").mkdir(parents=True)
    (d / "include" / "sub").mkdir(parents=True)
    (d / "Makefile").write_text(MAKEFILE)
    (d / "include" / "common.h").write_text("#pragma once\n#include <stdio.h>\n#include <string.h>\n#define SCALE 3\n")
    (d / "include" / "sub" / "extra.h").write_text("#pragma once\n#include <stdlib.h>\nstatic inline int twice(int x) { return 2 * x; }\n")
    for i in range(N_SOURCES):
        (d / "include" / f"m{i}.h").write_text(f"#pragma once\n#include \"common.h\"\nint f{i}(int);\n")
        (d / "src" / f"m{i}.c").write_text(
            f"#include \"m{i}.h\"\n#include \"extra.h\"\n"
            f"int f{i}(int x) {{ char b[32]; snprintf(b, sizeof b, \"%d\", x); return (int)strlen(b) * SCALE + twice({i}); }}\n")


def env(cache, stats):
    e = dict(os.environ, STARLING_CACHE=str(cache), STARLING_STATS_FILE=str(stats))
    e.pop("STARLING_CLUSTER", None)
    return e


def make(d, cc, e, job=None, jobs=4):
    if job:
        cc = f"{STARLING} exec --job {job} {cc}"
    r = subprocess.run(["make", "-s", f"-j{jobs}", f"CC={cc}"], cwd=d, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"make failed:\n{r.stdout}\n{r.stderr}"


def launches(stats):
    """The STARLING_STATS_FILE lines of the launches since the last call (the file is then removed)."""
    lines = [json.loads(l) for l in stats.read_text().splitlines()] if stats.exists() else []
    stats.unlink(missing_ok=True)
    return lines


def objects(d):
    return {p.name: p.read_bytes() for p in sorted((d / "obj").glob("*.o"))}


def local_objects(d):
    """The same build with plain gcc, in the same directory (object files name their source)."""
    remote = d / "obj"
    saved = d / "obj.starling"
    shutil.rmtree(saved, ignore_errors=True)
    remote.rename(saved)
    make(d, "gcc", dict(os.environ))
    local = objects(d)
    shutil.rmtree(remote)
    saved.rename(remote)
    return local


def test_second_build_answers_at_most_one_request_per_compile(cluster, workdir, tmp_path):
    d = workdir / "proj"
    write_project(d)
    cache, stats = tmp_path / "cache", tmp_path / "stats.jsonl"
    e = env(cache, stats)
    make(d, "gcc", e, job="predict-a")
    first = launches(stats)
    assert len(first) == N_SOURCES, first
    shutil.rmtree(d / "obj")
    # A new job name, as a build that names its job afresh would: what the first
    # build's compiles used is predicted all the same.
    make(d, "gcc", e, job="predict-b")
    second = launches(stats)
    assert len(second) == N_SOURCES, second
    requests = sum(l["file_requests"] for l in second)
    assert requests <= N_SOURCES, (
        f"second build answered {requests} file requests for {N_SOURCES} compiles "
        f"(first build: {sum(l['file_requests'] for l in first)}): {[l['serve'] for l in second]}")
    assert all(l["job_predicted"] > 0 for l in second), "every compile was bound the job's paths"
    assert objects(d) == local_objects(d), "objects differ from a local build"


def test_header_changed_between_builds_is_never_seen_stale(cluster, workdir, tmp_path):
    d = workdir / "proj"
    write_project(d)
    cache, stats = tmp_path / "cache", tmp_path / "stats.jsonl"
    e = env(cache, stats)
    for job in ("stale-a", "stale-b"):  # two builds: the job's paths and the profile are warm
        shutil.rmtree(d / "obj", ignore_errors=True)
        make(d, "gcc", e, job=job)
    before = objects(d)
    # Same length, so only the content tells the versions apart.
    common = d / "include" / "common.h"
    old = common.read_text()
    common.write_text(old.replace("#define SCALE 3", "#define SCALE 7"))
    assert len(common.read_text()) == len(old)
    shutil.rmtree(d / "obj")
    make(d, "gcc", e, job="stale-c")
    after = objects(d)
    assert after == local_objects(d), "objects differ from a local build with the changed header"
    assert all(after[n] != before[n] for n in before), "an object was built from the old header"
    launches(stats)


def test_fresh_client_cache_does_not_push_what_the_cluster_holds(cluster, workdir, tmp_path):
    """A launch's planned push of ≥ 16 KiB first asks the head what it holds (HoldsQuery): a
    second client cache pushes nothing of a file the first one already pushed."""
    big = workdir / "big.bin"
    big.write_bytes(os.urandom(256 << 10))  # new content: no cache on the cluster holds it
    stats = tmp_path / "stats.jsonl"
    outs = []
    for cache in ("cache-a", "cache-b"):
        r = subprocess.run([STARLING, "exec", "--", "md5sum", str(big)], cwd=workdir, env=env(tmp_path / cache, stats),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    a, b = launches(stats)
    assert outs[0] == outs[1] and outs[0].split()[0] == subprocess.run(
        ["md5sum", str(big)], capture_output=True, text=True, check=True).stdout.split()[0]
    assert a["pushed_bytes"] > 128 << 10, f"the first client cache pushes the new file: {a}"
    assert b["pushed_bytes"] == 0 and b["push_held_skipped"] > 0, f"the second asked and pushed nothing: {b}"


def test_second_build_all_at_once_answers_no_request(cluster, workdir, tmp_path):
    """Every compile of an unchanged second build uses only paths the first build's compiles used (the
    same sources, headers and compiler), so with all of them launched at once under a new job name none
    answers a request: the first wave is bound the last build's paths, and a launch that sends only a
    delta against the job's bindings never reaches the head before the launch that sent them (the
    client records what the head holds only once the head has taken a launch)."""
    d = workdir / "proj"
    write_project(d)
    cache, stats = tmp_path / "cache", tmp_path / "stats.jsonl"
    e = env(cache, stats)
    make(d, "gcc", e, job="wave-a", jobs=N_SOURCES)
    launches(stats)
    for job in ("wave-b", "wave-c"):
        shutil.rmtree(d / "obj")
        make(d, "gcc", e, job=job, jobs=N_SOURCES)
        got = launches(stats)
        assert len(got) == N_SOURCES, got
        asked = [a for l in got for a in l["asked"]]
        # A checkout under a temp dir (a fresh clone in /tmp, as CI makes) is looked up once per
        # compile: names under temp dirs are never learned (they are builds' scratch files).
        checkout = [a for a in asked if a == ["lookup", "temp", str(ROOT)]]
        other = [a for a in asked if a not in checkout]
        assert sum(l["file_requests"] for l in got) == len(checkout) and not other, f"{job}: requests answered: {asked}"
    assert objects(d) == local_objects(d), "objects differ from a local build"
