"""Gathered FSDP parameters kept between programs: ``unshard()`` / ``reshard()`` and
``set_reshard_after_backward(False)``.

FSDP2 lets a user all-gather a module's parameters early (``unshard(async_op=True)`` overlaps the
gather with other work, such as loading the next batch) and free them again (``reshard()``). Here
the gathered values are kept until the next forward, which then runs a program variant that takes
them as inputs (propagation/unshard.py, ``FsdpPlan.pregathered``) and has no forward all-gather for
those units; when a unit reshards after forward, its backward all-gather is still in the graph. The
gather itself is DTensor's redistribution of each parameter to its computing layout (in the mixed
precision ``param_dtype``), issued asynchronously when asked.

``set_reshard_after_backward(False)`` fills the same store from the other end: backward returns the
gathered parameters it used (propagation/unshard.py), so the next forward (a gradient accumulation
micro-step) gathers nothing. Once an optimizer steps the parameters (or a state dict is loaded)
the gathered values are stale and are dropped, so a forward never computes with old weights (FSDP2
leaves that to the user). Other in-place edits of the parameters need ``reshard()``.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import compat


class GatheredParams:
    """Unit -> {parameter FQN: gathered local value}. Registered with :func:`watch_optimizers`, it
    empties itself when an optimizer steps any parameter of its model."""

    def __init__(self, parameters=()):
        self.units: dict[str, dict[str, torch.Tensor]] = {}
        self._param_ids = {id(p) for p in parameters}

    def put(self, unit: str, values: dict[str, torch.Tensor]) -> None:
        self.units.setdefault(unit, {}).update(values)

    def drop(self, unit: str) -> None:
        self.units.pop(unit, None)

    def take(self, unit: str, fqn: str) -> torch.Tensor:
        return compat.wait_collective(self.units[unit][fqn])

    def clear(self) -> None:
        self.units.clear()

    def _after_optimizer_step(self, optimizer) -> None:
        if self.units and any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            self.clear()


_WATCHED: "weakref.WeakSet[GatheredParams]" = weakref.WeakSet()
_HOOK = []


def watch_optimizers(store: GatheredParams) -> None:
    """Drop ``store``'s gathered values whenever an optimizer steps one of its parameters: they
    would be stale (one hook for all optimizers, torch's ``register_optimizer_step_post_hook``)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_after_step))
    _WATCHED.add(store)


def _after_step(optimizer, args, kwargs) -> None:
    for store in list(_WATCHED):
        store._after_optimizer_step(optimizer)


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` blocks until the gathers finished. Not
    waiting is fine too: the next forward waits before it uses them."""

    def __init__(self, gathered: list[dict[str, torch.Tensor]]):
        self._gathered = gathered  # per unit: parameter FQN -> gathered local value (maybe pending)

    def wait(self) -> None:
        for unit in self._gathered:
            for fqn, value in list(unit.items()):
                unit[fqn] = compat.wait_collective(value)


def gather_unit(model: torch.nn.Module, fsdp, unit: str, async_op: bool) -> dict[str, torch.Tensor]:
    """Each parameter of ``unit``: this rank's local part of it in its computing layout."""
    params = dict(model.named_parameters())
    policy = fsdp.unit(unit).mixed_precision
    out = {}
    for fqn in fsdp.unit(unit).params:
        p = params[fqn].detach()
        if policy is not None and policy.param_dtype is not None and p.is_floating_point():
            p = p.to(policy.param_dtype)
        gathered = p.redistribute(placements=fsdp.compute_placements[fqn], async_op=async_op)
        out[fqn] = gathered.to_local()
    return out
