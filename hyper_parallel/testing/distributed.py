"""Persistent multi-process worker pool for distributed tests.

Starting a process that imports torch takes seconds, so distributed tests do not spawn a process
group per test case.  A :class:`WorkerPool` spawns ``world_size`` processes once, each of which
initialises ``torch.distributed`` (gloo on CPU by default) and then loops, running jobs::

    pool = get_pool(4)
    results = pool.run(my_module_level_fn, 3, scale=2.0)   # one result per rank, rank order

Jobs are ``(fn, args, kwargs)`` triples pickled by the standard pickler, so ``fn`` must be a
module-level function importable in the worker (test modules are: the worker mirrors the caller's
``sys.path`` for every job), and arguments and results must be picklable (tensors, dicts of
tensors, floats ... are copied, not shared).

Failure handling:

* If ``fn`` raises on any rank, :meth:`WorkerPool.run` raises in the caller.  The message names the
  function and the lowest failing rank and contains the full remote traceback.  The exception has
  the original type when it can be rebuilt (``ValueError`` stays ``ValueError``), else it is a
  :class:`RemoteError`; ``.remote_rank`` / ``.remote_traceback`` hold the details.
* After an error the pool stays usable.  Ranks that did not raise get ``error_grace_s`` seconds to
  finish; if some are still running (typically blocked in a collective the failed rank never
  joined) the workers are killed and the pool restarts transparently on the next :meth:`run`.  If
  all ranks returned, a short monitored barrier checks that collectives are still aligned, and the
  pool restarts if not.
* A job exceeding ``timeout_s`` kills the workers and raises :class:`TimeoutError` naming the
  function, with the Python stacks of the ranks that had not finished.  A test never hangs.
* Process groups created inside a job (``new_group``, ``init_device_mesh`` ...) are destroyed when
  the job ends (``destroy_new_groups=True``), so every job starts with only the default group and
  no file descriptors / threads accumulate over hundreds of test cases.

The harness (this module and its siblings) does not import torch at module level: workers set
their thread environment (``OMP_NUM_THREADS=1`` ...) before torch is loaded.

The harness, module by module: this one holds the process-wide pools (:func:`get_pool`,
:func:`run_on_ranks`, :func:`close_all_pools`); :mod:`.worker_pool` the :class:`WorkerPool` class;
:mod:`.pool_worker` the worker process; :mod:`.pool_spawn` the start-up (TCPStore, spawn);
:mod:`.pool_errors` how a remote failure is reported (:class:`RemoteError`, :class:`PoolStartError`).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Callable

from hyper_parallel.testing.pool_errors import PoolStartError, RemoteError
from hyper_parallel.testing.worker_pool import _LIVE_POOLS, WorkerPool

__all__ = [
    "WorkerPool",
    "RemoteError",
    "PoolStartError",
    "get_pool",
    "run_on_ranks",
    "close_all_pools",
]

_DEFAULT_TIMEOUT_ENV = "HP_TEST_TIMEOUT_S"


# --------------------------------------------------------------------------------------------
# Process-wide pools
# --------------------------------------------------------------------------------------------

_POOLS: dict[tuple[int, str], WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def _default_timeout() -> float:
    try:
        return float(os.environ.get(_DEFAULT_TIMEOUT_ENV, "300"))
    except ValueError:
        return 300.0


def get_pool(world_size: int, backend: str = "gloo") -> WorkerPool:
    """The process-wide pool for ``world_size`` ranks (created on first use, closed at exit).
    The job timeout defaults to 300 s (env ``HP_TEST_TIMEOUT_S``)."""
    key = (int(world_size), backend)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            pool = WorkerPool(world_size, backend=backend, timeout_s=_default_timeout())
            _POOLS[key] = pool
        return pool


def run_on_ranks(world_size: int, fn: Callable, *args, **kwargs) -> list:
    """``get_pool(world_size).run(fn, *args, **kwargs)``."""
    return get_pool(world_size).run(fn, *args, **kwargs)


def close_all_pools() -> None:
    """Close every pool of this process (cached or not)."""
    with _POOLS_LOCK:
        _POOLS.clear()
    for pool in list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:
            pass


# Registered after multiprocessing's own exit handler (imported by .worker_pool above), so it runs
# first: the workers are stopped before multiprocessing joins its non-daemonic children.
atexit.register(close_all_pools)
