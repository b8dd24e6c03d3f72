"""A parent whose stdout/stderr is a regular file (`prog > out.txt 2>&1`, `pytest > log`) clones onto
the cluster: the clones' output is a stream appended to that file, and the file is never committed
back as a whole (which replaced the parent's log and lost what it wrote after the clone started).

tests/fork/output_file.c (sf_clone) and tests/fork/output_file.py (starling.Executor) write a first
line, let 2 clones each write lines, write while they run and after they end; the file must hold
every line once, the parent's in their order.
"""
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, SCRATCH, require_module, sh

FORK = ROOT / "tests/fork"
LIB = ROOT / "target/release/libstarling.a"
BIN = SCRATCH / "fork-bin"


@pytest.fixture(scope="module")
def prog():
    assert LIB.exists(), "build it: cargo build --release -p starling-capi"
    BIN.mkdir(parents=True, exist_ok=True)
    out = BIN / "output_file"
    r = sh("cc", "-O1", "-g", "-Wall", "-I", str(ROOT / "include"), str(FORK / "output_file.c"), str(LIB),
           "-lpthread", "-ldl", "-lm", "-o", str(out), check=False)
    assert r.returncode == 0, r.stderr
    return str(out)


def run_into_file(cmd, path, env=None):
    """Run `cmd > path 2>&1` (the file opened by this process, as a shell would), return its exit
    status and the file's lines afterwards."""
    e = dict(os.environ)
    e.pop("STARLING_FORK_BACKEND", None)
    e.update(env or {})
    with open(path, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, timeout=300, cwd="/var/tmp")
    return r.returncode, pathlib.Path(path).read_text().splitlines()


def check_parent_lines(lines, last):
    """The parent's lines: each once, first is first, `last` is last, 'during' in between."""
    text = "\n".join(lines)
    assert lines and lines[0] == "PARENT first", text
    assert lines[-1] == last, text
    for want in ("PARENT first", "PARENT during", last):
        assert lines.count(want) == 1, f"{want!r} not exactly once in:\n{text}"
    assert lines.index("PARENT during") < lines.index(last), text


@pytest.mark.parametrize("hierarchical,dup", [(1, 0), (0, 0), (1, 1), (0, 2), (1, 2)],
                         ids=["hierarchical", "spread", "dup-fd", "captured-spread", "captured-hierarchical"])
def test_clone_output_to_a_file_is_appended(cluster, prog, workdir, hierarchical, dup):
    """`output_file 2 H DUP > out.txt 2>&1`: the parent's 3 lines and each clone's lines, all in the
    file. With DUP=1 the parent keeps a copy of fd 1 on fd 9 first and the clones write through it
    too: that copy is the same stream, not a file the clone commits. With DUP=2 the parent is arranged
    as under pytest's output capture (`pytest > log`): the log only on fd 9, an unlinked temporary file
    on fd 1 and 2. The clones hold fd 9 but never write it; the log must still be the parent's file
    when they end (a clone that committed its untouched copy back replaced it: every line the parent
    wrote afterwards went to the replaced file)."""
    status, lines = run_into_file([prog, "2", str(hierarchical), str(dup)], workdir / "out.txt")
    text = "\n".join(lines)
    assert status == 0, text
    check_parent_lines(lines, "PARENT last 2")
    kinds = ["out", "err"] + (["dup"] if dup == 1 else [])
    for i in (1, 2):
        for k in kinds:
            assert lines.count(f"CLONE {i} {k}") == 1, f"'CLONE {i} {k}' not exactly once in:\n{text}"
    # Nothing else came home: no conflict copy of the log next to it.
    assert sorted(p.name for p in workdir.iterdir()) == ["out.txt"], list(workdir.iterdir())


def test_join_returns_after_the_clones_last_output(cluster, prog, workdir):
    """Each of 2 clones ends by writing 3000 lines: when sf_join returns, every one of them is in the
    file already, before the parent's last line (a clone's status must not overtake its output)."""
    status, lines = run_into_file([prog, "2", "0", "0", "3000"], workdir / "out.txt")
    text = "\n".join(lines[-20:])
    assert status == 0, text
    check_parent_lines(lines, "PARENT last 2")
    for i in (1, 2):
        bulk = [l for l in lines if l.startswith(f"CLONE {i} bulk ")]
        assert bulk == [f"CLONE {i} bulk {k}" for k in range(3000)], f"clone {i}: {len(bulk)} bulk lines; file ends:\n{text}"


def test_executor_output_to_a_file_is_appended(cluster, workdir):
    """`python3 output_file.py > out.txt 2>&1` with a starling.Executor of 2 workers."""
    require_module("starling", "make python")
    status, lines = run_into_file([sys.executable, str(FORK / "output_file.py")], workdir / "out.txt")
    text = "\n".join(lines)
    assert status == 0, text
    check_parent_lines(lines, "PARENT last 2")
    for i in (0, 1):
        for k in ("out", "err"):
            assert lines.count(f"WORKER {i} {k}") == 1, f"'WORKER {i} {k}' not exactly once in:\n{text}"
    assert sorted(p.name for p in workdir.iterdir()) == ["out.txt"], list(workdir.iterdir())
