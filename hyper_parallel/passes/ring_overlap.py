"""ring_overlap: each ring-attention transfer runs while the current block's attention computes.

Ring attention (cp/ring.py) issues the transfer of the next K/V block (and, in backward, of the
travelling dK/dV accumulator) at the start of each step, and as lowered waits for it at once, so
the transfer and the block's attention take turns. For plans that ask for overlap
(``hp.AsyncContextParallel``, the reference's AsyncContextParallel) this pass sinks each such wait
to just before the first node that reads the received block: the next step's attention (or the
accumulator's add), so the transfer is in flight while the current block computes. Issue order is
unchanged, so every rank still issues the same collectives in the same order. (On gloo,
serialize_collectives later still waits for a group's previous collective before the next one is
issued: in backward, where a K/V block and an accumulator travel at once, one of the two then
overlaps compute.)

Reads: ``hp_cp_ring`` on the transfers (its ``overlap`` field). Writes: node order only, so the
numbers are the same with the pass disabled. Idempotent: a wait already right before its first
user stays there.
"""

from __future__ import annotations

import torch

from ..ir import meta
from ..propagation import recompile

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _overlapped_transfer(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _WAIT:
        return False
    issue = node.args[0]
    tag = issue.meta.get(meta.CP_RING) if isinstance(issue, torch.fx.Node) else None
    return bool(tag and tag.get("overlap"))


def ring_overlap(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Sink the wait of every overlapped ring transfer to its first user (in place)."""
    moved = False
    for wait in [n for n in gm.graph.nodes if _overlapped_transfer(n)]:
        if not wait.users:
            continue
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(wait.users, key=index.__getitem__)
        if wait.next is first:
            continue
        first.prepend(wait)  # the wait reads only its collective, issued before it: still valid
        moved = True
    if moved:
        gm.graph.lint()
        recompile(gm)
    return gm


def ring_overlap_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    return ring_overlap(gm)
