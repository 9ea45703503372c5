"""Teach the propagation engine an op it has no sharding rule for.

An op without a rule (a ``torch.library`` custom op, a kernel DTensor does not know) runs replicated:
its inputs are gathered, every rank computes the whole result, and the compile summary lists it under
``fallbacks``. ``register_sharding`` gives it strategies instead: for one mesh axis, the layouts its
tensor inputs may have and the layout of its outputs for each; propagation picks the cheapest per
axis, as it does for aten ops, and the op runs on local shards.

The rule database is DTensor's own (``propagation/rules.py`` reads it), so this is a thin layer over
``torch.distributed.tensor.experimental.register_sharding``: a rule registered here also serves eager
DTensor code, and one registered there is seen here. What this layer adds: static strategy lists,
argument checks with readable errors, and forgetting sharding decisions cached before the rule
existed.

A custom autograd function maps onto this as a ``torch.library.custom_op`` for its forward (and one
for its backward, wired with ``torch.library.register_autograd``), each with a rule: the compiled
program keeps them as single nodes, so their declared layouts are the ones they run with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor.experimental import register_sharding as _torch_register_sharding
from torch.distributed.tensor.placement_types import Placement

from . import compat

Strategy = tuple[Sequence[Placement | None], Sequence[Placement | None]]


def register_sharding(op, strategies: Sequence[Strategy] | Callable | None = None):
    """Register sharding strategies for ``op`` (an ``OpOverload``, e.g. ``torch.ops.mylib.f.default``,
    or a list of them).

    ``strategies``: a list of ``(output placements, input placements)`` pairs for one mesh axis (one
    placement per output; one per argument of the op, ``None`` for non-tensor arguments), or a
    function taking the op's arguments (tensors as layout specs) and returning such a list, as torch's
    ``register_sharding`` does. Without ``strategies`` this is a decorator for that function. The
    strategies apply to every mesh axis independently; include the all-``Replicate()`` one so the op
    can always run."""
    ops = list(op) if isinstance(op, (list, tuple)) else [op]
    for o in ops:
        if not isinstance(o, compat.OpOverload):
            raise TypeError(
                f"register_sharding: {o!r} is not an op overload; pass e.g. torch.ops.mylib.my_op.default "
                "(a torch.library custom op or an aten op), not a Python function or an OpOverloadPacket")

    def register(fn: Callable):
        _torch_register_sharding(ops if len(ops) > 1 else ops[0])(fn)
        compat.clear_sharding_caches()  # a decision cached before the rule existed is stale
        return fn

    if strategies is None:
        return register
    if callable(strategies):
        return register(strategies)
    fixed = [_checked(ops[0], i, s) for i, s in enumerate(strategies)]
    if not fixed:
        raise ValueError(f"register_sharding({ops[0]}): give at least one strategy (e.g. all Replicate())")
    return register(lambda *args, **kwargs: fixed)


def _checked(op, index: int, strategy) -> Strategy:
    if not (isinstance(strategy, (tuple, list)) and len(strategy) == 2):
        raise ValueError(f"register_sharding({op}): strategy {index} must be a pair "
                         f"(output placements, input placements), got {strategy!r}")
    outputs, inputs = (list(part) for part in strategy)
    returns, arguments = len(op._schema.returns), len(op._schema.arguments)
    if len(outputs) != returns or len(inputs) != arguments:
        names = ", ".join(a.name for a in op._schema.arguments)
        raise ValueError(
            f"register_sharding({op}): strategy {index} has {len(outputs)} output and {len(inputs)} input "
            f"placements; the op has {returns} output(s) and {arguments} argument(s) ({names}): give one "
            "placement per output and per argument, None for non-tensor arguments")
    for p in outputs + inputs:
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"register_sharding({op}): strategy {index} holds {p!r}; use Shard(d), "
                            "Replicate() or Partial() (or None for a non-tensor argument)")
    return outputs, inputs
