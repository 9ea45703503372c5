"""The caller's side of the harness: :class:`WorkerPool` (overview in :mod:`.distributed`).

A pool starts ``world_size`` worker processes (:mod:`.pool_worker`, spawned through
:mod:`.pool_spawn`), sends each job to every rank, collects the results in rank order, and on an
error, a dead worker or a timeout raises in the caller (:mod:`.pool_errors`) and restarts the
workers when they may be stuck. Like the whole harness, it does not import torch at module level.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Callable

from hyper_parallel.testing.pool_errors import (
    PoolStartError,
    RemoteError,
    _clean_stacks,
    _primary_failure,
    _rebuild_exception,
)
from hyper_parallel.testing.pool_spawn import _SpawnMainFilter, _create_store
from hyper_parallel.testing.pool_worker import _WORKER_ENV, _fn_name, _send, _worker_main

_START_ATTEMPTS = 3
_STACK_TAIL_CHARS = 6000


_DEAD = object()  # _next_messages: the worker process exited with nothing left to read


class _Worker:
    __slots__ = ("rank", "proc", "conn", "pid", "stack_path")

    def __init__(self, rank, proc, conn, stack_path):
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.pid = None
        self.stack_path = stack_path


def _death(w: _Worker) -> dict:
    """The error payload of a worker whose process exited: its exit code, and the signal that killed
    it if one did (multiprocessing reports a signal as a negative exit code)."""
    w.proc.join(1.0)
    code = w.proc.exitcode
    return {"dead": True, "message": f"process exited with code {code}",
            "signal": -code if code is not None and code < 0 else None}


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
                        replies[r] = (False, _death(w), False)
                    elif reply[1] != job_id:  # stale message from an earlier job
                        continue
                    else:
                        _, _, _, ok, out, healthy = reply
                        replies[r] = (ok, out, healthy)
                else:
                    replies[r] = (False, _death(w), False)
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
            if info.get("signal"):  # c10's handler printed C++ stacks before the signal killed it
                message += "\n--- its threads' C++ stacks were printed on the worker's stderr"
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
