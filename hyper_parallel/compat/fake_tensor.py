"""Fake tensors, proxy tracing and symbolic shapes: what capture, lowering and the passes trace on.

Private names: ``torch._subclasses.fake_tensor`` (``FakeTensorMode``, the ``FakeTensor``
constructor a pass uses to make a node's ``val`` without a dispatch, ``unset_fake_temporarily``,
and the exceptions raised for data-dependent outputs), ``torch.fx.experimental.proxy_tensor``'s
``disable_proxy_modes_tracing``, and ``ShapeEnv``'s hint overrides for unbacked sizes (an expert
region's received rows: estimates need a number for them).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.fx.experimental.symbolic_shapes import (  # noqa: F401
    GuardOnDataDependentSymNode,
    ShapeEnv,
)

try:  # torch 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11/2.12 (the lent GPU machines' image) had it as size_hint
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException  # noqa: F401

__all__ = [
    "FakeTensorMode",
    "make_fx",
    "GuardOnDataDependentSymNode",
    "ShapeEnv",
    "optimization_hint",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "DATA_DEPENDENT_ERRORS",
    "set_size_hint",
    "size_hint",
    "real_tensors",
    "fake_empty",
]

# Raised when code traced on data-dependent sizes branches on them or makes a value-sized output.
DATA_DEPENDENT_ERRORS = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


# --- data-dependent sizes (expert regions' all-to-all splits) -------------------------------------


def set_size_hint(size, hint: int) -> None:
    """Record the value estimates (memory, cost model) assume for an unbacked symbolic ``size``."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
        size.node.shape_env.var_to_hint_override[size.node.expr] = int(hint)


def size_hint(size) -> int:
    """A concrete int for ``size``: itself, or the hinted value of a data-dependent symbolic size."""
    if isinstance(size, torch.SymInt):
        return int(optimization_hint(size, fallback=0))
    return int(size)


@contextlib.contextmanager
def real_tensors():
    """Real tensors inside: no fake-tensor mode or proxy tracing that an enclosing compile step has
    active applies (a value the compiler computes for itself, such as a constant mask's)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def fake_empty(like: torch.Tensor, shape, dtype=None, device=None) -> torch.Tensor:
    """An empty contiguous FakeTensor in ``like``'s fake mode, of ``like``'s dtype and device unless
    given: the ``val`` of a node a pass adds. Built directly around a meta tensor, about 20× faster
    than ``torch.empty`` under the mode (a dispatch per value; passes add thousands at 70B scale);
    symbolic sizes take the dispatching way."""
    from torch._subclasses.fake_tensor import FakeTensor

    dtype, device = dtype or like.dtype, device or like.device
    if any(not isinstance(s, int) for s in shape):
        with like.fake_mode:
            return torch.empty(shape, dtype=dtype, device=device)
    return FakeTensor(like.fake_mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))
