"""expert_overlap: one token chunk's all-to-alls run while the other chunk's experts compute.

An expert region planned with ``hp.ExpertParallel(overlap=True)`` (the reference's
``CommComputeOverlap``) is lowered as two token chunks, one after the other, each node tagged with
its chunk (``hp_expert_chunk`` = ``"<experts fqn>#<chunk>"``, moe/lowering.py). Run as lowered, each
chunk waits for its own dispatch before its experts start, so nothing overlaps. This pass
interleaves the chunks of each region, forward and backward separately, like coroutines: every
chunk runs until it reaches the wait of a collective; when all are waiting, the wait of the
collective issued first is taken and that chunk resumes. The result per layer is
``dispatch(0) dispatch(1) | wait(0) experts(0) combine(0) | wait(1) experts(1) combine(1) | ...``:
chunk 1's dispatch is in flight while chunk 0's experts compute, chunk 0's combine while chunk 1's
do; backward likewise with the transposes. (On gloo, serialize_collectives then still waits for a
group's previous collective before issuing the next: each transfer overlaps the other chunk's
compute, not the other transfer.)

Reads: ``hp_expert_chunk`` and the phase of each node (``ir/phase.py``). Writes: node order only
(numerics unchanged). Nodes between a region's chunk nodes that the chunks read stay before them,
the others move after; a region whose chunks would read each other's values is left as it is.
Idempotent: the order within each chunk is kept, so a second run computes the same schedule.
"""

from __future__ import annotations

import collections

import torch

from ..ir import meta
from ..ir.phase import phases_of
from ..propagation import recompile

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is _WAIT


def _schedule(chunks: list[list[torch.fx.Node]]) -> list[torch.fx.Node]:
    """The chunks' nodes interleaved: each runs up to its next wait; then the earliest-issued
    collective among the waiting chunks is waited for and its chunk resumes."""
    pos = [0] * len(chunks)
    order: list[torch.fx.Node] = []
    emitted: dict[torch.fx.Node, int] = {}
    while True:
        for c, seq in enumerate(chunks):
            while pos[c] < len(seq) and not _is_wait(seq[pos[c]]):
                emitted[seq[pos[c]]] = len(order)
                order.append(seq[pos[c]])
                pos[c] += 1
        waiting = [c for c, seq in enumerate(chunks) if pos[c] < len(seq)]
        if not waiting:
            return order
        first = min(waiting, key=lambda c: emitted.get(chunks[c][pos[c]].args[0], -1))
        wait = chunks[first][pos[first]]
        emitted[wait] = len(order)
        order.append(wait)
        pos[first] += 1


def _reorder(graph: torch.fx.Graph, group: list[torch.fx.Node], schedule: list[torch.fx.Node]) -> bool:
    """Put ``schedule`` where ``group`` spans; nodes in between that the group reads go before it,
    the rest after. Returns False (graph unchanged) if that would read a value before it exists."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    first, last = index[group[0]], index[group[-1]]
    members = set(group)
    between = [n for n in nodes[first:last + 1] if n not in members]
    needed: set[torch.fx.Node] = set()
    stack = [a for n in group for a in n.all_input_nodes if first <= index[a] <= last and a not in members]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack += [a for a in n.all_input_nodes if first <= index[a] <= last and a not in members]
    if any(a in members for n in needed for a in n.all_input_nodes):
        return False
    new = [n for n in between if n in needed] + schedule + [n for n in between if n not in needed]
    position = {n: i for i, n in enumerate(new)}
    if any(position[a] > position[n] for n in new for a in n.all_input_nodes if a in position):
        return False
    anchor = nodes[first].prev
    for n in new:
        anchor.append(n)
        anchor = n
    return True


def expert_overlap(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Interleave the token chunks of every expert region, per phase (in place)."""
    phases = phases_of(gm.graph)
    groups: dict[tuple, dict[int, list[torch.fx.Node]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for node in gm.graph.nodes:
        tag = node.meta.get(meta.EXPERT_CHUNK)
        if tag is None:
            continue
        region, chunk = tag.rsplit("#", 1)
        groups[(region, phases[node])][int(chunk)].append(node)
    changed = False
    for by_chunk in groups.values():
        if len(by_chunk) < 2:
            continue
        chunks = [by_chunk[c] for c in sorted(by_chunk)]
        schedule = _schedule(chunks)
        index = {n: i for i, n in enumerate(gm.graph.nodes)}  # earlier regions may have moved nodes
        group = sorted(schedule, key=index.__getitem__)
        if schedule != group:
            changed |= _reorder(gm.graph, group, schedule)
    if changed:
        gm.graph.lint()
        recompile(gm)
    return gm


def expert_overlap_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    return expert_overlap(gm)
