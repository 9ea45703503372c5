"""One ``GraphModule.recompile()`` per run of rewrites or passes, not one per step.

``gm.recompile()`` regenerates and ``compile()``s the Python code of the whole graph: about a
third of a second for a 32-layer joint graph, once per rewrite and pass that changed the graph.
Nothing between two steps runs the graph or reads ``gm.code`` (the dumps print the graph itself,
``print_readable``), so the runner (passes/runner.py:run_steps) defers them: inside
:func:`deferred_recompiles`, :func:`recompile` only records the module, and the block's end
recompiles each recorded module once. Outside such a block (a pass called on its own, as the
tests do) :func:`recompile` is ``gm.recompile()``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_state = threading.local()


def recompile(gm: torch.fx.GraphModule) -> None:
    """``gm.recompile()`` now, or at the end of the enclosing :func:`deferred_recompiles`."""
    pending = getattr(_state, "pending", None)
    if pending is None:
        gm.recompile()
    else:
        pending[id(gm)] = gm


@contextlib.contextmanager
def deferred_recompiles() -> Iterator[None]:
    """Recompile the modules :func:`recompile` was called on inside the block once, when it ends
    (normally; after an exception the graphs are not used). Nested blocks defer to the outermost."""
    if getattr(_state, "pending", None) is not None:
        yield
        return
    _state.pending = {}
    try:
        yield
        pending = _state.pending
    finally:
        _state.pending = None
    for gm in pending.values():
        gm.recompile()
