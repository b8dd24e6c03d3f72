"""``starling.Executor``: a ``concurrent.futures.Executor`` on remote-fork clones.

How it works
------------
Creating an ``Executor`` opens a listening TCP socket, requests one ticket
(``max_workers`` clones, or every free core of the cluster when None) and
clones this interpreter once: clones 1..m start on the cluster's hosts with
the interpreter's whole memory (fetched lazily by the hosts' page-fault
handlers), connect back to the socket's port at ``starling.parent_host()``
and each run a worker loop: receive a call, run it, send back its result, or
its exception with the remote traceback. The parent has one thread per
worker that feeds it one call at a time from a shared FIFO queue, so a
future stays PENDING (and cancellable) until a worker takes it.

What a call sends
-----------------
Objects that existed when the pool was made are *referenced, not pickled*.
At creation the pool takes a registry ``{id(obj): obj}`` of every object the
garbage collector tracks, the objects those refer to, and the local
variables of every frame on every thread's stack (functions, classes,
modules, arrays, data frames, fitted models, closures...). The registry holds
them, so an id names the same object for the pool's life, and the workers
hold the very same registry at the very same addresses (it is in the memory
they were cloned from). A call ``(fn, args, kwargs)`` is pickled with
cloudpickle, except that each registered object is replaced by its id (a
pickle persistent id) and looked up on the worker; a numpy view of a
registered array (``X[a:b]``, ``np.array_split(X, n)``) goes as (array id,
offset, shape, strides, dtype). Anything newer — a lambda written after the
pool, a new list, a new array — goes by value (cloudpickle). Results and
exceptions come back by value.

Consequence (fork semantics): a worker sees a pre-pool object as it was when
the pool was made. If you change such an object in place afterwards (append
to a list, write into an array) and want the workers to see the change, pass
``starling.by_value(obj)`` or make a new Executor. A worker's own changes to
a pre-pool object stay in that worker, visible to its later calls only.

Failures
--------
An exception raised by the call is raised by ``future.result()`` with the
worker's traceback as its ``__cause__`` (as ``ProcessPoolExecutor`` does).
A worker whose host is lost — its connection drops, or the head reports the
clone lost/ended — fails the call it was running with ``starling.WorkerLost``
(the call is *not* rerun: it may have had effects); queued calls go to the
remaining workers. When no worker remains, queued calls fail and ``submit``
raises ``starling.BrokenExecutor`` (a ``concurrent.futures.BrokenExecutor``).

Progress on the dashboard
-------------------------
The pool shows on the head's dashboard as its ticket's group (the workers are the ticket's clone
tasks) with its futures submitted / done / failed / cancelled. The parent sends those counts
(``_native.executor_progress``) from its watcher thread when they changed, so at most four times
a second, and once more at shutdown: only the parent knows them, since calls and results go
straight between it and the workers, never through the head.
"""

import builtins
import concurrent.futures as _cf
import io
import itertools
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import traceback
import weakref

import cloudpickle

from . import _native

__all__ = ["Executor", "map", "by_value", "WorkerLost", "BrokenExecutor", "RemoteError"]


class WorkerLost(RuntimeError):
    """The worker running this call was lost (its host or connection went away); the call was not rerun."""

    def __init__(self, message, clone_id=None, host=None):
        super().__init__(message)
        self.clone_id = clone_id
        self.host = host

    def __reduce__(self):
        return (type(self), (self.args[0], self.clone_id, self.host))


class BrokenExecutor(_cf.BrokenExecutor):
    """Every worker of the pool is gone: queued calls failed, new ones are refused."""


class RemoteError(Exception):
    """A call raised an exception that could not be sent back as itself (not picklable); its text is kept."""


class _RemoteTraceback(Exception):
    """The worker's traceback, set as ``__cause__`` of the exception a call raised."""

    def __init__(self, tb):
        super().__init__(tb)
        self.tb = tb

    def __str__(self):
        return self.tb


class by_value:
    """``starling.by_value(obj)`` in a call's arguments sends ``obj`` by value (cloudpickle), even if it
    existed when the pool was made: for an object changed in place since, whose current state the
    worker must see. The worker receives ``obj`` itself, not the wrapper."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        return (pickle.loads, (cloudpickle.dumps(self.obj, protocol=pickle.HIGHEST_PROTOCOL),))


# Frames: kind (1 byte), call id, payload length, payload.
_HDR = struct.Struct("!BQQ")
_CALL, _STOP = 1, 2  # parent -> worker
_HELLO, _OK, _ERR = 10, 11, 12  # worker -> parent
_STOP_ITEM = object()
# The largest ticket the protocol allows (proto: TicketRequest n <= 4096).
MAX_WORKERS = 4096
# Sent by value even when registered: cheaper than a reference.
_SCALARS = frozenset([int, float, bool, complex, type(None), type(Ellipsis)])
_SMALL = 128


def _send(sock, kind, cid, payload=b""):
    header = _HDR.pack(kind, cid, len(payload))
    if len(payload) < 65536:
        sock.sendall(header + payload)
    else:
        sock.sendall(header)
        sock.sendall(payload)


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def _recv(sock):
    kind, cid, n = _HDR.unpack(_recv_exact(sock, _HDR.size))
    return kind, cid, _recv_exact(sock, n) if n else b""


class _Registry(dict):
    """{id: object} of one pool (a type of its own so that later snapshots leave it out)."""

    __slots__ = ()


def _snapshot(frame):
    """The registry of pre-pool objects: gc-tracked objects, what they refer to, and every stack frame's locals.
    Other pools' registries are left out (their ids would be registered otherwise, each pool's
    registry growing with all the earlier ones)."""
    import gc

    tracked = [o for o in gc.get_objects() if type(o) is not _Registry]
    reg = _Registry(zip(builtins.map(id, tracked), tracked))
    referents = gc.get_referents(*tracked)
    reg.update(zip(builtins.map(id, referents), referents))
    del tracked, referents
    # Every other thread's stack, and this one's from the caller up (not this function's frame:
    # its locals would keep these big lists alive in a cycle, and the next pool would register them).
    me = threading.get_ident()
    frames = [f for tid, f in sys._current_frames().items() if tid != me]
    frames.append(frame)
    for f in frames:
        while f is not None:
            loc = list(f.f_locals.values())
            reg.update(zip(builtins.map(id, loc), loc))
            f = f.f_back
    del frames, f, loc
    return reg


def _array_view_ref(np, a, reg):
    """(id of a registered C-contiguous base array, byte offset, shape, strides, dtype) for a view of it."""
    base = a.base
    while isinstance(base, np.ndarray):
        if reg.get(id(base)) is base and base.flags.c_contiguous:
            off = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            if a.size == 0:
                return None
            lo = off + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
            hi = off + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0) + a.itemsize
            if 0 <= lo and hi <= base.nbytes:
                return ("view", id(base), off, a.shape, a.strides, a.dtype.str)
            return None
        base = base.base
    return None


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with pre-pool objects replaced by their ids."""

    def __init__(self, file, reg):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._reg = reg
        self._np = sys.modules.get("numpy")

    def persistent_id(self, obj):
        t = type(obj)
        if t in _SCALARS or t is by_value:
            return None
        if (t is str or t is bytes) and len(obj) < _SMALL:
            return None
        if self._reg.get(id(obj)) is obj:
            return id(obj)
        np = self._np
        if np is not None and t is np.ndarray and obj.base is not None:
            return _array_view_ref(np, obj, self._reg)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, reg):
        super().__init__(file)
        self._reg = reg

    def persistent_load(self, pid):
        if isinstance(pid, tuple):
            _, base_id, off, shape, strides, dtype = pid
            np = sys.modules["numpy"]
            return np.ndarray(shape, np.dtype(dtype), buffer=self._reg[base_id], offset=off, strides=strides)
        return self._reg[pid]


def _dump_exception(e, clone_id, host):
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    text = f'\n"""\nTraceback on starling worker {clone_id} (host {host}):\n{tb}"""'
    summary = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    e.__traceback__ = None
    try:
        data = cloudpickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = None
    return pickle.dumps((data, text, summary))


def _load_exception(payload):
    data, text, summary = pickle.loads(payload)
    exc = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(summary)
    exc.__cause__ = _RemoteTraceback(text)
    return exc


def _worker_main(clone_id, addr, token, reg):
    """A clone's whole life: serve calls until told to stop, then exit. Never returns."""
    status = 0
    try:
        host = socket.gethostname()
        hello = pickle.dumps((token, host, os.getpid()))
        sock = socket.create_connection(addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(sock, _HELLO, clone_id, hello)
        while True:
            kind, call_id, payload = _recv(sock)
            if kind == _STOP:
                break
            try:
                fn, args, kwargs = _Unpickler(io.BytesIO(payload), reg).load()
                del payload
                result = fn(*args, **kwargs)
                del fn, args, kwargs
                out = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
                del result
                _send(sock, _OK, call_id, out)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to its future
                _send(sock, _ERR, call_id, _dump_exception(e, clone_id, host))
    except EOFError:
        pass  # the parent went away: nothing left to do
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        status = 1
    finally:
        _native.exit(status)


class _WorkItem:
    __slots__ = ("future", "payload")

    def __init__(self, future, payload):
        self.future = future
        self.payload = payload


class _Worker:
    def __init__(self, clone_id, host, sock):
        self.clone_id = clone_id
        self.host = host
        self.sock = sock
        self.lost = None  # why the watcher gave up on it
        self.done = False
        self.thread = None


def _describe_state(state):
    kind, value = state
    if kind == "lost":
        return f"lost ({value})"
    if kind == "exited":
        return f"exited with status {value}"
    if kind == "killed":
        return f"killed by signal {value}"
    return kind


class Executor(_cf.Executor):
    """A ``concurrent.futures.Executor`` whose workers are remote-fork clones of this interpreter.

    ``Executor(max_workers=None, hierarchical=True)``: ``max_workers`` clones (the head may grant
    fewer: ``ex.max_workers`` says how many), or one per free core of the cluster when None.
    ``hierarchical=True`` fills each host's cores and restores the interpreter once per host.

    Workers see the interpreter as it was when the pool was made, and objects of that moment are
    sent as references, not pickled; newer objects go by cloudpickle. See the module's docstring
    (``help(starling._executor)``) for the details, and for ``WorkerLost``: a lost worker's running
    call fails (it is not rerun); queued calls go to the other workers.
    """

    def __init__(self, max_workers=None, hierarchical=True):
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_workers is not None and max_workers > MAX_WORKERS:
            raise ValueError(f"max_workers must be at most {MAX_WORKERS} (the largest ticket the head grants)")
        n = max_workers if max_workers is not None else MAX_WORKERS
        self._lock = threading.Lock()
        self._ticket_lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._shutdown = False
        self._closing = False
        self._broken = None
        self._workers = {}
        self._gone = set()  # clone ids that ended or were lost
        self._finalizer = None
        self._stop_watch = threading.Event()
        self._counters = {"calls": 0, "bytes_sent": 0, "bytes_received": 0}
        # Futures by outcome, for the dashboard (a lock of their own: done-callbacks run where a
        # future ends, e.g. under self._lock when shutdown cancels queued calls).
        self._progress_lock = threading.Lock()
        self._progress = {"submitted": 0, "done": 0, "failed": 0, "cancelled": 0}
        self._progress_sent = None
        self._join_status = None

        ticket = _native.request_ticket(n, hierarchical)
        parent = _native.parent_host() or "127.0.0.1"
        family = socket.AF_INET6 if ":" in parent else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            listener.listen(max(64, ticket.allocation))
            addr = (parent, listener.getsockname()[1])
            token = os.urandom(16)
            # Everything the workers may be sent a reference to, taken last before the clone.
            reg = _snapshot(sys._getframe())
            clone_id = _native.clone(ticket)
        except BaseException:
            listener.close()
            raise
        if clone_id > 0:
            del listener
            _worker_main(clone_id, addr, token, reg)  # never returns
        self._ticket = ticket
        self._registry = reg
        self._listener = listener
        self._token = token
        self.max_workers = ticket.allocation
        self.placement = list(ticket.placement)
        self._accepter = threading.Thread(target=self._accept_loop, name="starling-executor-accept", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="starling-executor-watch", daemon=True)
        self._accepter.start()
        self._watcher.start()
        _register_atexit(self)

    # -- submitting ---------------------------------------------------------------------------

    def _dumps(self, obj):
        f = io.BytesIO()
        _Pickler(f, self._registry).dump(obj)
        return f.getvalue()

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            self._check_open()
        future = _cf.Future()
        with self._progress_lock:
            self._progress["submitted"] += 1
        future.add_done_callback(self._count_outcome)
        try:
            payload = self._dumps((fn, args, kwargs))
        except Exception as e:  # an unpicklable argument fails its future, as in ProcessPoolExecutor
            future.set_exception(e)
            return future
        with self._lock:
            self._check_open()
            self._queue.put(_WorkItem(future, payload))
        return future

    submit.__doc__ = _cf.Executor.submit.__doc__

    def _count_outcome(self, future):
        outcome = "cancelled" if future.cancelled() else "failed" if future.exception() is not None else "done"
        with self._progress_lock:
            self._progress[outcome] += 1

    def _report_progress(self, closed=False):
        """Send the head the futures' counts if they changed since the last report (its dashboard
        shows them). A failure only costs the dashboard its view: it is not the caller's."""
        with self._lock:
            workers = len(self._workers)
        with self._progress_lock:
            now = dict(self._progress, workers=workers, closed=closed)
        if now == self._progress_sent:
            return
        try:
            with self._ticket_lock:
                _native.executor_progress(self._ticket, **now)
        except _native.Error:
            return
        self._progress_sent = now

    def _check_open(self):
        if self._broken:
            raise BrokenExecutor(self._broken)
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def map(self, fn, *iterables, timeout=None, chunksize=1):
        """Like ``ProcessPoolExecutor.map``: ``chunksize`` items go to a worker in one call."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        results = super().map(_ChunkCall(fn), _chunks(iterables, chunksize), timeout=timeout)
        return _chain(results)

    # -- shutting down ------------------------------------------------------------------------

    @property
    def dashboard_url(self):
        """The address of the cluster head's live dashboard (this pool shows there as a ticket), as
        ``starling dashboard`` prints it; None if the head serves none or the command is not found
        (the wheel's bundled binary, else ``starling`` on PATH)."""
        import shutil
        import subprocess

        from . import _cli

        exe = _cli.binary() if os.access(_cli.binary(), os.X_OK) else shutil.which("starling")
        if exe is None:
            return None
        try:
            r = subprocess.run([exe, "dashboard"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return (r.stdout.strip() or None) if r.returncode == 0 else None

    def shutdown(self, wait=True, *, cancel_futures=False):
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                self._drain(lambda item: item.future.cancel())
            if self._finalizer is None:
                self._queue.put(_STOP_ITEM)
                self._finalizer = threading.Thread(target=self._finalize, name="starling-executor-finalize",
                                                   daemon=True)
                self._finalizer.start()
        # From a future's done-callback (one of this pool's threads) waiting would wait for itself.
        if wait and threading.current_thread() not in {w.thread for w in list(self._workers.values())}:
            self._finalizer.join()

    shutdown.__doc__ = _cf.Executor.shutdown.__doc__

    def _drain(self, each):
        """Take every queued item out (the stop marker goes back at the end)."""
        stop = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP_ITEM:
                stop = True
            else:
                each(item)
        if stop:
            self._queue.put(_STOP_ITEM)

    def _finalize(self):
        self._accepter.join()
        for w in list(self._workers.values()):
            w.thread.join()
        self._stop_watch.set()
        self._watcher.join()
        self._report_progress(closed=True)
        with self._ticket_lock:
            everyone = len(self._workers) + len(self._gone - set(self._workers)) >= self.max_workers
            if everyone and not any(w.lost for w in self._workers.values()):
                self._join_status = _native.join(self._ticket)
            else:
                self._join_status = _native.kill(self._ticket)
        self._listener.close()
        # The workers are gone: nothing will be looked up in the registry any more.
        self._registry = _Registry()

    # -- workers ------------------------------------------------------------------------------

    def _accept_loop(self):
        self._listener.settimeout(0.2)
        while True:
            with self._lock:
                if len(self._workers) + len(self._gone - set(self._workers)) >= self.max_workers:
                    return
                if self._shutdown and self._broken is None and self._idle_at_shutdown():
                    # Nothing left for clones still starting: the finalizer kills them.
                    return
                if self._broken is not None:
                    return
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            # The handshake runs on the worker's own thread: a clone still faulting its pages in
            # between connect and hello must not hold up the others.
            threading.Thread(target=self._handshake, args=(conn,), name="starling-executor-hello",
                             daemon=True).start()

    def _handshake(self, conn):
        try:
            conn.settimeout(120)
            kind, clone_id, payload = _recv(conn)
            token, host, _pid = pickle.loads(payload)
            if kind != _HELLO or token != self._token or not 1 <= clone_id <= self.max_workers:
                raise ValueError("not one of this pool's workers")
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(conn)
        except Exception:
            conn.close()
            return
        w = _Worker(clone_id, host, conn)
        w.thread = threading.current_thread()
        with self._lock:
            self._workers[clone_id] = w
        self._serve(w)

    def _idle_at_shutdown(self):
        """At shutdown: every connected worker is done and no call is queued (only the stop marker).
        Workers end on the stop marker, which follows every call queued before it; one that ended
        lost may have left calls behind, for clones still to come."""
        return all(w.done for w in self._workers.values()) and self._queue.qsize() <= 1

    def _serve(self, w):
        try:
            while True:
                if w.lost:
                    return
                try:
                    item = self._queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                if item is _STOP_ITEM:
                    self._queue.put(_STOP_ITEM)
                    try:
                        _send(w.sock, _STOP, 0)
                    except OSError:
                        pass
                    return
                if w.lost:
                    self._queue.put(item)  # another worker will take it
                    return
                if not item.future.set_running_or_notify_cancel():
                    continue
                try:
                    _send(w.sock, _CALL, 0, item.payload)
                    kind, _, data = _recv(w.sock)
                except (OSError, EOFError) as e:
                    why = w.lost or self._why_lost(w.clone_id, f"its connection dropped ({e})")
                    item.future.set_exception(WorkerLost(
                        f"starling worker {w.clone_id} on host {w.host} was lost while running this call: {why}; "
                        "the call was not rerun", w.clone_id, w.host))
                    w.lost = why
                    return
                with self._lock:
                    self._counters["calls"] += 1
                    self._counters["bytes_sent"] += len(item.payload)
                    self._counters["bytes_received"] += len(data)
                try:
                    if kind == _OK:
                        item.future.set_result(pickle.loads(data))
                    else:
                        item.future.set_exception(_load_exception(data))
                except Exception as e:  # the result could not be unpickled here
                    item.future.set_exception(e)
                del item, data
        finally:
            w.done = True
            try:
                w.sock.close()
            except OSError:
                pass
            if w.lost:
                with self._lock:
                    self._gone.add(w.clone_id)
            self._check_broken()

    def _why_lost(self, clone_id, fallback):
        """The head's word on a clone whose connection dropped (it may come a moment later)."""
        for _ in range(20):
            with self._ticket_lock:
                state = _native.clone_state(self._ticket, clone_id)
            if state[0] not in ("running", "unknown"):
                return f"{fallback}; the cluster reports it {_describe_state(state)}"
            if self._stop_watch.wait(0.1):
                break
        return fallback

    def _watch_loop(self):
        """Notice clones the head reports ended or lost (a lost host does not always drop the TCP connection)."""
        while not self._stop_watch.wait(0.25):
            self._report_progress()
            for clone_id in range(1, self.max_workers + 1):
                if clone_id in self._gone:
                    continue
                with self._ticket_lock:
                    state = _native.clone_state(self._ticket, clone_id)
                if state[0] in ("running", "unknown"):
                    continue
                with self._lock:
                    self._gone.add(clone_id)
                    w = self._workers.get(clone_id)
                if w is not None and not w.done:
                    w.lost = f"the cluster reports it {_describe_state(state)}"
                    try:
                        w.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self._check_broken()

    def _check_broken(self):
        with self._lock:
            if self._broken is not None:
                return
            alive = [w for w in self._workers.values() if not w.done]
            pending = self.max_workers - len(self._gone | set(self._workers))
            if alive or pending > 0:
                return
            if self._shutdown and all(not w.lost for w in self._workers.values()):
                return  # a normal end
            self._broken = "every starling worker of this pool was lost"
            failed = []
            self._drain(failed.append)
        for item in failed:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(BrokenExecutor(self._broken))

    # -- introspection ------------------------------------------------------------------------

    def stats(self):
        """Counters: calls completed, call bytes sent and result bytes received (pickles), the
        workers connected, and the page server's counters for the pool's memory (``bytes_wire``:
        what the hosts fetched from this machine, with headers; ``pages_served``...)."""
        with self._lock:
            out = dict(self._counters)
            out["workers"] = len(self._workers)
            out["hosts"] = sorted({w.host for w in self._workers.values()})
        with self._ticket_lock:
            out.update(_native.ticket_stats(self._ticket) or {})
        return out

    def worker_hosts(self):
        """{clone id: host} of the workers connected so far."""
        with self._lock:
            return {w.clone_id: w.host for w in self._workers.values()}

    def clone_stats(self, clone_id):
        """The page-fault counters of worker `clone_id` once it ended (after shutdown), or None."""
        with self._ticket_lock:
            return _native.clone_stats(self._ticket, clone_id)

    def __repr__(self):
        return f"<starling.Executor max_workers={self.max_workers} workers={len(self._workers)}>"


def _keepalive(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


_live = weakref.WeakSet()
_atexit_registered = False


def _register_atexit(ex):
    """At interpreter exit, wait for pools not shut down (as the standard library's executors do)."""
    global _atexit_registered
    _live.add(ex)
    if not _atexit_registered:
        _atexit_registered = True
        reg = getattr(threading, "_register_atexit", None)
        if reg is not None:
            reg(_python_exit)


def _python_exit():
    if _native.current_clone_id() != 0:
        return
    for ex in list(_live):
        try:
            ex.shutdown(wait=True)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class _ChunkCall:
    """fn applied to a chunk of argument tuples (one call per chunk)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, chunk):
        fn = self.fn
        return [fn(*args) for args in chunk]

    def __reduce__(self):
        return (_ChunkCall, (self.fn,))


def _chunks(iterables, chunksize):
    it = zip(*iterables)
    while True:
        chunk = tuple(itertools.islice(it, chunksize))
        if not chunk:
            return
        yield chunk


def _chain(results):
    for chunk in results:
        yield from chunk


def map(fn, *iterables, max_workers=None, chunksize=None, hierarchical=True):
    """``list(Executor().map(fn, *iterables))`` in one line: a pool for this call only.

    ``chunksize`` None: about four chunks per worker."""
    items = list(zip(*iterables))
    with Executor(max_workers=max_workers, hierarchical=hierarchical) as ex:
        if chunksize is None:
            chunksize = max(1, -(-len(items) // (4 * ex.max_workers)))
        return list(ex.map(fn, *zip(*items), chunksize=chunksize)) if items else []
