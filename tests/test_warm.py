"""Warm launches (issue 18): many concurrent `exec`s, and task isolation within one job on one host."""
import concurrent.futures
import pathlib
import subprocess
import tempfile

from conftest import STARLING


def test_200_concurrent_execs_keep_their_exit_codes(cluster):
    """200 `exec`s, 50 at a time: each succeeds and returns its own exit code and output."""
    def one(i):
        r = subprocess.run([STARLING, "exec", "--", "sh", "-c", f"echo task-{i}; exit $(({i} % 7))"],
                           capture_output=True, timeout=600)
        return i, r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")

    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(one, range(200)))
    wrong = [(i, rc, err[-300:]) for i, rc, out, err in results if rc != i % 7 or out != f"task-{i}\n"]
    assert not wrong, f"{len(wrong)} of 200 execs went wrong, e.g. {wrong[:3]}"


def start(args, cwd):
    p = subprocess.Popen([STARLING, "exec", *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return p


def read_line(p, what):
    line = p.stdout.readline()
    assert line, f"{what}: the task ended early: {p.stderr.read()[-2000:]}"
    return line.strip()


def test_tasks_of_one_job_on_one_host_do_not_see_each_others_uncommitted_files(cluster):
    """Two live tasks of one job on one host: neither sees the other's uncommitted file; both commit."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="starling-warm-"))
    job = f"warm-iso-{d.name}"
    # A writes its file and reports; on a line from us it looks for B's file, reports, and ends.
    a = start(["--job", job, "--host", "h2", "--", "sh", "-c",
               "echo a > a-secret; echo ready; read x || true; "
               "if [ -e b-secret ]; then echo b-visible; else echo b-hidden; fi"], d)
    try:
        assert read_line(a, "task A") == "ready"
        b = start(["--job", job, "--host", "h2", "--", "sh", "-c",
                   "echo b > b-secret; if [ -e a-secret ]; then echo a-visible; else echo a-hidden; fi; read x || true"], d)
        try:
            assert read_line(b, "task B") == "a-hidden", "task B saw task A's uncommitted file"
            a.stdin.write("go\n")
            a.stdin.flush()
            assert read_line(a, "task A") == "b-hidden", "task A saw task B's uncommitted file"
            b.stdin.close()
            assert b.wait(timeout=300) == 0, b.stderr.read()
        finally:
            b.kill()
        a.stdin.close()
        assert a.wait(timeout=300) == 0, a.stderr.read()
    finally:
        a.kill()
    # Both committed on their own ending.
    assert (d / "a-secret").read_text() == "a\n"
    assert (d / "b-secret").read_text() == "b\n"
