"""A starling.Executor whose calls wait at a gate the test holds (tests/test_dashboard.py: the
executor's progress on the dashboard while its futures are pending, then done).

Usage: executor_gate.py PORT N — N calls, each of which connects to PORT at the parent's host,
says its number and waits for one byte (the gate opening) before it returns its number squared.
Prints "submitted" once every call is submitted, then "results ..." when all came back."""
import socket
import sys

import starling


def through_gate(port, i):
    with socket.create_connection((starling.parent_host(), port)) as s:
        s.sendall(b"%d\n" % i)
        if s.recv(1) != b"x":
            raise RuntimeError("the gate closed without opening")
    return i * i


def main():
    port, n = int(sys.argv[1]), int(sys.argv[2])
    with starling.Executor(max_workers=2) as ex:
        futures = [ex.submit(through_gate, port, i) for i in range(n)]
        print("submitted", flush=True)
        results = [f.result() for f in futures]
    assert results == [i * i for i in range(n)], results
    print("results", results, flush=True)


if __name__ == "__main__":
    main()
