"""Token-weighted mean losses made global, before propagation.

``nll_loss_forward`` (and its 2-d form) with ``reduction="mean"`` divides the summed loss by the
*total weight* of the targets it counted: the number of labels that are not ``ignore_index`` (or
the sum of their class weights). When the batch is sharded, DTensor's rule computes that mean on
each shard and averages the per-rank means (``Partial(avg)``). That is the global mean only when
every rank counts the same number of tokens; with padded or masked labels (-100) it is not, and the
returned loss silently differs from one device's (the gradients were already exact: backward reads
the total weight, which is a ``Partial(sum)`` reduced over the ranks).

The rewrite makes the division explicit: the kernel runs with ``reduction="sum"`` and its result is
divided by its own total weight (the kernel's second output, the same value for both reductions).
Propagation then sees two partial sums, reduces both over the sharded axes and divides the global
sum by the global count, exactly as one device does; the backward node is unchanged and keeps
reading the (global) total weight. On one device ``sum / total_weight`` is the same arithmetic the
"mean" kernel does, so unsharded programs compute the same bits.

Reads: ``aten.nll_loss_forward`` / ``aten.nll_loss2d_forward`` nodes of the joint graph.
Writes: their reduction argument (mean -> sum) and one ``aten.div.Tensor`` node per rewritten loss,
tagged ``node.meta["hp_loss_mean"] = True`` (the mean loss: sum / count), which takes over every use
of the loss value.
"""

from __future__ import annotations

import operator

import torch

from ..errors import internal_error
from ..ir import meta
from . import recompile

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch's Reduction enum values (none=0, mean=1, sum=2)
_TOKEN_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_REDUCTION_ARG = 3  # (self, target, weight, reduction, ignore_index)


def _output(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    """The ``getitem(node, index)`` reading one output of a multi-output node (made if missing)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    item.meta = {**node.meta, "val": node.meta["val"][index]}
    return item


def make_token_means_global(gm: torch.fx.GraphModule) -> int:
    """Rewrite every mean-reduced token loss as ``sum / total_weight`` (module docstring).

    Returns how many losses were rewritten; idempotent (a rewritten loss is sum-reduced)."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TOKEN_LOSSES:
            continue
        args = list(node.args)
        if len(args) <= _REDUCTION_ARG or args[_REDUCTION_ARG] != _MEAN:
            continue
        loss = _output(graph, node, 0)
        total_weight = _output(graph, node, 1)
        args[_REDUCTION_ARG] = _SUM
        node.args = tuple(args)
        with graph.inserting_after(_later(loss, total_weight)):
            mean = graph.call_function(aten.div.Tensor, (loss, total_weight))
        # The mean keeps the loss's module, source line and phase, so dumps and plans read the same.
        mean.meta = {**loss.meta, meta.LOSS_MEAN: True}
        loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
        rewritten += 1
    if rewritten:
        graph.lint()
        recompile(gm)
    return rewritten


def _later(a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
    """Of two nodes of one graph, the one that comes later in its order."""
    for node in a.graph.nodes:
        if node is a:
            return b
        if node is b:
            return a
    raise internal_error(
        "loss reduction (token-mean losses made global)",
        f"nodes {a.name!r} and {b.name!r} (a loss and its total weight) are not both in the joint graph",
        node=a,
    )
