"""Merge plan boundaries that constrain the same value, before propagation.

Reads: ``hyper_parallel::boundary`` / ``boundary_grad`` nodes and the resolved plan's constraints.
Writes: the joint graph, in place:

1. Forward boundaries of one value with the same constraint (q/k/v projections all asking for the
   same input layout) become one node, so the value is redistributed once (one all-gather under
   sequence parallelism, not three). Their ``boundary_grad`` nodes are re-keyed to the survivor.
2. ``add(boundary_grad(a, k), boundary_grad(b, k))`` becomes ``boundary_grad(add(a, b), k)``: the
   gradients of the uses of one value are accumulated *before* they cross the boundary back, so the
   partial gradients of q, k and v are summed locally and reduced once (Megatron's single
   all-reduce per block input). Exact: the reduction is linear.
"""

from __future__ import annotations

import torch

from ..compile.annotations import BOUNDARY, BOUNDARY_GRAD, parse_boundary_key
from . import recompile

aten = torch.ops.aten


def _constraint(resolved, key: str):
    module_fqn, kind, index = parse_boundary_key(key)
    cons = resolved.modules[module_fqn]
    if kind == "in":
        return cons.inputs[int(index)]
    if kind == "kw":
        return cons.kwarg_inputs[index]
    return cons.outputs[int(index)]


def _constraint_text(constraint, ndim: int) -> str:
    parts = []
    for axis, p in sorted(constraint.placements.items()):
        dim = getattr(p, "dim", None)
        parts.append(f"{axis}={type(p).__name__}({dim % ndim if dim is not None else ''})")
    return ",".join(parts)


def merge_boundaries(gm: torch.fx.GraphModule, resolved) -> int:
    """Apply both rewrites (module docstring); returns how many boundary nodes were removed."""
    graph = gm.graph
    removed = 0
    survivors: dict[tuple, torch.fx.Node] = {}
    rekey: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not BOUNDARY:
            continue
        x, key = node.args
        ndim = node.meta["val"].dim()
        ident = (x, _constraint_text(_constraint(resolved, key), ndim))
        kept = survivors.setdefault(ident, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            rekey[key] = kept.args[1]
            removed += 1
    for node in graph.nodes:
        if node.op == "call_function" and node.target is BOUNDARY_GRAD and node.args[1] in rekey:
            node.args = (node.args[0], rekey[node.args[1]])

    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2:
                continue
            a, b = node.args
            if not (_is_grad_boundary(a) and _is_grad_boundary(b) and a.args[1] == b.args[1]):
                continue
            if len(a.users) != 1 or len(b.users) != 1 or node.kwargs:
                continue
            with graph.inserting_before(node):
                summed = graph.call_function(aten.add.Tensor, (a.args[0], b.args[0]))
                summed.meta.update(node.meta)
                merged = graph.call_function(BOUNDARY_GRAD, (summed, a.args[1]))
                merged.meta.update(a.meta)
                merged.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(merged)
            graph.erase_node(node)
            graph.erase_node(a)
            graph.erase_node(b)
            removed += 1
            changed = True
    graph.lint()
    recompile(gm)
    return removed


def _is_grad_boundary(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is BOUNDARY_GRAD
