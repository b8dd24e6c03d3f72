"""A shell-like terminal program for the terminal-move test. The parent (the task's first process,
leading its session, which has the pty) forks a child into a process group of its own and puts that
group in the terminal's foreground with tcsetpgrp, as a shell starts a job. Ctrl-C (ISIG) then
reaches the foreground group only: the child prints each SIGINT it takes, with its host and whether
its group is still the foreground one; the parent prints any SIGINT it takes (it should take none).
The child reads lines and prints each with its host; "q" ends it; the parent then takes the terminal back and prints how it ended."""
import os
import signal
import socket
import sys

TTY = 0


def say(text):
    os.write(1, f"{text}\r\n".encode())


def on_tty():
    return os.tcgetpgrp(TTY) == os.getpgrp()


signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background shell may set the foreground
go_r, go_w = os.pipe()
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    os.close(go_w)
    os.read(go_r, 1)  # the parent made our group the foreground one
    os.close(go_r)
    taken = 0

    def on_int(*_):
        global taken
        taken += 1
        say(f"child sigint {taken} on {socket.gethostname()} fg={on_tty()}")

    signal.signal(signal.SIGINT, on_int)
    say(f"child ready fg={on_tty()}")
    while (line := os.read(TTY, 100).strip()) != b"q":
        say(f"line {line.decode(errors='replace')} on {socket.gethostname()}")
    sys.exit(0)

signal.signal(signal.SIGINT, lambda *_: say("parent sigint"))
os.setpgid(child, child)
os.tcsetpgrp(TTY, child)
os.close(go_r)
os.write(go_w, b"g")
os.close(go_w)
_, status = os.waitpid(child, 0)
os.tcsetpgrp(TTY, os.getpgrp())
say(f"child ended {os.waitstatus_to_exitcode(status)}, parent on the terminal again fg={on_tty()}")
