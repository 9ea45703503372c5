"""One capture, propagation and lowering for compiles that differ only after lowering.

The auto-planner compiles each configuration of degrees and batch once per recompute mode
(none, selective, full): recompute is a pass, so the three compiles capture, propagate and lower the
same graph, and on fake ranks those three stages were 90% of each compile. Inside
:func:`reusing_lowerings` the driver keeps each lowering (``driver.Lowered``) and hands a later
compile with the same key a copy of it; the passes and everything after them run as always.

The key is everything ``capture_and_lower`` reads: the module's structure (every submodule's FQN,
class and train/eval mode, every buffer's shape and dtype), the request (mesh device type, shape,
axis names and process-group names; the resolved plan; every parameter's global shape, dtype,
requires_grad and capture device; the model's class; ``repeated_blocks`` and ``disable_passes``), the
input signature and grad mode and autocast. What it cannot see is the code and the Python values
the forward reads (a config flag, a global): the scope is for callers that build every module they
compile inside it the same way, from the same code and config, as the planner does. A reused
lowering records no attribute reads (``Lowered.reads`` is empty): the module compiled from it is
not guarded against its attributes changing. Pipelined compiles (a stage's loss wrapper) and
compiles that dump are never reused.

Nothing is kept outside a scope: the driver stays without state between calls (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import torch
import torch.nn as nn

from .. import compat

__all__ = ["LoweringReuse", "reusing_lowerings", "active_reuse"]

_ACTIVE: contextvars.ContextVar["LoweringReuse | None"] = contextvars.ContextVar("lowering_reuse_scope", default=None)


@dataclasses.dataclass
class LoweringReuse:
    """The lowerings kept by one :func:`reusing_lowerings` scope, and how often each was reused."""

    lowered: dict = dataclasses.field(default_factory=dict)
    reused: int = 0
    lowered_count: int = 0

    def key_for(self, module: nn.Module, request, flat, in_spec) -> tuple:
        """What ``capture_and_lower`` reads of ``module``, ``request`` and the call (module docstring)."""
        mesh = request.mesh
        groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
        # The root's class is the parallel subclass parallelize made for this module: its own class
        # (request.original_cls) stands for it.
        structure = tuple((fqn, type(m) if fqn else request.original_cls, m.training)
                          for fqn, m in module.named_modules())
        buffers = tuple((fqn, tuple(b.shape), b.dtype) for fqn, b in module.named_buffers())
        inputs = tuple((tuple(x.shape), x.dtype, x.requires_grad, x.device.type) if isinstance(x, torch.Tensor)
                       else ("value", type(x), repr(x)) for x in flat)
        ambient = (torch.is_grad_enabled(),
                   tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))
        options = request.options
        return (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names, groups, structure, buffers,
                repr(in_spec), inputs, ambient, request.original_cls, repr(request.resolved),
                repr(sorted(request.parameters.items())), repr(options.repeated_blocks),
                repr(options.disable_passes))

    def get(self, key):
        """A copy of the lowering kept under ``key`` (its lowered graph copied: the passes change it),
        or None."""
        kept = self.lowered.get(key)
        if kept is None:
            return None
        self.reused += 1
        return dataclasses.replace(kept, local=compat.copy_graph_module(kept.local), reads=())

    def put(self, key, lowered) -> None:
        """Keep ``lowered`` (a copy of its lowered graph, before the caller's passes change it)."""
        self.lowered_count += 1
        self.lowered[key] = dataclasses.replace(lowered, local=compat.copy_graph_module(lowered.local))


@contextlib.contextmanager
def reusing_lowerings() -> Iterator[LoweringReuse]:
    """Compiles inside reuse each other's lowering where their keys match (module docstring); the
    kept lowerings go when the scope ends. Nested scopes share the outer one."""
    outer = _ACTIVE.get()
    if outer is not None:
        yield outer
        return
    reuse = LoweringReuse()
    token = _ACTIVE.set(reuse)
    try:
        yield reuse
    finally:
        _ACTIVE.reset(token)


def active_reuse() -> LoweringReuse | None:
    """The scope a compile runs in, or None (outside any: nothing is kept)."""
    return _ACTIVE.get()
