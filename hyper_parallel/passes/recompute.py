"""recompute: values computed inside recompute regions are recomputed in backward, not saved.

Without this pass every forward value that backward reads is saved between the two (the partitioner
keeps exactly what the graph says). For each forward node inside a region of ``ctx.recompute``
(``recompute.RecomputePlan``: a module and its policy) that the policy does not keep, each backward
use is rewired to a copy of the node made in backward right before its first backward use, together
with the chain of region values it is computed from. Values the chain needs from outside the region
(the module's inputs, parameters) or that the policy keeps (``selective``: matmul, attention and
collective outputs; random ops always) stay saved: with ``full`` only a region's inputs cross from
forward to backward.

FSDP parameter all-gather chains are never recomputed here; they are inputs of the region, and the
reshard_after_forward pass (which runs next) decides whether backward gathers them again.

Reads: ``nn_module_stack`` (which module a node belongs to) and ``partitioner_tag`` /
``hp_fsdp_phase`` (phase) on nodes, ``ctx.recompute``. Writes: copies tagged
``partitioner_tag="is_backward"`` and ``meta["hp_recompute"] = <region module FQN>``. Idempotent
(backward uses already read copies); numerics unchanged (the same ops run again on the same values;
random ops are never recomputed).
"""

from __future__ import annotations

import operator

import torch

from .. import compat
from ..capture import module_fqn_of
from .reshard_after_forward import _is_backward, gathered_param_region


def op_name(node: torch.fx.Node) -> str:
    """``"aten.mm.default"`` for an aten overload; a getitem is named by the op it picks from."""
    if node.target is operator.getitem:
        return op_name(node.args[0])
    return compat.op_overload_name(node.target)


def recompute_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    plan = getattr(ctx, "recompute", None)
    if plan is None:
        return gm
    graph = gm.graph
    sources = gathered_param_region(graph)
    recomputed: dict[torch.fx.Node, str] = {}  # forward node -> its region's module FQN
    for node in graph.nodes:
        if node.op != "call_function" or _is_backward(node) or node in sources:
            continue
        fqn = module_fqn_of(node)
        region = plan.region_of(fqn)
        if region is None or region.saves(op_name(node), fqn):
            continue
        if compat.is_mutating_op(node.target):  # never re-run a mutation
            continue
        recomputed[node] = region.module_fqn
    if not recomputed:
        return gm
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def copy_before(node: torch.fx.Node, anchor: torch.fx.Node, region: str) -> torch.fx.Node:
        # Values of another region (e.g. the previous layer's output) are this region's inputs:
        # saved, not recomputed through (which would recompute every earlier layer again).
        if recomputed.get(node) != region:
            return node
        if node not in copies:
            for arg in node.all_input_nodes:
                copy_before(arg, anchor, region)
            with graph.inserting_before(anchor):
                new = graph.node_copy(node, lambda a: copies.get(a, a))
            new.meta["partitioner_tag"] = "is_backward"
            new.meta["hp_recompute"] = recomputed[node]
            copies[node] = new
        return copies[node]

    for user in list(graph.nodes):
        if not _is_backward(user) or user in copies.values():
            continue
        for arg in list(user.all_input_nodes):
            if arg in recomputed:
                user.replace_input_with(arg, copy_before(arg, user, recomputed[arg]))
    graph.lint()
    gm.recompile()
    return gm
