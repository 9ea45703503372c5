"""Validation of ``parallelize``'s keyword options, at the call, before anything is distributed.

A bad option is a ValueError/TypeError naming the option and what to give instead, raised where the
user passed it, not at the first forward (or never, as ``prefetch_depth=-1`` was).

The dump directory gets the same treatment: it must be writable now (not at the first forward's
first file), and two jobs must not mix their files in it. Each rank folder holds an owner file
(``owner.json``: host, process id, start time). A folder owned by a live process on this host
other than this one is refused; one left by a finished run is cleared first, so a dump never mixes
two runs. (A folder owned from another host cannot be checked for liveness and is treated as a
finished run's; give concurrent jobs on a shared filesystem different directories.)
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import time

from .passes.context import DEFAULT_FIRST_GRADIENT_BUCKET_BYTES, DEFAULT_GRADIENT_BUCKET_BYTES

OWNER_FILE = "owner.json"
_PROCESS_START = time.time()


def check_int(name: str, value, *, minimum: int, allow_none: bool = True):
    """``value`` as an int >= ``minimum`` (None passes through when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"parallelize({name}={value!r}): give an int >= {minimum}" + (" or None" if allow_none else ""))
    if value < minimum:
        raise ValueError(f"parallelize({name}={value!r}): must be >= {minimum}")
    return value


def check_bucket_cap_mb(value) -> float | None:
    """None (DDP's default buckets) or a positive size in MB."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"parallelize(bucket_cap_mb={value!r}): give a positive size in MB, or None for DDP's "
                         "default buckets")
    return float(value)


def gradient_bucket_sizes(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(bucket bytes, first bucket bytes) for ``parallelize(bucket_cap_mb=...)``, DDP's rule: by
    default 25 MB buckets after a 1 MiB first one (the gradients backward computes first, so their
    reduction starts early); a size given by the caller caps every bucket, the first one too."""
    if bucket_cap_mb is None:
        return DEFAULT_GRADIENT_BUCKET_BYTES, DEFAULT_FIRST_GRADIENT_BUCKET_BYTES
    cap = int(bucket_cap_mb * 1024 * 1024)
    return cap, cap


def check_memory_budget(value) -> int | None:
    """Bytes as an int (``"1GB"`` strings are refused: say ``1 << 30``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"parallelize(memory_budget_bytes={value!r}): give the per-rank budget in bytes as an int "
            "(e.g. 40 << 30 for 40 GiB)"
        )
    if value <= 0:
        raise ValueError(f"parallelize(memory_budget_bytes={value!r}): the budget must be a positive number of bytes")
    return value


def check_timeout(value) -> datetime.timedelta | None:
    """Seconds (int/float) or a timedelta, positive; None keeps the process groups' own timeout."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"parallelize(timeout={value!r}): give seconds or a datetime.timedelta")
    if seconds <= 0:
        raise ValueError(f"parallelize(timeout={value!r}): the timeout must be positive")
    return datetime.timedelta(seconds=seconds)


def check_check_inputs(value) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"parallelize(check_inputs={value!r}): give True, False or None (CPU inputs only)")
    return value


def prepare_dump_dir(dump_dir: str | None, rank: int, source: str) -> str | None:
    """Make ``dump_dir/rank<rank>`` ready for this process's dumps (module docstring); ``source``
    names where the directory came from, for errors ("dump_dir" or "HYPER_PARALLEL_DUMP_DIR")."""
    if not dump_dir:
        return None
    folder = os.path.join(dump_dir, f"rank{rank}")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _PROCESS_START}
    owner_path = os.path.join(folder, OWNER_FILE)
    try:
        owner = _read_owner(owner_path)
        if owner is not None and (owner.get("host"), owner.get("pid")) != (me["host"], me["pid"]):
            if owner.get("host") == me["host"] and _alive(owner.get("pid")):
                raise ValueError(
                    f"{source}={dump_dir!r}: {folder} is being written by another running process "
                    f"(pid {owner['pid']}); give each job its own dump directory"
                )
            shutil.rmtree(folder)  # a finished run's dump: replaced whole, never mixed
        elif owner is None and os.path.isdir(folder) and os.listdir(folder):
            shutil.rmtree(folder)  # written before owner files existed
        os.makedirs(folder, exist_ok=True)
        with open(owner_path, "w") as f:
            json.dump(me, f)
    except OSError as exc:
        raise ValueError(
            f"{source}={dump_dir!r}: cannot write the dump folder {folder} ({exc.strerror or exc}); "
            "give a writable directory"
        ) from exc
    return dump_dir


def _read_owner(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
