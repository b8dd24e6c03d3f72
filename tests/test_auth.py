"""Authentication (issue 12): on an embedded cluster every TCP connection is mutual TLS with a
certificate of the cluster's CA (made by `starling up`), and local users reach the head through
its Unix socket, where the kernel names them: their tasks run as them whatever their spec claims.

Checked on a real embedded cluster (STARLING_INSTANCE): a plain TCP peer is told why and closed, and
nothing runs; a TLS peer holding a certificate of another CA is refused while the cluster's own is
answered; a non-root user's task runs with its uid, also when its client forges uid 0 in the spec
(tests/… `forge_uid`, a test tool built from crates/session/examples, not the product's path);
`up --no-root-tasks` refuses root; a user behind the emulated link relay is still itself."""
import json
import os
import pathlib
import socket
import ssl
import struct
import subprocess

import pytest

from conftest import ROOT, STARLING, as_user, local_account, recv_until_closed, running_tasks, sh, starling, up

INSTANCE = int(os.environ.get("STARLING_INSTANCE", "").strip() or "0")
RUN_DIR = pathlib.Path("/run/starling" if INSTANCE == 0 else f"/run/starling-{INSTANCE}")
USER = "starling-ta"
FORGE = ROOT / "target" / "release" / "examples" / "forge_uid"


def record():
    return json.loads((RUN_DIR / "cluster.json").read_text())


def head_tcp():
    rec = record()
    addr = rec["link"]["head_direct"] if rec.get("link") else rec["head_addr"]
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def hello_frame():
    """The start of a starling frame of this protocol's magic (what a plain client sends first)."""
    return b"STRL" + struct.pack("<HHI", 7, 0, 0)


@pytest.fixture(scope="module")
def user():
    with local_account(USER) as account:
        yield account


@pytest.fixture(scope="module")
def forge():
    """The test tool that sends a spec claiming uid 0 (built like the workspace's other examples)."""
    sh("cargo", "build", "--release", "-q", "-p", "starling-session", "--example", "forge_uid", cwd=ROOT, timeout=1800)
    assert FORGE.exists()
    return str(FORGE)


def test_the_credentials_are_private(cluster):
    auth = RUN_DIR / "auth"
    assert auth.stat().st_mode & 0o777 == 0o700
    for key in auth.glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600, key
    assert {k.name for k in auth.glob("*.key")} == {"ca.key", "head.key", "agent.key", "relay.key", "client.key"}
    assert (RUN_DIR / "head.sock").stat().st_mode & 0o777 == 0o666


def test_plain_tcp_is_told_why_and_closed_and_nothing_runs(cluster):
    s = socket.create_connection(head_tcp(), timeout=60)
    s.sendall(hello_frame())
    reply = recv_until_closed(s, (ConnectionResetError, ssl.SSLError, OSError))
    s.close()
    assert b"mutual-TLS" in reply and b"head.sock" in reply, reply
    assert not reply.startswith(b"STRL\x07\x00\x00\x00") or b"Hello" not in reply
    assert running_tasks() == 0
    log = (RUN_DIR / "logs" / "head.log").read_text()
    assert "refused: plain starling connection without TLS" in log


def tls_exchange(cert_dir):
    """TLS to the head with `cert_dir`'s client certificate; send a frame start; what comes back."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # we test the head's check of us, not ours of it
    ctx.load_cert_chain(str(cert_dir / "client.pem"), str(cert_dir / "client.key"))
    raw = socket.create_connection(head_tcp(), timeout=60)
    try:
        s = ctx.wrap_socket(raw)
        s.sendall(hello_frame())
        return recv_until_closed(s, (ConnectionResetError, ssl.SSLError, OSError))
    except (ssl.SSLError, ConnectionResetError, OSError):
        return b""
    finally:
        raw.close()


def test_a_certificate_of_another_ca_is_refused(cluster, tmp_path):
    other = tmp_path / "other"
    r = subprocess.run([STARLING, "head", "--init", "--auth", str(other)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert tls_exchange(other) == b""
    # The same exchange with the cluster's own client certificate reaches the protocol: the head
    # answers (it refuses our truncated hello in a frame of its own).
    assert tls_exchange(RUN_DIR / "auth").startswith(b"STRL")


def test_a_user_without_the_client_key_gets_one_clear_line_over_tcp(cluster, user):
    pw, home = user
    host, port = head_tcp()
    r = as_user(pw, home, STARLING, "exec", "--cluster", f"{host}:{port}", "--", "true")
    assert r.returncode != 0
    assert "mutual-TLS" in r.stderr, r.stderr


def test_a_user_runs_as_itself(cluster, user):
    pw, home = user
    r = as_user(pw, home, STARLING, "exec", "--", "id", "-u")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pw.pw_uid)


def test_a_forged_uid_0_still_runs_as_the_user(cluster, user, forge):
    pw, home = user
    # Root's own forged spec does run as root: the tool really asks for uid 0.
    r = subprocess.run([forge, "id", "-u"], capture_output=True, text=True, timeout=300, cwd="/tmp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "0"
    r = as_user(pw, home, forge, "sh", "-c", "id -u; id -g; id -G")
    assert r.returncode == 0, r.stdout + r.stderr
    uid, gid, groups = r.stdout.split("\n")[:3]
    assert (int(uid), int(gid)) == (pw.pw_uid, pw.pw_gid), r.stdout
    assert "0" not in groups.split(), r.stdout


def test_no_root_tasks_refuses_root_and_not_users(user):
    pw, home = user
    try:
        starling("down", timeout=120)
        starling("up", "--hosts", "2", "--no-root-tasks", timeout=300)
        r = subprocess.run([STARLING, "exec", "--", "true"], capture_output=True, text=True, timeout=300, cwd="/tmp")
        assert r.returncode != 0
        assert "--no-root-tasks" in r.stderr, r.stderr
        r = as_user(pw, home, STARLING, "exec", "--", "id", "-u")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(pw.pw_uid)
    finally:
        up(4)


def test_a_user_behind_the_link_relay_is_itself(user):
    pw, home = user
    try:
        starling("down", timeout=120)
        starling("up", "--hosts", "2", "--link", "2,0,0", timeout=300)
        assert record()["socket"].endswith("link.sock")
        r = as_user(pw, home, STARLING, "exec", "--", "id", "-u")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(pw.pw_uid)
        r = subprocess.run([STARLING, "exec", "--", "id", "-u"], capture_output=True, text=True, timeout=300, cwd="/tmp")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "0"
        counters = json.loads((RUN_DIR / "link.json").read_text())["counters"]
        assert counters["connections"] >= 2
    finally:
        up(4)
