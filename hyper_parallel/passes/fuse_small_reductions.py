"""fuse_small_reductions: small independent all-reduces of one group become one.

Lowering gives every ``Partial`` value its own all-reduce. Many are a few bytes and independent of
each other: the loss's sum and its token count, each MoE layer's load-balancing statistics in
forward and their gradient rows in backward, a model's other batch statistics. Each blocking
collective costs its latency (about 4 ms on gloo across two CPU cores, tens of microseconds on
NCCL), whatever its size. This pass packs, per phase, reduce op, process group and dtype, the
all-reduces of at most ``SMALL_BYTES`` each into one flat all-reduce, issued after the last of
their inputs is computed; each result is a slice of it.

A fused collective reads every member's input and feeds every member's users, so only members
that do not depend on one another are packed (``bucketing._acyclic_parts`` cuts a group that
would); delaying a member's consumers to the fused wait is the price, bounded because members
are small and their consumers are reductions of statistics (a loss, an auxiliary loss), not the
layers' main data flow.

Reads: ``_c10d_functional.all_reduce`` nodes with one wait, not gradient reductions (``hp_grad_of``:
bucketing's) and not fused already (``hp_bucket``); the phase of each (``ir/phase.py``). Writes: one
fused all-reduce per part with ``hp_bucket = "small reductions <phase> (<n> values[, part k/m])"``,
the members removed, consumers moved after the fused wait. Numerics unchanged (the same sums,
element by element). Idempotent: a fused all-reduce is never a candidate again.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..ir import meta
from ..ir.phase import phases_of
from .bucketing import _acyclic_parts, _fuse_reduction, _restore_topological_order, _single_wait
from ..propagation import recompile

c10d = torch.ops._c10d_functional

SMALL_BYTES = 64 * 1024  # a member's input at most this size


def _groups(graph: torch.fx.Graph) -> dict[tuple, list[torch.fx.Node]]:
    phases = phases_of(graph)
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if (node.op != "call_function" or node.target is not c10d.all_reduce.default
                or meta.BUCKET in node.meta or meta.GRAD_OF in node.meta or _single_wait(node) is None):
            continue
        val = node.args[0].meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int):
            continue  # a data-dependent size: never small for sure
        if val.numel() * val.element_size() > SMALL_BYTES:
            continue
        _, op, group = node.args
        groups[(phases[node], op, group, val.dtype)].append(node)
    return {key: members for key, members in groups.items() if len(members) > 1}


def fuse_small_reductions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = gm.graph
    groups = _groups(graph)
    if not groups:
        return gm
    keys = list(groups)
    fused = False
    for key, parts in zip(keys, _acyclic_parts(graph, [groups[k] for k in keys])):
        phase = key[0]
        for k, part in enumerate(parts, 1):
            if len(part) < 2:
                continue
            where = f", part {k}/{len(parts)}" if len(parts) > 1 else ""
            _fuse_reduction(graph, part, f"small reductions {phase} ({len(part)} values{where})", phase=phase)
            fused = True
    if not fused:  # every group cut into parts of one (each reduction feeds the next): unchanged
        return gm
    _restore_topological_order(graph)
    graph.eliminate_dead_code()
    graph.lint()
    recompile(gm)
    return gm


def fuse_small_reductions_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    return fuse_small_reductions(gm)
