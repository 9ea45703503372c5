"""What selects and describes a compiled program, read by the driver and the runtime alike.

A program is compiled for one input signature (:func:`signature` of each flat input: shape, dtype,
requires_grad and device of a tensor, the value of a constant), which errors and the recompile log
word with :func:`format_signature`; :func:`capture_device` is where a value is captured;
:func:`current_rank` the rank that logs and dumps. Both the compile driver and the runtime above it
import these from here, so neither imports the other for them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def signature(x) -> tuple:
    """The part of a call's flat input that selects its program."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
    return ("const", type(x).__name__, repr(x))


def format_signature(signature: tuple) -> str:
    """``int64[4, 16] on cpu`` for a tensor's :func:`signature`, ``int 3`` for a constant."""
    if signature[0] == "tensor":
        _, shape, dtype, requires_grad, device = signature
        text = f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"
        return text + (" requiring grad" if requires_grad else "")
    return f"{signature[1]} {signature[2]}"


def capture_device(t: torch.Tensor) -> torch.device:
    """The device a value is captured on: where it lives, so factory ops in the graph (positions,
    masks) and the swap pass's copies back name the device the program runs on. Meta tensors
    (planning) are captured on the CPU."""
    return torch.device("cpu") if t.device.type == "meta" else t.device


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
