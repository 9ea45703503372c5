"""What ``step(inputs, targets)`` hands the model and takes back as the loss.

Shared by the plain module's ``ParallelModule.step`` (runtime/module.py) and the pipeline's step
(pipeline/step.py), so the runtime needs nothing of the pipeline's compile for it.
"""

from __future__ import annotations

from typing import Any

import torch


def loss_of(out) -> torch.Tensor:
    """The scalar loss of a forward's output: the output itself, or its ``loss`` entry."""
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, dict) or hasattr(out, "keys"):
        loss = out.get("loss") if hasattr(out, "get") else None
    else:
        loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "a pipelined model needs its loss: pass parallelize(..., loss_fn=fn) (called as "
            "fn(model_output, target)) or use a model whose forward returns a scalar loss or an "
            f"output with a 'loss' entry; got {type(out).__name__}"
        )
    return loss


def call_arguments(inputs: Any, targets: Any, loss_fn) -> tuple[tuple, dict]:
    """``step``'s ``inputs`` (a tensor, a tuple of positional arguments or a dict of keyword
    arguments) and ``targets`` as the (args, kwargs) the captured forward takes."""
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    if loss_fn is not None:
        if targets is None:
            raise ValueError("step(inputs, targets): this model was parallelized with loss_fn, so pass the targets")
        args = (*args, targets)
    elif targets is not None:
        raise ValueError(
            "step(inputs, targets): targets are for parallelize(..., loss_fn=...); this model computes its "
            "own loss, so pass everything it takes in inputs"
        )
    return args, kwargs
