"""How a failure in a worker becomes an exception in the caller (part of :mod:`.distributed`).

A worker encodes an exception it caught (``_encode_error``: type, message, traceback, pickled where
possible); the caller rebuilds it with its original type when it can, else as a
:class:`RemoteError` (``_rebuild_exception``), picks the rank whose failure is most likely the root
cause (``_primary_failure``), and trims the stack dumps of stuck workers (``_clean_stacks``). Like
the whole harness, this module does not import torch at module level.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback


class RemoteError(RuntimeError):
    """A job raised in a worker and its exception type could not be rebuilt in the caller."""


class PoolStartError(RuntimeError):
    """The worker processes could not be started or could not initialise torch.distributed."""


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
