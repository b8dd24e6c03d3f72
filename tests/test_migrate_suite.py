"""The remote-fork restore-correctness programs (crates/fork/tests/c) run through a live migration
instead of a clone (issue 9 part 7).

Each program is built with -DSFT_MIGRATE (see sftest.h): it sets up its state, says "sft: ready" and
waits; the test moves it with `starling migrate` to another host and lets it go on; the checks a
clone would run then run in the moved process, and "sft: checked" with exit 0 says every one held.
"""
import pathlib

import pytest

from conftest import ROOT, SCRATCH, sh, status
from test_migrate import Task, migrate

C = ROOT / "crates/fork/tests/c"
BIN = SCRATCH / "migrate-suite-bin"

# What each program checks, as it is checked after a move (the same CHECKs a clone runs).
PROGRAMS = {
    "heap": "brk heap, a malloc'ed 8 MiB chunk and a 1 GiB heap of which 64 MiB was written",
    "stack_tls_errno": "the stack, thread-local storage and errno",
    "env_cwd_file": "environment, cwd, umask and an open file's offset",
    "pid_sched_vdso": "its pid, rseq, sched_getcpu and the vDSO's clocks",
    "mutex_signal": "threads blocked on mutexes, condition variables and signal handlers",
    "cached_stack_threads": "threads started on stacks glibc cached, while faulting",
    "mremap": "memory moved with mremap",
    "shared_maps": "a MAP_SHARED file it wrote itself and MAP_SHARED anonymous memory",
    "altstack_rlimits": "the alternate signal stack and rlimits",
}
# Not here: pipes_sockets and dontfork (they check what a clone
# does by design: placeholders for pipes, no MADV_DONTFORK memory), refused, dlopen (not yet tried).


def build(name, *extra):
    BIN.mkdir(parents=True, exist_ok=True)
    out = BIN / name
    r = sh("cc", "-O1", "-g", "-Wall", "-DSFT_MIGRATE", "-I", str(ROOT / "include"), "-I", str(C),
           str(C / f"{name}.c"), str(ROOT / "target/release/libstarling_fork.a"), "-lpthread", "-ldl", "-lm",
           *extra, "-o", str(out), check=False)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_restore_suite_program_checks_hold_after_a_move(cluster, workdir, name):
    hosts = [h["name"] for h in status()["hosts"]]
    exe = build(name)
    t = Task([exe], hosts[0], workdir)
    t.read_until("sft: ready")
    report = migrate(t.id(str(exe)), hosts[1])
    assert report, "migrate gave no report"
    t.send("go\n")
    rc, out, err = t.finish()
    assert rc == 0 and "sft: checked" in out, f"{name} ({PROGRAMS[name]}) after a move: rc {rc}\n{out}\n{err}"
