"""The head's live dashboard (`starling dashboard` prints its URL): /api/state (JSON), /api/events
(server-sent events) read with urllib, and the page itself loaded in headless Chromium (Debian's
`chromium`, installed by .ci/run) while a job runs and after it ends.

The job is `starling exec --job NAME -- sh -c 'read x'`: it runs until the test writes a line to its
stdin (forwarded to the task), so the test decides when it ends; no sleeps."""
import json
import os
import pathlib
import re
import subprocess
import urllib.request
import uuid

import pytest

from conftest import STARLING, require_tool, starling, status, wait_for


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
