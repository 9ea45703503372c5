"""The worker process of a :class:`~.worker_pool.WorkerPool`, and the messages it exchanges.

``_worker_main`` (the spawn target) initialises ``torch.distributed`` from the caller's TCPStore,
then loops: it unpickles a job ``(fn, args, kwargs)``, runs it, sends back the pickled result or
the encoded error, and destroys the process groups the job created. A job that returns with a
functional collective issued and never waited fails, and the workers restart (torch keeps such a
work registered; it would run beside the next job's collectives on the same gloo group). A
watchdog thread exits when the caller goes away; ``SIGUSR1`` dumps the Python stacks to a file the
caller reads on a timeout.
Messages in both directions are pickled tuples (``_send``). Like the whole harness, this module
does not import torch at module level (the worker imports it after setting its environment).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from hyper_parallel.testing.pool_errors import _encode_error

_MASTER_ADDR = "127.0.0.1"

_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MASTER_ADDR": _MASTER_ADDR,
    # Hundreds of compiles per suite: no progress lines on the workers' stderr (progress.py).
    "HYPER_PARALLEL_LOG": "quiet",
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

        from hyper_parallel import compat

        compat.print_native_stacks_on_fatal_signal()  # a native crash shows its thread's C++ stack
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
        unwaited_before = compat.unwaited_collectives()
        left_in_flight = False
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
            left = compat.unwaited_collectives() - unwaited_before
            if left > 0:  # they would run beside the next job's collectives on the same groups
                left_in_flight = True
                raise RuntimeError(
                    f"{_fn_name(fn)} on rank {rank} left {left} collective(s) issued and never waited "
                    "(a functional collective without its wait_tensor, or a DTensor redistribution "
                    "whose result was never used): the next job's collectives would run beside them "
                    "on the same process groups; the workers restart")
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
        healthy = dist.is_initialized() and not left_in_flight  # torch cannot forget such a work
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
