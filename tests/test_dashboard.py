"""The head's live dashboard (`starling dashboard` prints its URL): /api/state (JSON), /api/events
(server-sent events) read with urllib, and the page itself loaded in headless Chromium (Debian's
`chromium`, installed by .ci/run) while a job runs and after it ends.

The job is `starling exec --job NAME -- sh -c 'read x'`: it runs until the test writes a line to its
stdin (forwarded to the task), so the test decides when it ends; no sleeps.

Live progress: a remote-fork clone (tests/fork/slow_faults.c) that keeps faulting pages in until the
test's TCP gate opens shows a non-zero fault count while it still runs (its agent reports each second);
a `starling.Executor` (tests/fork/executor_gate.py, needs the wheel: `make python`) whose calls wait
at the gate shows its futures submitted and none done, then all done once the gate opens."""
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid

import pytest

from conftest import ROOT, SCRATCH, STARLING, require_module, require_tool, sh, starling, status, wait_for


@pytest.fixture
def url(cluster):
    r = starling("dashboard")
    u = r.stdout.strip()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", u), r.stdout
    return u


def state(url):
    with urllib.request.urlopen(url + "api/state", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "application/json"
        return json.loads(r.read())


def job_in(st, label):
    return next((j for j in st["jobs"] if j["label"] == label), None)


class Job:
    """A one-task job that runs until `finish()` writes a line to its stdin."""

    def __init__(self):
        self.label = "dash-" + uuid.uuid4().hex[:8]
        env = dict(os.environ)
        self.p = subprocess.Popen([STARLING, "exec", "--job", self.label, "--", "sh", "-c", "read x; echo got $x"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def finish(self):
        out, err = self.p.communicate("go\n", timeout=120)
        assert self.p.returncode == 0, err
        assert out.strip() == "got go", out

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def job():
    j = Job()
    yield j
    j.kill()


def test_state_names_every_host_and_the_running_job(url, job):
    hosts = {h["name"]: h["cores"] for h in status()["hosts"]}
    st = wait_for(lambda: (s := state(url)) and job_in(s, job.label) and s, f"job {job.label} in /api/state")
    assert {h["name"]: h["cores"] for h in st["hosts"]} == hosts
    j = job_in(st, job.label)
    assert (j["kind"], j["state"], j["running"], j["total"]) == ("job", "running", 1, 1), j
    task = next(t for t in st["tasks"] if t["job"] == job.label)
    assert task["host"] in hosts and "read x" in task["command"], task
    job.finish()
    j = wait_for(lambda: (j := job_in(state(url), job.label)) and j["state"] != "running" and j, "the job's end")
    assert (j["state"], j["done"], j["finished"], j["failed"]) == ("done", 1, 1, 0), j
    assert not any(t["job"] == job.label for t in state(url)["tasks"])


def test_events_push_the_job_as_it_starts_and_ends(url):
    with urllib.request.urlopen(url + "api/events", timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"

        def next_state():
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    return json.loads(line[6:])
            pytest.fail("the event stream ended")

        first = next_state()  # sent at once
        assert {h["name"] for h in first["hosts"]} == {h["name"] for h in status()["hosts"]}
        j = Job()
        try:
            while (g := job_in(next_state(), j.label)) is None:
                pass
            assert g["state"] == "running", g
            j.finish()
            while (g := job_in(next_state(), j.label))["state"] == "running":
                pass
            assert g["state"] == "done", g
        finally:
            j.kill()


def chromium(url, out_dir, *extra):
    """Load `url` in headless Chromium, return what it printed (stdout): the DOM (or a screenshot)
    once the page has loaded and its script has run. (The page is never idle: its event stream stays
    open, so --virtual-time-budget would wait forever; the head puts the state in the page and the
    script draws it before the load event.)"""
    exe = require_tool("chromium", "chromium")
    home = out_dir / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home))
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--no-first-run", "--user-data-dir=" + str(home / "profile"),
                        *extra, url],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_page_in_chromium_shows_the_job_and_hosts_then_done(url, job, tmp_path):
    hosts = [h["name"] for h in status()["hosts"]]
    wait_for(lambda: job_in(state(url), job.label), f"job {job.label} in /api/state")
    dom = chromium(url, tmp_path, "--dump-dom")
    # Rows the page's script made from the live state: the job running, every host.
    assert re.search(rf'<tr class="job" data-label="{job.label}" data-state="running">', dom), dom[-4000:]
    for h in hosts:
        assert f'<tr class="host" data-host="{h}">' in dom, h
    job.finish()
    wait_for(lambda: (j := job_in(state(url), job.label)) and j["state"] == "done", "the job's end")
    dom = chromium(url, tmp_path, "--dump-dom")
    assert re.search(rf'<tr class="job" data-label="{job.label}" data-state="done">', dom), dom[-4000:]
    shot = tmp_path / "dashboard.png"
    chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1280,1000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG screenshot"
    print("screenshot:", shot)


class Gate:
    """A TCP gate in this process: a clone that connects and says a line waits until `open()`
    sends it one byte (at once, for those that come after)."""

    def __init__(self):
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.arrived = []
        self.opened = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn):
        with conn:
            line = conn.makefile("rb").readline()
            self.arrived.append(line.strip())
            self.opened.wait()
            try:
                conn.sendall(b"x")
            except OSError:
                pass

    def open(self):
        self.opened.set()

    def close(self):
        self.opened.set()
        self.sock.close()


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.close()


def fork_env():
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)  # the cluster's clones, not local ones
    return env


def ticket_in(st, ticket):
    return next((j for j in st["jobs"] if j["ticket"] == ticket), None)


@pytest.fixture(scope="module")
def slow_faults():
    """tests/fork/slow_faults.c built against the static libstarling."""
    lib = ROOT / "target/release/libstarling.a"
    assert lib.exists(), "build it: cargo build --release -p starling-capi"
    out = SCRATCH / "dash-bin"
    out.mkdir(parents=True, exist_ok=True)
    sh("cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/slow_faults.c"), str(lib),
       "-lpthread", "-ldl", "-lm", "-o", str(out / "slow_faults"))
    return str(out / "slow_faults")


def test_a_tickets_page_faults_show_while_its_clone_runs(url, gate, slow_faults):
    before = {j["ticket"] for j in state(url)["jobs"] if j["ticket"] is not None}
    p = subprocess.Popen([slow_faults, str(gate.port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=fork_env(), cwd="/var/tmp")
    try:
        # The clone is running (it said so at the gate, and waits there until it opens)...
        wait_for(lambda: gate.arrived or p.poll() is not None, "the clone at the gate")
        assert p.poll() is None, p.communicate()
        # ...and its ticket shows faults before it ended: its agent's live report.
        g = wait_for(lambda: next((j for j in state(url)["jobs"] if j["ticket"] is not None and j["ticket"] not in before
                                   and j["faults"] > 0), None), "a live fault count for the clone's ticket")
        assert p.poll() is None and not gate.opened.is_set()
        assert (g["kind"], g["state"], g["clones_ended"], g["clones_live"]) == ("ticket", "running", 0, 1), g
        assert g["fault_samples"][-1][1] == g["faults"], g
        assert g["fault_rate"] is not None and g["fault_rate"] > 0, g
        # Counts only grow: the clone keeps reading fresh pages.
        later = wait_for(lambda: (j := ticket_in(state(url), g["ticket"])) and j["faults"] > g["faults"] and j,
                         "the fault count to grow")
        assert later["clones_ended"] == 0, later
        gate.open()
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, out + err
        final_faults = int(re.search(r"faults=(\d+)", out).group(1))
        end = wait_for(lambda: (j := ticket_in(state(url), g["ticket"])) and j["state"] != "running" and j, "the ticket's end")
        # The final count is the clone's own (CloneStats), not the live one added again.
        assert (end["state"], end["clones_ended"], end["clones_live"], end["faults"]) == ("done", 1, 0, final_faults), end
        assert final_faults >= later["faults"], (final_faults, later)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


class BlockedExecutor:
    """tests/fork/executor_gate.py: a starling.Executor whose N calls wait at `gate`."""

    N = 5

    def __init__(self, url, gate):
        self.url, self.gate = url, gate
        before = {j["label"] for j in state(url)["jobs"] if j["kind"] == "executor"}
        script = ROOT / "tests/fork/executor_gate.py"
        self.p = subprocess.Popen([sys.executable, str(script), str(gate.port), str(self.N)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=fork_env(), cwd="/var/tmp")
        self.group = wait_for(lambda: self.p.poll() is None and next(
            (j for j in state(url)["jobs"] if j["kind"] == "executor" and j["label"] not in before
             and j["executor"]["submitted"] == self.N), None) or self._failed(), "the executor's submitted futures")

    def _failed(self):
        if self.p.poll() is not None:
            pytest.fail("executor_gate.py ended: " + "".join(self.p.communicate()))

    def now(self):
        return ticket_in(state(self.url), self.group["ticket"])

    def release(self):
        # Both workers (executor_gate.py asks for 2) hold a call first: a worker still starting when
        # the calls are all done would be killed at shutdown, and its ticket's group end as failed.
        wait_for(lambda: len(self.gate.arrived) >= 2 or self._failed(), "both workers at the gate")
        self.gate.open()
        out, err = self.p.communicate(timeout=300)
        assert self.p.returncode == 0, out + err
        assert "results [0, 1, 4, 9, 16]" in out, out

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def blocked_executor(url, gate):
    require_module("starling", "build and install it: make python (scripts/build-python.sh)")
    ex = BlockedExecutor(url, gate)
    yield ex
    ex.kill()


def test_b_executor_progress_shows_pending_then_done(blocked_executor):
    ex, n = blocked_executor, BlockedExecutor.N
    e = ex.group["executor"]
    # The gate is closed: no call can have returned.
    assert (e["submitted"], e["done"], e["failed"], e["closed"]) == (n, 0, 0, False), ex.group
    assert ex.group["state"] == "running", ex.group
    # Its workers are the ticket's clone tasks: the group counts them once they run a call.
    wait_for(lambda: ex.gate.arrived, "a worker running a call")
    g = wait_for(lambda: (j := ex.now()) and j["executor"]["workers"] >= 1 and j["running"] >= 1 and j, "the executor's workers")
    assert g["executor"]["done"] == 0, g
    ex.release()
    g = wait_for(lambda: (j := ex.now()) and j["executor"]["closed"] and j, "the executor's last report")
    assert (g["executor"]["submitted"], g["executor"]["done"], g["executor"]["failed"]) == (n, n, 0), g
    g = wait_for(lambda: (j := ex.now()) and j["state"] != "running" and j, "the executor's workers to end")
    assert g["state"] == "done", g


def test_c_page_in_chromium_shows_executor_progress(blocked_executor, url, tmp_path):
    ex, n = blocked_executor, BlockedExecutor.N
    label = re.escape(ex.group["label"])
    dom = chromium(url, tmp_path, "--dump-dom")
    row = re.search(rf'<tr class="job" data-label="{label}" data-state="running">.*?</tr>', dom)
    assert row, dom[-4000:]
    assert f'<span class="futures" data-submitted="{n}" data-done="0" data-failed="0">' in row.group(0), row.group(0)
    ex.release()
    wait_for(lambda: (j := ex.now()) and j["executor"]["closed"] and j["state"] == "done", "the executor's end")
    dom = chromium(url, tmp_path, "--dump-dom")
    row = re.search(rf'<tr class="job" data-label="{label}" data-state="done">.*?</tr>', dom)
    assert row, dom[-4000:]
    assert f'<span class="futures" data-submitted="{n}" data-done="{n}" data-failed="0">' in row.group(0), row.group(0)
    shot = tmp_path / "dashboard-executor.png"
    chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1280,1200")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG screenshot"
    print("screenshot:", shot)
