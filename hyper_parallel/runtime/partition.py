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

For zero-bubble pipeline schedules :func:`split_backward` cuts a backward program once more, by
dataflow: an input-gradient program (what the previous pipeline stage waits for) and a
weight-gradient program the schedule runs later (pipeline/runtime.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import compat
from ..errors import internal_error
from ..ir import meta
from ..ir.phase import BACKWARD, FORWARD, phases_of
from .collective_inputs import hold_in_graph, release_after_wait


def _copy(graph: torch.fx.Graph, node: torch.fx.Node, env: dict) -> torch.fx.Node:
    return compat.copy_node(graph, node, env.__getitem__)


def _ring_transfer(wait: torch.fx.Node) -> bool:
    issue = wait.args[0]
    return isinstance(issue, torch.fx.Node) and meta.CP_RING in issue.meta


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    # wait_tensor counts as impure for fx's DCE; a wait whose result nobody reads (and its
    # collective) is dead here all the same, since every rank drops the same ones. Except a ring
    # attention transfer (cp/ring.py): a rank whose queries precede a block's keys does not read
    # it, but the rank it comes from sends it all the same.
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op in ("placeholder", "output") or node.users:
                continue
            if node.target is torch.ops._c10d_functional.wait_tensor.default and _ring_transfer(node):
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
    # Each collective's input lives until its wait (runtime/collective_inputs.py); held in the
    # graphs before the modules generate their code, so each program's code is generated once.
    hold_in_graph(fwd)
    hold_in_graph(bwd)
    # Lazy: flattening the placeholders and the boxed convention change them before the first call.
    return compat.lazy_graph_module(joint, fwd), compat.lazy_graph_module(joint, bwd), len(saved)


class BackwardSplit(NamedTuple):
    """A backward program cut in two for zero-bubble schedules (:func:`split_backward`).

    Run ``input_gm`` on ``[bwd_inputs[i] for i in input_args]``: it returns ``bwd``'s output slots
    ``input_outputs`` (input gradients, ``send_bwd`` values) in order, then the hand-off, the values
    of its nodes W reads. Later run ``weight_gm`` on the hand-off followed by ``[bwd_inputs[i] for i
    in weight_args]``: it returns ``bwd``'s slots ``weight_outputs`` in order."""

    input_gm: torch.fx.GraphModule  # "I" (the paper's B): input gradients, then the hand-off to W
    weight_gm: torch.fx.GraphModule  # "W": parameter gradients, with their reductions if any
    input_outputs: tuple[int, ...]  # bwd's output slots input_gm returns first, in order
    weight_outputs: tuple[int, ...]  # bwd's output slots weight_gm returns, in order
    input_args: tuple[int, ...]  # indices of bwd's inputs input_gm reads, in order
    weight_args: tuple[int, ...]  # indices of bwd's inputs weight_gm reads after the hand-off


def split_backward(bwd: torch.fx.GraphModule, weight_outputs) -> BackwardSplit:
    """Zero-bubble cut of a backward program into an input-gradient program I and a weight-gradient
    program W (:class:`BackwardSplit`).

    ``weight_outputs``: indices of ``bwd``'s output slots that are parameter gradients (with their
    reductions, in a sync variant). W computes the nodes only those outputs need; every other node
    (input gradients, ``send_bwd`` values, and anything both need) goes to I. I reads only the
    ``bwd`` inputs it uses, so an input only W reads (a saved tensor of a weight gradient, a
    ``grad_accum`` sum) need not exist when I runs: W takes it directly, after I's hand-off. The
    cut moves nodes, it changes no op: W's outputs equal ``bwd``'s weight slots. With no weight
    slots W is empty and I is ``bwd``.
    """
    outputs = list(bwd.graph.output_node().args[0])
    weight_outputs = sorted(set(weight_outputs))
    if any(not 0 <= i < len(outputs) for i in weight_outputs):
        raise ValueError(f"split_backward: weight output slots {weight_outputs} are out of range for a "
                         f"backward with {len(outputs)} outputs")
    other = [i for i in range(len(outputs)) if i not in weight_outputs]

    def ancestors(roots):
        seen, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(node.all_input_nodes)
        return seen

    b_needs = ancestors(outputs[i] for i in other)
    w_needs = ancestors(outputs[i] for i in weight_outputs)
    w_nodes = [n for n in bwd.graph.nodes
               if n.op not in ("placeholder", "output") and n not in b_needs and n in w_needs]
    w_set = set(w_nodes)
    crossing = []  # values I hands to W, in graph order
    for node in bwd.graph.nodes:
        if node not in w_set and node.op != "output" and any(u in w_set for u in node.users):
            crossing.append(node)
    crossing += [outputs[i] for i in weight_outputs if isinstance(outputs[i], torch.fx.Node)
                 and outputs[i] not in w_set and outputs[i] not in crossing]
    placeholders = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    w_inputs = [n for n in placeholders if n in crossing]  # W reads these bwd inputs directly
    crossing = [n for n in crossing if n.op != "placeholder"]

    b_graph, env = torch.fx.Graph(), {}
    for node in bwd.graph.nodes:
        # Releases of collective inputs are placed anew in each half below.
        if node.op == "output" or node in w_set or node.target is release_after_wait:
            continue
        env[node] = b_graph.placeholder(node.name) if node.op == "placeholder" else _copy(b_graph, node, env)
        if node.op == "placeholder":
            env[node].meta = node.meta
    b_graph.output(tuple(env[outputs[i]] if isinstance(outputs[i], torch.fx.Node) else outputs[i] for i in other)
                   + tuple(env[n] for n in crossing))
    _eliminate_dead_code(b_graph)
    # I takes only what it reads (the caller may not have W's inputs yet when I runs).
    read = [i for i, n in enumerate(placeholders) if env[n].users]
    for node in placeholders:
        if not env[node].users:
            b_graph.erase_node(env[node])

    w_graph, wenv = torch.fx.Graph(), {}
    for node in crossing + w_inputs:
        wenv[node] = w_graph.placeholder(node.name)
        wenv[node].meta = node.meta
    for node in w_nodes:
        wenv[node] = _copy(w_graph, node, wenv)
    w_graph.output(tuple(wenv[outputs[i]] if isinstance(outputs[i], torch.fx.Node) else outputs[i]
                         for i in weight_outputs))
    _eliminate_dead_code(w_graph)
    hold_in_graph(b_graph)
    hold_in_graph(w_graph)
    return BackwardSplit(
        input_gm=torch.fx.GraphModule(bwd, b_graph),
        weight_gm=torch.fx.GraphModule(bwd, w_graph),
        input_outputs=tuple(other), weight_outputs=tuple(weight_outputs), input_args=tuple(read),
        weight_args=tuple(placeholders.index(n) for n in w_inputs),
    )
