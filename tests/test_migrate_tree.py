"""A task's whole process tree moves together (issue 9 part 4), on a real embedded cluster.

tests/migrate/groups.c: a parent leading its session, a child leading a process group, a child
leading a session of its own and a grandchild forked before that, in its aunt's group; each reports
its session and group (as PIDs, which moves keep) after the parent signalled one group.

tests/migrate/tree.c: a parent and its children each count in phases, printing a checksum of their
own heap per step; between phases they wait at a gate (the parent reads a line of stdin, then
signals each child), so the test moves the tree at known points without timing. Each moved run
must print, per process, exactly what an undisturbed local run prints, the parent's waitpid must
get each child's real exit status, and the task's exit status must be the parent's.
"""
import collections
import fcntl
import os
import pathlib
import struct
import subprocess
import termios

import pytest

from conftest import ROOT, status, wait_for
from test_migrate import Task, cc, local, migrate, ps_row, refused_then_runs_to_its_end


@pytest.fixture(scope="module")
def tree_prog():
    return cc(ROOT / "tests/migrate/tree.c", "tree")


@pytest.fixture(scope="module")
def groups_prog():
    return cc(ROOT / "tests/migrate/groups.c", "groups")


def per_process(out):
    """Lines of each process (by their "p<k>" prefix), in the order it printed them; the rest apart."""
    procs = collections.defaultdict(list)
    for line in out.splitlines():
        procs[line.split(" ", 1)[0] if line.startswith("p") else "end"].append(line)
    return dict(procs)


def wait_gate(t, children, phase):
    """Read until every process of the tree printed that it waits after `phase`."""
    want = {f"p{k} phase {phase} done\n" for k in range(children + 1)}
    while not want <= set(t.lines):
        t.read_until("p")


def test_a_parent_and_two_children_move_twice_and_reap_as_if_never_moved(cluster, tree_prog, workdir):
    hosts = [h["name"] for h in status()["hosts"]]
    argv = [tree_prog, 2, 3, 20, 20]
    t = Task(argv, hosts[0], workdir)
    wait_gate(t, 2, 0)
    task = t.id(" ".join(map(str, argv)))
    # First move: every process waits at its gate (the parent in read, the children in sigwaitinfo).
    report = migrate(task, hosts[1])
    assert report["to"] == hosts[1] and report["threads"] == 3, report
    assert ps_row(task)["host"] == hosts[1]
    t.send("\n")
    # Second move: right after the gate opened, while the processes work.
    report = migrate(task, hosts[2])
    assert report["to"] == hosts[2] and report["threads"] == 3, report
    assert ps_row(task)["host"] == hosts[2]
    wait_gate(t, 2, 1)
    t.send("\n")
    rc, moved, err = t.finish()
    ref_rc, ref = local(argv, "\n\n", cwd=workdir)
    assert ref_rc == 7, ref
    assert per_process(moved) == per_process(ref), f"moved run differs from an undisturbed one; stderr: {err}"
    assert per_process(moved)["end"] == ["reaped 1 exit 11", "reaped 2 exit 12", "done"]
    assert rc == 7, f"the task's exit status is the parent's: {rc}; stderr: {err}"
    wait_for(lambda: ps_row(task) is None, "the task to leave ps")


@pytest.mark.parametrize("child,reason", [
    # A child that has exited and that its parent has not reaped yet.
    ("os._exit(3)", "zombie"),
    # A child holding a socket.
    ("os.close(r); s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); os.write(w, b'x'); os.close(w); signal.pause()", "socket"),
])
def test_a_tree_with_a_zombie_or_a_socket_is_refused_and_runs_on(cluster, workdir, child, reason):
    # The parent says "ready" once its child is a zombie or listens (the child says so on a pipe
    # the parent closes before it says "ready": no pipe is left between them).
    prog = ("import os, signal, socket, sys, time\n"
            "r, w = os.pipe()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            f"    {child}\n"
            "os.close(w)\n"
            "os.read(r, 1); os.close(r)\n"
            "while open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] not in 'ZS':\n"
            "    time.sleep(0.01)\n")
    refused_then_runs_to_its_end(prog, reason, workdir, after="os.kill(pid, 9); os.waitpid(pid, 0)\n")


PRODUCER = ("import sys\n"
            "for i in range(int(sys.argv[1])):\n"
            "    sys.stdout.buffer.write(bytes((i * 7 + j) % 251 for j in range(4096)))\n")
# Reads 4 KiB at a time, slowly: the producer runs ahead until the pipe between them is full, so a
# move finds bytes in flight in it (and the producer blocked writing).
CONSUMER = ("import hashlib, sys, time\n"
            "h = hashlib.sha256()\n"
            "i = 0\n"
            "while chunk := sys.stdin.buffer.read(4096):\n"
            "    h.update(chunk)\n"
            "    print(f'chunk {i} {len(chunk)} {h.hexdigest()[:16]}', flush=True)\n"
            "    i += 1\n"
            "    time.sleep(float(sys.argv[1]))\n"
            "print('end', flush=True)\n"
            "sys.exit(5)\n")


def queued_in_stdin_of(cmdline):
    """Bytes waiting in the stdin pipe of the process whose command line starts with `cmdline`
    (FIONREAD on a new read end of that pipe, which takes nothing out)."""
    def command_of(pid):
        try:
            return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # ended meanwhile
            return b""
    pids = [p for p in os.listdir("/proc") if p.isdigit() and command_of(p).startswith(cmdline.encode())]
    assert len(pids) == 1, f"processes running {cmdline!r}: {pids}"
    fd = os.open(f"/proc/{pids[0]}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    finally:
        os.close(fd)


def test_a_shell_pipeline_moves_mid_stream_with_bytes_in_flight(cluster, workdir):
    (workdir / "producer.py").write_text(PRODUCER)
    (workdir / "consumer.py").write_text(CONSUMER)
    chunks = 300
    tag = workdir.name  # names this run's consumer among the machine's processes
    line = f"python3 producer.py {chunks} | python3 consumer.py 0.01 {tag}"
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task(["sh", "-c", line], hosts[0], workdir)
    t.read_until("chunk 30 ")
    task = t.id("producer.py")
    assert queued_in_stdin_of(f"python3 consumer.py 0.01 {tag}") > 0, "no bytes in flight in the pipe before the move"
    report = migrate(task, hosts[1])
    assert report["to"] == hosts[1] and report["threads"] >= 3, report
    t.read_until("chunk 120 ")
    report = migrate(task, hosts[2])
    assert report["to"] == hosts[2], report
    assert ps_row(task)["host"] == hosts[2]
    rc, moved, err = t.finish()
    ref = subprocess.run(["sh", "-c", line], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 5 and ref.stdout.endswith("end\n"), ref
    assert moved == ref.stdout, f"the consumer's output differs from an undisturbed run; stderr: {err}"
    assert rc == 5, f"the pipeline's exit status: {rc}; stderr: {err}"


def groups_round(t, n, names):
    """Ask groups.c for round `n` (a line of stdin) and read its four reports: name → fields, the
    PIDs among them named as the ready line names them (p0, pA, pB, pC)."""
    t.send("\n")
    t.read_until(f"round {n} done")
    out = {}
    for line in t.lines[-5:-1]:
        name, *fields = line.split()
        kv = dict(f.split("=") for f in fields)
        out[name] = {k: names.get(int(v), v) if k != "usr1" else int(v) for k, v in kv.items()}
    return out


def test_sessions_and_process_groups_move_twice_and_a_group_signal_reaches_exactly_that_group(cluster, groups_prog, workdir):
    hosts = [h["name"] for h in status()["hosts"]]
    t = Task([groups_prog], hosts[0], workdir)
    t.read_until("ready ")
    names = {int(v): k for k, v in (kv.split("=") for kv in t.lines[-1].split()[1:])}
    task = t.id("groups")

    def expected(rounds):
        # pA and pC are pA's group, which the parent signalled once per round; the parent's parent is
        # the sandbox's PID 1 before a move and the restorer's after.
        return {
            "p0": {"pid": "p0", "ppid": "1", "sid": "p0", "pgid": "p0", "usr1": 0},
            "pA": {"pid": "pA", "ppid": "p0", "sid": "p0", "pgid": "pA", "usr1": rounds},
            "pB": {"pid": "pB", "ppid": "p0", "sid": "pB", "pgid": "pB", "usr1": 0},
            "pC": {"pid": "pC", "ppid": "pB", "sid": "p0", "pgid": "pA", "usr1": rounds},
        }

    assert groups_round(t, 0, names) == expected(1), "before any move"
    for n, host in enumerate(hosts[1:3], start=1):
        report = migrate(task, host)
        assert report["to"] == host and report["threads"] == 4, report
        assert ps_row(task)["host"] == host
        assert groups_round(t, n, names) == expected(n + 1), f"after move {n}"
    rc, out, err = t.finish()
    assert (rc, out.splitlines()[-1]) == (0, "end"), f"{out[-500:]}\nstderr: {err}"


def test_a_process_group_whose_leader_ended_is_refused_and_the_task_runs_on(cluster, workdir):
    # The parent makes a child a group leader and puts a second child in that group (both
    # setpgid calls its own, so no child races it), then kills and reaps the leader.
    prog = ("import os, signal, sys\n"
            "a = os.fork()\n"
            "if a == 0:\n"
            "    signal.pause()\n"
            "os.setpgid(a, a)\n"
            "d = os.fork()\n"
            "if d == 0:\n"
            "    signal.pause()\n"
            "os.setpgid(d, a)\n"
            "os.kill(a, 9); os.waitpid(a, 0)\n")
    refused_then_runs_to_its_end(prog, "whose leader is not part of the task", workdir, after="os.kill(d, 9); os.waitpid(d, 0)\n")


def running_with(tag):
    """PIDs (as this host numbers them) of the python3 processes whose command line holds `tag` (not
    the `starling exec` client naming it)."""
    def cmdline(pid):
        try:
            return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            return b""
    return [p for p in os.listdir("/proc") if p.isdigit() and cmdline(p).startswith(b"python3\0") and tag.encode() in cmdline(p)]


# The root forks a child that would run for ever, waits for a line, says "bye" and exits 3 with
# the child still running (never reaped).
ROOT_EXITS_FIRST = ("import os, signal, sys\n"
                    "if os.fork() == 0:\n"
                    "    signal.pause()\n"
                    "print('ready', flush=True)\n"
                    "sys.stdin.readline()\n"
                    "print('bye', flush=True)\n"
                    "sys.exit(3)\n")


@pytest.mark.parametrize("moves", [0, 1])
def test_the_task_ends_with_its_root_and_its_other_processes_end_with_it_moved_or_not(cluster, workdir, moves):
    hosts = [h["name"] for h in status()["hosts"]]
    (workdir / "root_exits.py").write_text(ROOT_EXITS_FIRST)
    tag = f"root-exits-{workdir.name}-{moves}"
    t = Task(["python3", "root_exits.py", tag], hosts[0], workdir)
    t.read_until("ready")
    task = t.id(tag)
    wait_for(lambda: len(running_with(tag)) == 2, "the root and its child to run")
    for host in hosts[1:1 + moves]:
        report = migrate(task, host)
        assert report["to"] == host and report["threads"] == 2, report
    t.send("\n")
    rc, out, err = t.finish()
    assert (rc, out) == (3, "ready\nbye\n"), f"the task's status and output are its root's; stderr: {err}"
    wait_for(lambda: ps_row(task) is None, "the task to leave ps")
    wait_for(lambda: not running_with(tag), "the root's child to end with the task")


def test_an_orphan_in_the_task_is_refused_and_the_task_runs_on(cluster, workdir):
    # A child forks a grandchild and exits: the grandchild, adopted by the sandbox's PID 1, is not
    # in the root's tree; moving the tree alone would leave it behind.
    prog = ("import os, signal, sys\n"
            "r, w = os.pipe()\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    if os.fork() == 0:\n"
            "        os.close(r); os.close(w)\n"
            "        signal.pause()\n"
            "    os._exit(0)\n"
            "os.close(w)\n"
            "os.waitpid(child, 0)\n"
            "os.read(r, 1); os.close(r)\n")  # EOF: the grandchild has closed its copy
    refused_then_runs_to_its_end(prog, "orphaned", workdir)


# A parent and its child hold the same read end of a pipe (one open file description, so one set of
# file status flags); the child makes it nonblocking. Per line of stdin the parent may clear or set
# O_NONBLOCK on its own descriptor ("clear", "set"), then asks the child (SIGUSR1, answered on a
# second pipe) to print what its descriptor says, then prints its own, and reads the empty pipe
# where that cannot block (EAGAIN).
SHARED_NONBLOCK = ("import fcntl, os, signal, sys\n"
                   "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
                   "r, w = os.pipe()\n"
                   "ack_r, ack_w = os.pipe()\n"
                   "nonblocking = lambda: bool(fcntl.fcntl(r, fcntl.F_GETFL) & os.O_NONBLOCK)\n"
                   "pid = os.fork()\n"
                   "if pid == 0:\n"
                   "    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_NONBLOCK)\n"
                   "    os.write(ack_w, b's')\n"
                   "    while True:\n"
                   "        signal.sigwait({signal.SIGUSR1})\n"
                   "        print(f'child nonblock={nonblocking()}', flush=True)\n"
                   "        os.write(ack_w, b'r')\n"
                   "os.read(ack_r, 1)\n"
                   "print('ready', flush=True)\n"
                   "while cmd := sys.stdin.readline().strip():\n"
                   "    flags = fcntl.fcntl(r, fcntl.F_GETFL)\n"
                   "    if cmd == 'clear':\n"
                   "        fcntl.fcntl(r, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)\n"
                   "    elif cmd == 'set':\n"
                   "        fcntl.fcntl(r, fcntl.F_SETFL, flags | os.O_NONBLOCK)\n"
                   "    os.kill(pid, signal.SIGUSR1)\n"
                   "    os.read(ack_r, 1)\n"
                   "    got = ''\n"
                   "    if nonblocking():\n"
                   "        try:\n"
                   "            os.read(r, 1); got = ' read=data'\n"
                   "        except BlockingIOError:\n"
                   "            got = ' read=EAGAIN'\n"
                   "    print(f'parent nonblock={nonblocking()}{got}', flush=True)\n"
                   "os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)\n"
                   "print('end', flush=True)\n")


def test_a_pipe_end_shared_by_a_parent_and_its_child_keeps_one_o_nonblock_through_two_moves(cluster, workdir):
    hosts = [h["name"] for h in status()["hosts"]]
    (workdir / "shared_nonblock.py").write_text(SHARED_NONBLOCK)
    t = Task(["python3", "shared_nonblock.py"], hosts[0], workdir)
    t.read_until("ready")
    task = t.id("shared_nonblock.py")

    def ask(cmd):
        t.send(cmd + "\n")
        t.read_until("parent ")
        return t.lines[-2:]

    on = ["child nonblock=True\n", "parent nonblock=True read=EAGAIN\n"]
    off = ["child nonblock=False\n", "parent nonblock=False\n"]
    assert ask("report") == on, "the child's O_NONBLOCK is the parent's too, before any move"
    assert migrate(task, hosts[1])["to"] == hosts[1]
    assert ask("report") == on, "after a move"
    assert ask("clear") == off, "the parent clearing it clears it for the child: still one description"
    assert migrate(task, hosts[2])["to"] == hosts[2]
    assert ask("report") == off, "after a second move"
    assert ask("set") == on, "and setting it sets it for both"
    rc, out, err = t.finish()
    assert (rc, out.splitlines()[-1]) == (0, "end"), f"{out[-500:]}\nstderr: {err}"
