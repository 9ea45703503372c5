"""reduction_lanes: on gloo, gradient reductions run on their axis's reduction lane.

A lane is a second process group over the ranks of a data-parallel axis (plan/lanes.py explains
why gloo needs it): with the reductions there and the gathers on the axis's own group,
serialize_collectives (the next pass), which keeps one collective in flight per gloo group, lets an
FSDP unit's prefetched all-gather and the last unit's reduce-scatter run at the same time, as
FSDP2 overlaps them on NCCL.

Reads: ``ctx.reduction_lanes`` (group name -> lane name; empty unless the mesh is gloo), the
gradient reductions bucketing made (``hp_bucket`` on reduce-scatters and all-reduces) and their
group argument. Writes: that argument, replaced by the lane's name; nothing moves, so numerics are
unchanged (the same ranks reduce the same buffers in the same order). Idempotent.
"""

from __future__ import annotations

import torch

from ..ir import meta
from ..propagation import recompile

c10d = torch.ops._c10d_functional

_REDUCTIONS = frozenset({
    c10d.reduce_scatter_tensor.default, c10d.all_reduce.default, c10d.all_reduce_.default,
})


def reduction_lanes_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    lanes = ctx.reduction_lanes
    if not lanes:
        return gm
    moved = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _REDUCTIONS or meta.BUCKET not in node.meta:
            continue
        group = node.args[-1]  # every functional collective takes its group name last
        if isinstance(group, str) and group in lanes:
            node.update_arg(len(node.args) - 1, lanes[group])
            moved = True
    if moved:
        recompile(gm)
    return gm
