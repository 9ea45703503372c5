"""Gradient accumulation in the graph: earlier micro-steps' gradients become program inputs.

FSDP gradient accumulation (``set_requires_gradient_sync(False)``, HSDP's
``set_requires_all_reduce(False)``) keeps each FSDP gradient unreduced, or reduced over the shard
axis only, between micro-steps. When such gradients are pending, the next program takes them as
inputs and adds them to its own gradients *before* those leave the graph, so the reduction the
program ends with (reduce-scatter, then the replicate all-reduce) reduces the whole sum once, in the
graph, bucketed and overlapped with the rest of backward like any other step's. The numbers equal
one large batch: the reductions are linear.

Reads: ``resolved.fsdp.accumulated`` (the layout of the pending gradients, a name from
``fsdp.plan.GRADIENT_LAYOUTS``; None: nothing pending) and the joint graph's outputs. Writes: one
placeholder per FSDP gradient output (``InputInfo("grad_accum", <param FQN>)``, placed after the
last primal so the joint graph keeps primals before tangents), a ``None`` gradient slot for each,
and ``captured.pending_inputs`` (gradient output slot -> its placeholder). Lowering adds the pending
value where the gradient's way to its final layout passes through the pending layout: before the
reduce-scatter for unreduced gradients, between reduce-scatter and all-reduce for HSDP's
reduce-scattered ones. The slot holds the gradient after the mixed-precision cast and the "sum"
scaling, the form pending gradients were kept in.

Parameters no FSDP unit owns (every parameter of a data-parallel plan) accumulate the same way under
``model.no_sync()``, DDP's idiom: with ``resolved.replicated_sync`` False their gradients leave the
program in :func:`unreduced_placements` (Partial over the data-parallel and sequence axes they are
replicated on: no all-reduce), and with ``resolved.replicated_pending`` the next program takes those
sums as inputs and adds them before its (bucketed, overlapped) all-reduce. Reductions over other
axes (a sequence-parallel norm weight's over the tensor-parallel axis) still run every micro-step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate

from ..ir.kinds import InputKind, OutputKind
from ..ir.graph import CapturedGraph
from . import recompile

GRAD_ACCUM = InputKind.GRAD_ACCUM


def insert_gradient_accumulation(captured: CapturedGraph, resolved) -> int:
    """Add the pending-gradient inputs (module docstring); returns how many were added."""
    fsdp = resolved.fsdp
    fsdp_pending = fsdp is not None and fsdp.accumulated is not None
    if not fsdp_pending and not resolved.replicated_pending:
        return 0
    slots = list(captured.gm.graph.output_node().args[0])
    added = 0
    for i, (slot, info) in enumerate(zip(slots, list(captured.outputs))):
        if info.kind != OutputKind.GRAD or slot is None:
            continue
        if fsdp is not None and info.name in fsdp.unit_of:
            if not fsdp_pending:
                continue
        elif not resolved.replicated_pending or unreduced_placements(resolved, info.name) is None:
            continue
        val = slot.meta["val"]
        with val.fake_mode:
            pending_val = torch.empty_like(val)
        captured.pending_inputs[i] = captured.add_input(GRAD_ACCUM, info.name, pending_val)
        added += 1
    recompile(captured.gm)
    return added


def unreduced_placements(resolved, param: str) -> tuple | None:
    """The layout a gradient of ``param`` (no FSDP unit's) is kept in between no-sync micro-steps:
    its storage placements with Partial("sum") on each data-parallel or sequence axis of more than
    one rank it is replicated on (what each rank's own data contributes). None when it has no such
    axis: its gradient is final without a data-parallel reduction, nothing to defer."""
    storage = resolved.param_placements[param]
    axes = set(resolved.data_parallel_axes) | set(resolved.sequence_axes)
    sizes = resolved.mesh_shape or (None,) * len(storage)
    placements = tuple(
        Partial("sum") if name in axes and isinstance(p, Replicate) and size != 1 else p
        for name, size, p in zip(resolved.mesh_dim_names, sizes, storage)
    )
    return placements if placements != storage else None


def deferred_replicated(resolved, params) -> set[str]:
    """Which of ``params`` (FQNs) a program that skips the replicated gradients' sync keeps unreduced."""
    owned = resolved.fsdp.unit_of if resolved.fsdp is not None else {}
    return {p for p in params if p not in owned and unreduced_placements(resolved, p) is not None}
