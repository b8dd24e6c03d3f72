"""Shared fixtures: a real embedded cluster started with the project's own commands."""
import contextlib
import json
import os
import pathlib
import pwd
import re
import shutil
import subprocess
import time

import pytest

# The skip rule (require.py, loaded as a plugin by pytest.ini): fail with the reason unless
# STARLING_TEST_ALLOW_SKIP=1.
from require import require, require_module, require_root, require_tool  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target" / "release" / "starling")


def build_with_shared_libstarling(src, bin_dir, name):
    """Compile C program `src` (`-O2`) into `bin_dir/name`, linked against a private copy of
    libstarling.so in `bin_dir`: a rebuild of target/release during the tests must not replace the
    file the program (and its clones) map. Returns the program's path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "target/release/libstarling.so", bin_dir / "libstarling.so")
    exe = bin_dir / name
    r = subprocess.run(["cc", "-O2", "-Wall", "-I", str(ROOT / "include"), str(src), "-L", str(bin_dir), "-lstarling",
                        f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(exe)


def sh(*args, check=True, timeout=300, **kw):
    """Run a command, return CompletedProcess (text mode); with `check`, a failure says what the
    command printed on stderr."""
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {r.returncode}: {r.stderr.strip()}")
    return r


def netns_with_veth(netns, veth, host_ip, ns_ip):
    """A network namespace `netns` joined to this one by a veth pair: `veth` here with `host_ip`,
    `eth0` in the namespace with `ns_ip` (both /24), `lo` up there (a lone head and its agents)."""
    sh("ip", "netns", "add", netns)
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    sh("ip", "addr", "add", f"{host_ip}/24", "dev", veth)
    sh("ip", "link", "set", veth, "up")
    sh("ip", "netns", "exec", netns, "ip", "addr", "add", f"{ns_ip}/24", "dev", "eth0")
    sh("ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "up")
    sh("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")


def starling(*args, **kw):
    return sh(STARLING, *args, **kw)


def status():
    return json.loads(starling("status", "--json").stdout)


def wait_for(predicate, what, timeout=120.0, interval=0.1):
    """Poll `predicate` until it returns something truthy and return that; fail naming `what` after
    `timeout` seconds. Tests wait for events this way instead of sleeping: the deadline only bounds a
    hang and is far beyond what a 4x slower machine needs."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def terminate(p, timeout=60):
    """SIGTERM a process we started and reap it; SIGKILL it if it has not ended within `timeout`
    (cleanup, not a check: a test that needs a clean exit asserts on wait() itself)."""
    if p.poll() is None:
        p.terminate()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def recv_until_closed(s, tolerate=()):
    """Everything a peer sends on socket `s` until it closes; an exception of a type in `tolerate`
    (e.g. a reset, a TLS alert) ends the read like a close. A socket timeout is not tolerated unless
    named: a peer that keeps the connection open is a failure of its own."""
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except tolerate:
        pass
    return data


def instance_env(instance, **extra):
    """This process's environment for a `starling` command (or a program it runs) on embedded cluster
    `instance`, whatever cluster or fork backend this run was given."""
    e = dict(os.environ)
    e.pop("STARLING_FORK_BACKEND", None)
    e.pop("STARLING_CLUSTER", None)
    e["STARLING_INSTANCE"] = instance
    e.update(extra)
    return e


@contextlib.contextmanager
def local_account(user, groups=()):
    """A local user `user` (with its own group, and member of `groups`) and a home directory under
    /var/tmp/starling-tests owned by it, as an admin would make them; yields (pwd entry, home).
    Accounts and groups this made are removed afterwards; ones that existed are left alone."""
    require_root("creating a test user")
    require_tool("useradd", "passwd")
    require_tool("setpriv", "util-linux")
    made = []
    for g in groups:
        if subprocess.run(["getent", "group", g], capture_output=True).returncode != 0:
            sh("groupadd", g)
            made.append(("groupdel", g))
    if subprocess.run(["getent", "passwd", user], capture_output=True).returncode != 0:
        extra = ["-G", ",".join(groups)] if groups else []
        sh("useradd", "-M", "-s", "/bin/sh", "-U", *extra, user)
        made.append(("userdel", user))
    pw = pwd.getpwnam(user)
    home = pathlib.Path(f"/var/tmp/starling-tests/{user}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    try:
        yield pw, home
    finally:
        shutil.rmtree(home, ignore_errors=True)
        for cmd, name in reversed(made):
            sh(cmd, name, check=False)


@contextlib.contextmanager
def device_granted(user, device="/dev/fuse"):
    """`device` read-write for `user` (an ACL entry: what an admin does once so agents can run without
    root; here /dev/fuse and /dev/userfaultfd are root-only), taken back afterwards; named entries
    someone else granted are kept."""
    require_tool("setfacl", "acl")
    require_tool("getfacl", "acl")
    had_acl = bool(re.search(r"^(user|group):[^:]+:", sh("getfacl", "-c", device).stdout, re.M))
    sh("setfacl", "-m", f"u:{user}:rw", device)
    try:
        yield
    finally:
        sh("setfacl", "-x", f"u:{user}", device, check=False)
        if not had_acl:
            sh("setfacl", "-b", device, check=False)


def as_user(pw, home, *argv, timeout=300):
    """Run argv as the account `pw` (setpriv, with its groups) in `home`, with a minimal environment
    that still names this test run's cluster (STARLING_INSTANCE)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LC_ALL": "C"}
    if "STARLING_INSTANCE" in os.environ:
        env["STARLING_INSTANCE"] = os.environ["STARLING_INSTANCE"]
    return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", *argv],
                          cwd=home, env=env, capture_output=True, text=True, timeout=timeout)


def cores_by_host(st=None):
    """{host name: cores} as the running cluster reports them (never assume this machine's count)."""
    return {h["name"]: h["cores"] for h in (st or status())["hosts"]}


def running_tasks(st=None):
    """Cores held by running tasks, summed over the hosts (the head's own count)."""
    return sum(h.get("running", 0) for h in (st or status())["hosts"])


def up(hosts=4):
    starling("down", check=False)
    r = starling("up", "--hosts", str(hosts), check=False, timeout=120)
    assert r.returncode == 0, f"starling up failed:\n{r.stdout}\n{r.stderr}"
    return status()


def down():
    return starling("down", check=False, timeout=120)


@pytest.fixture(scope="session")
def session_cluster():
    """A 4-host embedded cluster for the whole session, removed at its end."""
    require_root("an embedded cluster (namespaces, FUSE, overlayfs)")
    require(pathlib.Path(STARLING).exists(), f"{STARLING} missing: build it (cargo build --release --workspace)")
    st = up(4)
    yield st
    down()


@pytest.fixture
def cluster(session_cluster):
    """The session's 4-host cluster as it is now: brought up again if a module that needed another
    cluster (Slurm, Linger-Longer, metrics, faults) took it down or left a different one."""
    r = starling("status", "--json", check=False)
    st = json.loads(r.stdout) if r.returncode == 0 else None
    if st is None or len(st["hosts"]) != 4:
        st = up(4)
    return st


# The tests' scratch root on the real disk (tasks see /tmp too), one per instance
# (STARLING_INSTANCE), so runs on two instances at once never share a built program.
SCRATCH = pathlib.Path(f"/var/tmp/starling-tests{os.environ.get('STARLING_INSTANCE', '')}")


@pytest.fixture
def workdir(tmp_path):
    """A scratch directory on the real disk (tmp_path is under /tmp, which tasks see too). Its path is
    kept short: tests find their task in `starling ps` by a path in its command line, which ps cuts at
    120 characters. Runs on other instances (STARLING_INSTANCE) get their own directories; two runs
    on one instance at once would share them."""
    d = SCRATCH / tmp_path.name
    d.mkdir(parents=True, exist_ok=True)
    yield d
    subprocess.run(["rm", "-rf", str(d)])


def lua_src():
    return subprocess.run([str(ROOT / "tests/fixtures/fetch-lua.sh")], capture_output=True, text=True, check=True).stdout.strip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test on the session's cluster gets the cluster's state at the moment of failure in
    its report (ps, status, the last lines of the head's and each host's log): a CI run is seen
    only through its output, and a hang leaves nothing else to go on."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or "cluster" not in item.fixturenames:
        return
    instance = os.environ.get("STARLING_INSTANCE", "")
    logs = pathlib.Path(f"/run/starling-{instance}" if instance else "/run/starling") / "logs"
    names = {"head", "home", "link"}
    for what in ("ps", "status"):
        try:
            r = starling(what, check=False, timeout=30)
            said = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            said = "(no answer within 30 s)"
        report.sections.append((f"starling {what} at the failure", said))
        if what == "status":
            names |= {line.split()[0] for line in said.splitlines() if re.match(r"h\d+\s", line)}
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        if log.stem not in names:
            continue
        lines = log.read_text(errors="replace").splitlines()[-40:]
        report.sections.append((f"{log.name}, last {len(lines)} lines", "\n".join(lines)))


def kv(line):
    """`KEY a=1 b=x` -> {"a": "1", "b": "x"}."""
    return dict(re.findall(r"(\w+)=(\S+)", line))


def _number(v):
    try:
        return int(v)
    except ValueError:
        return v


class CloneReport:
    """What the fork test programs print (bench/c/mcdist_work.c `verify`, tests/fork/shared_host.c),
    one `KEY k=v ...` line per fact: PSUM (the parent's checksum of a memory chunk), CSUM (a clone's
    of the same chunk), CLONE (where a clone ran), STAT (a clone's status and fault counters),
    WIRE (the parent's page-server and multicast counters) and PARENT (the descriptor's size)."""

    def __init__(self, out):
        def lines(tag):
            return [kv(line) for line in re.findall(rf"^{tag} .*$", out, re.M)]
        self.out = out
        self.parent = {m["chunk"]: m["sum"] for m in lines("PSUM")}
        self.sums = {}
        for m in lines("CSUM"):
            self.sums.setdefault(int(m["id"]), {})[m["chunk"]] = m["sum"]
        self.hosts = {int(m["id"]): m.get("host") for m in lines("CLONE")}
        self.stats = {int(m["id"]): {k: _number(v) for k, v in m.items()} for m in lines("STAT")}
        wire = lines("WIRE")
        assert wire, f"no WIRE line in the program's output: {out[-2000:]}"
        self.wire = {k: int(v) for k, v in wire[0].items()}
        self.descriptor_pages = -(-int(lines("PARENT")[0]["descriptor_bytes"]) // 4096)

    def assert_memory_identical(self, data_mib, ids):
        """Clones `ids` each read every chunk of the parent's `data_mib` MiB (+ its globals) and
        saw the parent's bytes in each."""
        assert len(self.parent) == data_mib + 1, "parent checksums: every 1 MiB chunk + globals"
        for i in ids:
            sums = self.sums.get(i, {})
            assert sums.keys() == self.parent.keys(), f"clone {i} read every chunk"
            bad = [c for c in sums if sums[c] != self.parent[c]]
            assert not bad, f"clone {i}: chunks {bad[:10]} differ from the parent's image"
