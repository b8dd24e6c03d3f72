"""A small cbreak-mode terminal program for the terminal-move test: each key it reads is printed with
the host it runs on and whether its terminal is still in cbreak mode (no ICANON, no ECHO); a window
size change prints the new size; Ctrl-C (ISIG stays on) kills it."""
import os
import signal
import socket
import sys
import termios
import tty

fd = sys.stdin.fileno()
tty.setcbreak(fd)


def winch(*_):
    rows, cols = os.get_terminal_size(fd)
    os.write(1, f"winch {rows} {cols}\r\n".encode())


signal.signal(signal.SIGWINCH, winch)
os.write(1, b"ready\r\n")
while True:
    try:
        b = os.read(fd, 1)
    except InterruptedError:
        continue
    if not b:
        break
    lflag = termios.tcgetattr(fd)[3]
    cbreak = not (lflag & (termios.ICANON | termios.ECHO))
    fg = os.tcgetpgrp(fd) == os.getpgrp()
    os.write(1, f"key {b.decode(errors='replace')} on {socket.gethostname()} cbreak={cbreak} fg={fg}\r\n".encode())
