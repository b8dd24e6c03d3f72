"""Live migration on a real embedded cluster: `starling migrate TASK --to HOST` moves a running
`starling exec` task between hosts while the client keeps its stdin, stdout, exit status and files.

The programs are unmodified binaries (not linked against libstarling): tests/migrate/phases.c (CPU
work in phases, a file written block by block, a line of stdin between phases, so a test moves it at
a known point without timing), crates/migrate/tests/c/{workers,state}.c (4 pthreads with mutexes and
condition variables; open file offset, interval timer, altstack handler, mask, umask, cwd),
tests/migrate/posix_timers.c (POSIX timers: periodic, one-shot, thread-directed, a disarmed one),
tests/migrate/identity.c (what /proc/self/exe, cmdline and environ say) and
crates/migrate/tests/numpy_work.py. Each moved run must print exactly what an undisturbed local run
prints.
"""
import json
import os
import pathlib
import queue
import re
import subprocess
import threading

import pytest

from conftest import ROOT, SCRATCH, STARLING, require_module, sh, starling, status, up, wait_for

BIN = SCRATCH / "migrate-bin"
MIGRATE_C = ROOT / "crates/migrate/tests/c"


def cc(src, name):
    BIN.mkdir(parents=True, exist_ok=True)
    out = BIN / name
    r = sh("cc", "-O1", "-g", "-Wall", str(src), "-lpthread", "-o", str(out), check=False)
    assert r.returncode == 0, r.stderr
    return str(out)


@pytest.fixture(scope="module")
def progs():
    return {
        "phases": cc(ROOT / "tests/migrate/phases.c", "phases"),
        "workers": cc(MIGRATE_C / "workers.c", "workers"),
        "state": cc(MIGRATE_C / "state.c", "state"),
        "vector_regs": cc(ROOT / "tests/migrate/vector_regs.c", "vector_regs"),
        "posix_timers": cc(ROOT / "tests/migrate/posix_timers.c", "posix_timers"),
        "identity": cc(ROOT / "tests/migrate/identity.c", "identity"),
    }


class Task:
    """A `starling exec` task whose stdout is read line by line as it comes."""

    def __init__(self, argv, host, cwd):
        self.p = subprocess.Popen([STARLING, "exec", "--host", host, "--", *map(str, argv)], cwd=cwd,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)

    def read_until(self, needle, timeout=300):
        """Lines up to and including the first that starts with `needle` (waits for the event)."""
        while True:
            try:
                line = self.q.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no line starting with {needle!r} after {timeout} s; got {''.join(self.lines)[-2000:]}")
            if line is None:
                pytest.fail(f"the task ended before printing {needle!r}: {''.join(self.lines)[-2000:]}"
                            f"\nstderr: {self.p.stderr.read()}")
            self.lines.append(line)
            if line.startswith(needle):
                return

    def send(self, text):
        self.p.stdin.write(text)
        self.p.stdin.flush()

    def finish(self, timeout=300):
        self.p.stdin.close()
        rc = self.p.wait(timeout=timeout)
        while (line := self.q.get(timeout=timeout)) is not None:
            self.lines.append(line)
        return rc, "".join(self.lines), self.p.stderr.read()

    def id(self, marker):
        """The task's id, from `starling ps` (the row whose command names `marker`)."""
        def find():
            rows = ps()
            return next((r["task"] for r in rows if marker in r["command"]), None)
        return wait_for(find, f"a ps row for {marker}")


def ps():
    return json.loads(starling("ps", "--json").stdout)


def ps_row(task):
    return next((r for r in ps() if r["task"] == task), None)


def cpu_of(task):
    """The task's CPU seconds as `starling ps` shows them (waits for its host's usage answer)."""
    return wait_for(lambda: (r := ps_row(task)) and r.get("cpu_seconds") is not None and r,
                    f"ps to show task {task}'s CPU time")["cpu_seconds"]


def migrate(task, to, check=True, timeout=300):
    """`starling migrate TASK --to TO --json`: its report (check) or the finished process. Once: a task
    that opens short connections now and then (movednet asks its parent every 200 ms) is looked at again
    by the move itself until it holds no socket."""
    r = starling("migrate", str(task), "--to", to, "--json", check=False, timeout=timeout)
    if check:
        assert r.returncode == 0, f"migrate to {to} failed:\n{r.stdout}\n{r.stderr}"
        return json.loads(r.stdout)
    return r


def local(argv, stdin="", cwd=None):
    r = subprocess.run(list(map(str, argv)), input=stdin, capture_output=True, text=True, timeout=300, cwd=cwd)
    return r.returncode, r.stdout


def block_file(blocks):
    """What phases.c writes: block N is 65536 bytes, byte j = (N*131 + j*7) & 0xff (computed here)."""
    return b"".join(bytes((n * 131 + j * 7) & 0xFF for j in range(65536)) for n in range(blocks))


def test_moved_three_times_across_hosts_prints_and_writes_as_if_never_moved(cluster, progs, workdir):
    hosts = [h["name"] for h in status()["hosts"]]
    assert len(hosts) >= 3, hosts
    route = [hosts[1], hosts[2], hosts[0]]
    steps, phases, heap = 6, 4, 64
    out = workdir / "moving.bin"
    t = Task([progs["phases"], steps, phases, out, heap], hosts[0], workdir)
    t.read_until("phase 0 done")
    task = t.id(str(out))
    assert ps_row(task)["host"] == hosts[0]
    cpu = cpu_of(task)
    assert cpu > 0, "phase 0 used no CPU time?"
    for p, to in enumerate(route):
        report = migrate(task, to)
        assert report["to"] == to, report
        assert report["pause_ms"] > 0 and report["memory_bytes"] >= heap << 20, report
        row = ps_row(task)
        assert row and row["host"] == to, f"ps after the move to {to}: {row}"
        # CPU time carries over a move (the target's counters start at zero).
        now = cpu_of(task)
        assert now >= cpu, f"ps CPU went from {cpu} s to {now} s at the move to {to}"
        cpu = now
        t.send("\n")
        t.read_until(f"phase {p + 1} done" if p + 1 < phases - 1 else "done ")
    rc, moved, err = t.finish()
    ref_rc, ref = local([progs["phases"], steps, phases, workdir / "reference.bin", heap], "\n" * (phases - 1))
    assert ref_rc == 7
    assert (rc, moved) == (ref_rc, ref), f"moved run differs from an undisturbed one; stderr: {err}"
    assert out.read_bytes() == block_file(steps * phases), "the file written across three moves is not complete"
    assert ps_row(task) is None, "the task still listed after it ended"


def moved_once_matches(argv, ready, cwd, to_index=1):
    """Run `argv` on the first host, move it once `ready` was printed, and compare with a local run."""
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task(argv, hosts[0], cwd)
    t.read_until(ready)
    task = t.id(" ".join(map(str, argv))[:100])
    report = migrate(task, hosts[to_index])
    rc, moved, err = t.finish()
    ref_rc, ref = local(argv, cwd=cwd)
    assert ref_rc == 0, ref
    assert (rc, moved) == (ref_rc, ref), f"moved run differs from an undisturbed one; stderr: {err}"
    return report


def test_four_threads_with_mutexes_and_condvars_move_mid_work(cluster, progs, workdir):
    report = moved_once_matches([progs["workers"], 300, 32, 20000], "round 5 ", workdir)
    assert report["threads"] == 5, report


def test_open_file_timer_handlers_mask_umask_cwd_survive_a_move(cluster, progs, workdir):
    data = workdir / "bytes"
    data.write_bytes(bytes((i * 7 + 3) & 0xFF for i in range(200)))
    moved_once_matches([progs["state"], data, 120], "step 20 ok", workdir)


def test_python_numpy_computation_moved_mid_way(cluster, workdir):
    require_module("numpy", "pip install numpy")
    script = ROOT / "crates/migrate/tests/numpy_work.py"
    moved_once_matches(["python3", script, 80, 300, 0.02], "step 5 ", workdir)


def refused_and_runs_on(argv, ready, ident, reason, workdir):
    """Start `argv` on the first host, wait for `ready`, and ask to move it (found in ps by `ident`):
    the move must be refused naming `reason`, and the task stays where it was. Returns the Task,
    waiting for a line of input, for the caller to finish."""
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task(argv, hosts[0], workdir)
    t.read_until(ready)
    task = t.id(ident)
    r = migrate(task, hosts[1], check=False)
    assert r.returncode != 0, r.stdout
    assert reason in r.stderr and "not moved" in r.stderr, r.stderr
    assert ps_row(task)["host"] == hosts[0], "a refused task stays where it was"
    return t


def refused_then_runs_to_its_end(setup, reason, workdir, after=""):
    """A python3 program that runs `setup` (which imports sys), says `ready` and waits for a line: the
    move is refused naming `reason` (see `refused_and_runs_on`), and the program then ends normally,
    with all its output, after running `after`."""
    prog = setup + "print('ready', flush=True)\nsys.stdin.readline()\nprint('still here', flush=True)\n" + after
    t = refused_and_runs_on(["python3", "-c", prog], "ready", "python3", reason, workdir)
    t.send("\n")
    rc, out, err = t.finish()
    assert (rc, out) == (0, "ready\nstill here\n"), err


def test_a_listening_socket_is_refused_and_the_task_runs_on(cluster, workdir):
    refused_then_runs_to_its_end("import socket, sys\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n",
                                 "socket", workdir)


@pytest.fixture
def fresh_cluster():
    st = up(3)
    yield st
    # Leave a healthy 4-host cluster for whatever runs next.
    up(4)


def test_target_killed_mid_migration_leaves_the_task_running_on_its_source(fresh_cluster, progs, workdir):
    """The copy to the target is slowed (tbf on its veth) so the move is still copying when the target's
    agent is killed: the migration fails, says so, and the task finishes where it was, nothing lost."""
    hosts = {h["name"]: h for h in fresh_cluster["hosts"]}
    src, dst = sorted(hosts)[:2]
    instance = os.environ.get("STARLING_INSTANCE", "")
    veth = f"stv{instance}-{dst}"
    sh("tc", "qdisc", "replace", "dev", veth, "root", "tbf", "rate", "8mbit", "burst", "64kb", "latency", "400ms")
    try:
        steps, phases, heap = 4, 2, 64
        out = workdir / "stays.bin"
        t = Task([progs["phases"], steps, phases, out, heap], src, workdir)
        t.read_until("phase 0 done")
        task = t.id(str(out))
        mover = subprocess.Popen([STARLING, "migrate", str(task), "--to", dst], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (ps_row(task) or {}).get("state", "").startswith("moving"), "the move to start")
        os.kill(hosts[dst]["pid"], 9)
        _, err = mover.communicate(timeout=300)
        assert mover.returncode != 0, "the move cannot succeed without its target"
        assert "not moved" in err and src in err, err
        row = wait_for(lambda: (r := ps_row(task)) and r["state"] == "running" and r, "the task back to running")
        assert row["host"] == src, row
        t.send("\n")
        rc, moved, err = t.finish()
    finally:
        sh("tc", "qdisc", "del", "dev", veth, "root", check=False)
    ref_rc, ref = local([progs["phases"], steps, phases, workdir / "reference.bin", heap], "\n")
    assert (rc, moved) == (ref_rc, ref), f"the task did not run on undisturbed; stderr: {err}"
    assert out.read_bytes() == block_file(steps * phases)


def test_a_signal_sent_to_the_client_reaches_the_moved_task(cluster, progs, workdir):
    """SIGTERM to `starling exec` after the move ends the task where it now runs: exit 128+15."""
    hosts = [h["name"] for h in status()["hosts"]]
    out = workdir / "signalled.bin"
    t = Task([progs["phases"], 2, 3, out, 16], hosts[0], workdir)
    t.read_until("phase 0 done")
    task = t.id(str(out))
    migrate(task, hosts[1])
    t.p.send_signal(15)
    t.p.wait(timeout=300)  # stdin stays open until then: an EOF would end the task its own way
    rc, _, err = t.finish()
    assert rc == 128 + 15, f"exit {rc}: {err}"
    wait_for(lambda: ps_row(task) is None, "the signalled task to leave ps")


def test_a_task_that_ends_while_it_moves_ends_the_move_cleanly(cluster, progs, workdir):
    """The copy is slowed (tbf on the target's veth) and the task is let finish during it: the move
    reports that the task ended, the task's exit status and output are its own, and the target's
    cores are free again."""
    hosts = [h["name"] for h in status()["hosts"]]
    src, dst = hosts[0], hosts[1]
    veth = f"stv{os.environ.get('STARLING_INSTANCE', '')}-{dst}"
    sh("tc", "qdisc", "replace", "dev", veth, "root", "tbf", "rate", "8mbit", "burst", "64kb", "latency", "400ms")
    try:
        out = workdir / "ends.bin"
        t = Task([progs["phases"], 2, 2, out, 64], src, workdir)
        t.read_until("phase 0 done")
        task = t.id(str(out))
        mover = subprocess.Popen([STARLING, "migrate", str(task), "--to", dst], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (ps_row(task) or {}).get("state", "").startswith("moving"), "the move to start")
        t.send("\n")
        rc, moved, _ = t.finish()
        _, err = mover.communicate(timeout=300)
    finally:
        sh("tc", "qdisc", "del", "dev", veth, "root", check=False)
    assert mover.returncode != 0 and "ended" in err, err
    ref_rc, ref = local([progs["phases"], 2, 2, workdir / "reference.bin", 64], "\n")
    assert (rc, moved) == (ref_rc, ref)
    wait_for(lambda: all(h["running"] == 0 for h in status()["hosts"]), "every core free again (the target's too)")


def test_a_remote_fork_clone_moves_twice_and_its_parent_joins_it(cluster, workdir):
    """A clone (memory partly still at its parent's page server) is moved to another host and on to a
    third: its memory becomes its own first, its output reaches the parent's stdout, sf_join sees it
    exit 0 (the status comes from the host it ended on)."""
    lib = ROOT / "target/release/libstarling.a"
    assert lib.exists(), "build it: cargo build --release -p starling-capi"
    BIN.mkdir(parents=True, exist_ok=True)
    prog = BIN / "clone_steps"
    r = sh("cc", "-O1", "-I", str(ROOT / "include"), str(ROOT / "tests/migrate/clone_steps.c"), str(lib),
           "-lpthread", "-ldl", "-lm", "-o", str(prog), check=False)
    assert r.returncode == 0, r.stderr
    steps = 150
    p = subprocess.Popen([str(prog), str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in p.stdout] + [lines.put(None)], daemon=True).start()
    assert lines.get(timeout=300) == "clone ready\n"
    task = wait_for(lambda: next((r["task"] for r in ps() if "starling-clone" in r["command"]), None), "the clone in ps")
    first = ps_row(task)["host"]
    others = [h["name"] for h in status()["hosts"] if h["name"] != first]
    for to in others[:2]:
        report = migrate(task, to)
        assert report["to"] == to
        assert ps_row(task)["host"] == to
    rc = p.wait(timeout=600)
    out = []
    while (line := lines.get(timeout=60)) is not None:
        out.append(line)
    M = 2**64
    data = lambda j: (j * 2654435761 + 12345) % M  # noqa: E731
    want = [f"clone step {i} {(i + 1) * sum(data(j) for j in range(i * 1000, i * 1000 + 1000)) % M}\n"
            for i in range(steps)]
    got = [l for l in out if l.startswith("clone step")]
    assert got == want, f"the moved clone's output differs; stderr: {p.stderr.read()}"
    assert out[-1] == "join 0\n" and rc == 0, out[-3:]


def test_a_clone_refused_for_its_socket_moves_in_one_go_once_it_holds_none(cluster, workdir):
    """tests/fork/heldnet.c: a clone holding a connection to its parent is refused, naming the socket and
    how often it was looked at, and runs on where it was. Once the parent closed it (the clone then asks
    its parent over a fresh connection every 200 ms), one `starling migrate` moves it: its memory became
    its own at the refused move, and the second move does not ask for that again from a fault handler
    that let go (it waited 600 s for an answer), nor is it refused for a short connection."""
    lib = ROOT / "target/release/libstarling.a"
    assert lib.exists(), "build it: cargo build --release -p starling-capi"
    BIN.mkdir(parents=True, exist_ok=True)
    prog = BIN / "heldnet"
    r = sh("cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/heldnet.c"), str(lib),
           "-lpthread", "-ldl", "-lm", "-o", str(prog), check=False)
    assert r.returncode == 0, r.stderr
    p = subprocess.Popen([str(prog)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=workdir)
    try:
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in p.stdout] + [lines.put(None)], daemon=True).start()
        assert lines.get(timeout=300) == "clone holding\n"
        task = wait_for(lambda: next((r["task"] for r in ps() if "starling-clone" in r["command"]), None), "the clone in ps")
        first = ps_row(task)["host"]
        to = next(h["name"] for h in status()["hosts"] if h["name"] != first)
        r = migrate(task, to, check=False)
        assert r.returncode != 0, r.stdout
        assert re.search(r"fd \d+ \(socket:\[\d+\]\) is a socket: .* at each of \d+ looks", r.stderr), r.stderr
        assert "not moved" in r.stderr, r.stderr
        assert ps_row(task)["host"] == first, "a refused clone stays where it was"
        p.stdin.write("release\n")
        p.stdin.flush()
        assert lines.get(timeout=300) == "clone released\n"
        report = migrate(task, to)
        assert report["to"] == to and ps_row(task)["host"] == to, report
        p.stdin.write("go\n")
        p.stdin.flush()
        rc = p.wait(timeout=600)
        out = []
        while (line := lines.get(timeout=60)) is not None:
            out.append(line)
        assert rc == 0 and out == ["STATUS 1 0\n"], f"{out}; stderr: {p.stderr.read()}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_every_vector_register_survives_two_moves(cluster, progs, workdir):
    """zmm0-31 (AVX-512; else ymm/xmm) hold patterns while the program spins in raw system calls; it
    is moved twice mid-spin and then checks them (a frame larger than the process's own made
    rt_sigreturn restore only the SSE part: the AVX-512 upper halves came back zero)."""
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task([progs["vector_regs"]], hosts[0], workdir)
    t.read_until("spinning")
    task = t.id("vector_regs")
    migrate(task, hosts[1])
    migrate(task, hosts[2])
    t.send("\n")
    rc, out, err = t.finish()
    assert (rc, out.splitlines()[-1]) == (0, "registers same"), out + err


def test_posix_timers_move_with_their_ids_and_remaining_times(cluster, progs, workdir):
    """posix_timers.c holds four POSIX timers whose IDs a fresh process would not get (it deleted the
    first two it made). Moved twice: each time its IDs still name its timers (timer_gettime on each
    works and it prints the same IDs), the periodic one keeps its interval and goes on ticking where
    the task now runs, and the one-shot ones are still armed with no more time left than before."""
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task([progs["posix_timers"]], hosts[0], workdir)
    t.read_until("ready")
    task = t.id("posix_timers")

    def report():
        t.send("\n")
        t.read_until("report ")
        f = t.lines[-1].split()
        return {"ticks": int(f[1]), "ids": f[2:6], "oneshot": int(f[6]), "thread": int(f[7]), "interval": int(f[8])}

    before = wait_for(lambda: (r := report())["ticks"] > 0 and r, "the periodic timer's first tick")
    ids = before["ids"]
    assert int(ids[0]) >= 2, f"the spare timer got id {ids[0]}: the deleted timers' ids were reused"
    assert 0 < before["oneshot"] <= 1000 * 10**9 and 0 < before["thread"] <= 2000 * 10**9, before
    for to in hosts[1:3]:
        migrate(task, to)
        assert ps_row(task)["host"] == to
        after = report()
        assert after["ids"] == ids, f"timer ids changed on {to}"
        assert after["interval"] == 10**7, after
        assert after["ticks"] >= before["ticks"], (before, after)
        assert 0 < after["oneshot"] <= before["oneshot"], (before, after)
        assert 0 < after["thread"] <= before["thread"], (before, after)
        wait_for(lambda: report()["ticks"] > after["ticks"], f"the periodic timer to tick on {to}")
        before = after
    rc, _, err = t.finish()
    assert rc == 0, err


@pytest.mark.parametrize("extra, reason", [("thread-clock", "(clock -2, notify 1) cannot move"), ("many", "at most 32")])
def test_posix_timers_that_cannot_move_are_refused_and_the_task_runs_on(cluster, progs, workdir, extra, reason):
    """A timer on a thread's CPU clock (the restorer could only give it back on another thread) or
    more timers than the image holds: the move is refused naming why, and the task goes on where it was."""
    t = refused_and_runs_on([progs["posix_timers"], extra], "ready", f"posix_timers {extra}", reason, workdir)
    t.send("\n")
    t.read_until("report ")
    rc, _, err = t.finish()
    assert rc == 0, err


def test_proc_exe_cmdline_and_environ_name_the_program_after_two_moves(cluster, progs, workdir):
    """/proc/PID/exe, cmdline and environ (what ps, top and the program itself read) are the
    program's before and after two moves, not the restorer's (which runs every moved process)."""
    hosts = [h["name"] for h in status()["hosts"]]
    prog = progs["identity"]
    t = Task([prog, "an arg", "2"], hosts[0], workdir)
    t.send("\n")
    t.read_until("round 1 done")
    before = t.lines[-3:-1]
    assert before[0] == f"exe={prog} cmdline={prog}|an arg|2|\n", before
    task = t.id(prog)
    for n, to in enumerate([hosts[1], hosts[2]], start=2):
        report = migrate(task, to)
        assert report["to"] == to, report
        t.send("\n")
        t.read_until(f"round {n} done")
        assert t.lines[-3:-1] == before, f"after move {n - 1} (to {to})"
    rc, out, err = t.finish()
    assert rc == 0 and out.endswith("round 3 done\nend\n"), (rc, out[-500:], err)
