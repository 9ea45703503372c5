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

This module does not import torch at module level: workers set their thread environment
(``OMP_NUM_THREADS=1`` ...) before torch is loaded.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

__all__ = [
    "WorkerPool",
    "RemoteError",
    "PoolStartError",
    "get_pool",
    "run_on_ranks",
    "close_all_pools",
]

_MASTER_ADDR = "127.0.0.1"
_START_ATTEMPTS = 3
_DEFAULT_TIMEOUT_ENV = "HP_TEST_TIMEOUT_S"
_STACK_TAIL_CHARS = 6000


_DEAD = object()  # _next_messages: the worker process exited with nothing left to read


class RemoteError(RuntimeError):
    """A job raised in a worker and its exception type could not be rebuilt in the caller."""


class PoolStartError(RuntimeError):
    """The worker processes could not be started or could not initialise torch.distributed."""


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MASTER_ADDR": _MASTER_ADDR,
}


def _fn_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}" if mod else str(name)


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _parent_watchdog(ppid: int) -> None:
    # Exit if the process that started us goes away (pytest killed, os._exit ...), even when the
    # main thread is blocked inside a collective and never reads the pipe again.
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(3)


def _encode_error(exc: BaseException) -> dict:
    info = {
        "type_name": type(exc).__qualname__,
        "type_module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "type": None,
        "exc": None,
    }
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.OutcomeException):
        # pytest.skip / fail / xfail inside a job; these classes claim to live in "builtins" and
        # cannot be pickled by reference.
        info["pytest_outcome"] = (type(exc).__name__, exc.msg)
    try:
        info["type"] = pickle.dumps(type(exc))
    except Exception:
        pass
    try:
        info["exc"] = pickle.dumps(exc)
    except Exception:
        pass
    return info


def _sync_sys_path(sys_path: list[str] | None) -> None:
    if sys_path is not None and sys.path != sys_path:
        sys.path[:] = sys_path


def _worker_main(rank: int, world_size: int, backend: str, store_port: int, conn,
                 timeout_s: float, start_timeout_s: float, stack_path: str,
                 destroy_new_groups: bool, ppid: int) -> None:
    os.environ.update(_WORKER_ENV)
    os.environ.update({
        "MASTER_PORT": str(store_port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    threading.Thread(target=_parent_watchdog, args=(ppid,), daemon=True).start()
    stack_file = open(stack_path, "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(_MASTER_ADDR, store_port, world_size + 1, False,
                              timeout=timedelta(seconds=start_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        from torch.distributed import distributed_c10d as c10d
    except BaseException:
        _send(conn, ("init_error", rank, traceback.format_exc()))
        return
    _send(conn, ("ready", rank, os.getpid()))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "stop":
            break
        if kind == "sync":
            _, job_id, sync_timeout = msg
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=sync_timeout),
                                       wait_all_ranks=True)
                _send(conn, ("result", job_id, rank, True, None, True))
            except BaseException as e:  # noqa: BLE001
                _send(conn, ("result", job_id, rank, False, _encode_error(e), True))
            continue
        # kind == "job"
        _, job_id, payload, sys_path = msg
        groups_before = set(c10d._world.pg_map) if destroy_new_groups else None
        ok = True
        try:
            _sync_sys_path(sys_path)
            try:
                fn, args, kwargs = pickle.loads(payload)
            except BaseException as e:  # noqa: BLE001
                raise RuntimeError(
                    f"rank {rank} could not unpickle the job ({type(e).__name__}: {e}); the "
                    "function must be defined at module level in a module the worker can import"
                ) from e
            result = fn(*args, **kwargs)
            try:
                out = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # noqa: BLE001
                raise TypeError(
                    f"the result of {_fn_name(fn)} on rank {rank} is not picklable "
                    f"({type(e).__name__}: {e}); return plain tensors / containers / numbers"
                ) from e
        except BaseException as e:  # noqa: BLE001
            ok = False
            out = _encode_error(e)
            del e
        healthy = dist.is_initialized()
        if healthy and destroy_new_groups:
            for pg in list(c10d._world.pg_map):
                if pg not in groups_before and pg is not c10d.GroupMember.WORLD:
                    try:
                        dist.destroy_process_group(pg)
                    except Exception:
                        pass
            # DTensor's caches may still name the destroyed groups (they key on mesh shape only).
            from hyper_parallel.compat import clear_sharding_caches

            clear_sharding_caches()
        _send(conn, ("result", job_id, rank, ok, out, healthy))
        if not healthy:  # the job destroyed the default group: this worker is unusable
            break

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


# --------------------------------------------------------------------------------------------
# Caller side
# --------------------------------------------------------------------------------------------

def _main_is_useful(data: dict) -> bool:
    """Whether a spawned worker should re-import the caller's ``__main__`` (multiprocessing does
    so that functions defined in a script can be unpickled).  Not for pytest (test functions live
    in test modules; skipping saves importing pytest in every worker) nor for a main that is not
    a file (``python - <<EOF``), which spawn cannot re-import at all."""
    name = data.get("init_main_from_name")
    if name is not None:
        return not name.split(".")[0] in ("pytest", "_pytest")
    path = data.get("init_main_from_path")
    if path is None:
        return False
    if not os.path.isfile(path):
        return False
    base = os.path.basename(path)
    return not (base in ("pytest", "py.test") or base.startswith("pytest-")
                or os.sep + "_pytest" + os.sep in path or os.sep + "pytest" + os.sep in path)


class _SpawnMainFilter:
    """Temporarily filters multiprocessing's spawn preparation data (see _main_is_useful)."""

    _lock = threading.Lock()

    def __enter__(self):
        import multiprocessing.spawn as mp_spawn

        self._lock.acquire()
        self._mod = mp_spawn
        self._orig = orig = mp_spawn.get_preparation_data

        def get_preparation_data(name):
            data = orig(name)
            if not _main_is_useful(data):
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        mp_spawn.get_preparation_data = get_preparation_data
        return self

    def __exit__(self, *exc):
        self._mod.get_preparation_data = self._orig
        self._lock.release()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_MASTER_ADDR, 0))
        return s.getsockname()[1]


def _create_store(world_size: int, timeout_s: float):
    """TCPStore server hosted by the caller.  Port 0 lets the OS pick a free port atomically;
    if that is refused, fall back to probing free ports with retries."""
    import torch.distributed as dist

    errors = []
    ports = [0] + [None] * 5
    for port in ports:
        if port is None:
            port = _free_port()
        try:
            store = dist.TCPStore(_MASTER_ADDR, port, world_size + 1, True,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
            return store, store.port
        except Exception as e:  # noqa: BLE001  (port taken between probe and bind)
            errors.append(f"port {port}: {type(e).__name__}: {e}")
    raise PoolStartError("could not create a TCPStore on 127.0.0.1: " + "; ".join(errors))


def _rebuild_exception(info: dict, message: str) -> BaseException:
    exc_type = None
    if info.get("type") is not None:
        try:
            exc_type = pickle.loads(info["type"])
        except Exception:
            exc_type = None
    original = None
    if info.get("exc") is not None:
        try:
            original = pickle.loads(info["exc"])
        except Exception:
            original = None
    # pytest outcomes (pytest.skip / pytest.fail / pytest.xfail called inside a job) keep their
    # meaning in the caller.
    if info.get("pytest_outcome"):
        name, msg = info["pytest_outcome"]
        try:
            from _pytest import outcomes

            cls = getattr(outcomes, name)
            return cls(message if name == "Failed" else msg)
        except Exception:
            pass
    new: BaseException | None = None
    if isinstance(exc_type, type) and issubclass(exc_type, BaseException) \
            and exc_type not in (KeyboardInterrupt, SystemExit, GeneratorExit):
        try:
            cand = exc_type(message)
            if str(cand) == message:
                new = cand
        except Exception:
            new = None
        if new is None:  # e.g. KeyError quotes its message, or a custom __init__ signature
            try:
                sub = type(exc_type.__name__, (exc_type,), {
                    "__str__": lambda self: self.args[0] if self.args else "",
                    "__module__": exc_type.__module__,
                    "__qualname__": exc_type.__qualname__,
                    "__init__": lambda self, *a: None,
                })
                cand = sub.__new__(sub, message)
                cand.args = (message,)
                if str(cand) == message:
                    new = cand
            except Exception:
                new = None
    if new is None:
        new = RemoteError(message)
    new.remote_traceback = info.get("traceback", "")
    new.remote_exception = original
    return new


_STACK_NOISE = (
    os.sep + "multiprocessing" + os.sep + "process.py",
    os.sep + "multiprocessing" + os.sep + "spawn.py",
    'File "<string>", line 1',
)


def _clean_stacks(text: str) -> str:
    """Drop the pool's own watchdog thread and the multiprocessing bootstrap frames from a
    faulthandler dump."""
    blocks = [b for b in text.split("\n\n") if "_parent_watchdog" not in b]
    lines = [ln for ln in "\n\n".join(blocks).splitlines()
             if not any(n in ln for n in _STACK_NOISE)]
    return "\n".join(lines)


_COMM_ERROR_HINTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Socket Timeout",
)


def _primary_failure(errors: dict) -> int:
    """The rank whose failure is most likely the root cause.  ``errors`` is in arrival order.
    A crashed worker comes first, then a Python exception that is not a communication error
    (peers of a failed rank typically see "connection closed"), earliest first; among ranks that
    failed the same way, the lowest rank."""
    def category(info):
        if info.get("dead"):
            return 0
        msg = info.get("message", "")
        return 2 if any(h in msg for h in _COMM_ERROR_HINTS) else 1

    order = {r: i for i, r in enumerate(errors)}
    first = min(errors, key=lambda r: (category(errors[r]), order[r]))
    info = errors[first]
    same = [r for r, o in errors.items()
            if category(o) == category(info) and o.get("type_name") == info.get("type_name")]
    return min(same)


class _Worker:
    __slots__ = ("rank", "proc", "conn", "pid", "stack_path")

    def __init__(self, rank, proc, conn, stack_path):
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.pid = None
        self.stack_path = stack_path


_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class WorkerPool:
    """``world_size`` persistent worker processes sharing one torch.distributed process group.

    Args:
        world_size: number of ranks.
        backend: torch.distributed backend ("gloo" on CPU).
        timeout_s: wall-clock limit of one :meth:`run`; exceeding it kills the workers and raises
            :class:`TimeoutError`.  Also the process-group timeout inside the workers.
        error_grace_s: after one rank raised, how long the other ranks may still take before the
            pool is considered stuck and restarted.
        destroy_new_groups: destroy process groups created by a job when it ends.
        start_timeout_s: limit for starting the workers (import torch + rendezvous).
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 300.0, *,
                 error_grace_s: float = 3.0, destroy_new_groups: bool = True,
                 start_timeout_s: float | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.error_grace_s = float(error_grace_s)
        self.destroy_new_groups = destroy_new_groups
        self.start_timeout_s = float(start_timeout_s if start_timeout_s is not None
                                     else max(120.0, 30.0 * world_size))
        self.restarts = 0          # how many times the workers were (re)started after the first
        self.last_start_s = 0.0    # duration of the last start
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._workers: list[_Worker] = []
        self._store = None
        self._tmpdir: str | None = None
        self._job_id = 0
        self._closed = False
        self._starts = 0
        _LIVE_POOLS.add(self)
        self._start()

    # ---------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (rank order); empty if not running."""
        return [w.pid for w in self._workers]

    def _running(self) -> bool:
        return bool(self._workers) and all(w.proc.is_alive() for w in self._workers)

    def _start(self) -> None:
        errors = []
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except PoolStartError as e:
                errors.append(f"attempt {attempt}: {e}")
                self._teardown(graceful=False)
        raise PoolStartError(
            f"could not start a {self.backend} WorkerPool of world_size {self.world_size} after "
            f"{_START_ATTEMPTS} attempts:\n" + "\n".join(errors))

    def _start_once(self) -> None:
        t0 = time.monotonic()
        self._store, port = _create_store(self.world_size, self.start_timeout_s)
        self._tmpdir = tempfile.mkdtemp(prefix=f"hp_pool{self.world_size}_")
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)  # inherited by the spawned interpreters before torch loads
        try:
            with _SpawnMainFilter():
                self._spawn_workers(port)
        except Exception as e:  # noqa: BLE001
            raise PoolStartError(f"spawning workers failed: {type(e).__name__}: {e}") from e
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._await_ready(t0)

    def _spawn_workers(self, port: int) -> None:
        for rank in range(self.world_size):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            stack_path = os.path.join(self._tmpdir, f"rank{rank}.stacks")
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, port, child_conn, self.timeout_s,
                      self.start_timeout_s, stack_path, self.destroy_new_groups, os.getpid()),
                name=f"hp-worker-{self.world_size}-r{rank}",
                daemon=False,
            )
            proc.start()
            child_conn.close()
            self._workers.append(_Worker(rank, proc, parent_conn, stack_path))

    def _next_messages(self, ranks: set, timeout: float):
        """Yield (rank, message) for the ranks in ``ranks`` that have something to report within
        ``timeout``: the unpickled message, None if the pipe closed, or _DEAD if the process died
        with nothing left to read."""
        objs = {}
        for r in ranks:
            w = self._workers[r]
            objs[w.conn] = (r, "conn")
            objs[w.proc.sentinel] = (r, "dead")
        for obj in multiprocessing.connection.wait(list(objs), timeout=timeout):
            r, what = objs[obj]
            if r not in ranks:  # already handled through its other handle
                continue
            w = self._workers[r]
            if what == "dead" and not w.conn.poll():
                yield r, _DEAD
                continue
            try:
                yield r, pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                yield r, None

    def _await_ready(self, t0: float) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = {w.rank for w in self._workers}
        failures = []
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolStartError(
                    f"ranks {sorted(waiting)} did not initialise within {self.start_timeout_s:.0f}s"
                    + self._stack_report(sorted(waiting)))
            for r, msg in self._next_messages(waiting, remaining):
                w = self._workers[r]
                if msg is not _DEAD:
                    if msg is None:
                        msg = ("init_error", r, "worker closed its pipe during start-up")
                    if msg[0] == "ready":
                        w.pid = msg[2]
                    else:
                        failures.append(f"rank {r}:\n{msg[2]}")
                    waiting.discard(r)
                else:
                    w.proc.join(0.1)
                    failures.append(f"rank {r}: process exited with code {w.proc.exitcode} "
                                    "during start-up" + self._stack_report([r], signal_=False))
                    waiting.discard(r)
            if failures:
                raise PoolStartError("worker start-up failed:\n" + "\n".join(failures))
        self.last_start_s = time.monotonic() - t0
        if self._starts:
            self.restarts += 1
        self._starts += 1

    def _teardown(self, graceful: bool) -> None:
        workers, self._workers = self._workers, []
        if graceful:
            for w in workers:
                try:
                    if w.proc.is_alive():
                        _send(w.conn, ("stop",))
                except Exception:
                    pass
            deadline = time.monotonic() + 10.0
            for w in workers:
                w.proc.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.proc.is_alive():
                w.proc.terminate()
        for w in workers:
            w.proc.join(2.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2.0)
            try:
                w.conn.close()
            except Exception:
                pass
            try:
                w.proc.close()
            except Exception:
                pass
        self._store = None  # shuts the TCPStore server down
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def close(self) -> None:
        """Stop the workers.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._teardown(graceful=True)
            _LIVE_POOLS.discard(self)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._running() else "stopped")
        return f"WorkerPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ---------------------------------------------------------------- diagnostics
    def _stack_report(self, ranks, signal_: bool = True) -> str:
        """Python stacks of ``ranks``; with ``signal_`` the workers are asked to dump them now."""
        workers = [self._workers[r] for r in ranks if r < len(self._workers)]
        offsets = {}
        for w in workers:
            try:
                offsets[w.rank] = os.path.getsize(w.stack_path)
            except OSError:
                offsets[w.rank] = 0
            if signal_ and w.proc.is_alive():
                try:
                    os.kill(w.proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        if signal_:
            time.sleep(0.5)
        parts = []
        for w in workers:
            try:
                with open(w.stack_path, errors="replace") as f:
                    f.seek(offsets[w.rank] if signal_ else 0)
                    text = f.read()
            except OSError:
                text = ""
            text = _clean_stacks(text)
            if text.strip():
                if len(text) > _STACK_TAIL_CHARS:
                    text = "...\n" + text[-_STACK_TAIL_CHARS:]
                parts.append(f"\n--- Python stacks of rank {w.rank} ---\n{text.rstrip()}")
        return "".join(parts)

    # ---------------------------------------------------------------- jobs
    def run(self, fn: Callable, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        return self.run_with_timeout(self.timeout_s, fn, *args, **kwargs)

    def run_with_timeout(self, timeout_s: float, fn: Callable, *args, **kwargs) -> list:
        """:meth:`run` with a job time limit other than the pool's ``timeout_s``."""
        name = _fn_name(fn)
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"cannot send {name} to the workers: {type(e).__name__}: {e}. The function must "
                "be defined at module level and its arguments must be picklable") from e
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if not self._running():
                self._teardown(graceful=False)
                self._start()
            self._job_id += 1
            job_id = self._job_id
            try:
                replies, pending = self._dispatch(("job", job_id, payload, list(sys.path)),
                                                  job_id, timeout_s, stop_on_error=True)
            except BaseException:
                # Interrupted (KeyboardInterrupt, pytest-timeout ...) with a job in flight.
                self._teardown(graceful=False)
                raise
            return self._finish(name, timeout_s, replies, pending)

    def _dispatch(self, msg, job_id: int, timeout_s: float, stop_on_error: bool):
        """Send ``msg`` to every rank and collect ``{rank: (ok, payload, healthy)}``.
        Returns (replies, still-pending ranks).  Dead workers reply ``(False, info, False)``."""
        replies: dict[int, tuple] = {}
        for w in self._workers:
            try:
                _send(w.conn, msg)
            except (BrokenPipeError, OSError) as e:
                replies[w.rank] = (False, {"dead": True, "message":
                                           f"could not send the job: {type(e).__name__}: {e}"},
                                   False)
        pending = {w.rank for w in self._workers} - set(replies)
        deadline = time.monotonic() + timeout_s
        error_deadline = None
        if any(not ok for ok, _, _ in replies.values()):
            error_deadline = time.monotonic() + self.error_grace_s
        while pending:
            now = time.monotonic()
            limit = deadline if error_deadline is None else min(deadline, error_deadline)
            if limit - now <= 0:
                break
            for r, reply in self._next_messages(pending, limit - now):
                w = self._workers[r]
                if reply is not _DEAD:
                    if reply is None:
                        w.proc.join(1.0)
                        replies[r] = (False, {"dead": True, "message":
                                              f"process exited with code {w.proc.exitcode}"},
                                      False)
                    elif reply[1] != job_id:  # stale message from an earlier job
                        continue
                    else:
                        _, _, _, ok, out, healthy = reply
                        replies[r] = (ok, out, healthy)
                else:
                    w.proc.join(1.0)
                    replies[r] = (False, {"dead": True, "message":
                                          f"process exited with code {w.proc.exitcode}"}, False)
                pending.discard(r)
                if not replies[r][0] and error_deadline is None and stop_on_error:
                    error_deadline = time.monotonic() + self.error_grace_s
        return replies, pending

    def _finish(self, name: str, timeout_s: float, replies: dict, pending: set) -> list:
        errors = {r: out for r, (ok, out, _) in replies.items() if not ok}
        if pending and not errors:
            stacks = self._stack_report(sorted(pending))
            self._teardown(graceful=False)
            raise TimeoutError(
                f"{name} did not finish within {timeout_s:g}s on ranks {sorted(pending)} of a "
                f"world of {self.world_size}; the workers were killed and the pool will restart "
                f"on the next run()" + stacks)

        if not errors:
            if not all(h for _, _, h in replies.values()):
                self._teardown(graceful=False)
            return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

        # Some rank raised or died.
        notes = []
        restart = bool(pending) or any(not h for _, _, h in replies.values())
        if pending:
            notes.append(f"ranks {sorted(pending)} were still running {self.error_grace_s:g}s "
                         "after the failure (probably blocked in a collective)")
            stacks = self._stack_report(sorted(pending))
            if stacks:
                notes[-1] += ":" + stacks
        dead_stacks = {r: self._stack_report([r], signal_=False)
                       for r, o in errors.items() if o.get("dead")}
        if not restart and not self._collectives_aligned():
            restart = True
            notes.append("a barrier after the failure did not complete, so collectives were "
                         "out of step")
        if restart:
            self._teardown(graceful=False)
            notes.append("the workers were stopped; the pool restarts transparently on the "
                         "next run()")

        first = _primary_failure(errors)
        info = errors[first]
        if info.get("dead"):
            message = (f"{name} failed on rank {first} (world_size {self.world_size}): worker "
                       f"{info['message']}{dead_stacks.get(first, '')}")
        else:
            message = (f"{name} raised on rank {first} (world_size {self.world_size}): "
                       f"{info['type_name']}: {info['message']}\n\n"
                       f"--- remote traceback (rank {first}) ---\n{info['traceback'].rstrip()}")
        for r in sorted(set(errors) - {first}):
            o = errors[r]
            if o.get("dead"):
                message += f"\n--- rank {r}: worker {o['message']}"
            else:
                message += f"\n--- rank {r} also raised {o['type_name']}: {o['message']}"
        if notes:
            message += "\n--- " + "\n--- ".join(notes)
        if info.get("dead"):
            exc: BaseException = RemoteError(message)
        else:
            exc = _rebuild_exception(info, message)
        try:
            exc.remote_rank = first
            exc.failed_ranks = sorted(errors)
        except Exception:
            pass
        raise exc

    def _collectives_aligned(self) -> bool:
        """After a job where some ranks raised but all returned: check with a monitored barrier
        that no rank is a collective ahead of another.  False means the pool must restart."""
        self._job_id += 1
        job_id = self._job_id
        sync_timeout = 5.0
        try:
            replies, pending = self._dispatch(("sync", job_id, sync_timeout), job_id,
                                              sync_timeout + 10.0, stop_on_error=False)
        except BaseException:
            self._teardown(graceful=False)
            raise
        return not pending and all(ok for ok, _, _ in replies.values())


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


# Registered after multiprocessing's own exit handler (imported above), so it runs first: the
# workers are stopped before multiprocessing joins its non-daemonic children.
atexit.register(close_all_pools)
