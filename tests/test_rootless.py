"""Agents without root (as Slurm starts job steps): an agent started by an ordinary user moves into a
user namespace of its own where that user is 0, mounts each task's view and overlay there and runs
tasks as that user. It needs /dev/fuse read-write for the user: on this machine /dev/fuse is
root-only, so the test grants it the way an admin would (an ACL for the test's user,
`setfacl -m u:USER:rw /dev/fuse`) and takes it back at the end.

Checked: the agent and its tasks run with the user's uid; a root client and the user as client both
exec, and their files come home (the user's with the user's ownership); a job of 3 tasks; a change
the client itself may not make (the user writing /etc) is refused at commit with one line and
nothing is written; remote fork onto the rootless agent is refused with one line naming the fix while
/dev/userfaultfd is root-only, and works once an admin grants it (8 MiB of the parent's memory, checked
in the clone, and the clone's file comes home). The agent cannot enforce a fork ticket's own network (no
CAP_NET_ADMIN, no cgroup of its own to make groups in): `starling status` says so, a ticket with
fork.isolate_network on (the default) still runs its clone there, saying on stderr that it runs with the
host's network, and one with `required` is refused naming the host."""
import json
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import time

import pytest

from conftest import STARLING, device_granted, require_root, require_tool, sh, wait_for

USER = "starling-rl"
BASE = pathlib.Path("/var/tmp/starling-tests/rootless")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_user(*argv):
    return ["setpriv", "--reuid", USER, "--regid", USER, "--clear-groups", "env", f"HOME={BASE / 'home'}", *argv]


def uid_of(pid):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])


@pytest.fixture(scope="module")
def rootless():
    require_root("creating a user and granting it /dev/fuse")
    for tool, pkg in [("useradd", "passwd"), ("setfacl", "acl"), ("getfacl", "acl"), ("setpriv", "util-linux")]:
        require_tool(tool, pkg)
    sh("userdel", USER, check=False)
    sh("useradd", "-M", "-s", "/bin/sh", "-U", USER)
    uid = pwd.getpwnam(USER).pw_uid
    shutil.rmtree(BASE, ignore_errors=True)
    for d in ["state", "home", "head"]:
        (BASE / d).mkdir(parents=True)
    for d in ["state", "home"]:
        os.chown(BASE / d, uid, uid)
    try:
        with device_granted(USER):  # what an admin does once
            port = free_port()
            cluster = f"127.0.0.1:{port}"
            logs = {n: open(BASE / f"{n}.log", "wb") for n in ["head", "agent"]}
            env = dict(os.environ, STARLING_LOG="info")
            head = subprocess.Popen([STARLING, "head", "--listen", cluster, "--state", str(BASE / "head")], env=env,
                                    stdout=logs["head"], stderr=subprocess.STDOUT)
            agent = subprocess.Popen(as_user(STARLING, "agent", "--head", cluster, "--name", "rl1", "--state", str(BASE / "state")),
                                     env=env, stdout=logs["agent"], stderr=subprocess.STDOUT)
            try:
                def hosts():
                    r = subprocess.run([STARLING, "status", "--json", "--cluster", cluster], capture_output=True, text=True, timeout=30)
                    return json.loads(r.stdout)["hosts"] if r.returncode == 0 else []
                wait_for(lambda: hosts(), "the rootless agent to register", timeout=60)
                yield {"cluster": cluster, "uid": uid, "agent": agent, "hosts": hosts}
            finally:
                for p in (agent, head):
                    p.terminate()
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    finally:
        sh("userdel", USER, check=False)
        shutil.rmtree(BASE, ignore_errors=True)


def exec_(cluster, *argv, user=False, cwd=None, timeout=120):
    cmd = [STARLING, "exec", "--cluster", cluster, "--", *argv]
    return subprocess.run(as_user(*cmd) if user else cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_the_agent_runs_as_the_user(rootless):
    (h,) = rootless["hosts"]()
    assert h["name"] == "rl1"
    assert uid_of(rootless["agent"].pid) == rootless["uid"]
    # The setpriv process execs the agent: it is the agent.
    assert "agent" in pathlib.Path(f"/proc/{rootless['agent'].pid}/cmdline").read_bytes().decode()


def test_a_root_client_runs_and_its_files_come_home(rootless, tmp_path):
    r = exec_(rootless["cluster"], "sh", "-c", "echo made > made.txt; uname -n; echo ok", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "ok"
    assert (tmp_path / "made.txt").read_text() == "made\n"


def test_the_users_tasks_run_as_the_user_and_its_files_come_home_as_its_own(rootless):
    home = BASE / "home"
    p = subprocess.Popen(as_user(STARLING, "exec", "--cluster", rootless["cluster"], "--", "sh", "-c",
                                 "echo hers > hers.txt; exec sleep 4242"), cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def sleeper():
            for d in pathlib.Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        if (d / "cmdline").read_bytes() == b"sleep\x004242\x00":
                            return int(d.name)
                    except OSError:
                        pass
        pid = wait_for(sleeper, "the task to run", timeout=60)
        assert uid_of(pid) == rootless["uid"]
        os.kill(pid, 9)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    st = (home / "hers.txt").stat()
    assert (home / "hers.txt").read_text() == "hers\n"
    # Its own: the user's uid and primary group (useradd -U makes the group, whose gid need not be the uid).
    assert (st.st_uid, st.st_gid) == (rootless["uid"], pwd.getpwuid(rootless["uid"]).pw_gid)


def test_a_job_runs(rootless, tmp_path):
    r = subprocess.run([STARLING, "run", "-n", "3", "--quiet", "--cluster", rootless["cluster"], "--", "sh", "-c",
                        "echo task $STARLING_TASK"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:-1]) == ["task 0", "task 1", "task 2"]


def test_a_change_the_client_may_not_make_is_refused_at_commit(rootless):
    target = pathlib.Path("/etc/starling-rootless-test")
    target.unlink(missing_ok=True)
    r = exec_(rootless["cluster"], "sh", "-c", f"echo x > {target}", user=True, cwd=BASE / "home")
    assert r.returncode == 255
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "committing" in lines[0] and "Permission denied" in lines[0], r.stderr
    assert not target.exists()


CLONE_ONE = r"""
#include <stdio.h>
#include <stdlib.h>
#include "starling.h"
/* 8 MiB written before the clone: the clone finds it by lazy page faults, writes a file, and its exit
   status says whether every byte was what the parent wrote (0) or not (9). */
#define N (8 << 20)
int main(void) {
    unsigned char *buf = malloc(N);
    for (long i = 0; i < N; i++) buf[i] = (unsigned char)(i * 31 + 7);
    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { printf("TICKET %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id > 0) {
        for (long i = 0; i < N; i++) if (buf[i] != (unsigned char)(i * 31 + 7)) sf_exit(9);
        FILE *f = fopen("from-clone.txt", "w");
        fprintf(f, "clone %d\n", id);
        fclose(f);
        sf_exit(0);
    }
    if (id < 0) { printf("CLONE %s\n", sf_last_error()); return 3; }
    if (sf_join(t) != 0) { printf("JOIN %s\n", sf_last_error()); return 4; }
    printf("STATUS %d\n", sf_clone_status(t, 1));
    return 0;
}
"""


def clone_one(rootless, tmp_path, **env_extra):
    from conftest import ROOT
    lib = ROOT / "target/release/libstarling.a"
    assert lib.exists(), "build it: cargo build --release -p starling-capi"
    (tmp_path / "clone_one.c").write_text(CLONE_ONE)
    sh("cc", "-O1", "-I", str(ROOT / "include"), str(tmp_path / "clone_one.c"), str(lib), "-lpthread", "-ldl", "-lm",
       "-o", str(tmp_path / "clone_one"))
    env = {k: v for k, v in os.environ.items() if k != "STARLING_FORK_ISOLATE_NETWORK"}
    env.update(env_extra, STARLING_CLUSTER=rootless["cluster"])
    r = subprocess.run([str(tmp_path / "clone_one")], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    return r, r.stdout + r.stderr


def test_remote_fork_onto_a_rootless_agent_without_the_device_is_refused_naming_the_fix(rootless, tmp_path):
    r, out = clone_one(rootless, tmp_path)
    assert r.returncode != 0 and "STATUS" not in out, out
    assert "without root" in out and "setfacl -m u:$(id -un):rw /dev/userfaultfd" in out, out
    assert not (tmp_path / "from-clone.txt").exists()


def test_remote_fork_onto_a_rootless_agent_granted_userfaultfd(rootless, tmp_path):
    """With /dev/userfaultfd granted to the agent's user (as an admin would), the clone runs there: its
    memory arrives by lazy faults through a userfaultfd made from the device, and its file comes home."""
    with device_granted(USER, "/dev/userfaultfd"):
        r, out = clone_one(rootless, tmp_path)
    assert r.returncode == 0 and "STATUS 0" in out, out
    assert (tmp_path / "from-clone.txt").read_text() == "clone 1\n"
    # fork.isolate_network is on by default: the one host cannot enforce it, so the clone runs with its
    # host's network, and the caller is told which host and why, once.
    notices = [line for line in r.stderr.splitlines() if "run with their host's whole network" in line]
    assert len(notices) == 1 and "clones on rl1 (" in notices[0], r.stderr


def test_the_rootless_agent_reports_it_cannot_enforce_a_tickets_network(rootless):
    (h,) = [h for h in rootless["hosts"]() if h["name"] == "rl1"]
    assert h["isolates_network"] is False and h["cannot_isolate"], h
    r = subprocess.run([STARLING, "status", "--cluster", rootless["cluster"]], capture_output=True, text=True, timeout=30)
    assert "rl1: cannot enforce a fork ticket's own network (" in r.stdout, r.stdout + r.stderr


def test_a_ticket_requiring_its_own_network_is_refused_naming_the_host_that_cannot(rootless, tmp_path):
    with device_granted(USER, "/dev/userfaultfd"):
        r, out = clone_one(rootless, tmp_path, STARLING_FORK_ISOLATE_NETWORK="required")
    assert r.returncode == 2 and out.startswith("TICKET "), out
    assert "`required`" in out and "rl1 (" in out, out
    assert not (tmp_path / "from-clone.txt").exists()
