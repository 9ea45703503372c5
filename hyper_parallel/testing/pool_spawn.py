"""Starting a pool's workers: the caller's TCPStore, and spawn's preparation data filtered.

Part of :mod:`.distributed`. The caller hosts the TCPStore the workers rendezvous at
(``_create_store``), and spawned workers re-import the caller's ``__main__`` only where that is
useful and possible (``_SpawnMainFilter``). Like the whole harness, this module does not import
torch at module level.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

from hyper_parallel.testing.pool_errors import PoolStartError
from hyper_parallel.testing.pool_worker import _MASTER_ADDR


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
