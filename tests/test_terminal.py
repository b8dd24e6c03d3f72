"""`starling exec` on a terminal (issue 11 part 2): the task gets a pty on its host, as with `ssh -t`.

Driven through tmux (a real terminal emulator, on a private server socket) on the real embedded
cluster. Every wait polls the screen until the expected text appears; the timeouts only bound a hang.
"""
import os
import pathlib
import re
import subprocess
import time

import pytest

from conftest import STARLING, require_tool, status, wait_for

ROWS, COLS = 30, 100


class Tmux:
    def __init__(self, tmux, name="starling-terminal-test"):
        """A terminal: a tmux server of its own (socket `name`-INSTANCE) with one session `t`."""
        self.tmux = tmux
        self.sock = f"{name}-{os.environ.get('STARLING_INSTANCE', '0')}"
        self.run("kill-server", check=False)
        env = dict(os.environ, PS1="$ ", TERM="xterm")
        # The server gets this environment (STARLING_INSTANCE included): the pane's shell inherits it.
        self.run("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", str(COLS), "-y", str(ROWS), "sh", env=env)
        self.run("set-option", "-g", "status", "off")
        self.run("set-option", "-g", "window-size", "manual")
        self.run("resize-window", "-t", "t", "-x", str(COLS), "-y", str(ROWS))
        self.marks = 0

    def run(self, *args, check=True, env=None):
        return subprocess.run([self.tmux, "-L", self.sock, *args], capture_output=True, text=True, check=check,
                              timeout=60, env=env)

    def type(self, text, enter=True):
        self.run("send-keys", "-t", "t", "-l", text)
        if enter:
            self.run("send-keys", "-t", "t", "Enter")

    def key(self, *keys):
        self.run("send-keys", "-t", "t", *keys)

    def screen(self):
        return self.run("capture-pane", "-p", "-t", "t").stdout

    def wait(self, pattern, what, timeout=180.0):
        """The screen once `pattern` (a regex, multiline) matches it; fail naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.screen()
            m = re.search(pattern, s, re.M)
            if m:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; the screen:\n{s}")
            time.sleep(0.1)

    def shell(self, command, timeout=180.0):
        """Run `command` at the pane's shell prompt; return its exit status (read off the screen)."""
        self.marks += 1
        mark = f"done{self.marks}"
        self.type(f'clear; {command}; echo "{mark} rc=$?"')
        return int(self.wait(rf"{mark} rc=(\d+)", f"`{command}` to end", timeout).group(1))

    def start(self, command):
        """Start `command` at the prompt, not waiting for it."""
        self.marks += 1
        self.mark = f"done{self.marks}"
        self.type(f'clear; {command}; echo "{self.mark} rc=$?"')

    def finished(self, what, timeout=180.0):
        """The exit status of what `start` started, once it ended."""
        return int(self.wait(rf"{self.mark} rc=(\d+)", what, timeout).group(1))

    def close(self):
        self.run("kill-server", check=False)


@pytest.fixture
def term(cluster):
    t = Tmux(require_tool("tmux", "tmux"))
    yield t
    t.close()


def test_task_runs_on_a_terminal_of_the_callers_size(term):
    rc = term.shell(f"{STARLING} exec -- sh -c 'tty; stty size'")
    s = term.screen()
    assert rc == 0, s
    assert re.search(r"^/dev/pts/\d+\s*$", s, re.M), s
    assert re.search(rf"^{ROWS} {COLS}\s*$", s, re.M), s
    assert "not a tty" not in s


def test_window_size_changes_reach_the_program(term):
    term.start(f"{STARLING} exec -- sh -c 'trap \"stty size\" WINCH; echo armed; while :; do sleep 1; done'")
    term.wait(r"^armed\s*$", "the program to set its SIGWINCH trap")
    term.run("resize-window", "-t", "t", "-x", "90", "-y", "25")
    term.wait(r"^25 90\s*$", "the new size printed by the program's SIGWINCH trap")
    term.run("resize-window", "-t", "t", "-x", "120", "-y", "40")
    term.wait(r"^40 120\s*$", "the second new size")
    term.key("C-c")
    assert term.finished("the program to end on Ctrl-C") == 130


def test_ctrl_c_kills_and_the_terminal_is_restored(term):
    term.type("before=$(stty -g)")
    term.start(f"{STARLING} exec -- sh -c 'echo sleeping; exec sleep 600'")
    term.wait(r"^sleeping\s*$", "the remote sleep to start")
    term.key("C-c")
    assert term.finished("sleep to end on Ctrl-C") == 130
    # The local terminal is back in the modes it had (cooked, echo on).
    assert term.shell('[ "$(stty -g)" = "$before" ] && stty -a | grep -q " icanon" && stty -a | grep -q " echo "') == 0


def test_interactive_python(term):
    term.start(f"{STARLING} exec -- /usr/bin/python3 -q")
    term.wait(r"^>>>", "python's prompt")
    term.type("x = 6 * 7")
    term.type("print('answer', x)")
    term.wait(r"^answer 42\s*$", "python to evaluate the typed expression")
    term.type("exit()")
    assert term.finished("python to exit") == 0


def test_less_pages(term, workdir):
    f = workdir / "long.txt"
    f.write_text("".join(f"row-{i:04d}\n" for i in range(1, 1001)))
    term.start(f"{STARLING} exec -- less {f}")
    term.wait(r"^row-0001\s*$", "less's first page")
    s = term.screen()
    assert "row-0100" not in s, s
    term.type(" ", enter=False)
    term.wait(r"\A(?![\s\S]*^row-0001)[\s\S]*^row-0040", "less's second page (row 40 shown, row 1 gone)")
    assert not re.search(r"^row-0001", term.screen(), re.M)
    term.type("G", enter=False)
    term.wait(r"^row-1000\s*$", "less at the end of the file")
    term.type("q", enter=False)
    assert term.finished("less to quit") == 0


def test_no_tty_flag_and_job_tasks_get_pipes(term):
    assert term.shell(f"{STARLING} exec -T -- sh -c 'tty || echo pipes-here'") == 0
    term.wait(r"^not a tty\s*$", "-T: no terminal")
    term.wait(r"^pipes-here\s*$", "-T: no terminal")
    assert term.shell(f"{STARLING} exec --job j -- sh -c 'tty || echo job-pipes'") == 0
    term.wait(r"^job-pipes\s*$", "a --job task: no terminal")
    # A step of another program in the foreground (as make runs CC): in its process group, pipes.
    assert term.shell(f"sh -c \"{STARLING} exec -- sh -c 'tty || echo step-pipes'; true\"") == 0
    term.wait(r"^step-pipes\s*$", "a step of a foreground program: no terminal")
    # stdin not a terminal (even though stdout is): pipes.
    assert term.shell(f"{STARLING} exec -- sh -c 'tty || echo stdin-pipes' </dev/null") == 0
    term.wait(r"^stdin-pipes\s*$", "stdin from /dev/null: no terminal")


def test_forced_tty_without_a_terminal(cluster):
    # -t with stdin a pipe: still a pty (default size); the input's end is the terminal's EOF.
    r = subprocess.run([STARLING, "exec", "-t", "--", "sh", "-c", "tty >/dev/null && echo on-a-tty; cat"],
                       input=b"typed\n", capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.replace(b"\r\n", b"\n")
    assert b"on-a-tty\n" in out, r.stdout
    assert b"typed\n" in out, r.stdout


def test_output_of_a_non_terminal_exec_is_unchanged(cluster):
    r = subprocess.run([STARLING, "exec", "--", "sh", "-c", "tty; echo out; echo err >&2"], stdin=subprocess.PIPE,
                       capture_output=True, timeout=300)
    assert r.stdout == b"not a tty\nout\n", r.stdout
    assert r.stderr == b"err\n", r.stderr
    assert r.returncode == 0


def test_a_terminal_task_moves_twice_and_keeps_its_terminal(term):
    # A cbreak-mode program on a pty (tests/terminal/keys.py) moved h0 -> h1 -> h2 with `starling migrate`:
    # after each move the keys typed in the same tmux pane reach it on its new host, its terminal is still
    # in cbreak mode and it is still the terminal's foreground group, a resize after a move reaches it as
    # SIGWINCH, and Ctrl-C kills it (exit 130).
    import json
    hosts = [h["name"] for h in status()["hosts"]]
    prog = pathlib.Path(__file__).parent / "terminal" / "keys.py"
    term.start(f"{STARLING} exec -t --host {hosts[0]} -- /usr/bin/python3 {prog}")
    term.wait(r"^ready\s*$", "the program to start")
    term.type("a", enter=False)
    term.wait(rf"^key a on {hosts[0]} cbreak=True fg=True", "the first key read on the first host")

    def find():
        rows = json.loads(subprocess.run([STARLING, "ps", "--json"], capture_output=True, text=True).stdout)
        return next((r for r in rows if "keys.py" in r["command"]), None)
    task = wait_for(find, "the task's ps row")["task"]
    for key, host in (("b", hosts[1]), ("c", hosts[2])):
        r = subprocess.run([STARLING, "migrate", str(task), "--to", host], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        assert find()["host"] == host
        term.type(key, enter=False)
        term.wait(rf"^key {key} on {host} cbreak=True fg=True", f"key {key} read on {host} after the move")
    term.run("resize-window", "-t", "t", "-x", "90", "-y", "25")
    term.wait(r"^winch 90 25\s*$", "the resize after the moves")
    term.key("C-c")
    assert term.finished("the moved program to end on Ctrl-C") == 130
    s = term.screen()
    # Every key read exactly once.
    for key in "abc":
        assert len(re.findall(rf"^key {key} on", s, re.M)) == 1, s


def test_ctrl_c_reaches_the_foreground_job_only_after_two_moves(term):
    # A shell-like program (tests/terminal/foreground.py) put its child's process group in the
    # terminal's foreground with tcsetpgrp: Ctrl-C, sent into the relayed pty, reaches that group and
    # not the parent's, before and after each of two moves (the restorer gives the group the terminal
    # back); when the child ends the parent takes the terminal back.
    import json
    hosts = [h["name"] for h in status()["hosts"]]
    prog = pathlib.Path(__file__).parent / "terminal" / "foreground.py"
    term.start(f"{STARLING} exec -t --host {hosts[0]} -- /usr/bin/python3 {prog}")
    term.wait(r"^child ready fg=True\s*$", "the child to be the terminal's foreground job")
    term.key("C-c")
    term.wait(rf"^(\^C)?child sigint 1 on {hosts[0]} fg=True", "Ctrl-C to reach the child before any move")

    def find():
        rows = json.loads(subprocess.run([STARLING, "ps", "--json"], capture_output=True, text=True).stdout)
        return next((r for r in rows if "foreground.py" in r["command"]), None)
    task = wait_for(find, "the task's ps row")["task"]
    for n, host in ((2, hosts[1]), (3, hosts[2])):
        r = subprocess.run([STARLING, "migrate", str(task), "--to", host], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        assert find()["host"] == host
        # What is typed reaches the moved program once a line comes back from it (a ^C typed before
        # that can still meet the old host's pty, where its SIGINT is lost with the frozen source).
        term.type(f"moved{n}")
        term.wait(rf"^line moved{n} on {host}", f"a line typed after move {n - 1} to reach the child")
        term.key("C-c")
        term.wait(rf"^(\^C)?child sigint {n} on {host} fg=True", f"Ctrl-C to reach the child after move {n - 1}")
    term.type("q")
    assert term.finished("the program to end once its child read q") == 0
    s = term.screen()
    assert re.search(r"^child ended 0, parent on the terminal again fg=True", s, re.M), s
    assert "parent sigint" not in s, s


def test_less_keeps_paging_after_it_moves(term, workdir):
    # less reads its keys from /dev/tty, not stdin: after `starling migrate` its /dev/tty must be the
    # new host's pty, in the modes less set, so the keys typed in the same pane still page it.
    import json
    hosts = [h["name"] for h in status()["hosts"]]
    f = workdir / "long.txt"
    f.write_text("".join(f"row-{i:04d}\n" for i in range(1, 1001)))
    term.start(f"{STARLING} exec -t --host {hosts[0]} -- less {f}")
    term.wait(r"^row-0001\s*$", "less's first page")

    def find():
        rows = json.loads(subprocess.run([STARLING, "ps", "--json"], capture_output=True, text=True).stdout)
        return next((r for r in rows if r["command"].startswith("less")), None)
    task = wait_for(find, "less's ps row")["task"]
    r = subprocess.run([STARLING, "migrate", str(task), "--to", hosts[1]], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert find()["host"] == hosts[1]
    term.type(" ", enter=False)
    term.wait(r"\A(?![\s\S]*^row-0001)[\s\S]*^row-0040", "less's second page after the move (row 40 shown, row 1 gone)")
    term.type("G", enter=False)
    term.wait(r"^row-1000\s*$", "less at the end of the file")
    term.type("q", enter=False)
    assert term.finished("less to quit") == 0


def vim_timers(path):
    """`/proc/PID/timers` of each vim process editing `path` (seen from here: tasks' PID namespaces
    are children of this one), with thread IDs (this namespace's: another on each host) left out.
    Found by its command line; on a target host the restorer's processes above the restored one
    (sandbox, PID namespace init) show that command line too: only the innermost counts."""
    found = {}
    for p in pathlib.Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0") if p.name.isdigit() else []
            if argv and argv[0].endswith(b"vim") and str(path).encode() in argv:
                ppid = re.search(r"^PPid:\s*(\d+)", (p / "status").read_text(), re.M).group(1)
                found[p.name] = (ppid, re.sub(r"/tid\.\d+", "/tid", (p / "timers").read_text()))
        except OSError:
            continue  # gone meanwhile
    parents = {ppid for ppid, _ in found.values()}
    return [timers for pid, (_, timers) in found.items() if pid not in parents]


def test_vim_moves_twice_mid_edit_and_saves(term, workdir):
    # vim holds a POSIX timer (timer_create with SIGEV_THREAD: glibc's helper thread gets its signal, so
    # the timer is thread-directed), which made it unmovable. Moved h0 -> h1 -> h2 mid-edit: what was
    # typed stays on its screen, keys typed after each move reach it, the timer is there on the target,
    # and `:wq` saves the file on the client.
    require_tool("vim", "vim")
    import json
    hosts = [h["name"] for h in status()["hosts"]]
    f = workdir / "notes.txt"
    term.start(f"{STARLING} exec -t --host {hosts[0]} -- vim -u NONE -i NONE -N {f}")
    term.wait(r"notes\.txt.*\[New", "vim to open the new file")
    term.type("ifirst line", enter=False)
    term.key("Escape")
    term.wait(r"^first line\s*$", "the first typed line on vim's screen")
    [timers] = wait_for(lambda: vim_timers(f), "vim's process")
    assert "ID:" in timers, f"vim holds no POSIX timer here, so this test would not move one:\n{timers}"

    def find():
        rows = json.loads(subprocess.run([STARLING, "ps", "--json"], capture_output=True, text=True).stdout)
        return next((r for r in rows if "notes.txt" in r["command"]), None)
    task = wait_for(find, "the task's ps row")["task"]
    typed = ["first line"]
    for host in hosts[1:3]:
        r = subprocess.run([STARLING, "migrate", str(task), "--to", host], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        assert find()["host"] == host
        # The source's copy may still be on its way out.
        wait_for(lambda: vim_timers(f) == [timers], f"vim's one process on {host} to hold its timer")
        typed.append(f"typed on {host}")
        term.type(f"o{typed[-1]}", enter=False)
        term.key("Escape")
        term.wait(rf"^{typed[-1]}\s*$", f"the line typed on {host} on vim's screen")
    term.type(":wq")
    assert term.finished("vim to save and quit") == 0
    assert f.read_text() == "".join(f"{line}\n" for line in typed)
