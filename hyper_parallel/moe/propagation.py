"""Layouts of the expert-region ops (moe/region.py) for the propagation engine.

Reads the op's arguments' current layouts and the region's plan (``ResolvedPlan.experts``). Writes
the op's ``NodeLayout``: the tokens, routing indices, routing weights (and, in backward, the
gradient of the output) are wanted batch-sharded, ``Shard(0)`` on every data-parallel axis (the
expert axis is one) and whole on the others; the stacked expert weights ``Shard(0)`` on the expert
axis, split over the expert tensor-parallel axis as the plan says (moe/resolve.py), and whole
elsewhere. The output is batch-sharded like the tokens (whole on the tensor-parallel axis: lowering
all-reduces the partial sums there); a weight's gradient has the weight's layout (complete over the
expert axis: every row routed to this rank's experts was computed here) but ``Partial`` on the
other data-parallel axes, whose ranks computed it from other tokens.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..ir.graph import describe_node
from ..layout import format_placements


def expert_op_layout(node: torch.fx.Node, spec_of, make_spec, mesh, resolved, backward: bool):
    """(output spec or specs, wanted input specs) of an ``experts`` / ``experts_backward`` node."""
    key = node.args[-1]
    region = resolved.experts[key]
    names = tuple(mesh.mesh_dim_names or ())
    dp_axes = resolved.data_parallel_axes
    batch = tuple(Shard(0) if a in dp_axes else Replicate() for a in names)
    ranks = math.prod(mesh.size(names.index(a)) for a in dp_axes) if dp_axes else 1
    weights = [region.weight_placements(name) for name in region.param_names]

    def gradient(placements):  # other data-parallel ranks computed it from other tokens
        return tuple(Partial("sum") if a in dp_axes and a != region.axis else p for a, p in zip(names, placements))

    def batched(n):
        val = n.meta["val"] if isinstance(n, torch.fx.Node) else n
        if val.shape[0] % ranks:
            raise ValueError(
                f"expert_parallel module {key!r}: {describe_node(node)} gets {val.shape[0]} tokens, "
                f"which the data-parallel axes {list(dp_axes)} ({ranks} ranks) do not divide; every "
                "rank routes its own tokens, so give each rank the same number of batch rows"
            )
        return make_spec(mesh, batch, val)

    tokens = node.args[1:4] if backward else node.args[0:3]
    params = node.args[4] if backward else node.args[3]
    wanted = [batched(node.args[0])] if backward else []
    wanted += [batched(t) for t in tokens]
    for p, want in zip(params, weights):
        have = spec_of(p).placements
        off = [a for a, h, w in zip(names, have, want) if h != w and not isinstance(h, Replicate)]
        if off:
            raise ValueError(
                f"expert_parallel module {key!r}: expert weight {p.name} is planned "
                f"{format_placements(have)} on mesh axes {list(names)}, but its expert region computes "
                f"with {format_placements(want)}; remove the other entries that shard it on {off}"
            )
        wanted.append(make_spec(mesh, want, p.meta["val"]))
    if not backward:
        return batched(node), tuple(wanted)
    val = node.meta["val"]
    outputs = [make_spec(mesh, batch, val[0]), make_spec(mesh, batch, val[1])]
    outputs += [make_spec(mesh, gradient(w), v) for w, v in zip(weights, val[2:])]
    return tuple(outputs), tuple(wanted)
