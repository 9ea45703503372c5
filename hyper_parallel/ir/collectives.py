"""The functional collectives of a lowered program, the kind each one counts as, and
:class:`Collective`, the record of one collective of a program.

Dumps, summaries, the SPMD check (``analysis/debug.py``, ``distributed/spmd.py``), the cost model's timeline
(``cost/simulate.py``) and the pipeline split read a collective's kind from here, so they agree on
it; ``debug.collectives`` lists a program's collectives as :class:`Collective` records (it stays in
analysis/debug.py because it asks ``why.reason`` why the program has each one).
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: what a user counts and what the SPMD check compares."""

    kind: str
    axis: str  # mesh axis name (or group name if it is not a mesh axis)
    dtype: str
    shape: tuple  # local input shape; a data-dependent size (expert dispatch) as its symbol's text
    nbytes: int  # bytes of the local input (data-dependent sizes at their balanced-routing hint)
    node: str
    source: str  # the joint-graph node it serves ("" for one a pass made: a fused bucket)
    group: str = ""  # the process group's name (names differ between ranks, so not in signature())
    why: str = ""  # why the program has it (why.reason): a fused bucket's members, a plan entry

    def signature(self) -> str:
        return f"{self.kind}[{self.axis}] {self.dtype}{list(self.shape)}"

    def structure(self) -> str:
        """The signature without the sizes: what every rank of the mesh has in common, also where
        a shard's size depends on the rank (an uneven FSDP shard of a dim smaller than the mesh
        axis) and so differs between the groups of one axis."""
        return f"{self.kind}[{self.axis}] {self.dtype} {len(self.shape)}-d"

    def describe(self) -> str:
        """The node, what it serves and why, for messages: ``node 'all_reduce_3' for 'mm_3' (op
        rule: aten.mm ...)``."""
        serves = f" for '{self.source}'" if self.source else ""
        return f"node '{self.node}'{serves}" + (f" ({self.why})" if self.why else "")
