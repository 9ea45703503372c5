"""Insert one ``hyper_parallel::unshard`` node per FSDP parameter, before propagation.

Reads: ``resolved.fsdp`` (which parameters are stored sharded) and the placeholders' descriptors.
Writes: the joint graph, in place: each FSDP parameter placeholder's uses are rerouted through an
``unshard(param, fqn)`` node placed right before its first use, so the all-gather it lowers to sits
where the parameter is needed (the prefetch pass may move it earlier). The node's ``meta`` gets
``hp_fsdp_param`` (FQN) and ``hp_fsdp_unit`` (unit module FQN).
"""

from __future__ import annotations

import torch

from ..annotations import UNSHARD
from ..capture import CapturedGraph


def insert_unshard_nodes(captured: CapturedGraph, resolved) -> int:
    fsdp = resolved.fsdp
    if fsdp is None:
        return 0
    graph = captured.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    inserted = 0
    for node, info in zip(list(graph.find_nodes(op="placeholder")), captured.inputs):
        if info.kind != "param" or info.name not in fsdp.unit_of or not node.users:
            continue
        first_user = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first_user):
            gathered = graph.call_function(UNSHARD, (node, info.name))
        gathered.meta["val"] = node.meta["val"]
        gathered.meta["hp_fsdp_param"] = info.name
        gathered.meta["hp_fsdp_unit"] = fsdp.unit_of[info.name]
        for key in ("nn_module_stack", "stack_trace"):
            if key in first_user.meta:
                gathered.meta[key] = first_user.meta[key]
        node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        inserted += 1
    captured.gm.recompile()
    return inserted
