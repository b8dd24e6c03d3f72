"""X11 forwarding (issue 11 part 3): `starling exec --x11` gives the task a DISPLAY served by its
host, and each X connection it opens is relayed to the user's own X server, as `ssh -X` does; a
roaming task's X input and drawing, counted by the relay, are its migration manager's X sensors
(part 4).

The user's X server is a real Xvfb started here with a screen size the test chose and with access
control on (a cookie in an Xauthority file of its own): a program on a host reaches it only if
starling swapped its stand-in cookie for the real one, which never leaves this machine. Every wait
polls for an event (a window in the server's tree, a process's end); timeouts only bound a hang.
"""
import hashlib
import json
import os
import secrets
import subprocess
import time

import pytest

from conftest import ROOT, STARLING, require_tool, sh, starling, terminate, wait_for
from test_roam import CRUNCHY

WIDTH, HEIGHT = 1234, 567


@pytest.fixture(scope="module")
def xserver(tmp_path_factory):
    """An Xvfb of WIDTHxHEIGHT that admits only the holder of its cookie; yields the environment
    (DISPLAY, XAUTHORITY) a user's shell has, and the cookie in hex."""
    require_tool("Xvfb", "xvfb")
    require_tool("xauth", "xauth")
    require_tool("xdpyinfo", "x11-utils")
    require_tool("xwininfo", "x11-utils")
    require_tool("xlogo", "x11-apps")
    auth = tmp_path_factory.mktemp("x11") / "Xauthority"
    auth.touch()
    cookie = secrets.token_hex(16)
    r, w = os.pipe()
    # -displayfd: Xvfb picks a free display number and writes it once it accepts connections.
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", f"{WIDTH}x{HEIGHT}x24", "-auth", str(auth),
                             "-nolisten", "tcp"], pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    with os.fdopen(r) as f:
        number = f.readline().strip()
    assert number.isdigit(), f"Xvfb did not start: {xvfb.stderr.read() if xvfb.poll() is not None else ''}"
    display = f":{number}"
    sh("xauth", "-f", str(auth), "add", display, "MIT-MAGIC-COOKIE-1", cookie)
    env = dict(os.environ, DISPLAY=display, XAUTHORITY=str(auth))
    # The server admits the cookie, and only it (so a relay that passed the stand-in on would fail).
    assert sh("xdpyinfo", env=env).returncode == 0
    assert subprocess.run(["xdpyinfo"], env=dict(env, XAUTHORITY="/dev/null"), capture_output=True).returncode != 0
    yield env, cookie
    terminate(xvfb)


def x11_exec(env, *cmd, host=None, cwd=None, timeout=300):
    args = [STARLING, "exec", "--x11", "-T"] + (["--host", host] if host else []) + ["--"] + list(cmd)
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_program_on_a_host_sees_the_users_display(cluster, xserver):
    env, _ = xserver
    r = x11_exec(env, "xdpyinfo", host="h2")
    assert r.returncode == 0, r.stderr
    assert f"dimensions:    {WIDTH}x{HEIGHT} pixels" in r.stdout, r.stdout[:2000]


def test_a_window_made_on_a_host_appears_on_the_users_display(cluster, xserver):
    env, _ = xserver
    title = f"starling-x11-{secrets.token_hex(4)}"
    p = subprocess.Popen([STARLING, "exec", "--x11", "-T", "--host", "h3", "--", "xlogo", "-title", title], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tree = lambda: sh("xwininfo", "-root", "-tree", env=env).stdout  # noqa: E731
        wait_for(lambda: title in tree() or p.poll() is not None, f"the window {title!r} on the local X server")
        assert p.poll() is None, f"exec ended: {p.communicate()}"
        assert f'"{title}"' in tree()
        # Ctrl-C as a user would: the program ends on its host and its window goes with it.
        p.send_signal(2)
        assert p.wait(timeout=120) == 130, p.communicate()
        wait_for(lambda: title not in tree(), f"the window {title!r} gone")
    finally:
        terminate(p)


def test_the_real_cookie_stays_home_and_only_the_stand_in_is_admitted(cluster, xserver):
    env, cookie = xserver
    # The task's Xauthority holds a stand-in, for its display, never the server's cookie.
    r = x11_exec(env, "sh", "-c", 'echo "display=$DISPLAY"; xauth -f "$XAUTHORITY" list', host="h1")
    assert r.returncode == 0, r.stderr
    assert "MIT-MAGIC-COOKIE-1" in r.stdout and cookie not in r.stdout, r.stdout
    number = r.stdout.split("display=:")[1].split()[0]
    assert f":{number}" in r.stdout.split("\n", 1)[1], "the entry is for the task's display"
    # Without it the relay refuses the connection (the server never sees it).
    r = x11_exec(env, "sh", "-c", 'XAUTHORITY=/dev/null xdpyinfo', host="h1")
    assert r.returncode != 0 and "unable to open display" in r.stderr, (r.stdout, r.stderr)


def test_the_display_leaves_nothing_behind(cluster, xserver, tmp_path):
    env, _ = xserver
    # What the task's /tmp/.X11-unix held while it ran is never committed here.
    before = sorted(os.listdir("/tmp/.X11-unix"))
    r = x11_exec(env, "sh", "-c", 'ls -a /tmp/.X11-unix; echo made > made.txt', host="h4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any(n.startswith("X") and n not in before for n in r.stdout.split()), f"the task's socket: {r.stdout}"
    assert (tmp_path / "made.txt").read_text() == "made\n", "the task's own file was committed"
    assert sorted(os.listdir("/tmp/.X11-unix")) == before


def test_without_a_display_the_task_runs_and_says_so(cluster, xserver):
    env, _ = xserver
    env = {k: v for k, v in env.items() if k != "DISPLAY"}
    r = x11_exec(env, "sh", "-c", 'echo "[$DISPLAY]"', host="h2")
    assert r.returncode == 0, r.stderr
    assert "X11 forwarding is off: DISPLAY is not set" in r.stderr
    assert r.stdout.strip() == "[]"


def ps():
    return json.loads(starling("ps", "--json").stdout)


def xprop_ticks(env, wid):
    """The window's STARLING_TICKS (bumped by its program every 100 ms), or None."""
    r = subprocess.run(["xprop", "-id", wid, "STARLING_TICKS"], env=env, capture_output=True, text=True)
    tail = r.stdout.rpartition("=")[2].strip()
    return int(tail) if r.returncode == 0 and tail.isdigit() else None


def window_image(env, wid):
    """The window's pixels as the X server holds them (xwd), hashed."""
    r = subprocess.run(["xwd", "-id", wid, "-silent"], env=env, capture_output=True)
    assert r.returncode == 0, r.stderr
    return hashlib.sha256(r.stdout).hexdigest()


def ticking(env, wid, after):
    """Wait until the program has bumped its property past `after`: its X connection works."""
    return wait_for(lambda: (t := xprop_ticks(env, wid)) is not None and t > after + 3 and t, "the window's ticks to advance")


# A roaming profile with no rules: the task stays where it is put (moves are by hand).
STILL = """
initial = "here"
[states.here]
site = "home"
"""


@pytest.mark.parametrize("how, start, moves", [
    ("exec", ["--host", "h1"], ["h2", "h3"]),
    # Snowbird's trip: started at home (this machine), out to the cluster and back.
    ("roam", ["--roam", "--profile", "PROFILE"], ["h2", "home"]),
])
def test_a_window_survives_its_program_moving_between_hosts(cluster, xserver, workdir, how, start, moves):
    """The real X connection never moves: the program's leg is re-attached on each new host, so its
    window, its id and its pixels stay, and its requests go on reaching the server."""
    require_tool("xprop", "x11-utils")
    require_tool("xwd", "x11-apps")
    require_tool("gcc", "gcc")
    env, _ = xserver
    prog = workdir / "ticker"
    r = sh("gcc", "-O1", "-Wall", "-o", str(prog), str(ROOT / "tests/x11/ticker.c"), "-lX11", check=False)
    assert r.returncode == 0, f"building the Xlib program (libx11-dev): {r.stderr}"
    title = f"starling-move-{secrets.token_hex(4)}"
    (workdir / "still.toml").write_text(STILL)
    start = [str(workdir / "still.toml") if a == "PROFILE" else a for a in start]
    p = subprocess.Popen([STARLING, "exec", "--x11", "-T", *start, "--", str(prog), title], env=env, cwd=workdir,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("window 0x"), f"{line!r} {p.stderr.read() if p.poll() is not None else ''}"
        wid = line.split()[1]
        task = wait_for(lambda: next((r["task"] for r in ps() if str(prog) in r["command"]), None), "the task in ps")
        assert next(r["host"] for r in ps() if r["task"] == task) == ("home" if how == "roam" else "h1")
        ticks = ticking(env, wid, 0)
        image = window_image(env, wid)
        for to in moves:
            r = starling("migrate", str(task), "--to", to, "--json", check=False, timeout=300)
            assert r.returncode == 0, f"migrate to {to}: {r.stdout}\n{r.stderr}"
            assert next(r["host"] for r in ps() if r["task"] == task) == to
            ticks = ticking(env, wid, ticks)
            tree = sh("xwininfo", "-root", "-tree", env=env).stdout
            assert tree.count(f'"{title}"') == 1 and wid in tree, "the same window, under the same id"
            assert window_image(env, wid) == image, f"the window's pixels after the move to {to}"
        assert p.poll() is None, p.communicate()
        p.send_signal(2)
        assert p.wait(timeout=120) == 130, p.communicate()
        wait_for(lambda: title not in sh("xwininfo", "-root", "-tree", env=env).stdout, "the window gone with its program")
    finally:
        terminate(p)


# test_roam's short windows (3 s averaging, samples every 0.5 s, 6 s minimum dwell), with X input
# events where that test has keystrokes.
X_CRUNCHY = CRUNCHY.replace("inputs_", "x_inputs_")


def build_x_program(workdir, name, *libs):
    require_tool("gcc", "gcc")
    prog = workdir / name
    r = sh("gcc", "-O1", "-Wall", "-o", str(prog), str(ROOT / f"tests/x11/{name}.c"), *libs, "-lX11", check=False)
    assert r.returncode == 0, f"building {name} (libx11-dev, libxtst-dev): {r.stderr}"
    return prog


def test_x_input_keeps_a_crunching_program_home_and_brings_it_back(cluster, xserver, workdir):
    """The manager's X sensors: input events the user's server sends the program and the frames it
    draws after each, counted by the relay at home. While the pointer and keys work the program's
    window it stays home though it crunches; left alone it goes to the cluster; input brings it back."""
    env, _ = xserver
    crunch = build_x_program(workdir, "xcrunch")
    poke = build_x_program(workdir, "xpoke", "-lXtst")
    prof = workdir / "x-crunchy.toml"
    prof.write_text(X_CRUNCHY)
    title = f"starling-xcrunch-{secrets.token_hex(4)}"
    p = subprocess.Popen([STARLING, "exec", "--x11", "-T", "--roam", "--profile", str(prof), "--", str(crunch), title], env=env,
                         cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pokers = []

    def start_poking():
        pokers.append(subprocess.Popen([str(poke), wid], env=env, stderr=subprocess.PIPE, text=True))

    try:
        line = p.stdout.readline()
        assert line.startswith("window 0x"), f"{line!r} {p.communicate(timeout=60) if not line else ''}"
        wid = line.split()[1]
        task = wait_for(lambda: next((r["task"] for r in ps() if str(crunch) in r["command"]), None), "the task in ps")

        def row():
            return next((r for r in ps() if r["task"] == task), None)

        def decisions():
            return (row() or {}).get("roam", {}).get("decisions", [])

        def moved(home):
            return [d for d in decisions() if d["action"] == "moved" and (d["to_site"] == "home") == home]

        assert row()["host"] == "home"
        # The program crunches from its first input on, so every window the manager averages
        # while it crunches at home holds input (a burst every 200 ms).
        start_poking()
        assert p.stdout.readline().strip() == "crunching", p.stderr.read() if p.poll() is not None else ""
        # Long enough that the manager has averaged several windows of crunch with input in them.
        wait_for(lambda: (r := row()) and r["host"] == "home" and (r["cpu_seconds"] or 0) >= 10, "10 CPU seconds of crunch at home",
                 timeout=300)
        stopped_ms = int(time.time() * 1000)
        terminate(pokers[-1])
        assert row()["host"] == "home", "the crunch stayed home while its window had input"
        early = [d for d in decisions() if d["to_state"] == "crunch"]
        assert not early, f"no rule sent it away while its window had input: {early}"

        out = wait_for(lambda: moved(False), "the manager to move the crunch, left alone, to the cluster", timeout=300)[0]
        assert out["at_ms"] >= stopped_ms, (out, stopped_ms)
        sensors = dict(out["sensors"])
        assert sensors["cpu"] >= 0.3 and sensors["x_inputs"] < 4, out
        wait_for(lambda: (r := row()) and r["host"] != "home", "ps to show the task on a host")

        # Input again, on the program's window on its host: it comes home for it.
        start_poking()
        home = wait_for(lambda: moved(True), "the manager to bring the task home for the X input", timeout=300)[0]
        sensors = dict(home["sensors"])
        assert sensors["x_inputs"] >= 4, decisions()
        assert sensors.get("fps", 0) > 0, f"frames drawn after the input were counted: {decisions()}"
        assert "x_inputs" in home["reason"], home
        assert [d["to_site"] == "home" for d in decisions() if d["action"] == "moved"] == [False, True], "one move out, one back"
        why = starling("ps", "--why", str(task)).stdout
        assert "x_inputs=" in why and "fps=" in why, why
        assert p.poll() is None, p.communicate()
        p.send_signal(2)
        assert p.wait(timeout=120) == 130, p.communicate()
    finally:
        for q in pokers:
            terminate(q)
        terminate(p)
