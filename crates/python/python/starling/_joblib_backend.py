"""joblib's "starling" backend: ``with joblib.parallel_backend("starling"): Parallel(n_jobs=-1)(...)``.

Registered on ``import starling`` when joblib is installed. Each ``Parallel`` call gets its own
``starling.Executor``, made when the call starts (``configure``) and shut down when it ends
(``terminate``): its workers see the interpreter as it was then — the data set loaded before
``GridSearchCV.fit`` is read in place, never pickled. ``n_jobs=-1`` (or None with the backend
active) takes every free core of the cluster; ``n_jobs=k`` asks for k workers. Nested
``Parallel`` calls inside a worker run sequentially (a clone cannot clone).
"""

from joblib import parallel as _parallel
from joblib._parallel_backends import AutoBatchingMixin, ParallelBackendBase, SequentialBackend

from ._executor import Executor

NAME = "starling"


class StarlingBackend(AutoBatchingMixin, ParallelBackendBase):
    """A joblib backend on ``starling.Executor`` (one pool per ``Parallel`` call)."""

    supports_retrieve_callback = True
    supports_timeout = True
    default_n_jobs = -1

    def __init__(self, hierarchical=True, **kwargs):
        super().__init__(**kwargs)
        self.hierarchical = hierarchical
        self._executor = None
        self._last_size = None

    def effective_n_jobs(self, n_jobs):
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            n_jobs = -1
        if self._executor is not None:
            return self._executor.max_workers if n_jobs < 0 else min(n_jobs, self._executor.max_workers)
        if n_jobs > 0:
            return n_jobs
        # Before the pool exists the cluster's free cores are unknown here: the size of the last
        # pool, else this machine's count, is joblib's "guesstimate" (configure returns the truth).
        import os

        return self._last_size or os.cpu_count() or 1

    def configure(self, n_jobs=-1, parallel=None, prefer=None, require=None, **kwargs):
        if require == "sharedmem":
            raise ValueError("the starling backend runs calls in other processes: it cannot share memory "
                             "with this one (require='sharedmem')")
        if n_jobs is None:
            n_jobs = -1
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        self.parallel = parallel
        self._executor = Executor(max_workers=None if n_jobs < 0 else n_jobs, hierarchical=self.hierarchical)
        self._last_size = self._executor.max_workers
        return self._executor.max_workers

    def submit(self, func, callback=None):
        future = self._executor.submit(func)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def retrieve_result_callback(self, out):
        return out.result()

    def retrieve_result(self, out, timeout=None):
        return out.result(timeout=timeout)

    def terminate(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready=True):
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if ensure_ready:
            self.configure(n_jobs=self.parallel.n_jobs, parallel=self.parallel)

    def get_nested_backend(self):
        # Runs in a worker: a clone cannot clone, so nested Parallel calls run there, in order.
        return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None


def register():
    _parallel.register_parallel_backend(NAME, StarlingBackend)
