"""starling.Executor and the joblib backend on a real embedded cluster (tests/conftest.py's `cluster`).

The workers are clones of this pytest process: they start with its memory (the module's functions,
the arrays built before each pool) and run a worker loop that never returns into pytest. Build and
install the package first: `make python` (scripts/build-python.sh). Needs root (embedded cluster).

The lost-host test kills a host's agent and restarts the cluster afterwards, which ends this
process's link to the old head: it comes last in this file, and the tests after it in a session
(test_python_fork.py) use the local backend.
"""
import concurrent.futures as cf
import math
import os
import signal
import socket
import threading

import pytest

from conftest import cluster, running_tasks, session_cluster, status, up, wait_for  # noqa: F401  (the shared cluster fixtures)
from require import require_module

starling = require_module("starling", "build and install it: make python (scripts/build-python.sh)")
np = require_module("numpy", "pip install numpy (scripts/build-python.sh does)")

# Built before every pool below: 32 MiB the workers read in place.
BIG = np.arange(4 * 1024 * 1024, dtype=np.float64)
# Changed in place after a pool is made (test_workers_see_pre_pool_objects_as_they_were).
SNAPSHOT = [1]


@pytest.fixture(autouse=True)
def cluster_backend(cluster, monkeypatch):  # noqa: F811
    # test_python_fork.py sets the local backend when it is imported (collection): not for these.
    monkeypatch.setenv("STARLING_FORK_BACKEND", "cluster")


def free_cores():
    return sum(h["cores"] for h in status()["hosts"])


def host_names():
    return {h["name"] for h in status()["hosts"]}


class Gate:
    """A TCP gate in this process: a call running `gate_wait(port, tag)` on a worker reports
    (tag, host) and blocks until the test opens the gate, so tests order events without sleeping."""

    def __init__(self):
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.arrivals = []  # (tag, host)
        self._conns = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            line = conn.makefile().readline().split()
            with self._lock:
                self._conns.append(conn)
                self.arrivals.append((int(line[0]), line[1]))

    def wait_arrivals(self, n):
        wait_for(lambda: len(self.arrivals) >= n, f"{n} calls at the gate")
        return list(self.arrivals)

    def open(self):
        with self._lock:
            for c in self._conns:
                c.sendall(b"x")
                c.close()
            self._conns.clear()

    def close(self):
        self.open()
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not)
        self.sock.close()


def gate_wait(port, tag):
    s = socket.create_connection((starling.parent_host(), port))
    s.sendall(f"{tag} {socket.gethostname()}\n".encode())
    s.recv(1)
    s.close()
    return tag


def slice_sum(i, width=100_000):
    return float(BIG[i * width:(i + 1) * width].sum()), socket.gethostname()


def raise_value_error(n):
    raise ValueError(f"boom {n}")


class Unpicklable(Exception):
    def __init__(self, lock):
        super().__init__("holds a lock")
        self.lock = lock


def raise_unpicklable():
    raise Unpicklable(threading.Lock())


def test_results_come_from_other_hosts_and_old_data_is_not_pickled():
    # Earlier tests' tasks end as their pools are joined; wait for the head to free their cores.
    wait_for(lambda: running_tasks() == 0, "an idle cluster")
    cores = free_cores()
    with starling.Executor() as ex:
        # max_workers=None: one worker per free core of the cluster.
        assert ex.max_workers == cores
        futures = [ex.submit(slice_sum, i) for i in range(40)]
        results = [f.result() for f in futures]
        # The same arithmetic on the same slices here: bit-identical.
        assert [r[0] for r in results] == [float(BIG[i * 100_000:(i + 1) * 100_000].sum()) for i in range(40)]
        hosts = {r[1] for r in results}
        assert hosts <= host_names() and socket.gethostname() not in hosts
        # The 32 MiB array itself and views of it as arguments: sent as references.
        assert ex.submit(np.sum, BIG).result() == BIG.sum()
        parts = np.array_split(BIG, 8)
        assert list(ex.map(np.sum, parts)) == [p.sum() for p in parts]
        # Made after the pool: a lambda and a new array go by value.
        fresh = np.full(1000, 3.0)
        assert ex.submit(lambda a, k: float((a * k).sum()), fresh, k=2).result() == 6000.0
        stats = ex.stats()
        sent = stats["bytes_sent"]
    assert stats["calls"] == 40 + 1 + 8 + 1
    # 50 calls touched 4 × 32 MiB of arrays; their pickles stay far below one array's size.
    assert sent < BIG.nbytes // 100, stats
    # ...and the hosts really read the array's pages from this process (page server).
    assert stats["pages_served"] * 4096 >= BIG.nbytes, stats


def test_workers_see_pre_pool_objects_as_they_were():
    SNAPSHOT[:] = [1]
    with starling.Executor(max_workers=1) as ex:
        SNAPSHOT.append(2)  # after the pool was made: the worker's copy is the one of that moment
        assert ex.submit(len, SNAPSHOT).result() == 1
        assert ex.submit(len, starling.by_value(SNAPSHOT)).result() == 2
        # A new object goes by value with its current content.
        assert ex.submit(sum, list(SNAPSHOT)).result() == 3


def test_exception_carries_the_remote_traceback():
    with starling.Executor(max_workers=2) as ex:
        f = ex.submit(raise_value_error, 7)
        with pytest.raises(ValueError, match="boom 7") as info:
            f.result()
        tb = str(info.value.__cause__)
        assert "Traceback on starling worker" in tb and "raise_value_error" in tb and "boom 7" in tb
        assert any(f"(host {h})" in tb for h in host_names()), tb
        assert isinstance(f.exception(), ValueError)
        # An exception that cannot travel back as itself arrives as RemoteError with its text.
        with pytest.raises(starling.RemoteError, match="Unpicklable: holds a lock") as info:
            ex.submit(raise_unpicklable).result()
        assert "raise_unpicklable" in str(info.value.__cause__)
        # The pool still works after failures.
        assert ex.submit(pow, 3, 4).result() == 81


def test_cancel_queued_futures():
    gate = Gate()
    try:
        with starling.Executor(max_workers=1) as ex:
            running = ex.submit(gate_wait, gate.port, 0)
            gate.wait_arrivals(1)
            queued = [ex.submit(gate_wait, gate.port, i) for i in range(1, 6)]
            assert running.running()
            assert all(not f.running() and not f.done() for f in queued)
            assert [f.cancel() for f in queued[1:]] == [True] * 4
            assert not running.cancel()  # a running call cannot be cancelled
            gate.open()
            assert running.result() == 0
            gate.wait_arrivals(2)
            gate.open()
            assert queued[0].result() == 1
            for f in queued[1:]:
                assert f.cancelled()
                with pytest.raises(cf.CancelledError):
                    f.result()
            stats = ex.stats()
        # Only the two calls that were not cancelled ran.
        assert stats["calls"] == 2
        assert [tag for tag, _ in gate.arrivals] == [0, 1]
    finally:
        gate.close()


def test_shutdown_cancel_futures_and_submit_after_shutdown():
    gate = Gate()
    try:
        ex = starling.Executor(max_workers=1)
        running = ex.submit(gate_wait, gate.port, 0)
        gate.wait_arrivals(1)
        queued = [ex.submit(pow, 2, i) for i in range(5)]
        ex.shutdown(wait=False, cancel_futures=True)
        assert all(f.cancelled() for f in queued)
        with pytest.raises(RuntimeError, match="after shutdown"):
            ex.submit(pow, 2, 2)
        assert not running.done()
        gate.open()
        ex.shutdown(wait=True)  # returns once the running call has ended and the workers are joined
        assert running.result() == 0
        assert ex.stats()["calls"] == 1
    finally:
        gate.close()


def test_shutdown_waits_for_queued_calls():
    ex = starling.Executor(max_workers=2)
    futures = [ex.submit(slice_sum, i) for i in range(12)]
    ex.shutdown(wait=True)
    assert all(f.done() and not f.cancelled() for f in futures)
    assert [f.result()[0] for f in futures] == [slice_sum(i)[0] for i in range(12)]


def test_as_completed_and_wait():
    gate = Gate()
    try:
        with starling.Executor(max_workers=2) as ex:
            slow = ex.submit(gate_wait, gate.port, 0)
            gate.wait_arrivals(1)
            fast = ex.submit(pow, 5, 2)
            done, not_done = cf.wait([slow, fast], return_when=cf.FIRST_COMPLETED)
            assert done == {fast} and not_done == {slow}
            order = []
            for f in cf.as_completed([slow, fast]):
                order.append(f)
                if f is fast:
                    gate.open()
            assert order == [fast, slow]
            done, not_done = cf.wait([slow, fast], return_when=cf.ALL_COMPLETED)
            assert done == {slow, fast} and not not_done
            failing = ex.submit(raise_value_error, 1)
            done, _ = cf.wait([failing], return_when=cf.FIRST_EXCEPTION)
            assert done == {failing}
    finally:
        gate.close()


def test_map_with_chunksize_and_the_one_liner():
    with starling.Executor(max_workers=3) as ex:
        assert list(ex.map(math.gcd, range(100), range(0, 300, 3), chunksize=7)) == \
            [math.gcd(a, b) for a, b in zip(range(100), range(0, 300, 3))]
        # One call per chunk of 7: ceil(100 / 7) = 15.
        assert ex.stats()["calls"] == 15
        with pytest.raises(ValueError, match="chunksize"):
            ex.map(abs, [1], chunksize=0)
        # An exception in a chunk is raised when its result is reached.
        results = ex.map(raise_value_error, [1, 2], chunksize=1)
        with pytest.raises(ValueError, match="boom 1"):
            next(results)
    assert starling.map(lambda x: x * x, range(20)) == [x * x for x in range(20)]


def test_joblib_backend_gridsearch_equals_local():
    joblib = require_module("joblib", "pip install joblib (scripts/build-python.sh does)")
    require_module("sklearn", "pip install scikit-learn (scripts/build-python.sh does)")
    from sklearn.datasets import make_classification
    from sklearn.model_selection import GridSearchCV
    from sklearn.svm import SVC

    # Loaded before the call: the workers read it from their inherited memory.
    X, y = make_classification(n_samples=400, n_features=12, random_state=3)
    grid = {"C": [0.1, 1.0, 10.0], "gamma": [0.01, 0.1]}
    local = GridSearchCV(SVC(), grid, cv=3, n_jobs=1).fit(X, y)
    with joblib.parallel_backend("starling"):
        remote = GridSearchCV(SVC(), grid, cv=3, n_jobs=-1).fit(X, y)
        # The same backend runs plain Parallel calls on the cluster's hosts.
        hosts = joblib.Parallel(n_jobs=-1)(joblib.delayed(socket.gethostname)() for _ in range(8))
    assert set(hosts) <= host_names() and socket.gethostname() not in hosts
    assert remote.best_params_ == local.best_params_
    assert remote.best_score_ == local.best_score_
    keys = [k for k in local.cv_results_ if "time" not in k]
    assert keys and keys == [k for k in remote.cv_results_ if "time" not in k]
    for k in keys:
        assert np.array_equal(np.asarray(local.cv_results_[k], dtype=object),
                              np.asarray(remote.cv_results_[k], dtype=object)), k


# Last in this file: it kills a host and restarts the cluster (see the module docstring).
def test_lost_host_fails_its_running_calls_with_worker_lost():
    gate = Gate()
    try:
        ex = starling.Executor()
        m = ex.max_workers
        futures = [ex.submit(gate_wait, gate.port, i) for i in range(m)]
        placed = dict(gate.wait_arrivals(m))  # tag -> host
        victim = sorted(set(placed.values()))[0]
        pid = next(h["pid"] for h in status()["hosts"] if h["name"] == victim)
        os.kill(pid, signal.SIGKILL)
        on_victim = [futures[t] for t, h in placed.items() if h == victim]
        elsewhere = [futures[t] for t, h in placed.items() if h != victim]
        assert on_victim and elsewhere
        for f in on_victim:
            e = f.exception(timeout=120)
            assert isinstance(e, starling.WorkerLost), e
            assert e.host == victim and f"on host {victim}" in str(e) and "not rerun" in str(e)
        assert not any(f.done() for f in elsewhere)
        gate.open()
        assert sorted(f.result() for f in elsewhere) == sorted(t for t, h in placed.items() if h != victim)
        # The pool goes on with the workers it has left.
        later = ex.submit(slice_sum, 3).result()
        assert later[1] != victim and later[0] == slice_sum(3)[0]
        ex.shutdown(wait=True)

        # A pool whose only worker is lost: its running call fails with WorkerLost, the queued ones
        # with BrokenExecutor, and it takes no more.
        gate.arrivals.clear()
        ex = starling.Executor(max_workers=1)
        running = ex.submit(gate_wait, gate.port, 100)
        (_, host), = gate.wait_arrivals(1)
        queued = [ex.submit(pow, 2, i) for i in range(3)]
        os.kill(next(h["pid"] for h in status()["hosts"] if h["name"] == host), signal.SIGKILL)
        assert isinstance(running.exception(timeout=120), starling.WorkerLost)
        for f in queued:
            assert isinstance(f.exception(timeout=120), starling.BrokenExecutor)
        assert isinstance(starling.BrokenExecutor(), cf.BrokenExecutor)
        with pytest.raises(starling.BrokenExecutor):
            ex.submit(pow, 2, 2)
        ex.shutdown(wait=True)
    finally:
        gate.close()
        up(4)
