"""Identities (issue 12): join tokens, per-host agent certificates, per-user certificates, revocation.

A head started by hand in this machine's network namespace with the cluster's credentials
(`starling head --init --auth DIR`, then `starling head --auth DIR`), and agents in a network
namespace of their own that enrol with `starling agent --join HEAD --token T --auth THEIR_DIR`,
as the README tells an administrator to do on real hosts:

* a token enrols one host, once; an expired token enrols none;
* an enrolled host's certificate registers as that host only, and the shared agent certificate
  cannot register as an enrolled host;
* `starling host revoke` drops the host's live connection and its agent is refused with one line;
  the other hosts, which serve each other chunks, refuse it too (the head tells them the list);
* a client holding `starling user add NAME --uid 1000`'s certificate, run by root (its spec says
  uid 0), runs tasks as 1000; `starling user revoke` refuses it from then on;
* `user add --groups` puts supplementary groups in the certificate: the user's tasks run with exactly
  its gid and those groups, whatever groups the client's spec claims."""
import json
import os
import pathlib
import re
import shutil
import socket
import ssl
import subprocess
import time

import pytest

from conftest import netns_with_veth, STARLING, require_root, require_tool, sh, terminate, wait_for

INSTANCE = int(os.environ.get("STARLING_INSTANCE", "").strip() or "0")
NETNS = f"st-ident{INSTANCE}"
VETH = f"st-id{INSTANCE}"
HEAD_IP, AGENT_IP = f"10.219.{INSTANCE}.1", f"10.219.{INSTANCE}.2"
HEAD = f"{HEAD_IP}:17377"
BASE = pathlib.Path(f"/var/tmp/starling-tests/ident-{INSTANCE}")
AUTH = BASE / "auth"


def cleanup_net():
    sh("ip", "netns", "del", NETNS, check=False)
    sh("ip", "link", "del", VETH, check=False)


class Daemons:
    """Processes this module started; each stopped by its pid."""

    def __init__(self):
        self.procs = {}

    def start(self, name, argv):
        assert name not in self.procs, f"a process named {name} is already running"
        log = open(BASE / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, STARLING_LOG="info"))
        self.procs[name] = p
        return p

    def stop(self, name):
        terminate(self.procs.pop(name))

    def stop_all(self):
        for name in list(self.procs):
            self.stop(name)

    def log(self, name):
        return (BASE / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def head():
    require_root("network namespaces and agents")
    require_tool("ip", "iproute2")
    cleanup_net()
    netns_with_veth(NETNS, VETH, HEAD_IP, AGENT_IP)
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(parents=True)
    (BASE / "work").mkdir()
    r = subprocess.run([STARLING, "head", "--init", "--auth", str(AUTH)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = Daemons()
    d.start("head", [STARLING, "head", "--listen", HEAD, "--auth", str(AUTH), "--state", str(BASE / "head")])
    wait_for(lambda: status() is not None, "the head to answer", timeout=120)
    yield d
    d.stop_all()
    cleanup_net()
    shutil.rmtree(BASE, ignore_errors=True)


def admin(*args):
    """An administrator's command on the head's machine."""
    return subprocess.run([STARLING, *args, "--auth", str(AUTH)], capture_output=True, text=True, timeout=60)


def client(*args, creds=AUTH, groups=None):
    """A client command; `groups`: the client process's supplementary groups (what its spec claims)."""
    env = dict(os.environ, STARLING_CLUSTER=HEAD, STARLING_AUTH=str(creds))
    env.pop("STARLING_INSTANCE", None)
    env.pop("STARLING_FORK_BACKEND", None)
    return subprocess.run([STARLING, *args], cwd=BASE / "work", env=env, capture_output=True, text=True, timeout=300,
                          extra_groups=groups)


def status():
    r = client("status", "--json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def hosts():
    st = status()
    return {h["name"]: h for h in st["hosts"]} if st else {}


def new_token(ttl="10m"):
    r = admin("token", "create", "--ttl", ttl)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}\.[0-9a-f]{64}", token), token
    return token


def agent_argv(name, *args):
    return ["ip", "netns", "exec", NETNS, STARLING, "agent", "--name", name, "--state", str(BASE / f"state-{name}"),
            "--cache-mib", "128", *args]


def join(head, name, token, creds=None, label=None):
    """Start an agent that enrols as `name` with `token` (its credentials in `creds`); its process and
    log are named `label` (default: `name`)."""
    creds = creds or BASE / f"creds-{name}"
    return head.start(label or name, agent_argv(name, "--join", HEAD, "--token", token, "--auth", str(creds))), creds


def enrolled(head, name):
    """A host enrolled with a fresh token and registered; returns its credentials directory."""
    p, creds = join(head, name, new_token())
    wait_for(lambda: name in hosts() or p.poll() is not None, f"{name} to enrol and register", timeout=120)
    assert name in hosts(), head.log(name)
    return creds


def test_a_token_enrols_one_host_once(head):
    token = new_token()
    # The head keeps the token's hash, never the token.
    secret = token.split(".")[0]
    assert all(secret not in f.name and secret not in f.read_text() for f in (AUTH / "tokens").iterdir())
    p, creds = join(head, "node1", token)
    host = wait_for(lambda: hosts().get("node1") or (p.poll() is not None and "exited"), "node1 to register", timeout=120)
    assert host != "exited", head.log("node1")
    assert host["address"] == AGENT_IP, host
    # revoked-seen: the revocation list the head sends at registration, kept for the next start.
    wait_for(lambda: (creds / "revoked-seen").exists(), "node1 to keep the revocation list it was sent", timeout=120)
    assert {f.name for f in creds.iterdir()} == {"ca.pem", "agent.pem", "agent.key", "revoked-seen"}
    assert creds.stat().st_mode & 0o777 == 0o700 and (creds / "agent.key").stat().st_mode & 0o777 == 0o600
    r = client("exec", "--", "sh", "-c", "ip -4 -o addr show")
    assert r.returncode == 0, r.stderr + head.log("head")[-2000:]
    assert f"inet {AGENT_IP}/" in r.stdout, r.stdout
    # The same token a second time, by another host: refused, nothing registered.
    p2, _ = join(head, "node2", token)
    assert p2.wait(timeout=120) != 0
    assert "already used" in head.log("node2"), head.log("node2")
    assert "node2" not in hosts()
    # The head logs the refusal after sending it, so the log line may follow node2's exit.
    wait_for(lambda: re.search(r"enrolment from .* refused: host node2: this join token is unknown or was already used", head.log("head")),
             "the head to log node2's refusal", timeout=120)


def test_an_expired_token_is_refused(head):
    token = new_token(ttl="1s")
    time.sleep(2)  # past its expiry, however slow the machine
    p, creds = join(head, "late", token)
    assert p.wait(timeout=120) != 0
    assert "expired" in head.log("late"), head.log("late")
    assert not (creds / "agent.pem").exists()
    assert "late" not in hosts()


def test_a_host_cannot_register_as_another(head):
    creds = enrolled(head, "node3")
    # node3's own certificate, claiming another name: refused with one line, never listed.
    p = head.start("node3-as-node4", agent_argv("node4", "--head", HEAD, "--auth", str(creds)))
    line = "this agent's certificate was issued to host node3; it cannot register as host node4"
    wait_for(lambda: line in head.log("node3-as-node4"), "the impostor to be refused", timeout=120)
    assert "node4" not in hosts()
    head.stop("node3-as-node4")
    # The shared agent certificate of `head --init` cannot take an enrolled host's name either.
    head.start("shared-as-node3", agent_argv("node3", "--head", HEAD, "--auth", str(AUTH)))
    line = "host node3 is enrolled with a certificate of its own; the shared agent certificate cannot register as it"
    wait_for(lambda: line in head.log("shared-as-node3"), "the shared certificate to be refused", timeout=120)
    head.stop("shared-as-node3")
    # Enrolling again under a taken name is refused too, and does not use the token up.
    token = new_token()
    p, _ = join(head, "node3", token, creds=BASE / "creds-node3-again", label="node3-again")
    assert p.wait(timeout=120) != 0
    assert "host node3 is already enrolled" in head.log("node3-again"), head.log("node3-again")
    p, _ = join(head, "node7", token)
    wait_for(lambda: "node7" in hosts() or p.poll() is not None, "node7 to enrol with the same token", timeout=120)
    assert "node7" in hosts(), head.log("node7")


def test_a_revoked_host_is_dropped_and_refused(head):
    enrolled(head, "node5")
    r = admin("host", "revoke", "node5")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: "node5" not in hosts(), "the head to drop node5", timeout=120)
    # Its agent, dialling again, is told why in one line.
    line = re.compile(r"peer refused us: the certificate of host node5 \(serial [0-9a-f]+\) was revoked")
    wait_for(lambda: len(line.findall(head.log("node5"))) >= 2, "node5 to be refused again after the drop", timeout=120)
    assert "node5" not in hosts()
    # Revoking what was never issued is an error.
    r = admin("host", "revoke", "nobody")
    assert r.returncode != 0 and "no host named nobody" in r.stderr, r.stderr


def peer_port(head, name):
    """The port host `name` serves chunks to other hosts on (from its log)."""
    found = []
    wait_for(lambda: found.extend(re.findall(r"serving chunks to other hosts on port (\d+)", head.log(name))) or found,
             f"{name} to listen for other hosts", timeout=120)
    return int(found[0])


def talk_to_host(port, creds):
    """Open a mutual-TLS connection to a host's chunk port with the agent certificate in `creds`, send
    bytes that are no starling greeting, and return everything the host sends until it closes."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(AUTH / "ca.pem")
    ctx.load_cert_chain(creds / "agent.pem", creds / "agent.key")
    with socket.create_connection((AGENT_IP, port), timeout=60) as raw, \
            ctx.wrap_socket(raw, server_hostname="agent.role.starling") as tls:
        tls.sendall(b"not a greeting\n" * 4)
        got = b""
        try:
            while chunk := tls.recv(65536):
                got += chunk
        except (ConnectionError, ssl.SSLError):
            pass
        return got


def test_hosts_refuse_a_revoked_host_their_chunks(head):
    """Hosts serve each other chunks: once a host's certificate is revoked, the others refuse it too."""
    enrolled(head, "share1")
    port = peer_port(head, "share1")
    creds = enrolled(head, "share2")
    head.stop("share2")
    # Not revoked: its certificate is accepted (the host then closes on the bad greeting, saying nothing).
    assert b"was revoked" not in talk_to_host(port, creds)
    r = admin("host", "revoke", "share2")
    assert r.returncode == 0, r.stderr
    # share1 hears of it from the head and refuses share2 with one line.
    wait_for(lambda: b"the certificate of host share2" in talk_to_host(port, creds), "share1 to refuse share2", timeout=120)
    assert re.search(r"the certificate of host share2 \(serial [0-9a-f]+\) was revoked by this cluster's administrator; "
                     r"this host refuses it", head.log("share1")), head.log("share1")[-3000:]


def test_a_restarted_host_refuses_a_revoked_host_before_it_reaches_the_head(head):
    """A host keeps the last revocation list its head sent: started again while the head is out of
    reach, it refuses a revoked host's certificate on its chunk port from the start."""
    enrolled(head, "keep1")
    revoked_creds = enrolled(head, "keep2")
    head.stop("keep2")
    r = admin("host", "revoke", "keep2")
    assert r.returncode == 0, r.stderr
    port = peer_port(head, "keep1")
    wait_for(lambda: b"the certificate of host keep2" in talk_to_host(port, revoked_creds), "keep1 to hear of it", timeout=120)
    kept = BASE / "creds-keep1" / "revoked-seen"
    assert kept.stat().st_mode & 0o777 == 0o600, oct(kept.stat().st_mode)
    # keep1 again, with a head address nobody answers at: it never registers, and still refuses keep2.
    head.stop("keep1")
    head.start("keep1-alone", agent_argv("keep1", "--head", f"{HEAD_IP}:1", "--auth", str(BASE / "creds-keep1")))
    port = peer_port(head, "keep1-alone")
    assert "keep1" not in hosts()
    assert b"the certificate of host keep2" in talk_to_host(port, revoked_creds), head.log("keep1-alone")[-3000:]
    head.stop("keep1-alone")


def test_a_user_certificate_runs_as_its_uid_only(head):
    if not hosts():
        enrolled(head, "node6")
    r = admin("user", "add", "rooty", "--uid", "0")
    assert r.returncode != 0 and "--root" in r.stderr, r.stderr
    alice = BASE / "alice"
    r = admin("user", "add", "alice", "--uid", "1000", "--gid", "1001", "--out", str(alice))
    assert r.returncode == 0, r.stderr
    assert os.getuid() == 0  # so this client's specs say uid 0
    r = client("exec", "--", "sh", "-c", "id -u; id -g", creds=alice)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1000", "1001"], r.stdout
    # The administrator's client certificate is still believed.
    r = client("exec", "--", "id", "-u")
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stdout + r.stderr
    r = admin("user", "revoke", "alice")
    assert r.returncode == 0, r.stderr
    r = client("exec", "--", "true", creds=alice)
    assert r.returncode != 0
    assert "the certificate of user alice" in r.stderr and "was revoked" in r.stderr, r.stderr


def test_a_user_certificate_carries_its_groups(head):
    if not hosts():
        enrolled(head, "node9")
    dave, erin = BASE / "dave", BASE / "erin"
    r = admin("user", "add", "dave", "--uid", "1004", "--gid", "1005", "--groups", "2002,2001", "--out", str(dave))
    assert r.returncode == 0, r.stderr
    r = admin("user", "add", "erin", "--uid", "1006", "--out", str(erin))
    assert r.returncode == 0, r.stderr
    try:
        # The client claims groups 0, 2001 and 3003 in its spec (root, with those supplementary groups):
        # the administrator's certificate is believed, so the task shows what the spec claims ...
        r = client("exec", "--", "id", "-G", groups=[0, 2001, 3003])
        assert r.returncode == 0 and r.stdout.split() == ["0", "2001", "3003"], r.stdout + r.stderr
        # ... while dave's runs with exactly his certificate's gid and groups, and nothing of the spec's.
        r = client("exec", "--", "sh", "-c", "id -u; id -g; id -G", creds=dave, groups=[0, 2001, 3003])
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["1004", "1005", "1005 2001 2002"], r.stdout
        # A user certified without --groups gets their gid alone.
        r = client("exec", "--", "id", "-G", creds=erin, groups=[0, 2001, 3003])
        assert r.returncode == 0 and r.stdout.split() == ["1006"], r.stdout + r.stderr
    finally:
        # (The CA-rotation test counts the users whose credentials it re-issues.)
        for name in ("dave", "erin"):
            admin("user", "revoke", name)


def test_revoking_a_user_ends_its_live_session(head):
    if not hosts():
        enrolled(head, "node8")
    bob = BASE / "bob"
    r = admin("user", "add", "bob", "--uid", "1002", "--out", str(bob))
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, STARLING_CLUSTER=HEAD, STARLING_AUTH=str(bob))
    env.pop("STARLING_INSTANCE", None)
    p = subprocess.Popen([STARLING, "exec", "--", "sh", "-c", "id -u; sleep 1000"], cwd=BASE / "work", env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "1002"  # its task is running
        r = admin("user", "revoke", "bob")
        assert r.returncode == 0, r.stderr
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "the certificate of user bob" in err and "was revoked" in err, err
        wait_for(lambda: sum(h["running"] for h in hosts().values()) == 0, "bob's task to end", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_ca_rotation_keeps_the_cluster_running_and_then_refuses_the_old_ca(head):
    creds = enrolled(head, "rot1")
    carol = BASE / "carol"
    r = admin("user", "add", "carol", "--uid", "1003", "--out", str(carol))
    assert r.returncode == 0, r.stderr
    # What a holder that missed the rotation keeps: the old CA's certificates.
    carol_old, rot1_old = BASE / "carol-old", BASE / "creds-rot1-old"
    shutil.copytree(carol, carol_old)
    shutil.copytree(creds, rot1_old)
    env = dict(os.environ, STARLING_CLUSTER=HEAD, STARLING_AUTH=str(AUTH))
    env.pop("STARLING_INSTANCE", None)
    env.pop("STARLING_FORK_BACKEND", None)
    task = subprocess.Popen([STARLING, "exec", "-T", "--", "sh", "-c", "echo started; read line; echo got $line"],
                            cwd=BASE / "work", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert task.stdout.readline().strip() == "started"  # a task runs across the whole rotation
        r = admin("ca", "rotate")
        assert r.returncode == 0, r.stderr
        assert re.fullmatch(r"[0-9a-f]{64}", r.stdout.strip()), r.stdout
        assert "1 user(s)' credentials re-issued (carol in" in r.stderr, r.stderr
        r = admin("ca", "rotate")
        assert r.returncode != 0 and "a CA rotation is under way" in r.stderr, r.stderr
        # The head gives the connected host a certificate of the new CA over its connection.
        old_pem = (rot1_old / "agent.pem").read_text()
        wait_for(lambda: (creds / "agent.pem").read_text() != old_pem, "the head to re-issue rot1's certificate")
        assert (creds / "ca.pem").read_text() == (AUTH / "ca.pem").read_text()
        assert "installed a new certificate and CAs from the head" in head.log("rot1")
        # During the window both CAs' holders are served: the re-issued credentials and the old ones.
        for c in (carol, carol_old):
            r = client("exec", "--", "id", "-u", creds=c)
            assert r.returncode == 0 and r.stdout.strip() == "1003", r.stdout + r.stderr
        r = admin("ca", "rotate", "--finish")
        assert r.returncode == 0, r.stderr
        # The old CA's credentials are refused in one line, once the head has read the change.
        retired = "was issued by a CA this cluster has retired"
        refused = wait_for(lambda: (lambda r: r if r.returncode != 0 else None)(client("exec", "--", "true", creds=carol_old)),
                           "the head to refuse carol's old certificate")
        assert f"the certificate of user carol (serial" in refused.stderr and retired in refused.stderr, refused.stderr
        # ... and so is an agent holding only the old certificate.
        # (Its own state directory: rot1's holds the running task.)
        argv = agent_argv("rot1", "--head", HEAD, "--auth", str(rot1_old))
        argv[argv.index("--state") + 1] = str(BASE / "state-rot1-old")
        head.start("rot1-old", argv)
        wait_for(lambda: f"peer refused us: the certificate of host rot1 (serial" in head.log("rot1-old")
                 and retired in head.log("rot1-old"), "rot1's old certificate to be refused")
        head.stop("rot1-old")
        # The task started before the rotation ran through it.
        out, err = task.communicate("x\n", timeout=120)
        assert task.returncode == 0, err
        assert out.strip() == "got x", out
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()
    # Jobs run after the rotation with the re-issued credentials, and the re-issued host
    # connects again with its new certificate.
    r = client("exec", "--", "id", "-u", creds=carol)
    assert r.returncode == 0 and r.stdout.strip() == "1003", r.stdout + r.stderr
    head.stop("rot1")
    wait_for(lambda: "rot1" not in hosts(), "the head to notice rot1 left")
    p = head.start("rot1-again", agent_argv("rot1", "--head", HEAD, "--auth", str(creds)))
    wait_for(lambda: "rot1" in hosts() or p.poll() is not None, "rot1 to come back with its new certificate")
    assert "rot1" in hosts(), head.log("rot1-again")
    # Revoking it revokes the certificates of both CAs.
    r = admin("host", "revoke", "rot1")
    assert r.returncode == 0, r.stderr
    assert len([l for l in (AUTH / "revoked").read_text().splitlines() if l.endswith(" host rot1")]) == 2
