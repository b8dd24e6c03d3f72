"""A Python parent whose stdout is a regular file (`python3 output_file.py > out.txt`): it prints a
line, makes a starling.Executor of 2 workers that each print a line (to stdout and to stderr), prints
a line while the pool lives, shuts the pool down, and prints a final line."""
import os
import sys

import starling


def work(i):
    print(f"WORKER {i} out", flush=True)
    print(f"WORKER {i} err", file=sys.stderr, flush=True)
    return os.uname().nodename


if __name__ == "__main__":
    print("PARENT first", flush=True)
    with starling.Executor(max_workers=2) as ex:
        print("PARENT during", flush=True)
        hosts = list(ex.map(work, range(2)))
    print(f"PARENT last {len(hosts)}", flush=True)
