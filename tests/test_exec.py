"""`starling exec` end to end on a real embedded cluster."""
import hashlib
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, STARLING, lua_src, sh, starling, status


def exec_(*cmd, cwd=None, env=None, check=False, timeout=300, input=None, host=None):
    args = [STARLING, "exec"] + (["--host", host] if host else []) + ["--"] + list(cmd)
    return subprocess.run(args, capture_output=True, cwd=cwd, env=env, timeout=timeout, input=input, check=check)


def test_status_lists_hosts_and_network(cluster):
    st = status()
    names = [h["name"] for h in st["hosts"]]
    assert names == ["h1", "h2", "h3", "h4"]
    addrs = {h["address"] for h in st["hosts"]}
    assert len(addrs) == 4, "each host has its own address"
    for h in st["hosts"]:
        assert h["cores"] >= 1 and h["pid"] > 1
        assert pathlib.Path(f"/proc/{h['pid']}").exists(), "agent pid is a live process on this machine"
    assert st["network"]["bridge"] and st["network"]["subnet"]
    text = starling("status").stdout
    assert "h1" in text and "ADDRESS" in text


def test_runs_on_another_host(cluster):
    r = exec_("uname", "-n", host="h3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "h3"


def test_exit_codes(cluster):
    assert exec_("true").returncode == 0
    assert exec_("false").returncode == 1
    assert exec_("sh", "-c", "exit 42").returncode == 42


def test_command_not_found(cluster):
    r = exec_("no-such-command-xyz")
    assert r.returncode == 127
    assert b"no-such-command-xyz: command not found" in r.stderr


def test_killed_by_signal(cluster):
    r = exec_("sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + signal.SIGTERM


def start_until_ready(script):
    """`starling exec -- sh -c SCRIPT`, returned once the task printed `ready` (it runs remotely by then)."""
    p = subprocess.Popen([STARLING, "exec", "--", "sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    line = readline_within(p.stdout, 120)
    assert line == b"ready\n", (line, p.stderr.read() if p.poll() is not None else b"")
    return p


def readline_within(f, timeout):
    """One line of a pipe, or a test failure after `timeout` s (a hang must not hang the suite)."""
    ready, _, _ = select.select([f], [], [], timeout)
    if not ready:
        pytest.fail(f"no line within {timeout} s")
    return f.readline()


def test_ctrl_c_is_forwarded(cluster):
    p = start_until_ready("echo ready; exec sleep 600")
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=120)
    assert rc == 128 + signal.SIGINT


def test_sigterm_is_forwarded(cluster):
    # The trap is set before `ready` is printed: the signal cannot arrive before it.
    p = start_until_ready("trap 'echo got-term; exit 7' TERM; echo ready; sleep 600 & wait")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 7 and b"got-term" in out


def test_stdin_100mb_through_sha256sum(cluster, workdir):
    data = os.urandom(100 << 20)
    want = hashlib.sha256(data).hexdigest()
    r = exec_("sha256sum", input=data, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split()[0] == want


def test_stdout_streams_live(cluster):
    # The task prints its second line only after reading a line that the test sends only after
    # it got the first: without live streaming neither side ever gets further (failed by the deadline).
    p = subprocess.Popen([STARLING, "exec", "--", "sh", "-c", "echo first; read reply; echo \"second $reply\""],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert readline_within(p.stdout, 120) == b"first\n"
    p.stdin.write(b"after-first\n")
    p.stdin.close()
    rest = p.stdout.read()
    p.wait(timeout=120)
    assert rest == b"second after-first\n" and p.returncode == 0


def test_configuration_transparency(cluster, workdir):
    (workdir / "sub").mkdir()
    env = dict(os.environ, STARLING_TEST_VAR="hello world")
    script = 'pwd; echo "$STARLING_TEST_VAR"; umask; id -u; ulimit -n; echo "$0" "$@"'
    args = ["sh", "-c", script, "argzero", "a b", "c"]
    local = subprocess.run(["sh", "-c", "umask 027; ulimit -n 777; exec \"$@\"", "x"] + args,
                           cwd=workdir / "sub", env=env, capture_output=True)
    remote = subprocess.run(["sh", "-c", f"umask 027; ulimit -n 777; exec {STARLING} exec -- \"$@\"", "x"] + args,
                            cwd=workdir / "sub", env=env, capture_output=True)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    assert b"0027" in remote.stdout and b"777" in remote.stdout


def test_sees_callers_files_not_hosts(cluster, workdir):
    """A host-only file planted in each host's own root is invisible to tasks."""
    marker = "/etc/starling-host-only-marker"
    for h in status()["hosts"]:
        p = pathlib.Path(f"/proc/{h['pid']}/root{marker}")
        p.write_text(f"host {h['name']}\n")
        assert p.exists()
    assert not pathlib.Path(marker).exists()
    for h in status()["hosts"]:
        r = exec_("cat", marker, host=h["name"])
        assert r.returncode != 0 and b"No such file" in r.stderr, (h["name"], r)
    (workdir / "mine.txt").write_text("client file\n")
    r = exec_("cat", str(workdir / "mine.txt"), host="h2")
    assert r.stdout == b"client file\n"


def test_unexported_paths(cluster):
    r = exec_("sh", "-c", "ls /dev; ls /sys | wc -l; test -e /var/lib/starling && echo LEAK; cat /proc/self/status | head -1; ls -d /proc/[0-9]* | wc -l")
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    for node in ["null", "zero", "full", "random", "urandom", "tty", "pts", "shm"]:
        assert node in out.split(), out
    assert "sda" not in out and "vda" not in out and "LEAK" not in out
    assert "Name:" in out
    nprocs = int(out.strip().split("\n")[-1])
    assert nprocs < 10, "the task sees its own PID namespace only"


def test_python_reads_data_writes_results(cluster, workdir):
    data = workdir / "data"
    data.mkdir()
    for i in range(5):
        (data / f"part{i}.csv").write_text("\n".join(f"{i},{j},{i * j % 7}" for j in range(1000)))
    script = workdir / "summarise.py"
    script.write_text(
        "import csv, glob, json, os\n"
        "tot = {}\n"
        "for f in sorted(glob.glob('data/*.csv')):\n"
        "    tot[os.path.basename(f)] = sum(int(r[2]) for r in csv.reader(open(f)))\n"
        "os.makedirs('results', exist_ok=True)\n"
        "json.dump(tot, open('results/summary.json', 'w'), sort_keys=True)\n"
        "print('done', len(tot))\n")
    r = exec_(sys.executable, "summarise.py", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"done 5\n"
    remote = (workdir / "results/summary.json").read_text()
    (workdir / "results/summary.json").unlink()
    subprocess.run([sys.executable, "summarise.py"], cwd=workdir, check=True, capture_output=True)
    assert (workdir / "results/summary.json").read_text() == remote


def test_writes_overwrites_deletes_renames(cluster, workdir):
    (workdir / "keep.txt").write_text("old\n")
    (workdir / "gone.txt").write_text("x\n")
    (workdir / "olddir").mkdir()
    (workdir / "olddir/f").write_text("f\n")
    (workdir / "mv-src").write_text("moved\n")
    r = exec_("sh", "-c", "echo new > keep.txt && rm gone.txt && rm -r olddir && mkdir -p a/b && echo deep > a/b/c"
              " && mv mv-src mv-dst && ln -s keep.txt link && chmod 600 keep.txt", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert (workdir / "keep.txt").read_text() == "new\n"
    assert oct((workdir / "keep.txt").stat().st_mode & 0o777) == oct(0o600)
    assert not (workdir / "gone.txt").exists()
    assert not (workdir / "olddir").exists()
    assert (workdir / "a/b/c").read_text() == "deep\n"
    assert not (workdir / "mv-src").exists() and (workdir / "mv-dst").read_text() == "moved\n"
    assert os.readlink(workdir / "link") == "keep.txt"
    leftovers = [p for p in workdir.rglob("*") if ".starling-" in p.name]
    assert leftovers == []


def test_conflict_keeps_local_change(cluster, workdir):
    f = workdir / "shared.txt"
    f.write_text("v1\n")
    # The task writes only after the test edited the file here (it waits for a line on stdin).
    p = subprocess.Popen([STARLING, "exec", "--", "sh", "-c", "cat shared.txt; read go; echo task > shared.txt"],
                         cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = readline_within(p.stdout, 120)
    f.write_text("local edit\n")
    out, err = p.communicate(input=b"go\n", timeout=120)
    assert first + out == b"v1\n", "the task saw the file as it was at launch"
    assert f.read_text() == "local edit\n", "the local change is never overwritten"
    assert (workdir / "shared.txt.starling-conflict").read_text() == "task\n"
    assert b"conflict" in err and b"shared.txt" in err


def test_changes_while_running_are_not_seen(cluster, workdir):
    f = workdir / "input.txt"
    f.write_text("before\n")
    p = subprocess.Popen([STARLING, "exec", "--", "sh", "-c", "cat input.txt; read go; cat input.txt"],
                         cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = readline_within(p.stdout, 120)
    f.write_text("after, longer\n")  # changed here after the task's first read, before its second
    out, _ = p.communicate(input=b"go\n", timeout=120)
    assert first + out == b"before\nbefore\n"


def build_lua(dest, src, cc_prefix=None, jobs=8):
    dest.mkdir(parents=True, exist_ok=True)
    cc = "gcc" if not cc_prefix else f"{cc_prefix} gcc"
    t0 = time.time()
    r = subprocess.run(["make", f"-j{jobs}", "-f", str(ROOT / "tests/fixtures/lua/Makefile"), f"LUA_SRC={src}", f"CC={cc}"],
                       cwd=dest, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return time.time() - t0


def outputs(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_parallel_make_is_byte_identical(cluster, workdir):
    src = workdir / "lua"
    subprocess.run(["cp", "-r", lua_src(), str(src)], check=True)
    build_lua(workdir / "local", src)
    build_lua(workdir / "remote", src, cc_prefix=f"{STARLING} exec")
    local, remote = outputs(workdir / "local"), outputs(workdir / "remote")
    assert len(local) >= 34, sorted(local)
    assert sorted(local) == sorted(remote)
    diff = [k for k in local if local[k] != remote[k]]
    assert diff == [], f"differ: {diff}"
    r = exec_(str(workdir / "remote/luarun"), "-e", "print(string.format('%d', 6*7))")
    assert r.stdout == b"42\n"
    # A rebuild through the cluster overwrites existing outputs.
    obj = workdir / "remote/obj/lvm.o"
    before = obj.stat().st_mtime_ns
    subprocess.run(["touch", str(src / "lvm.c")], check=True)
    build_lua(workdir / "remote", src, cc_prefix=f"{STARLING} exec")
    assert obj.stat().st_mtime_ns > before
    assert obj.read_bytes() == local["obj/lvm.o"]
