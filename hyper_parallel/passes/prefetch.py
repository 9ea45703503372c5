"""prefetch: issue FSDP all-gathers ahead of need.

Functional collectives are asynchronous: ``all_gather_into_tensor`` starts the transfer and
``wait_tensor`` blocks on it. After bucketing, each unit's fused all-gather is issued right before
its own wait, so nothing overlaps. This pass moves the *issue* of unit k's all-gather (the collective
and the copy-in of the shards it reads) to just before the wait of unit k-depth, in each phase's
execution order: in forward the next layer's parameters arrive while the current layer computes,
in backward (where graph order runs the layers in reverse) the mirror. The gradient reductions'
waits are the next pass's (``overlap_reductions``).

Explicit lists (``set_modules_to_forward_prefetch`` / ``_backward_prefetch``, in
``ctx.explicit_prefetch``) are applied first: the listed units' gathers are issued before the wait
of the unit that names them.

``ctx.prefetch_depth`` 0 (``parallelize(..., prefetch_depth=0)``; the default is 1) moves nothing but
the explicit lists. On gloo, serialize_collectives then keeps one collective per process group in
flight, so a unit's gather is issued right after the previous unit's wait (still before its compute).

Reads: ``hp_bucket``, ``hp_fsdp_phase``, ``hp_fsdp_unit`` on the fused collectives (bucketing),
``ctx.prefetch_depth``, ``ctx.explicit_prefetch``.
Writes: node order only (no node is added or removed), so numerics are unchanged. Idempotent: a
collective already issued early is not moved again.
"""

from __future__ import annotations

import torch
from ..ir import meta
from ..ir.phase import BACKWARD, FORWARD, gather_phase
from ..propagation import recompile

c10d = torch.ops._c10d_functional


# ``a < b``: node a is before node b in the graph. fx keeps an order key on every node as nodes are
# inserted and moved, so no {node: index} map is rebuilt per moved gather (quadratic in graph size).


def _movable_chain(node: torch.fx.Node, before: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``node`` and its ancestors that sit after ``before``, if they can all move in front of it
    (pure ops whose own inputs are placeholders or nodes already before ``before``)."""
    chain: list[torch.fx.Node] = []
    seen: set = set()

    def visit(n: torch.fx.Node) -> bool:
        if n in seen or n.op == "placeholder" or n < before:
            return True
        if n.op != "call_function" or (n.is_impure() and n.target is not c10d.all_gather_into_tensor.default):
            return False
        seen.add(n)
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        chain.append(n)
        return True

    return sorted(chain) if visit(node) else None


def _fused(graph, kind, target):
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is target and kind in n.meta.get(meta.BUCKET, "")
    ]


def _wait_of(node):
    return next(u for u in node.users if u.target is c10d.wait_tensor.default)


def prefetch_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    depth = ctx.prefetch_depth
    graph = gm.graph
    gathers = _fused(graph, "all_gather", c10d.all_gather_into_tensor.default)
    explicit = ctx.explicit_prefetch
    for phase, table in explicit.items():
        # set_modules_to_{forward,backward}_prefetch: when a unit waits for its gather, the listed
        # units' gathers are already in flight.
        by_unit = {g.meta.get(meta.FSDP_UNIT): g for g in gathers if gather_phase(g) == phase}
        for unit, targets in table.items():
            if unit not in by_unit:
                continue
            anchor = _wait_of(by_unit[unit])
            for target in targets:
                gather = by_unit.get(target)
                if gather is None or gather < anchor:
                    continue
                for node in _movable_chain(gather, anchor) or ():
                    anchor.prepend(node)
    if depth > 0:
        for phase in (FORWARD, BACKWARD):
            # Units in need order (where their gathers are waited for: this pass never moves a
            # wait, so a second run sees the same order and moves nothing). When unit j waits,
            # units j+1..j+depth are in flight: unit k's gather goes before the wait of unit
            # k-depth, the first depth+1 units' before the first wait, each in need order.
            ordered = sorted((g for g in gathers if gather_phase(g) == phase), key=_wait_of)
            for k in range(1, len(ordered)):
                anchor = _wait_of(ordered[max(k - depth, 0)])
                if ordered[k] < anchor:
                    continue  # already issued early enough
                chain = _movable_chain(ordered[k], anchor)
                for node in chain or ():
                    anchor.prepend(node)
    graph.lint()
    recompile(gm)
    return gm
