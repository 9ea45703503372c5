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
"""

from __future__ import annotations

import torch

from ..ir.kinds import InputKind, OutputKind
from ..compile.capture import CapturedGraph
from . import recompile

GRAD_ACCUM = InputKind.GRAD_ACCUM


def insert_gradient_accumulation(captured: CapturedGraph, fsdp) -> int:
    """Add the pending-gradient inputs (module docstring); returns how many were added."""
    if fsdp is None or fsdp.accumulated is None:
        return 0
    slots = list(captured.gm.graph.output_node().args[0])
    added = 0
    for i, (slot, info) in enumerate(zip(slots, list(captured.outputs))):
        if info.kind != OutputKind.GRAD or info.name not in fsdp.unit_of or slot is None:
            continue
        val = slot.meta["val"]
        with val.fake_mode:
            pending_val = torch.empty_like(val)
        captured.pending_inputs[i] = captured.add_input(GRAD_ACCUM, info.name, pending_val)
        added += 1
    recompile(captured.gm)
    return added
