"""Progress lines: what a long compile or ``explain`` is doing, on rank 0, through ``logging``.

A compile is silent for seconds (minutes at scale) otherwise. Each phase logs one INFO line on
the ``hyper_parallel.progress`` logger when it ends, with its seconds: ``capture``,
``propagation``, ``lowering``, ``passes`` (each pass's seconds on the same line), ``partition``,
``SPMD check``, then the total. Only rank 0 logs them (every rank runs the same phases).

Visible by default: the first :func:`enable_default_logging` (``hp.parallelize`` and ``explain``
call it) gives the ``hyper_parallel`` logger a stderr handler at INFO, unless the application
configured logging itself (the root logger or ``hyper_parallel`` already has a handler: then its
configuration decides) or the environment variable ``HYPER_PARALLEL_LOG`` says otherwise:
``quiet`` (warnings only), ``info`` (the default) or ``debug`` (also per-pass details the
compiler logs at DEBUG). ``TORCH_LOGS`` is torch's and does not apply here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

log = logging.getLogger("hyper_parallel.progress")

ENV = "HYPER_PARALLEL_LOG"
_LEVELS = {"quiet": logging.WARNING, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
_configured = False


def enable_default_logging() -> None:
    """Give the ``hyper_parallel`` logger a stderr handler at the level ``HYPER_PARALLEL_LOG`` asks
    (INFO by default), once per process, unless the application configured logging already."""
    global _configured
    if _configured:
        return
    _configured = True
    value = os.environ.get(ENV, "").strip().lower() or "info"  # set but empty (``VAR=``): the default
    if value not in _LEVELS:
        raise ValueError(f"{ENV}={value!r}: choose one of {sorted(_LEVELS)}")
    package = logging.getLogger("hyper_parallel")
    if package.handlers or logging.getLogger().handlers:
        return  # the application's (or pytest's) logging configuration decides
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[hyper_parallel] %(message)s"))
    package.addHandler(handler)
    package.setLevel(_LEVELS[value])
    package.propagate = False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Progress:
    """The phases of one piece of work (``what``: "compile LlamaForCausalLM"), each logged with its
    seconds as it ends (rank 0 only, and not when ``enabled`` is False: only timed), and the total
    by :meth:`done`."""

    def __init__(self, what: str, enabled: bool = True):
        self.what = what
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.enabled = enabled and _rank() == 0 and log.isEnabledFor(logging.INFO)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float, detail: str = "") -> None:
        """A phase that took ``seconds`` (``detail``: more on the same line)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if self.enabled:
            log.info("%s: %s %.2f s%s", self.what, name, seconds, f" ({detail})" if detail else "")

    def done(self, detail: str = "") -> float:
        """Log the total; returns its seconds."""
        total = time.perf_counter() - self.started
        if self.enabled:
            log.info("%s: done in %.2f s%s", self.what, total, f"; {detail}" if detail else "")
        return total
