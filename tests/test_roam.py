"""Roaming tasks (issue 11 parts 1 and 4): `starling exec --roam` starts a program at home (this
machine, same sandbox and file view as a host), `starling migrate --to HOST|home` moves it both ways,
and its migration manager moves it to the cluster while it crunches and home when keys resume.

Driven through tmux (a real terminal) on the real embedded cluster. Every wait polls the screen or
`starling ps` for an event (a decision in the log, the task on a site); timeouts only bound a hang.
"""
import json
import re
import time

import pytest

from conftest import STARLING, require_tool, starling, status, wait_for
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
