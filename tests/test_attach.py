"""A task on a terminal outlives its client (issue 11 part 6): kill -9 its `starling exec` (or lose
the link) and the task keeps running where it is; `starling attach TASK` from another terminal
re-attaches to it, going on from the first output byte the dead client had not printed, and gets its
exit status and its changes.

Driven through tmux on the real embedded cluster. Waits poll the screen or `starling ps` for an
event; timeouts only bound a hang.
"""
import json
import os
import re
import signal

import pytest

from conftest import STARLING, require_tool, starling, wait_for
from test_terminal import Tmux

# One numbered line every 0.1 s: a line lost, repeated or reordered shows in the numbers.
COUNTER = r"""
import sys, time
i = 0
while True:
    i += 1
    print(f"count {i}", flush=True)
    time.sleep(0.1)
"""

# Writes `out` (a change, committed when the task ends), then runs 10 s touching no file (a detached
# task's file requests wait for a client) and ends with status 5.
WAITER = r"""
import sys, time
with open(sys.argv[1], "w") as f:
    f.write("written before the client died\n")
print("waiting", flush=True)
time.sleep(10)
print("bye", flush=True)
sys.exit(5)
"""


@pytest.fixture
def term(cluster):
    t = Tmux(require_tool("tmux", "tmux"))
    yield t
    t.close()


@pytest.fixture
def other(cluster):
    """A second terminal (a tmux server of its own: the user opened another terminal)."""
    t = Tmux(require_tool("tmux", "tmux"), "starling-attach-test")
    yield t
    t.close()


def rows():
    return json.loads(starling("ps", "--json").stdout)


def task_running(marker):
    """The ps row of the task whose command line has `marker`, once there is one."""
    return wait_for(lambda: next((r for r in rows() if marker in r["command"]), None), f"a task running {marker}")


def row(tid):
    return next((r for r in rows() if r["task"] == tid), None)


def pane_counts(term):
    """Every `count N` line in the current window's pane (its whole history), in order."""
    text = term.run("capture-pane", "-p", "-S", "-100000", "-t", "t").stdout
    return [int(n) for n in re.findall(r"^count (\d+)\s*$", text, re.M)]


def kill_client(term):
    """kill -9 the `starling exec` the pane's shell is running; its pid."""
    pid = exec_pid(term)
    os.kill(pid, signal.SIGKILL)
    return pid


def exec_pid(term):
    """The pid of the `starling exec` the pane's shell is running."""
    shell = int(term.run("display-message", "-p", "-t", "t", "#{pane_pid}").stdout)
    def child():
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                stat = open(f"/proc/{p}/stat").read()
                cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == shell and cmd[0].endswith(b"starling") and b"exec" in cmd:
                return int(p)
        return None
    return wait_for(child, "the pane's starling exec process")


def test_killed_client_the_task_runs_on_and_attach_resumes_without_losing_a_byte(term, other, workdir):
    prog = workdir / "counter.py"
    prog.write_text(COUNTER)
    # After the client dies its shell sleeps: nothing it prints overwrites the client's last line.
    term.type(f"clear; {STARLING} exec -- /usr/bin/python3 -S {prog}; exec sleep 100000")
    term.wait(r"^count 5\s*$", "the program to count")
    r = task_running(str(prog))
    tid, task = r["task"], f"t{r['task']}"

    pid = kill_client(term)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), "the killed client to be gone")
    printed = pane_counts(term)
    last = printed[-1]
    assert printed == list(range(1, last + 1)), "the first client printed every count once, in order"

    # The task runs on (where it was), detached; its output is kept meanwhile.
    x = wait_for(lambda: (y := row(tid)) and y["state"] == "detached" and y, f"ps to show {task} detached")
    assert x["host"] == r["host"], (r, x)
    base = x["cpu_seconds"] or 0.0
    wait_for(lambda: (y := row(tid)) and (y["cpu_seconds"] or 0.0) > base and y["runtime_seconds"] > x["runtime_seconds"] + 2,
             "the detached task to go on running")

    # A second attach while one is attached is refused; an unknown task is refused.
    other.start(f"{STARLING} attach {task}")
    # (In its history: the replay of a long detached time scrolls past a screen at once.)
    wait_for(lambda: (c := pane_counts(other)) and c[-1] >= last + 40, "the counter to go on in the attached terminal")
    again = starling("attach", task, check=False, stdin=open(os.devnull))
    assert again.returncode != 0 and "--force" in again.stderr, again.stderr
    unknown = starling("attach", "t1", check=False, stdin=open(os.devnull))
    assert unknown.returncode != 0 and "no task t1" in unknown.stderr, unknown.stderr

    seen = pane_counts(other)
    assert seen[0] == last + 1, f"the attached terminal starts right after the last count the dead client printed ({last}): {seen[:5]}"
    assert seen == list(range(last + 1, seen[-1] + 1)), "no count lost, repeated or reordered"
    assert row(tid)["state"] == "running", "attached again"

    other.key("C-c")
    assert other.finished("the program to end on Ctrl-C through the attach") == 130
    wait_for(lambda: row(tid) is None, f"{task} to be gone from ps")


def test_force_takes_a_task_over_from_its_client(term, other, workdir):
    prog = workdir / "counter.py"
    prog.write_text(COUNTER)
    term.start(f"{STARLING} exec -- /usr/bin/python3 -S {prog}")
    term.wait(r"^count 3\s*$", "the program to count")
    task = f"t{task_running(str(prog))['task']}"
    other.start(f"{STARLING} attach --force {task}")
    other.wait(r"^count \d+\s*$", "the counter in the terminal that took the task over")
    assert term.finished("the first client to let go") == 255
    term.wait(r"another client took this task over", "the first client to say why it ended")
    other.key("C-c")
    assert other.finished("the program to end on Ctrl-C") == 130


def test_a_task_that_ends_while_detached_is_kept_for_attach(term, other, workdir):
    prog, out = workdir / "waiter.py", workdir / "out.txt"
    prog.write_text(WAITER)
    term.start(f"{STARLING} exec -- /usr/bin/python3 -S {prog} {out}")
    term.wait(r"^waiting\s*$", "the program to wait")
    tid = task_running(str(prog))["task"]
    kill_client(term)
    assert term.finished("the killed client's shell") == 128 + signal.SIGKILL
    assert row(tid)["state"] == "detached", "the task outlived its client"
    wait_for(lambda: row(tid) is None, "the task to end while detached")
    assert not out.exists(), "nothing is committed with no client attached"
    other.start(f"{STARLING} attach t{tid}")
    assert other.finished("the attach to get the ended task's status") == 5
    other.wait(r"^bye\s*$", "the output it printed while detached")
    assert out.read_text() == "written before the client died\n", "its change was committed by the attach"
    gone = starling("attach", f"t{tid}", check=False, stdin=open(os.devnull))
    assert gone.returncode != 0 and "no task" in gone.stderr, gone.stderr
