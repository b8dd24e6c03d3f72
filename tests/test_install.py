"""Real-host operations: `make install` (binary, libstarling, header, systemd units), the units'
commands run the way systemd would run them (ExecStart + Environment, settings from one config file
named by STARLING_CONFIG), and an agent that loses its head dials it again (with backoff) and comes
back as the same process, its cache kept."""
import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess

import pytest

from conftest import ROOT, require_root, require_tool, sh, terminate, wait_for

BASE = pathlib.Path("/var/tmp/starling-tests/install")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit(path):
    """ExecStart argv and Environment of a unit file."""
    exec_start, env = None, {}
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            exec_start = shlex.split(line.split("=", 1)[1])
        elif line.startswith("Environment="):
            k, v = line.split("=", 1)[1].split("=", 1)
            env[k] = v
    return exec_start, env


@pytest.fixture(scope="module")
def installed():
    require_root("an agent (FUSE, mount namespaces)")
    require_tool("make", "make")
    shutil.rmtree(BASE, ignore_errors=True)
    prefix = BASE / "prefix"
    r = sh("make", "-C", str(ROOT), "install", f"PREFIX={prefix}", f"UNITDIR={prefix}/units", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    yield prefix
    shutil.rmtree(BASE, ignore_errors=True)


def test_install_puts_binary_library_header_and_units_in_place(installed):
    for f in ["bin/starling", "lib/libstarling.a", "lib/libstarling.so", "include/starling.h",
              "units/starling-head.service", "units/starling-agent.service"]:
        assert (installed / f).is_file(), f
    assert os.access(installed / "bin/starling", os.X_OK)
    assert (installed / "bin/starling").read_bytes() == (ROOT / "target/release/starling").read_bytes()
    for role in ["head", "agent"]:
        argv, _ = unit(installed / f"units/starling-{role}.service")
        assert argv == [str(installed / "bin/starling"), role]


def test_units_run_from_one_config_file_and_the_agent_outlives_a_head_restart(installed):
    port = free_port()
    cfg = BASE / "config.toml"
    cfg.write_text(f"""[head]
listen = "127.0.0.1:{port}"
state = "{BASE}/head"
[agent]
head = "127.0.0.1:{port}"
name = "installed1"
state = "{BASE}/agent"
""")
    procs = []

    def start(role):
        argv, env = unit(installed / f"units/starling-{role}.service")
        log = open(BASE / f"{role}.log", "ab")
        p = subprocess.Popen(argv, env=dict(os.environ, **env, STARLING_CONFIG=str(cfg)), stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    starling = str(installed / "bin/starling")

    def hosts():
        r = subprocess.run([starling, "status", "--json", "--cluster", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return None
        import json
        return {h["name"]: h["pid"] for h in json.loads(r.stdout)["hosts"]}

    try:
        head = start("head")
        agent = start("agent")
        first = wait_for(lambda: hosts() if (hosts() or {}).get("installed1") else None, "the agent to register", timeout=60)
        assert first == {"installed1": agent.pid}
        r = subprocess.run([starling, "exec", "--cluster", f"127.0.0.1:{port}", "--", "sh", "-c", "echo ran"],
                           capture_output=True, text=True, timeout=120, cwd=BASE)
        assert r.returncode == 0 and r.stdout == "ran\n", r.stderr
        cache = BASE / "agent" / "cache"
        assert cache.is_dir()

        # The head goes away and comes back (as systemd would restart it): the same agent process
        # registers again, nothing restarted it.
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=30)
        wait_for(lambda: b"lost the head" in (BASE / "agent.log").read_bytes(), "the agent to notice", timeout=60)
        head = start("head")
        again = wait_for(lambda: hosts() if (hosts() or {}).get("installed1") else None, "the agent to register again",
                         timeout=120)
        assert again == {"installed1": agent.pid}
        assert agent.poll() is None and cache.is_dir()
        r = subprocess.run([starling, "exec", "--cluster", f"127.0.0.1:{port}", "--", "sh", "-c", "echo again"],
                           capture_output=True, text=True, timeout=120, cwd=BASE)
        assert r.returncode == 0 and r.stdout == "again\n", r.stderr
    finally:
        for p in procs:
            terminate(p, timeout=30)


def test_an_agent_without_root_and_without_dev_fuse_names_the_fix_in_one_line(installed):
    require_tool("setpriv", "util-linux")
    require_tool("unshare", "util-linux")
    # The user must not be granted /dev/fuse, whatever this machine's mode or ACL on it (a package
    # install can leave it 0666): in a private mount namespace a root-only file covers it, as a
    # device of mode 0600 without an ACL for the user would be.
    covered = BASE / "fuse-not-granted"
    covered.write_bytes(b"")
    covered.chmod(0o600)
    agent = shlex.join(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                        str(installed / "bin/starling"), "agent", "--head", "127.0.0.1:1", "--state", str(BASE / "nobody")])
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"mount --bind {shlex.quote(str(covered))} /dev/fuse && exec {agent}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 255
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "without root" in lines[0] and "/dev/fuse" in lines[0] and "setfacl" in lines[0], r.stderr
