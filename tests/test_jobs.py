"""Jobs end to end: `starling batch` (a file and `-`), `starling run --json`, their exit statuses."""
import json
import subprocess

from conftest import STARLING, status


def job(*args, cwd, input=None, timeout=300):
    return subprocess.run([STARLING, *args], cwd=cwd, input=input, capture_output=True, timeout=timeout)


BATCH = b"""\
# a comment line: skipped
echo "first $STARLING_TASK/$STARLING_TASKS" > out-first.txt

   echo second > out-second.txt; echo second-ran
# echo skipped > never.txt
sh -c 'echo "third $(( 6 * 7 ))"' > out-third.txt
"""


def check_batch_ran(d, r):
    assert r.returncode == 0, r.stderr.decode()
    # One task per command line, in order (blank and # lines are not tasks), each run once.
    assert (d / "out-first.txt").read_text() == "first 0/3\n"
    assert (d / "out-second.txt").read_text() == "second\n"
    assert (d / "out-third.txt").read_text() == "third 42\n"
    assert not (d / "never.txt").exists()
    assert r.stdout == b"second-ran\n"


def test_batch_file(cluster, workdir):
    (workdir / "commands.txt").write_bytes(BATCH)
    check_batch_ran(workdir, job("batch", "--quiet", "commands.txt", cwd=workdir))


def test_batch_from_stdin(cluster, workdir):
    check_batch_ran(workdir, job("batch", "--quiet", "-", cwd=workdir, input=BATCH))


def test_batch_exit_status_is_the_first_failing_tasks(cluster, workdir):
    r = job("batch", "--quiet", "-", cwd=workdir, input=b"true\nexit 5\nexit 3\ntrue\n")
    assert r.returncode == 5, r.stderr.decode()


def test_run_json_events(cluster, workdir):
    """--json: every stdout line is one JSON event: started (with the host), output (per stream),
    finished (with the exit code) per task, then one summary."""
    n = 4
    r = job("run", "-n", str(n), "--json", "--", "sh", "-c",
            'echo "out-$STARLING_TASK"; echo "err-$STARLING_TASK" >&2; exit $STARLING_TASK', cwd=workdir)
    assert r.returncode == 1, r.stderr.decode()  # tasks 1..3 fail; the first failing one exits 1
    events = [json.loads(line) for line in r.stdout.decode().splitlines()]
    hosts = {h["name"] for h in status()["hosts"]}
    for i in range(n):
        mine = [e for e in events if e.get("task") == i]
        kinds = [e["event"] for e in mine]
        assert kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("started") == 1, mine
        assert mine[0]["host"] in hosts, mine[0]
        out = "".join(e["data"] for e in mine if e["event"] == "output" and e["stream"] == "stdout")
        err = "".join(e["data"] for e in mine if e["event"] == "output" and e["stream"] == "stderr")
        assert (out, err) == (f"out-{i}\n", f"err-{i}\n"), mine
        assert mine[-1]["exit"] == i and mine[-1]["commit_ok"] is True, mine[-1]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["tasks"] == n and summary["failed"] == n - 1, summary
    assert [e["event"] for e in events].count("summary") == 1
    assert r.stderr == b"", "with --json, task output goes into the events"
