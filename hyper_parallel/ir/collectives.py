"""The functional collectives of a lowered program and the kind each one counts as.

Dumps, summaries, the SPMD check (``debug.py``), the cost model's timeline (``cost/simulate.py``)
and the pipeline split read a collective's kind from here, so they agree on it.
"""

from __future__ import annotations

import torch

from . import meta

c10d = torch.ops._c10d_functional

COLLECTIVE_KINDS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_reduce_.default: "all_reduce",  # in place: the bucketing pass's fused gradient buckets
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast.default: "broadcast",
}

# A ring transfer of context parallelism (cp/ring.py) is an all_to_all_single in which each rank
# sends its whole tensor to one peer: a point-to-point send/recv, counted and priced as one.
SEND_RECV = "send_recv"


def collective_kind(node: torch.fx.Node) -> str | None:
    """The kind a node of a lowered program counts as ("all_gather", ..., "send_recv"), or None."""
    if node.op != "call_function":
        return None
    kind = COLLECTIVE_KINDS.get(node.target)
    if kind == "all_to_all" and meta.CP_RING in node.meta:
        return SEND_RECV
    return kind
