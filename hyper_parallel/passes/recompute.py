"""recompute: values computed inside recompute regions are recomputed in backward, not saved.

Without this pass every forward value that backward reads is saved between the two (the partitioner
keeps exactly what the graph says). For each forward node inside a recompute region of
``ctx.activation`` (``recompute.ActivationPlan``: module regions of the plan, and the calls the
model made to ``hp.checkpoint``) whose policy says recompute, each backward use is rewired to a copy
of the node made in backward right before its first backward use, together with the chain of the
region's values it is computed from. Values the chain needs from outside the region (the region's
inputs, parameters) or that the policy keeps (``selective``: matmul, attention and collective
outputs; random ops always) stay saved: with ``full`` only a region's inputs cross from forward to
backward. Values a policy marks ``MUST_SWAP``, every saved value of a swap region, and with
``swap_inputs`` the saved inputs of a checkpointed call, are marked for the swap pass.

FSDP parameter all-gather chains are never recomputed here; they are inputs of the region, and the
reshard_after_forward pass (which runs next) decides whether backward gathers them again.

Reads: ``nn_module_stack`` and ``hp_region`` (which region a node belongs to), ``partitioner_tag`` /
``hp_fsdp_phase`` (phase), ``val`` (fake inputs for policy callables), ``ctx.activation``. Writes:
copies tagged ``partitioner_tag="is_backward"`` and ``meta["hp_recompute"] = <region>``;
``meta["hp_swap"] = <region>`` on values to swap. Idempotent (backward uses already read copies);
numerics unchanged (the same ops run again on the same values; random ops are never recomputed).
"""

from __future__ import annotations

import operator

import torch

from ..compat import pytree
from .. import compat
from ..ir.graph import module_fqn_of
from ..recompute import CheckpointPolicy
from ..ir import meta
from ..ir.ops import is_view_of_input
from ..ir.phase import BACKWARD, is_tagged_backward, tag
from .reshard_after_forward import gathered_param_region
from ..propagation import recompile


def op_name(node: torch.fx.Node) -> str:
    """``"aten.mm.default"`` for an aten overload; a getitem is named by the op it picks from."""
    if node.target is operator.getitem:
        return op_name(node.args[0])
    return compat.op_overload_name(node.target)


def _decision(region, node: torch.fx.Node, module_fqn: str) -> CheckpointPolicy:
    source = node.args[0] if node.target is operator.getitem else node
    args, kwargs = pytree.tree_map_only(
        torch.fx.Node, lambda n: n.meta.get("val"), (source.args, source.kwargs)
    )
    return region.decide(op_name(node), source.target, args, kwargs, module_fqn)


def recompute_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    plan = ctx.activation
    if not plan:
        return gm
    graph = gm.graph
    sources = gathered_param_region(graph)
    recomputed: dict[torch.fx.Node, str] = {}  # forward node -> its region's key
    swapped: dict[torch.fx.Node, object] = {}  # forward node -> its region
    for node in graph.nodes:
        if node.op != "call_function" or is_tagged_backward(node) or node in sources:
            continue
        fqn = module_fqn_of(node)
        region = plan.region_of(node, fqn)
        if region is None or compat.is_mutating_op(node.target):
            continue
        decision = _decision(region, node, fqn)
        if decision is CheckpointPolicy.MUST_SWAP:
            if not is_view_of_input(node):  # copying a view of a parameter to host saves nothing
                swapped[node] = region
        elif region.kind == "recompute" and not decision.saves:
            recomputed[node] = region.key
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    made: set[torch.fx.Node] = set()  # copies.values(), for the membership test below (a set: O(1))
    region_inputs: dict[torch.fx.Node, object] = {}  # values recompute chains read from outside

    def copy_before(node: torch.fx.Node, anchor: torch.fx.Node, key: str) -> torch.fx.Node:
        # Values of another region (e.g. the previous layer's output) are this region's inputs:
        # saved, not recomputed through (which would recompute every earlier layer again).
        if recomputed.get(node) != key:
            region_inputs.setdefault(node, plan.annotated.get(key))
            return node
        if node not in copies:
            for arg in node.all_input_nodes:
                copy_before(arg, anchor, key)
            with graph.inserting_before(anchor):
                new = graph.node_copy(node, lambda a: copies.get(a, a))
            tag(new, BACKWARD)
            new.meta[meta.RECOMPUTE] = key
            copies[node] = new
            made.add(new)
        return copies[node]

    for user in list(graph.nodes):
        if not is_tagged_backward(user) or user in made:
            continue
        for arg in list(user.all_input_nodes):
            if arg in recomputed:
                user.replace_input_with(arg, copy_before(arg, user, recomputed[arg]))
    # hp.checkpoint(swap_inputs=True): the region inputs its recompute reads go to host memory.
    for node, region in region_inputs.items():
        if region is not None and region.swap_inputs and node.op == "call_function" and node not in sources:
            swapped.setdefault(node, region)
    for node, region in swapped.items():
        node.meta[meta.SWAP] = region.key
        node.meta[meta.SWAP_GROUP] = region.group_swap
    graph.lint()
    recompile(gm)
    return gm
