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

A loss that is not such a mean (an MSE from ``loss_fn``, a model's own combination of losses such
as cross-entropy plus a router's load-balancing loss) has no count: the step then averages the
micro-batch losses (each backward seeded with ``1/M``), which equals one device accumulating
gradients over the same M micro-batches (``loss_m / M`` each), as torchtitan and Megatron do; it
equals one device on the whole batch only when every micro-batch weighs the same and the loss is
linear in the batch (a load-balancing loss over batch statistics is not). :func:`loss_combination`
says which of the two a compiled pipeline does, and ``parallelize`` logs a warning for the second.
"""

from __future__ import annotations

import torch

from ..ir.kinds import OutputKind
from ..ir.graph import CapturedGraph, OutputInfo
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


TOKEN_MEAN = "token mean over the step"
MICROBATCH_MEAN = "mean of the micro-batch losses"


def loss_combination(token_mean: bool) -> str:
    """How the step's loss (and gradients) combine the micro-batches (module docstring)."""
    return TOKEN_MEAN if token_mean else MICROBATCH_MEAN


def loss_source(local: torch.fx.GraphModule, captured: CapturedGraph) -> str:
    """``"<op> (<file:line of the user's code>)"`` of the node the loss output is, for messages."""
    slots = local.graph.output_node().args[0]
    position = next((i for i, o in enumerate(captured.outputs) if o.kind == OutputKind.OUTPUT), None)
    node = slots[position] if position is not None else None
    if not isinstance(node, torch.fx.Node):
        return "the loss"
    while node.op == "call_function" and node.target in _THROUGH:
        node = node.args[0]
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip().startswith("File")]
    where = f" ({frames[-1]})" if frames else ""
    return f"{getattr(node.target, '__name__', node.target)}{where}"


def summed_loss(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``s_m`` from the micro-batch's mean and count; 0 for a micro-batch with no counted token (its
    mean is 0/0)."""
    return torch.where(count > 0, mean * count, torch.zeros_like(mean))
