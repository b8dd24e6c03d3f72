"""Task hardening and commit safety on a real embedded cluster (issue 12, first slice; docs/SECURITY.md).

- A non-root user's task has no capabilities, no_new_privs and the seccomp filter; a root task keeps its
  capabilities but is filtered too.
- Inside a task, even as root: mount(2) (and the `mount` command), loading or removing a kernel module and
  ptrace fail with EPERM.
- A task moved to another host (`starling migrate`, restored by the restorer) is still filtered there.
- Remote-fork clones run under the same filter (ptrace and mount(2) fail with EPERM, no_new_privs); a
  non-root user's clones have no capabilities at all, bounding set included, though their parent on the
  client has a full bounding set and no filter.
- The symlink-commit attacks write nothing outside the working tree: a symlink to a scratch "etc" put where
  another task made a directory and wrote into it (committed first), and a symlink left where an output goes.
- A ticket's own network (fork.isolate_network, on by default): its clones reach each other, their parent and their
  ticket's hosts only; the cluster's ports (TCP and UDP) and the port the parent reaches the cluster at
  (a relay) are refused; another ticket's clone on the same host cannot reach its listeners; root clones
  lack CAP_NET_ADMIN and CAP_NET_RAW; a clone moved to another host is still fenced there.
"""
import json
import os
import pathlib
import platform
import re
import shutil
import socket
import subprocess

import pytest

from conftest import ROOT, STARLING, as_user, require_tool, sh, status, wait_for
from test_exec import exec_, readline_within
from test_migrate import Task, migrate, ps
from test_user import user  # noqa: F401  (the fixture: a user and group made for the test)

# System call numbers the tasks try directly (so the error is the kernel's answer, not a tool's guess).
SYSCALLS = {
    "x86_64": {"init_module": 175, "finit_module": 313, "delete_module": 176, "ptrace": 101, "mount": 165},
    "aarch64": {"init_module": 105, "finit_module": 273, "delete_module": 106, "ptrace": 117, "mount": 40},
}


def status_fields(text):
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith(" "))


def field(fields, name):
    return fields[name].strip()


def test_a_non_root_users_task_has_no_capabilities_no_new_privs_and_the_filter(cluster, user):  # noqa: F811
    pw, home = user
    r = as_user(pw, home, STARLING, "exec", "--", "cat", "/proc/self/status")
    assert r.returncode == 0, r.stderr
    f = status_fields(r.stdout)
    assert field(f, "Uid").split()[:2] == [str(pw.pw_uid)] * 2
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]:
        assert int(field(f, caps), 16) == 0, f"{caps}: {field(f, caps)}"
    assert field(f, "NoNewPrivs") == "1"
    assert field(f, "Seccomp") == "2"


def test_a_root_task_keeps_capabilities_but_is_filtered(cluster):
    r = exec_("cat", "/proc/self/status")
    assert r.returncode == 0, r.stderr
    f = status_fields(r.stdout.decode())
    assert int(field(f, "CapEff"), 16) != 0, "uid 0 on the client keeps its capabilities"
    assert field(f, "NoNewPrivs") == "1"
    assert field(f, "Seccomp") == "2"


def syscall_script(name, args):
    """Python for the task: call `name` with `args` and print `rc errno`."""
    machine = platform.machine()
    if machine not in SYSCALLS:
        pytest.fail(f"no system call numbers for {machine} in this test")
    nr = SYSCALLS[machine][name]
    return ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long; "
            f"r = libc.syscall({nr}, {args}); print(r, ctypes.get_errno())")


@pytest.mark.parametrize("name,args", [
    ("mount", "b'none', b'/mnt', b'tmpfs', 0, None"),
    # With CAP_SYS_MODULE (a root task has it) these would fail with EBADF / EFAULT / ENOENT, not EPERM.
    ("finit_module", "-1, b'', 0"),
    ("init_module", "None, 0, b''"),
    ("delete_module", "b'starling_no_such_module', 0"),
    # Without the filter, PTRACE_TRACEME succeeds (0).
    ("ptrace", "0, 0, None, None"),
])
def test_denied_calls_get_eperm_even_as_root(cluster, name, args):
    require_tool("python3", "python3")  # the task runs the client's python3
    r = exec_("python3", "-c", syscall_script(name, args))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == ["-1", str(1)], f"{name}: {r.stdout!r} (want -1 EPERM)"


def test_the_mount_command_fails_inside_a_task_even_as_root(cluster):
    r = exec_("sh", "-c", "mount -t tmpfs none /mnt; echo rc=$?; grep -c ' /mnt tmpfs ' /proc/self/mounts")
    out = r.stdout.decode()
    assert "rc=0" not in out and "rc=" in out, (out, r.stderr)
    assert out.strip().endswith("0"), f"a tmpfs got mounted on /mnt: {out!r}"
    assert b"ermission denied" in r.stderr or b"not permitted" in r.stderr, r.stderr


@pytest.fixture
def scratch_etc(workdir):
    """A stand-in for /etc outside the working tree, with a passwd file (never the real /etc/passwd)."""
    etc = workdir.parent / f"{workdir.name}-etc"
    shutil.rmtree(etc, ignore_errors=True)
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:scratch:/root:/bin/sh\n")
    yield etc
    shutil.rmtree(etc, ignore_errors=True)


def tree(d):
    return sorted((p.relative_to(d).as_posix(), p.read_text() if p.is_file() else "dir") for p in d.rglob("*"))


def test_a_directory_replaced_by_a_symlink_is_not_committed_through(cluster, workdir, scratch_etc):
    before = tree(scratch_etc)
    # Task B makes sub/ and writes into it, then waits until task A has committed.
    b = subprocess.Popen([STARLING, "exec", "--", "sh", "-c",
                          "mkdir sub; echo pwned > sub/passwd; echo pwned > sub/new; echo written; read go"],
                         cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert readline_within(b.stdout, 120) == b"written\n"
    # Task A puts a symlink out of the tree where sub/ goes; its commit lands first.
    a = exec_("ln", "-s", str(scratch_etc), "sub", cwd=workdir)
    assert a.returncode == 0, a.stderr
    assert os.readlink(workdir / "sub") == str(scratch_etc)
    out, err = b.communicate(input=b"go\n", timeout=120)
    assert b.returncode == 0, err
    assert tree(scratch_etc) == before, "B's commit wrote through the symlink, outside the working tree"
    assert b"conflict" in err and b"symlink" in err, err


def test_a_symlink_where_an_output_goes_is_not_written_through(cluster, workdir, scratch_etc):
    before = tree(scratch_etc)
    # Two tasks of one job: task 0 leaves out.txt -> the scratch passwd, task 1 writes out.txt as a file.
    # Whichever commits first, the other is a conflict; the passwd is never written.
    script = f"if [ $STARLING_TASK = 0 ]; then ln -s {scratch_etc}/passwd out.txt; else echo pwned > out.txt; fi"
    r = subprocess.run([STARLING, "run", "--quiet", "-n", "2", "--", "sh", "-c", script], cwd=workdir,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert tree(scratch_etc) == before, "a commit wrote through the symlink"
    assert b"conflict" in r.stderr, r.stderr
    left = sorted(p.name for p in workdir.iterdir())
    assert left == ["out.txt", "out.txt.starling-conflict"] or left == ["out.txt"], left


def test_a_non_root_users_symlink_attack_writes_nothing_outside(cluster, user, scratch_etc):  # noqa: F811
    pw, home = user
    before = tree(scratch_etc)
    work = home / "attack"
    work.mkdir()
    os.chown(work, pw.pw_uid, pw.pw_gid)
    os.chmod(scratch_etc, 0o777)  # writable by the user: only the commit's care keeps it unchanged
    b = subprocess.Popen(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
                          STARLING, "exec", "--", "sh", "-c", "mkdir sub; echo pwned > sub/new; echo written; read go"],
                         cwd=work, env={**os.environ, "HOME": str(home)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert readline_within(b.stdout, 120) == b"written\n"
    a = as_user(pw, work, STARLING, "exec", "--", "ln", "-s", str(scratch_etc), "sub")
    assert a.returncode == 0, a.stderr
    assert os.readlink(work / "sub") == str(scratch_etc)
    out, err = b.communicate(input=b"go\n", timeout=120)
    assert b.returncode == 0, err
    assert tree(scratch_etc) == before, "the user's commit wrote through the symlink"


def test_a_moved_task_is_still_filtered_on_its_new_host(cluster, workdir):
    require_tool("python3", "python3")
    hosts = [h["name"] for h in status()["hosts"]]
    nr = SYSCALLS[platform.machine()]["ptrace"]
    # Prints "HOST Seccomp NoNewPrivs ptrace-rc errno" every 0.2 s, from wherever it runs.
    script = ("# moved-and-filtered\nimport ctypes, time\n"
              "libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long\n"
              "for _ in range(3000):\n"
              "    f = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
              f"    r = libc.syscall({nr}, 0, 0, None, None)\n"
              "    host = open('/proc/sys/kernel/hostname').read().strip()\n"
              "    print(host, f['Seccomp'].strip(), f['NoNewPrivs'].strip(), r, ctypes.get_errno(), flush=True)\n"
              "    time.sleep(0.2)\n")
    t = Task(["python3", "-c", script], hosts[0], workdir)
    t.read_until(hosts[0] + " ")
    assert t.lines[-1].split() == [hosts[0], "2", "1", "-1", "1"], t.lines[-1]
    migrate(t.id("moved-and-filtered"), hosts[1])
    t.read_until(hosts[1] + " ")
    assert t.lines[-1].split() == [hosts[1], "2", "1", "-1", "1"], "unfiltered after the move: " + t.lines[-1]
    t.p.send_signal(15)
    t.p.wait(timeout=300)


def build_confined(where):
    """tests/fork/confined.c linked with the static libstarling, readable and runnable by anyone."""
    lib = ROOT / "target/release/libstarling.a"
    assert lib.exists(), "build it: cargo build --release --workspace"
    exe = where / "confined"
    sh("cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/confined.c"), str(lib),
       "-lpthread", "-ldl", "-lm", "-o", str(exe))
    os.chmod(exe, 0o755)
    return exe


def confinement_lines(stdout, clones):
    """{who-id: fields} of confined's report lines; every clone must have reported and exited 0."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("PARENT", "CLONE"):
            rows[f"{parts[0]}-{parts[1]}"] = dict(zip(
                ["seccomp", "nnp", "eff", "prm", "inh", "bnd", "amb", "ptrace", "ptrace_errno", "mount", "mount_errno"],
                parts[2:]))
    assert sorted(k for k in rows if k.startswith("CLONE")) == [f"CLONE-{i}" for i in range(1, clones + 1)], stdout
    for i in range(1, clones + 1):
        assert f"STATUS {i} 0" in stdout, stdout
    return rows


@pytest.mark.parametrize("hierarchical", [False, True])
def test_clones_are_filtered_like_exec_tasks(cluster, workdir, hierarchical):
    exe = build_confined(workdir)
    env = dict(os.environ)
    env.pop("STARLING_FORK_BACKEND", None)
    r = subprocess.run([str(exe), "2", "1" if hierarchical else "0"], capture_output=True, text=True, timeout=300, env=env, cwd="/var/tmp")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = confinement_lines(r.stdout, 2)
    assert rows["PARENT-0"]["seccomp"] == "0", "the parent (on the client) has no filter: " + r.stdout
    for i in (1, 2):
        c = rows[f"CLONE-{i}"]
        assert (c["seccomp"], c["nnp"]) == ("2", "1"), f"clone {i} is not filtered: {c}"
        assert (c["ptrace"], c["ptrace_errno"]) == ("-1", "1"), f"clone {i}: ptrace {c}"
        assert (c["mount"], c["mount_errno"]) == ("-1", "1"), f"clone {i}: mount {c}"
        assert int(c["eff"], 16) != 0, "a root clone keeps its capabilities, as a root exec task does"


def test_a_non_root_users_clones_have_no_capabilities(cluster, user):  # noqa: F811
    pw, home = user
    exe = build_confined(home)
    r = as_user(pw, home, str(exe), "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = confinement_lines(r.stdout, 2)
    assert int(rows["PARENT-0"]["bnd"], 16) != 0, "the parent's bounding set is full: " + r.stdout
    for i in (1, 2):
        c = rows[f"CLONE-{i}"]
        for caps in ["eff", "prm", "inh", "bnd", "amb"]:
            assert int(c[caps], 16) == 0, f"clone {i}: Cap{caps} {c[caps]}"
        assert (c["seccomp"], c["nnp"]) == ("2", "1"), f"clone {i} is not filtered: {c}"
        assert (c["ptrace"], c["ptrace_errno"]) == ("-1", "1"), f"clone {i}: ptrace {c}"


def host_netns(name):
    """The network namespace of embedded host `name` on this instance (`starling up`'s naming)."""
    n = os.environ.get("STARLING_INSTANCE", "").strip()
    return f"starling{'' if n in ('', '0') else n}-{name}"  # instance 0: `starling-h1` (cluster::net)


def ticket_tables(netns):
    """The per-ticket nftables tables (`starling_AGENT_tTICKET`) in a host's namespace."""
    r = sh("ip", "netns", "exec", netns, "nft", "list", "tables", "inet")
    return [line.split()[-1] for line in r.stdout.splitlines() if re.fullmatch(r"starling_\w+_t\d+", line.split()[-1])]


LISTENER = ("import socket, sys\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(64); print('ready', flush=True)\n"
            "while True:\n    c, _ = s.accept(); c.close()\n")
# Answers every datagram on 0.0.0.0:PORT with one of its own.
UDP_ECHO = ("import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "s.bind(('0.0.0.0', int(sys.argv[1]))); print('ready', flush=True)\n"
            "while True:\n    d, a = s.recvfrom(64); s.sendto(d, a)\n")


def in_hosts(hosts, script, port_of):
    """`script` (LISTENER or UDP_ECHO) in each host's namespace on port_of(host); started and ready."""
    procs = [subprocess.Popen(["ip", "netns", "exec", host_netns(n), "python3", "-c", script, str(port_of(h))],
                              stdout=subprocess.PIPE, text=True) for n, h in hosts.items()]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def build_fork_program(name, where):
    """tests/fork/NAME.c linked with the static libstarling."""
    exe = where / name
    sh("cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / f"tests/fork/{name}.c"), str(ROOT / "target/release/libstarling.a"),
       "-lpthread", "-ldl", "-lm", "-o", str(exe))
    return exe


def fork_env(**extra):
    env = dict(os.environ, **extra)
    env.pop("STARLING_FORK_BACKEND", None)
    return env


def run_ticketnet(exe, targets, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("STARLING_FORK_BACKEND", "STARLING_FORK_ISOLATE_NETWORK")}
    env.update(env_extra)
    r = subprocess.run([str(exe), "17391", *targets], capture_output=True, text=True, timeout=600, env=env, cwd="/var/tmp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATUS 1 0" in r.stdout and "STATUS 2 0" in r.stdout, r.stdout + r.stderr
    reach = dict(line.split()[1:3] for line in r.stdout.splitlines() if line.startswith("REACH "))
    selves = {line.split()[2] for line in r.stdout.splitlines() if line.startswith("SELF ")}
    return reach, selves


def test_a_tickets_clones_reach_each_other_and_their_parent_only(cluster, workdir):
    """SnowFlock's network per ticket: two spread clones reach their parent and each other; from a clone,
    a listener on a host outside the ticket and a host's chunk port are refused when the job turns
    fork.isolate_network is on (the default: every embedded host, root, can enforce it, as
    `starling status` says), and reachable with it off;
    so are datagrams to the refused ports, members' included (a UDP echo on each host's chunk port
    number); nothing of the ticket's rules is left once it ended."""
    require_tool("nft", "nftables")
    hosts = {h["name"]: h for h in cluster["hosts"]}
    assert len(hosts) >= 3, "needs a host outside a 2-clone ticket"
    exe = workdir / "ticketnet"
    lib = ROOT / "target/release/libstarling.a"
    sh("cc", "-O1", "-Wall", "-I", str(ROOT / "include"), str(ROOT / "tests/fork/ticketnet.c"), str(lib),
       "-lpthread", "-ldl", "-lm", "-o", str(exe))
    port = 17392
    chunk = {h["address"]: h["peer"] for h in hosts.values() if h.get("peer")}
    assert len(chunk) == len(hosts), "the hosts serve chunks to each other (agent.peers on): " + str(hosts)
    assert all(h["isolates_network"] and h["cannot_isolate"] is None for h in hosts.values()), hosts
    listeners = in_hosts(hosts, LISTENER, lambda h: port)
    listeners += in_hosts(hosts, UDP_ECHO, lambda h: h["peer"].rsplit(":", 1)[1])
    try:
        targets = [f"{h['address']}:{port}" for h in hosts.values()] + list(chunk.values()) + [f"udp:{p}" for p in chunk.values()]

        reach, members = run_ticketnet(exe, targets)  # the default: on
        assert len(members) == 2, f"two spread clones on two hosts: {members}"
        assert (reach.get("parent"), reach.get("clone1")) == ("ok", "ok"), reach
        for h in hosts.values():
            want_ok = h["address"] in members
            got = reach[f"{h['address']}:{port}"]
            assert (got == "ok") == want_ok, f"{h['name']} ({'in' if want_ok else 'outside'} the ticket): {got}; {reach}"
        for addr, peer in chunk.items():
            assert reach[peer] != "ok", f"a clone reached the chunk port {peer} of {addr}: {reach}"
            assert reach[f"udp:{peer}"] != "ok", f"a datagram to the refused port {peer} of {addr} was answered: {reach}"
        # The ticket's rules go with it, on every host.
        wait_for(lambda: not any(ticket_tables(host_netns(n)) for n in hosts), "the ticket tables to be removed", timeout=120)

        # The job's opt-out: the same clones reach everything.
        reach, _ = run_ticketnet(exe, targets, STARLING_FORK_ISOLATE_NETWORK="off")
        assert all(v == "ok" for v in reach.values()), reach
        assert not any(ticket_tables(host_netns(n)) for n in hosts)
    finally:
        for p in listeners:
            p.kill()
            p.wait()


def run_dir():
    """The embedded cluster's run directory on this instance (its record, its credentials)."""
    n = os.environ.get("STARLING_INSTANCE", "").strip()
    return pathlib.Path(f"/run/starling-{n}" if n not in ("", "0") else "/run/starling")


def test_a_clone_cannot_reach_the_port_its_parent_reaches_the_cluster_at(cluster, workdir):
    """The parent reaches the head through a relay on its own machine (`starling __link`, as `up --link`
    runs it; here on the bridge's address, where the hosts could reach it, as a relay on a real client
    machine is): with fork.isolate_network on, its clones cannot connect to that port (it would carry
    their bytes to the head), though the parent's machine is a member and its own port is reachable;
    with the opt-out they can."""
    require_tool("nft", "nftables")
    record = json.loads((run_dir() / "cluster.json").read_text())
    head = record["head_addr"]
    bridge_ip = head.rsplit(":", 1)[0]
    relay_addr = f"{bridge_ip}:17395"
    relay = subprocess.Popen([STARLING, "__link", "--listen", relay_addr, "--target", head, "--profile", "lan"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def listening():
            with socket.socket() as s:
                return s.connect_ex((bridge_ip, 17395)) == 0
        wait_for(listening, "the relay to listen")
        exe = build_fork_program("ticketnet", workdir)
        through = dict(STARLING_CLUSTER=relay_addr, STARLING_AUTH=str(run_dir() / "auth"))
        reach, _ = run_ticketnet(exe, [relay_addr], STARLING_FORK_ISOLATE_NETWORK="on", **through)
        assert (reach.get("parent"), reach.get("clone1")) == ("ok", "ok"), reach
        assert reach[relay_addr] != "ok", f"a clone reached the relay its parent reaches the cluster through: {reach}"
        reach, _ = run_ticketnet(exe, [relay_addr], STARLING_FORK_ISOLATE_NETWORK="off", **through)
        assert reach[relay_addr] == "ok", reach
    finally:
        relay.kill()
        relay.wait()


def run_twotickets(exe, **env_extra):
    """twotickets.c with one U clone per host: (every REACH line as (what, result), T's host)."""
    n = len(status()["hosts"])
    r = subprocess.run([str(exe), "17393", str(n)], capture_output=True, text=True, timeout=600, env=fork_env(**env_extra), cwd="/var/tmp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATUS T 1 0" in r.stdout and all(f"STATUS U {i} 0" in r.stdout for i in range(1, n + 1)), r.stdout + r.stderr
    reach = [tuple(line.split()[1:3]) for line in r.stdout.splitlines() if line.startswith("REACH ")]
    t_host = next(line.split()[3] for line in r.stdout.splitlines() if line.startswith("SELF T "))
    return reach, t_host


def test_two_tickets_clones_on_one_host_reach_only_their_own_tickets_listeners(cluster, workdir):
    """Ticket T's clone listens on its host; ticket U's clone on that same host cannot connect to it, at
    the host's address or on loopback, when the jobs turn fork.isolate_network on, while T's clone
    reaches its own listener both ways; with the opt-out U's clone reaches it."""
    require_tool("nft", "nftables")
    exe = build_fork_program("twotickets", workdir)
    reach, t_host = run_twotickets(exe, STARLING_FORK_ISOLATE_NETWORK="on")
    got = dict(reach)
    assert (got.get("T-self-host"), got.get("T-self-lo")) == ("ok", "ok"), f"T's clone reaches its own listener: {reach}"
    u = [(w, v) for w, v in reach if w.startswith("U-")]
    assert u, f"a U clone landed on T's host {t_host}: {reach}"
    assert all(v != "ok" for _, v in u), f"another ticket's clone reached T's listener on {t_host}: {reach}"

    reach, _ = run_twotickets(exe, STARLING_FORK_ISOLATE_NETWORK="off")
    u = [(w, v) for w, v in reach if w.startswith("U-")]
    assert u and all(v == "ok" for _, v in u), reach


def test_root_clones_of_an_isolated_ticket_lose_network_admin_only(cluster, workdir):
    """A root clone keeps its capabilities, but with fork.isolate_network on not CAP_NET_ADMIN (which could
    flush its ticket's rules in the host's namespace) nor CAP_NET_RAW, in any set, bounding set included;
    with the opt-out it has them."""
    require_tool("nft", "nftables")
    exe = build_confined(workdir)
    net_admin = (1 << 12) | (1 << 13)
    for isolate in ("on", "off"):
        r = subprocess.run([str(exe), "2"], capture_output=True, text=True, timeout=300,
                           env=fork_env(STARLING_FORK_ISOLATE_NETWORK=isolate), cwd="/var/tmp")
        assert r.returncode == 0, r.stdout + r.stderr
        rows = confinement_lines(r.stdout, 2)
        for i in (1, 2):
            c = rows[f"CLONE-{i}"]
            eff, bnd = int(c["eff"], 16), int(c["bnd"], 16)
            assert eff & (1 << 21), f"clone {i} is root and keeps CAP_SYS_ADMIN (isolate {isolate}): {c}"
            want = 0 if isolate == "on" else net_admin
            assert (eff & net_admin, int(c["prm"], 16) & net_admin, bnd & net_admin) == (want, want, want), \
                f"clone {i}, fork.isolate_network {isolate}: {c}"
            assert int(c["inh"], 16) & net_admin == 0 and int(c["amb"], 16) & net_admin == 0, c


def clone_ready(p):
    """Read movednet's output up to its clone's "clone ready": what the clone reached where it was cloned
    (its "REACH BEFORE TARGET result" lines, as {TARGET: result})."""
    before = {}
    for line in p.stdout:
        if line == "clone ready\n":
            return before
        words = line.split()
        assert words[:2] == ["REACH", "BEFORE"] and len(words) == 4, line
        before[words[2]] = words[3]
    raise AssertionError(f"movednet ended before its clone was ready: {p.stderr.read()}")


def test_a_clone_moved_to_another_host_stays_in_its_tickets_network(cluster, workdir):
    """A one-clone ticket's clone is moved (`starling migrate`) to a host outside its grant; there it still
    cannot reach a listener on the other two hosts (it joined its ticket's group and rules on the new
    host), while it reaches its own host and the one it was cloned on."""
    require_tool("nft", "nftables")
    hosts = {h["name"]: h for h in cluster["hosts"]}
    assert len(hosts) >= 4, "needs two hosts outside a moved one-clone ticket"
    exe = build_fork_program("movednet", workdir)
    port = 17394
    listeners = in_hosts(hosts, LISTENER, lambda h: port)
    try:
        targets = [f"{h['address']}:{port}" for h in hosts.values()]
        p = subprocess.Popen([str(exe), *targets], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=fork_env(STARLING_FORK_ISOLATE_NETWORK="on"), cwd="/var/tmp")
        try:
            clone_ready(p)
            row = wait_for(lambda: next((r for r in ps() if "starling-clone" in r["command"]), None), "the clone in ps")
            first = row["host"]
            to = next(n for n in hosts if n != first)
            assert migrate(row["task"], to)["to"] == to
            p.stdin.write("go\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0 and "STATUS 1 0" in out, out + err
        reach = dict(line.split()[1:3] for line in out.splitlines() if line.startswith("REACH "))
        for name, h in hosts.items():
            want_ok = name in (first, to)
            got = reach[f"{h['address']}:{port}"]
            assert (got == "ok") == want_ok, f"moved from {first} to {to}: {name}: {got}; {reach}"
    finally:
        for lp in listeners:
            lp.kill()
            lp.wait()


def test_a_clone_moved_outside_its_grant_is_let_in_by_its_tickets_other_clone(cluster, workdir):
    """tests/fork/movedpair.c: a two-clone ticket spread on two hosts; clone 1 is moved to a third host, outside
    the grant. Its ticket's members learn that host: clone 2's listener answers clone 1 there, and clone 2
    reaches a listener on the new host, while a listener on the fourth host answers neither."""
    require_tool("nft", "nftables")
    hosts = {h["name"]: h for h in cluster["hosts"]}
    assert len(hosts) >= 4, "needs a host outside a two-clone ticket to move one to, and one more outside it"
    by_address = {h["address"]: n for n, h in hosts.items()}
    exe = build_fork_program("movedpair", workdir)
    port = 17397
    listeners = in_hosts(hosts, LISTENER, lambda h: port)
    try:
        p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=fork_env(STARLING_FORK_ISOLATE_NETWORK="on"), cwd="/var/tmp")
        try:
            seen = {}
            while len(seen) < 2:
                line = p.stdout.readline()
                assert line, f"movedpair ended before both clones were ready: {p.stderr.read()}"
                words = line.split()
                assert words[0] in ("SELF", "LISTEN") and len(words) == 3, line
                seen[words[1]] = words[2]
            first, second = by_address[seen["1"]], by_address[seen["2"].split(":")[0]]
            assert first != second, f"the grant put both clones on {first}"
            rows = wait_for(lambda: (lambda rs: rs if len(rs) == 2 else None)([r for r in ps() if "starling-clone" in r["command"]]),
                            "both clones in ps")
            moved = next(r for r in rows if r["host"] == first)
            to = next(n for n in hosts if n not in (first, second))
            outside = next(n for n in hosts if n not in (first, second, to))
            assert migrate(moved["task"], to)["to"] == to
            at_to, at_outside = f"{hosts[to]['address']}:{port}", f"{hosts[outside]['address']}:{port}"
            p.stdin.write(f"{seen['2']} {at_to} {at_outside}\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0 and "STATUS 1 0" in out and "STATUS 2 0" in out, out + err
        reach = {(w[1], w[2]): w[3] for w in (line.split() for line in out.splitlines()) if w[:1] == ["REACH"] and len(w) == 4}
        where = f"clone 1 moved from {first} to {to}, clone 2 on {second}: {reach}"
        assert reach[("1", seen["2"])] == "ok", where
        assert reach[("2", at_to)] == "ok", where
        assert reach[("1", at_to)] == "ok", where
        assert reach[("1", at_outside)] != "ok" and reach[("2", at_outside)] != "ok", where
    finally:
        for lp in listeners:
            lp.kill()
            lp.wait()
