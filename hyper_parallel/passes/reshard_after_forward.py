"""reshard_after_forward: gather FSDP parameters again in backward instead of keeping them.

Without this pass the partitioner saves every all-gathered parameter (and views of it, such as the
transposed weight a matmul's backward uses) from forward to backward: FSDP with
``reshard_after_forward=False``. For units that reshard, every backward use of an all-gathered
parameter, or of a cheap view of it computed in forward, is rewired to a copy of that chain made in
the backward region, right before its first backward use; the forward copy then dies after its
last forward use and only the shard (a graph input) crosses to backward.

Reads: ``hp_fsdp_param``/``hp_fsdp_unit``/``hp_role`` (lowering) and ``partitioner_tag`` on nodes,
``ctx.fsdp`` (units and their reshard flags). Writes: copied nodes with
``meta["hp_fsdp_phase"] = "backward"``. Idempotent (backward uses already point at copies);
numerics unchanged (the copies compute the same values).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# Ops that only re-view or re-type a gathered parameter: recomputing them in backward is free next
# to keeping their unsharded result alive.
_CHEAP = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int, aten.split_with_sizes.default, aten.cat.default,
    aten.contiguous.default,
}


def _is_backward(node: torch.fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward" or node.meta.get("hp_fsdp_phase") == "backward"


def gathered_param_region(graph: torch.fx.Graph, params=None) -> set[torch.fx.Node]:
    """Forward nodes holding an all-gathered FSDP parameter (of ``params``, default all) or a cheap
    view of one: what keeping a parameter unsharded between forward and backward costs."""
    region: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if _is_backward(node) or node.op != "call_function":
            continue
        param = node.meta.get("hp_fsdp_param")
        if param is not None and (params is None or param in params) and node.meta.get("hp_role") == "redistribute":
            region.add(node)
        elif node.target in _CHEAP and any(a in region for a in node.all_input_nodes):
            if all(a in region or a.op == "placeholder" for a in node.all_input_nodes):
                region.add(node)
    return region


def reshard_after_forward_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    fsdp = getattr(ctx, "fsdp", None)
    if fsdp is None:
        return gm
    resharding = {p for u in fsdp.units if u.reshard_after_forward for p in u.params}
    graph = gm.graph
    # The forward region that may be recomputed: the all-gather chains of resharding parameters and
    # the cheap views computed from them in forward.
    region = gathered_param_region(graph, resharding)
    if not region:
        return gm
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def copy_before(node: torch.fx.Node, anchor: torch.fx.Node) -> torch.fx.Node:
        if node not in region:
            return node
        if node not in copies:
            for arg in node.all_input_nodes:
                copy_before(arg, anchor)
            with graph.inserting_before(anchor):
                new = graph.node_copy(node, lambda a: copies.get(a, a))
            new.meta["hp_fsdp_phase"] = "backward"
            new.meta["partitioner_tag"] = "is_backward"
            copies[node] = new
        return copies[node]

    for user in list(graph.nodes):
        if not _is_backward(user) or user in copies.values():
            continue
        for arg in list(user.all_input_nodes):
            if arg in region:
                user.replace_input_with(arg, copy_before(arg, user))
    graph.lint()
    gm.recompile()
    return gm
