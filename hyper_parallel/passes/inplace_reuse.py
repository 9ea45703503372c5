"""inplace_reuse: an elementwise op writes into an input that dies there instead of a new buffer.

Eager programs allocate a fresh tensor for every op. Where an elementwise op (``exp``, ``mul``,
``sub`` ...) reads a tensor of its own shape, dtype and layout for the last time, its result can
take that tensor's storage: ``exp(x)`` becomes ``exp_(x)``. The loss is where this matters most: the
vocab-parallel cross-entropy's backward reads the saved log-probabilities once, into
``exp``, ``mul`` and ``sub`` of ``[tokens, vocab / tp]`` each, so out of place it holds three
logits-sized fp32 buffers at once (the peak of Llama 3 70B's step under FSDP x TP in ``explain``),
in place two. Inductor plans its own buffer reuse, so the pass runs for ``codegen="eager"`` only.

Reads the final local joint graph (the last pass: the order is the schedule) and ``meta["val"]``.
Writes: such a node's target becomes the in-place overload (for a commutative op whose second
operand is the one that dies, the operands are swapped: ``a * b == b * a`` exactly) and
``meta[INPLACE_OF]`` keeps the out-of-place op. Numerics unchanged: the same kernel writes the same
values, only into another buffer.

Which tensor may be overwritten: one a non-aliasing ``aten`` op allocated (its output, or an element
of its tuple output), contiguous, whose storage nothing reads after this op. Storage is followed
through every op that may alias an input (views, in-place ops, per their schemas), and through
anything else that is not an ``aten`` op (collectives and waits, the runtime's helpers): those are
assumed to hold every tensor they are given for as long as their own outputs live. Graph inputs
and outputs are never overwritten, nor anything that shares their storage: parameters, the user's
batch, tangents, gradients, returned values. A forward value backward reads for the last time (a
saved activation) may be overwritten there: the runtime hands backward the only reference to it,
except under ``backward(retain_graph=True)``, where it runs :func:`without_saved_overwrites` of the
program instead. Backward programs a pipeline stage runs split into input- and weight-gradient parts
(zero bubble) are run in another order than the joint graph's, so there the pass leaves backward alone.
"""

from __future__ import annotations

import operator

import torch

from .. import compat
from ..ir import meta
from ..ir.ops import aliases_input
from ..ir.phase import BACKWARD, phases_of
from ..propagation import recompile

aten = torch.ops.aten

# Out-of-place elementwise op -> its in-place overload (same schema but ``self`` written).
_INPLACE = {
    aten.exp.default: aten.exp_.default, aten.log.default: aten.log_.default,
    aten.neg.default: aten.neg_.default, aten.reciprocal.default: aten.reciprocal_.default,
    aten.sqrt.default: aten.sqrt_.default, aten.rsqrt.default: aten.rsqrt_.default,
    aten.sigmoid.default: aten.sigmoid_.default, aten.tanh.default: aten.tanh_.default,
    aten.silu.default: aten.silu_.default, aten.relu.default: aten.relu_.default,
    aten.gelu.default: aten.gelu_.default,
    aten.mul.Tensor: aten.mul_.Tensor, aten.mul.Scalar: aten.mul_.Scalar,
    aten.add.Tensor: aten.add_.Tensor, aten.add.Scalar: aten.add_.Scalar,
    aten.sub.Tensor: aten.sub_.Tensor, aten.sub.Scalar: aten.sub_.Scalar,
    aten.div.Tensor: aten.div_.Tensor, aten.div.Scalar: aten.div_.Scalar,
    aten.pow.Tensor_Scalar: aten.pow_.Scalar,
}
# Two tensor operands that may trade places (``add`` only without ``alpha``).
_COMMUTATIVE = frozenset({aten.mul.Tensor, aten.add.Tensor})


class _Storages:
    """Union-find over nodes that may share a storage, with the last position anything in each
    group is read at and whether the group is pinned (a graph input or output is in it)."""

    def __init__(self):
        self.parent: dict = {}
        self.last: dict = {}
        self.pinned: dict = {}

    def find(self, node):
        root = node
        while self.parent[root] is not root:
            root = self.parent[root]
        while self.parent[node] is not root:  # path compression
            self.parent[node], node = root, self.parent[node]
        return root

    def add(self, node, position: int, pinned: bool = False) -> None:
        self.parent[node] = node
        self.last[node] = position
        self.pinned[node] = pinned

    def union(self, a, b) -> None:
        a, b = self.find(a), self.find(b)
        if a is b:
            return
        self.parent[b] = a
        self.last[a] = max(self.last[a], self.last[b])
        self.pinned[a] = self.pinned[a] or self.pinned[b]

    def read_at(self, node, position: int) -> None:
        root = self.find(node)
        self.last[root] = max(self.last[root], position)


def _fresh(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is a storage an ``aten`` op allocated (not a view of anything)."""
    target = node.target
    if target is operator.getitem:
        node = node.args[0]
        target = node.target
    return (node.op == "call_function" and isinstance(target, compat.OpOverload)
            and target.namespace == "aten" and not aliases_input(target))


def _shares_with_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes whose storage ``node``'s value may share."""
    target = node.target
    if target is operator.getitem:
        producer = node.args[0]
        return [] if _fresh(producer) else [producer]
    if isinstance(target, compat.OpOverload) and target.namespace == "aten":
        if not aliases_input(target):
            return []
        first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        return [first] if first is not None else []
    return list(node.all_input_nodes)  # not an aten op: it may keep anything it is given


def _storage_groups(graph: torch.fx.Graph) -> tuple[_Storages, dict]:
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups = _Storages()
    for node in graph.nodes:
        if node.op == "output":
            for a in node.all_input_nodes:
                groups.read_at(a, order[node])
                groups.pinned[groups.find(a)] = True
            continue
        groups.add(node, order[node], pinned=node.op == "placeholder")
        for a in node.all_input_nodes:
            groups.read_at(a, order[node])
        for a in _shares_with_inputs(node):
            groups.union(a, node)
    return groups, order


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node``'s value is, through results this pass made in place."""
    while node.op == "call_function" and meta.INPLACE_OF in node.meta:
        node = node.args[0]
    return node


def _overwritable(operand, node: torch.fx.Node, groups: _Storages, order: dict) -> bool:
    if not isinstance(operand, torch.fx.Node) or not _fresh(_base(operand)):
        return False
    root = groups.find(operand)
    if groups.pinned[root] or groups.last[root] != order[node]:
        return False
    if any(groups.find(a) is root for a in node.all_input_nodes if a is not operand):
        return False  # another operand reads the same storage
    val, out = operand.meta.get("val"), node.meta.get("val")
    return (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.shape == out.shape
            and val.dtype == out.dtype and val.device == out.device and val.is_contiguous()
            and out.is_contiguous())


def inplace_reuse_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    if ctx.codegen != "eager":
        return gm
    graph = gm.graph
    groups, order = _storage_groups(graph)
    phases = phases_of(graph) if ctx.backward_reordered else {}
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _INPLACE:
            continue
        if ctx.backward_reordered and phases[node] == BACKWARD:
            continue
        if "alpha" in node.kwargs or len(node.args) > 2:
            positions = (0,)
        else:
            positions = (0, 1) if node.target in _COMMUTATIVE else (0,)
        position = next((p for p in positions if p < len(node.args)
                         and _overwritable(node.args[p], node, groups, order)), None)
        if position is None:
            continue
        if position == 1:
            node.args = (node.args[1], node.args[0], *node.args[2:])
        node.meta[meta.INPLACE_OF] = node.target
        node.target = _INPLACE[node.target]
        groups.union(node.args[0], node)  # the result is the operand's storage from here on
        changed = True
    if changed:
        recompile(gm)
    return gm


def without_saved_overwrites(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of backward program ``gm`` in which no op overwrites one of its inputs (the saved
    activations): for ``backward(retain_graph=True)``, which may run backward again on them."""
    result = compat.copy_graph_module(gm)
    for node in result.graph.nodes:
        if _overwrites_input(node):
            node.target = node.meta.pop(meta.INPLACE_OF)
    result.recompile()
    return result


def overwrites_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether program ``gm`` writes into one of its inputs (a saved activation) somewhere."""
    return any(_overwrites_input(n) for n in gm.graph.nodes)


def _overwrites_input(node: torch.fx.Node) -> bool:
    # (The partition copies a saved value's meta onto backward's placeholder for it: only ops count.)
    return node.op == "call_function" and meta.INPLACE_OF in node.meta and _reads_input_storage(node.args[0])


def _reads_input_storage(node) -> bool:
    """Whether ``node``'s value is a program input, or the result of in-place ops on one."""
    return isinstance(node, torch.fx.Node) and _base(node).op == "placeholder"
