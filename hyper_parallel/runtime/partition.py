"""Split the local joint graph into forward and backward programs by phase, not by heuristics.

Every node of the lowered joint graph knows its phase: captured nodes carry autograd's
``partitioner_tag`` ("is_forward"/"is_backward"), and passes that add nodes tag them (the
reshard_after_forward copies, the fused backward collectives). A node without a tag is backward if
any of its inputs is, else forward. The forward program runs the forward nodes and returns its
outputs (the user outputs, then the new values of buffers updated in forward: no tangent, written
back by the runtime) plus every forward value a backward node reads (the saved tensors); the
backward program takes the saved tensors and the tangents and returns one gradient per primal.

torch's partitioners decide placement from dataflow and heuristics (a forward value that backward
could recompute from saved inputs is copied into backward; every collective is forcibly saved),
which fights the schedule our passes build — e.g. it would keep a gathered FSDP parameter alive or
re-run a forward all-gather in backward. Here the schedule in the graph is the schedule that runs.
"""

from __future__ import annotations

import torch

from ..errors import internal_error
from ..ir.phase import BACKWARD, FORWARD, phases_of


def _copy(graph: torch.fx.Graph, node: torch.fx.Node, env: dict) -> torch.fx.Node:
    new = graph.node_copy(node, lambda a: env[a])
    new.meta = node.meta
    return new


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    # wait_tensor counts as impure for fx's DCE; a wait whose result nobody reads (and its
    # collective) is dead here all the same, since every rank drops the same ones.
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op in ("placeholder", "output") or node.users:
                continue
            if node.target is torch.ops._c10d_functional.wait_tensor.default or not node.is_impure():
                graph.erase_node(node)
                changed = True


def partition_by_phase(joint: torch.fx.GraphModule, num_fwd_outputs: int):
    """(forward GraphModule, backward GraphModule, number of saved tensors). The joint graph's first
    ``num_fwd_outputs`` output slots are the forward's (user outputs and buffer updates)."""
    phases = phases_of(joint.graph)
    outputs = list(joint.graph.output_node().args[0])
    fwd_outputs, grads = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    for out in fwd_outputs:
        if isinstance(out, torch.fx.Node) and phases[out] == BACKWARD:
            raise internal_error(
                "the forward/backward partition", "a forward output (user output or buffer update) is "
                "computed in backward: a node it depends on is tagged backward", node=out,
                workaround="turn the passes off one at a time (parallelize(..., disable_passes=[...])) to "
                "find the one that tags it",
            )

    saved: list[torch.fx.Node] = []
    for node in joint.graph.nodes:
        if phases.get(node) != FORWARD:
            continue
        if any(phases.get(u) == BACKWARD for u in node.users) or node in grads:
            saved.append(node)

    fwd = torch.fx.Graph()
    env: dict = {}
    for node in joint.graph.nodes:
        if phases.get(node) != FORWARD:
            continue
        env[node] = fwd.placeholder(node.name) if node.op == "placeholder" else _copy(fwd, node, env)
        if node.op == "placeholder":
            env[node].meta = node.meta
    fwd.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in fwd_outputs) + tuple(env[s] for s in saved))
    _eliminate_dead_code(fwd)

    bwd = torch.fx.Graph()
    benv: dict = {}
    for node in saved:
        benv[node] = bwd.placeholder(node.name)
        benv[node].meta = node.meta
    for node in joint.graph.nodes:
        if phases.get(node) != BACKWARD:
            continue
        benv[node] = bwd.placeholder(node.name) if node.op == "placeholder" else _copy(bwd, node, benv)
        if node.op == "placeholder":
            benv[node].meta = node.meta
    bwd.output(tuple(benv[g] if isinstance(g, torch.fx.Node) else g for g in grads))
    _eliminate_dead_code(bwd)
    return torch.fx.GraphModule(joint, fwd), torch.fx.GraphModule(joint, bwd), len(saved)
