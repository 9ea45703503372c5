"""A pipeline step's loss over its micro-batches: the mean over all the step's tokens.

A token-averaged loss (cross-entropy with ignored labels) on micro-batch ``m`` is ``s_m / n_m``:
the summed loss over the ``n_m`` tokens it counts. One device on the whole batch computes
``sum(s_m) / sum(n_m)``; averaging the micro-batches' means (``sum(s_m / n_m) / M``) differs whenever
micro-batches count different numbers of tokens (padding), in the loss and in every gradient.

So the last stage's forward program also returns ``n_m`` (the denominator of the loss's mean, made
explicit by propagation/loss_reduction.py, already global over the data-parallel ranks); the
executor seeds micro-batch ``m``'s backward with ``n_m`` (the gradient of ``s_m``), sums ``s_m`` and
``n_m`` over the step, and at the end every pp rank divides its gradients by ``N = sum(n_m)``
(broadcast from the last stage with the loss). The loss returned is ``sum(s_m) / N``.

A loss that is not such a mean (an MSE from ``loss_fn``, a model's own combination of losses) has
no count: the step then averages the micro-batch losses (each backward seeded with ``1/M``), which
is exact when every micro-batch weighs the same.
"""

from __future__ import annotations

import torch

from ..ir.kinds import OutputKind
from ..compile.capture import CapturedGraph, OutputInfo
from ..passes.pipeline_split import LOSS_COUNT
from ..ir import meta

_c10d = torch.ops._c10d_functional
_THROUGH = (_c10d.wait_tensor.default, _c10d.all_reduce.default)


def expose_loss_count(local: torch.fx.GraphModule, captured: CapturedGraph) -> bool:
    """Add a ``LOSS_COUNT`` forward output right after the loss when the loss is a token mean
    (``hp_loss_mean``, reached from the loss output through its reduction's collectives). Returns
    whether it did; ``captured.outputs`` gets the matching slot description."""
    out = local.graph.output_node()
    slots = list(out.args[0])
    position = next((i for i, o in enumerate(captured.outputs) if o.kind == OutputKind.OUTPUT), None)
    if position is None or not isinstance(slots[position], torch.fx.Node):
        return False
    node = slots[position]
    while node.op == "call_function" and node.target in _THROUGH:
        node = node.args[0]
    if not node.meta.get(meta.LOSS_MEAN):
        return False
    count = node.args[1]
    slots.insert(position + 1, count)
    out.args = (tuple(slots),)
    captured.outputs.insert(position + 1, OutputInfo(LOSS_COUNT, "loss", -1))
    local.recompile()
    return True


def summed_loss(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``s_m`` from the micro-batch's mean and count; 0 for a micro-batch with no counted token (its
    mean is 0/0)."""
    return torch.where(count > 0, mean * count, torch.zeros_like(mean))
