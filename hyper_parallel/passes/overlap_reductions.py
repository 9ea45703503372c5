"""overlap_reductions: wait for each gradient reduction as late as ``ctx.reductions_in_flight`` allows.

Bucketing issues every fused gradient reduction (an FSDP unit's reduce-scatter, an HSDP unit's
all-reduce, a DDP-style bucket's all-reduce) right after the last gradient it reads, and waits for
it at once. This pass moves each wait, and the copy-out that only reads the reduced buffer, later:
with ``N = ctx.reductions_in_flight``, reduction k is waited for just before reduction k+N of the
same kind is issued (or before the first node that needs its result, if that comes first), so it
runs while backward computes the layers before it and at most N reductions of a kind are in flight
at any point. N = 1 is FSDP2's schedule (one reduce-scatter in flight: the full-size gradients a
reduction reads are freed as backward proceeds); N = 0 leaves every wait where bucketing put it.

``parallelize(..., reductions_in_flight=)`` sets N; by default 1 where FSDP units are prefetched
(the default) and 0 where they are not (``prefetch_depth=0``), so one option, ``prefetch_depth``,
still turns all overlap on or off. On gloo, serialize_collectives (the next pass) also waits for a
reduction before the next collective of its process group is issued.

Reads: ``hp_bucket`` on the fused reductions (bucketing), ``ctx.reductions_in_flight``.
Writes: node order only (no node is added or removed), so numerics are unchanged. Idempotent: a
wait already at its place does not move again.
"""

from __future__ import annotations

import torch

from ..ir import meta
from ..propagation import recompile

c10d = torch.ops._c10d_functional

# Per kind: the fused reductions bucketing labels with that kind. An all-reduce bucket is reduced in
# place (all_reduce_); a gradient alone in its bucket keeps its own out-of-place all_reduce.
_KINDS = {
    "reduce_scatter": (c10d.reduce_scatter_tensor.default,),
    "all_reduce": (c10d.all_reduce_.default, c10d.all_reduce.default),
}


# ``a < b``: node a is before node b in the graph (fx keeps an order key on every node as nodes are
# inserted and moved), so no {node: index} map is rebuilt per reduction.


def _wait_of(node):
    return next(u for u in node.users if u.target is c10d.wait_tensor.default)


def overlap_reductions_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    in_flight = ctx.reductions_in_flight
    if in_flight == 0:
        return gm
    graph = gm.graph
    for kind, targets in _KINDS.items():
        reductions = [n for n in graph.nodes
                      if n.op == "call_function" and n.target in targets and kind in n.meta.get(meta.BUCKET, "")]
        for k, reduction in enumerate(reductions):
            limit = reductions[k + in_flight] if k + in_flight < len(reductions) else None
            _sink_wait(graph, _wait_of(reduction), limit)
    graph.lint()
    recompile(gm)
    return gm


def _sink_wait(graph, wait: torch.fx.Node, limit: torch.fx.Node | None = None) -> None:
    """Move ``wait`` and the copy-out that only depends on it to just before its first consumer
    outside that copy-out, or before ``limit`` if that comes first."""
    tail: list[torch.fx.Node] = [wait]
    frontier = [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            # Collectives reading the result (HSDP's all-reduce after the reduce-scatter) and
            # impure ops stay where they are: they are consumers the wait must precede.
            if (user in tail or user.op != "call_function" or user.is_impure()
                    or getattr(user.target, "namespace", None) == "_c10d_functional"):
                continue
            if all(a in tail or a < wait for a in user.all_input_nodes):
                tail.append(user)
                frontier.append(user)
    outside = [u for n in tail for u in n.users if u not in tail]
    if limit is not None:
        outside.append(limit)
    if not outside:
        return
    first = min(outside)
    if first <= wait:
        return
    for node in sorted(tail):
        first.prepend(node)
