"""Roaming tasks (issue 11 parts 1 and 4): `starling exec --roam` starts a program at home (this
machine, same sandbox and file view as a host), `starling migrate --to HOST|home` moves it both ways,
and its migration manager moves it to the cluster while it crunches and home when keys resume.

Driven through tmux (a real terminal) on the real embedded cluster. Every wait polls the screen or
`starling ps` for an event (a decision in the log, the task on a site); timeouts only bound a hang.
"""
import json
import os
import re
import signal
import time

import pytest

from conftest import STARLING, require_tool, starling, status, wait_for
from test_attach import exec_pid, other  # noqa: F401 (a fixture)
from test_terminal import Tmux

# A profile with no rules: the task stays where it is put (moves are by hand).
STILL = """
initial = "here"
[states.here]
site = "home"
"""

# Short windows for tests: 3 s averaging, samples every 0.5 s, 6 s minimum dwell.
CRUNCHY = """
window_s = 3
sample_ms = 500
min_dwell_s = 6
speedup = 4.0
crunch_s = 600
move_cost_s = 1
initial = "cognitive"

[states.cognitive]
site = "home"

[states.crunch]
site = "cluster"

[[rules]]
from = "cognitive"
to = "crunch"
cpu_min = 0.3
runnable_min = 0.7
inputs_max = 4

[[rules]]
from = "crunch"
to = "cognitive"
inputs_min = 4
"""

COUNTER = r"""
import select, sys
i = 0
while True:
    i += 1
    print(f"count {i}", flush=True)
    if select.select([sys.stdin], [], [], 0.2)[0] and sys.stdin.readline().strip() == "quit":
        print(f"quit at {i}", flush=True)
        sys.exit(7)
"""

# Waits for "go", then a noisy CPU sensor (short bursts: the rate between two samples swings
# between 0 and 1, its average stays low), then a real crunch until it reads "quit".
BIMODAL = r"""
import select, sys, time
print("ready", flush=True)
while sys.stdin.readline().strip() != "go":
    pass
for k in range(12):
    end = time.time() + 0.3
    while time.time() < end:
        pass
    time.sleep(0.9)
print(f"crunch from {int(time.time() * 1000)}", flush=True)
n, last = 0, time.time()
while True:
    n += 1
    if time.time() - last > 1:
        print(f"crunching {n}", flush=True)
        last = time.time()
    if n % 1000 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        if sys.stdin.readline().strip().endswith("quit"):
            print("quitting", flush=True)
            sys.exit(3)
"""


@pytest.fixture
def term(cluster):
    t = Tmux(require_tool("tmux", "tmux"))
    yield t
    t.close()


def roaming_task(marker):
    """The ps row of the roaming task whose command line has `marker`, once there is one."""
    def find():
        for r in json.loads(starling("ps", "--json").stdout):
            if marker in r["command"] and r["roam"] is not None:
                return r
        return None
    return wait_for(find, f"a roaming task running {marker}")


def row(task):
    rows = [r for r in json.loads(starling("ps", "--json").stdout) if r["task"] == task]
    return rows[0] if rows else None


def counts(term):
    """Every `count N` the program printed (the pane's whole history), in order."""
    text = term.run("capture-pane", "-p", "-S", "-100000", "-t", "t").stdout
    return [int(n) for n in re.findall(r"^count (\d+)\s*$", text, re.M)]


def test_starts_at_home_moves_out_and_back_keeping_its_state(term, workdir):
    prog, prof = workdir / "counter.py", workdir / "still.toml"
    prog.write_text(COUNTER)
    prof.write_text(STILL)
    term.start(f"{STARLING} exec --roam --profile {prof} -- python3 {prog}")
    term.wait(r"^count 3\s*$", "the program to count at home")
    r = roaming_task(str(prog))
    task = f"t{r['task']}"
    assert r["host"] == "home", r
    assert "started at home" in r["roam"]["reason"], r
    st = status()
    assert st["home"] and st["home"]["name"] == "home", st
    assert len(st["hosts"]) == 4 and all(h["name"] != "home" for h in st["hosts"]), "home is not a cluster host"

    for to in ("h2", "home"):
        before = max(counts(term))
        m = starling("migrate", task, "--to", to, check=False)
        assert m.returncode == 0, m.stderr
        assert f" to {to}:" in m.stdout, m.stdout
        r = wait_for(lambda: (x := row(r["task"])) and x["host"] == to and x, f"ps to show {task} on {to}")
        assert "moved by hand" in r["roam"]["reason"], r
        # It goes on counting from where it was, and its output still reaches this terminal.
        wait_for(lambda: max(counts(term)) >= before + 5, f"the counter to go on after the move to {to}")

    term.type("quit")
    assert term.finished("the program to quit") == 7
    seen = counts(term)
    quit_at = int(term.wait(r"^quit at (\d+)", "the program's last line").group(1))
    assert seen == list(range(1, quit_at + 1)), "every count once, in order, across two moves"
    why = starling("ps", "--why", task, check=False)
    assert why.returncode != 0, "the task has ended: ps --why has nothing to show"


def test_manager_moves_a_crunch_out_and_comes_home_for_keys(term, workdir):
    prog, prof = workdir / "bimodal.py", workdir / "crunchy.toml"
    prog.write_text(BIMODAL)
    prof.write_text(CRUNCHY)
    term.start(f"{STARLING} exec --roam --profile {prof} -- python3 {prog}")
    term.wait(r"^ready\s*$", "the program to wait for input at home")
    r = roaming_task(str(prog))
    task, tid = f"t{r['task']}", r["task"]
    assert r["host"] == "home", r
    term.type("go")
    crunch_from = int(term.wait(r"^crunch from (\d+)", "the noisy phase to end and the crunch to start", timeout=300).group(1))

    def decisions():
        x = row(tid)
        return x["roam"]["decisions"] if x else []

    def moved(site):
        return [d for d in decisions() if d["action"] == "moved" and (d["to_site"] == site or (site == "cluster" and d["to_site"] != "home"))]

    out = wait_for(lambda: moved("cluster"), "the manager to move the crunching task to the cluster", timeout=300)[0]
    # The noisy sensor did not move it: the first move came after the real crunch began.
    assert out["at_ms"] >= crunch_from, (out, crunch_from)
    sensors = dict(out["sensors"])
    assert sensors["cpu"] >= 0.3 and sensors["runnable"] >= 0.7 and sensors["inputs"] < 4, out
    assert "C/(C-m)" in out["reason"], out
    x = wait_for(lambda: (y := row(tid)) and y["host"] != "home" and y, "ps to show the task on a host")
    assert "moved" not in x["roam"]["reason"] or "cpu" in x["roam"]["reason"], x

    # Keys resume at once: the dwell time holds the move home back first (logged), then it goes.
    def type_until(pred, what):
        deadline = time.monotonic() + 300
        while not (v := pred()):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; decisions: {decisions()}")
            term.type("x", enter=False)
            time.sleep(0.2)
        return v

    hold = type_until(lambda: [d for d in decisions() if d["action"] == "stay" and "dwell" in d["reason"]], "a move home held back by the dwell time")[0]
    assert hold["to_state"] == "cognitive", hold
    home = type_until(lambda: moved("home"), "the manager to bring the task home for the keys")[0]
    assert home["at_ms"] > hold["at_ms"], (hold, home)
    assert dict(home["sensors"])["inputs"] >= 4, home
    assert [d["to_site"] == "home" for d in decisions() if d["action"] == "moved"] == [False, True], "one move out, one back: no flapping"
    why = starling("ps", "--why", task)
    assert "inputs=" in why.stdout and "dwell" in why.stdout, why.stdout

    term.type("")
    term.type("quit")
    assert term.finished("the program to quit") == 3
    term.wait(r"^quitting\s*$", "the program's last line")


# Prints each line it reads back (its terminal's own echo off, so the lines never mix on screen).
ECHO = r"""
import sys, termios
modes = termios.tcgetattr(0)
modes[3] &= ~termios.ECHO
termios.tcsetattr(0, termios.TCSANOW, modes)
print("ready", flush=True)
for line in sys.stdin:
    line = line.strip()
    print(f"got {line}", flush=True)
    if line == "quit":
        sys.exit(5)
"""


def got(term):
    """Every `got X` line the program printed (the pane's whole history), in order."""
    text = term.run("capture-pane", "-p", "-S", "-100000", "-t", "t").stdout
    return re.findall(r"^got (\S+)\s*$", text, re.M)


def test_at_home_the_terminal_talks_to_its_client_directly_and_moves_keep_every_byte(term, workdir):
    """At home (this machine) a task's terminal stream goes straight between its client and the
    home site, never through the head (which sits across the link from the client): the head's
    count of the task's relayed stream messages stays put while keys are typed and echoed. On h2
    the head relays it again; back home it is direct again; every line arrives once, in order."""
    prog, prof = workdir / "echo.py", workdir / "still.toml"
    prog.write_text(ECHO)
    prof.write_text(STILL)
    term.start(f"{STARLING} exec --roam --profile {prof} -- python3 {prog}")
    term.wait(r"^ready\s*$", "the program to start at home")
    tid = roaming_task(str(prog))["task"]
    typed = []

    def lines(tag, n):
        # Each after the last one's echo: lines typed at once may reach the task in one read,
        # and their echoes in one output, which the head's count would see as one message.
        for i in range(n):
            typed.append(f"{tag}-{i}")
            term.type(typed[-1])
            term.wait(rf"^got {tag}-{i}\s*$", f"the echo of {tag}-{i}")

    def on(site, direct):
        return wait_for(lambda: (x := row(tid)) and x["host"] == site and x["direct"] is direct and x,
                        f"ps to show the task on {site} with direct={direct}")

    # Through the head, each line typed would be at least two stream messages there (its input and
    # the answer): 20 lines at home add fewer than 20 (the head may still count a few it got before
    # the switch to the direct path, e.g. the program's first line).
    relayed = on("home", True)["relayed"]
    lines("home", 20)
    at_home = row(tid)
    assert at_home["direct"] and at_home["relayed"] - relayed < 20, (relayed, at_home)

    assert starling("migrate", f"t{tid}", "--to", "h2", check=False).returncode == 0
    relayed = on("h2", False)["relayed"]
    lines("away", 5)
    # Through the head: each line's input and answer.
    assert row(tid)["relayed"] >= relayed + 10, "away from home the head relays the stream"

    assert starling("migrate", f"t{tid}", "--to", "home", check=False).returncode == 0
    relayed = on("home", True)["relayed"]
    lines("back", 20)
    back = row(tid)
    assert back["direct"] and back["relayed"] - relayed < 20, (relayed, back)

    term.type("quit")
    assert term.finished("the program to quit") == 5
    assert got(term) == typed + ["quit"], "every line once, in order, across the paths' switches"


# One numbered line every 0.05 s: a line lost, repeated or reordered shows in the numbers.
TICKER = r"""
import time
i = 0
while True:
    i += 1
    print(f"count {i}", flush=True)
    time.sleep(0.05)
"""


def gone(pid):
    """Process `pid` ended (its shell, which saw it stop, may not have reaped it yet)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_at_home_a_killed_client_loses_nothing_that_went_to_it_directly(term, other, workdir):
    """The output of a task at home goes to its client directly, not through the head, which
    keeps what it relays for `starling attach`. The home site keeps what it sent directly until
    the client acknowledges writing it, and hands the rest to the head when the client dies:
    kill -9 the client while direct, and the attach goes on from the first count it had not
    printed, none lost or repeated, also of what the client was sent and never wrote."""
    prog, prof = workdir / "ticker.py", workdir / "still.toml"
    prog.write_text(TICKER)
    prof.write_text(STILL)
    # After the client dies its shell sleeps: nothing it prints overwrites the client's last line.
    term.type(f"clear; {STARLING} exec --roam --profile {prof} -- python3 {prog}; exec sleep 100000")
    term.wait(r"^count 3\s*$", "the program to count at home")
    tid = roaming_task(str(prog))["task"]
    direct = wait_for(lambda: (x := row(tid)) and x["host"] == "home" and x["direct"] and x, "ps to show the task's stream direct")
    start = max(counts(term))
    wait_for(lambda: max(counts(term)) >= start + 20, "the counter to go on through the direct path")
    # Through the head each count would be a message there.
    still = row(tid)
    assert still["direct"] and still["relayed"] - direct["relayed"] < 20, (direct, still)

    # The client stops reading (stopped), the task goes on printing into its direct connection:
    # output the client was sent and never wrote.
    pid = exec_pid(term)
    os.kill(pid, signal.SIGSTOP)
    ran = row(tid)["runtime_seconds"]
    wait_for(lambda: row(tid)["runtime_seconds"] > ran + 1, "the task to run on a second (about 20 counts)")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: gone(pid), "the killed client to be gone")
    printed = counts(term)
    last = printed[-1]
    assert printed == list(range(1, last + 1)), "the first client printed every count once, in order"
    x = wait_for(lambda: (y := row(tid)) and y["state"] == "detached" and y, f"ps to show t{tid} detached")
    assert x["host"] == "home", x

    other.start(f"{STARLING} attach t{tid}")
    wait_for(lambda: (c := counts(other)) and c[-1] >= last + 40, "the counter to go on in the attached terminal")
    seen = counts(other)
    assert seen[0] == last + 1, f"the attach starts right after the last count the dead client printed ({last}): {seen[:5]}"
    assert seen == list(range(last + 1, seen[-1] + 1)), "no count lost, repeated or reordered"
    other.key("C-c")
    assert other.finished("the program to end on Ctrl-C through the attach") == 130
