"""starling for Python: borrow a cluster's CPUs from a running interpreter.

Two levels:

* ``starling.Executor`` / ``starling.map`` — a ``concurrent.futures.Executor``
  whose workers are remote-fork clones of this interpreter: they start with
  everything it held when the pool was made (fetched lazily, page by page),
  so data loaded before the pool is never pickled. ``joblib``'s
  ``parallel_backend("starling")`` (scikit-learn's ``n_jobs``) runs on it.

      import starling
      X = load_big_dataset()                  # before the pool: workers read it in place
      with starling.Executor() as ex:         # one worker per free core of the cluster
          print(list(ex.map(score, range(100), chunksize=4)))

* the ticket API (``request_ticket``, ``clone``, ``exit``, ``join``, ``kill``,
  ``clone_status``...), the binding of ``include/starling.h``.
"""

from ._native import (  # noqa: F401  (re-exported)
    Error,
    Ticket,
    clone,
    clone_host,
    clone_state,
    clone_stats,
    clone_status,
    current_clone_id,
    exit,
    join,
    kill,
    parent_host,
    request_ticket,
    ticket_stats,
)
from ._executor import BrokenExecutor, Executor, RemoteError, WorkerLost, by_value, map  # noqa: F401

__all__ = [
    "Error", "Ticket", "clone", "clone_host", "clone_state", "clone_stats", "clone_status",
    "current_clone_id", "exit", "join", "kill", "parent_host", "request_ticket", "ticket_stats",
    "Executor", "map", "by_value", "WorkerLost", "BrokenExecutor", "RemoteError",
]

# joblib's "starling" backend, registered when joblib is installed.
try:
    import joblib as _joblib  # noqa: F401
except ImportError:  # joblib is optional
    pass
else:
    from . import _joblib_backend

    _joblib_backend.register()
