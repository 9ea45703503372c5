"""prefetch: issue FSDP all-gathers ahead of need.

Functional collectives are asynchronous: ``all_gather_into_tensor`` starts the transfer and
``wait_tensor`` blocks on it. After bucketing, each unit's fused all-gather is issued right before
its own wait, so nothing overlaps. This pass moves the *issue* of unit k's all-gather (the collective
and the copy-in of the shards it reads) to just after unit k-depth has unpacked its own gathered
buffer (its wait, then the copies of each parameter out of the buffer), in
each phase's execution order: in forward the next layer's parameters arrive while the current
layer computes, in backward (where graph order runs the layers in reverse) the mirror. The
gradient reductions' waits are the next pass's (``overlap_reductions``).

Why after the unpack rather than before the wait: a unit's parameters are strided in the gathered
buffer (rank-major), so unpacking copies them out, and the buffer dies once they are copied. Issued
before the wait, the next unit's buffer was allocated while the current one's buffer and its
copies were both alive: three units' worth of parameters at once where two suffice (fp32, 4 ranks,
``bench/bench_fsdp_step.py``, 2026-11-28: peak 36.00 -> 33.80 MB; FSDP2 36.59). FSDP2 issues its
prefetch after its copy-out too. The transfer starts later by the copies' time only.

Explicit lists (``set_modules_to_forward_prefetch`` / ``_backward_prefetch``, in
``ctx.explicit_prefetch``) are applied first: the listed units' gathers are issued after the unpack
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

import operator

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


# What unpacking a gathered buffer consists of: views and splits of it, and reshapes (which copy the
# strided pieces of one parameter out).
_UNPACK = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor, torch.ops.aten.slice.Tensor,
    torch.ops.aten.t.default, torch.ops.aten.as_strided.default, operator.getitem,
})


def _issue_chains(gathers) -> set:
    """Every fused gather and the copy-in nodes it reads (its call_function ancestors: casts,
    flattening and the cat of the shards)."""
    out: set = set()
    frontier = list(gathers)
    while frontier:
        node = frontier.pop()
        if node.op == "call_function" and node not in out:
            out.add(node)
            frontier.extend(node.all_input_nodes)
    return out


def _after_unpack(wait: torch.fx.Node, issued: set) -> torch.fx.Node:
    """The first node after ``wait`` that is neither part of unpacking its buffer (lowering places
    the unpack right after the wait) nor a gather already issued there (``issued``: gathers and
    their copy-in): where the next gather is issued, after those already moved."""
    unpacked = {wait}
    node = wait.next
    while node.op == "call_function" and (
            node in issued or (node.target in _UNPACK and any(a in unpacked for a in node.all_input_nodes))):
        if node not in issued:
            unpacked.add(node)
        node = node.next
    return node


def _issue_at(gather: torch.fx.Node, anchor: torch.fx.Node) -> None:
    """Move ``gather`` (with the copy-in chain it reads) in front of ``anchor``, unless it is there
    already or earlier (idempotence: a second run finds the chain starting at the anchor)."""
    if gather < anchor:
        return
    chain = _movable_chain(gather, anchor)
    if not chain or chain[0] is anchor:
        return
    for node in chain:
        anchor.prepend(node)


def prefetch_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    depth = ctx.prefetch_depth
    graph = gm.graph
    gathers = _fused(graph, "all_gather", c10d.all_gather_into_tensor.default)
    issued = _issue_chains(gathers)
    explicit = ctx.explicit_prefetch
    for phase, table in explicit.items():
        # set_modules_to_{forward,backward}_prefetch: when a unit waits for its gather, the listed
        # units' gathers are already in flight.
        by_unit = {g.meta.get(meta.FSDP_UNIT): g for g in gathers if gather_phase(g) == phase}
        for unit, targets in table.items():
            if unit not in by_unit:
                continue
            anchor = _after_unpack(_wait_of(by_unit[unit]), issued)
            for target in targets:
                gather = by_unit.get(target)
                if gather is not None:
                    _issue_at(gather, anchor)
    if depth > 0:
        for phase in (FORWARD, BACKWARD):
            # Units in need order (where their gathers are waited for: this pass never moves a
            # wait, so a second run sees the same order and moves nothing). Once unit j has
            # unpacked its parameters, units j+1..j+depth are in flight: unit k's gather goes
            # right after the unpack of unit k-depth (the first unit's stays before its wait),
            # each in need order.
            ordered = sorted((g for g in gathers if gather_phase(g) == phase), key=_wait_of)
            for k in range(1, len(ordered)):
                _issue_at(ordered[k], _after_unpack(_wait_of(ordered[max(k - depth, 0)]), issued))
    graph.lint()
    recompile(gm)
    return gm
