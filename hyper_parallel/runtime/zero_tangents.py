"""The backward program for a step in which some outputs got no gradient.

A compiled step returns the model's outputs from one ``torch.autograd.Function``; its backward
program takes one tangent (the output's gradient) per differentiable output. Usually only the loss
gets one: a model that returns its loss *and* its logits, trained with ``loss.backward()``. By
default autograd then hands the function a zeros tensor of each unused output's full size (for
logits, ``[tokens, vocab]``, the largest activation of a language model) and the program adds it
into the gradient flowing back from the loss: one allocation and one pass over that size, for
nothing, at the start of backward, near the step's memory peak.

The runtime asks autograd not to materialise them (``ctx.set_materialize_grads(False)``: an unused
output's gradient arrives as None) and runs :func:`without_tangents` of the program instead: the
same graph with those tangent placeholders read as zeros. An ``add`` of one and a value of the same
shape and dtype becomes that value; any other use (a redistribution of the tangent, a
context-parallel reordering) reads a zeros tensor the program creates. Every collective stays, so
the program's collective sequence does not depend on which outputs a rank's loss used (ranks may
differ there without a hang). Numbers are unchanged: adding zeros is exact.

Reads the backward GraphModule (placeholders named ``tangents_<k>``, runtime/program.py) and
``meta["val"]`` of the tangents and of the values added to them; returns a new GraphModule with the
same signature (the missing tangents are passed as None and never read).
"""

from __future__ import annotations

import torch

from .. import compat

aten = torch.ops.aten


def tangent_placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """A backward program's tangent placeholders, in argument order (one per differentiable
    output, after the saved values)."""
    return [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents_")]


def _same_value(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    x, y = a.meta.get("val"), b.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype


def zero_add_operand(user: torch.fx.Node, tangent: torch.fx.Node) -> torch.fx.Node | None:
    """The other operand of ``user`` when it adds ``tangent`` to a value of its own shape and
    dtype (what :func:`without_tangents` replaces it by), else None. The add may be in place into
    that value (passes/inplace_reuse.py), never into the tangent."""
    if user.target not in (aten.add.Tensor, aten.add_.Tensor) or len(user.args) != 2 or user.kwargs:
        return None
    a, b = user.args
    if user.target is aten.add_.Tensor and a is tangent:
        return None
    other = b if a is tangent else a
    if isinstance(other, torch.fx.Node) and other is not tangent and _same_value(other, user):
        return other
    return None


def without_tangents(gm: torch.fx.GraphModule, missing: tuple[int, ...]) -> torch.fx.GraphModule:
    """``gm`` with the tangents at positions ``missing`` (indices into :func:`tangent_placeholders`)
    treated as zeros (module docstring)."""
    result = compat.copy_graph_module(gm)
    graph = result.graph
    tangents = tangent_placeholders(graph)
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    for position in missing:
        tangent = tangents[position]
        for user in list(tangent.users):
            other = zero_add_operand(user, tangent)
            if other is not None:
                user.replace_all_uses_with(other)
                graph.erase_node(user)
        if tangent.users:
            val = tangent.meta["val"]
            with graph.inserting_before(first_compute):
                zeros = graph.call_function(aten.zeros.default, (list(val.shape),),
                                            {"dtype": val.dtype, "device": val.device})
            zeros.meta = {**tangent.meta}
            tangent.replace_all_uses_with(zeros)
    graph.lint()
    result.recompile()
    return result

