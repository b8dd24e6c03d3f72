"""A Python parent whose stdout is a regular file (`python3 output_file.py > out.txt`): it prints a
line, makes a starling.Executor of 2 workers that each print a line (to stdout and to stderr), prints
a line while the pool lives, shuts the pool down, and prints a final line.

Each line is written whole, in one write(2): the two workers run at once and append to the same
file, as two local processes would, and `print` makes two writes (text, then end) when Python is
unbuffered (PYTHONUNBUFFERED=1, as in CI), so two workers' lines could interleave mid-line."""
import os
import sys

import starling


def say(line, f=sys.stdout):
    f.write(line + "\n")
    f.flush()


def work(i):
    say(f"WORKER {i} out")
    say(f"WORKER {i} err", sys.stderr)
    return os.uname().nodename


if __name__ == "__main__":
    say("PARENT first")
    with starling.Executor(max_workers=2) as ex:
        say("PARENT during")
        hosts = list(ex.map(work, range(2)))
    say(f"PARENT last {len(hosts)}")
