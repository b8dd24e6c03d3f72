"""The head's Prometheus endpoint (`starling up --metrics ADDR` / `starling head --metrics ADDR`),
scraped over HTTP and checked against what `starling status --json` and the test itself did: hosts
and their cores, tasks started/finished, a running task by state and on its host, the relay cache's
traffic, and a task lost with its host."""
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import STARLING, require_root, starling, status, up, wait_for

SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (\S+)$')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not exposition format: {line!r}"
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    # Every sample's metric has its HELP and TYPE.
    for name, _ in out:
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text, name
    return out


@pytest.fixture(scope="module")
def cluster():
    require_root("an embedded cluster")
    starling("down", check=False)
    addr = f"127.0.0.1:{free_port()}"
    r = starling("up", "--hosts", "2", "--metrics", addr, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    yield f"http://{addr}/metrics"
    # Leave a healthy 4-host cluster for the modules that share the session's (conftest.cluster).
    up(4)


def test_status_names_the_endpoint_and_other_paths_are_404(cluster):
    assert status()["network"]["metrics"] == cluster
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(cluster.replace("/metrics", "/other"), timeout=30)
    assert e.value.code == 404


def test_hosts_tasks_and_relay_match_what_happened(cluster, tmp_path):
    st = status()
    m = scrape(cluster)
    assert m[("starling_hosts", "")] == len(st["hosts"]) == 2
    for h in st["hosts"]:
        assert m[("starling_host_cores", f'{{host="{h["name"]}"}}')] == h["cores"]
        assert m[("starling_host_memory_bytes", f'{{host="{h["name"]}"}}')] == h["mem_bytes"]
    assert m[("starling_tasks", '{state="running"}')] == 0
    started0 = m[("starling_tasks_started_total", "")]
    finished0 = m[("starling_tasks_ended_total", '{how="finished"}')]

    (tmp_path / "data").write_bytes(os.urandom(300_000))
    r = starling("run", "-n", "3", "--quiet", "--", "sh", "-c", "cat data > /dev/null; echo ok $STARLING_TASK", cwd=tmp_path)
    assert r.stdout.count("ok ") == 3
    m = scrape(cluster)
    assert m[("starling_tasks_started_total", "")] - started0 == 3
    assert m[("starling_tasks_ended_total", '{how="finished"}')] - finished0 == 3
    # The file's content went through the relay to the hosts.
    chunk_requests = m[("starling_relay_requests_total", '{kind="chunk",result="hit"}')] + \
        m[("starling_relay_requests_total", '{kind="chunk",result="miss"}')]
    assert chunk_requests > 0
    assert m[("starling_relay_bytes_total", '{direction="to_hosts"}')] >= 300_000


def test_a_running_task_is_counted_on_its_host_and_lost_with_it(cluster, tmp_path):
    host = status()["hosts"][1]
    p = subprocess.Popen([STARLING, "exec", "--host", host["name"], "--", "sh", "-c", "echo started; sleep 120"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"started\n"
        st = status()
        m = scrape(cluster)
        running = {h["name"]: h["running"] for h in st["hosts"]}
        assert running[host["name"]] == 1
        assert m[("starling_tasks", '{state="running"}')] == 1
        assert m[("starling_host_running_cores", f'{{host="{host["name"]}"}}')] == running[host["name"]]
        lost0 = m[("starling_tasks_ended_total", '{how="lost"}')]
        os.kill(host["pid"], signal.SIGKILL)
        p.communicate(timeout=120)
        assert p.returncode == 255
        m = wait_for(lambda: (lambda m: m if m[("starling_hosts", "")] == 1 else None)(scrape(cluster)),
                     "the head to drop the killed host", timeout=60)
        assert m[("starling_tasks_ended_total", '{how="lost"}')] - lost0 == 1
        assert m[("starling_tasks", '{state="running"}')] == 0
    finally:
        if p.poll() is None:
            p.kill()
