"""Boundary annotations: identity ops that mark where a plan constrains an activation's layout.

During capture, each module the plan constrains (a ParallelStyle's desired input layouts, a
``layouts`` ``forward`` entry) has its inputs and outputs passed through ``hyper_parallel::boundary``
for exactly the duration of the export. The op is an identity whose backward is
``hyper_parallel::boundary_grad``, so the captured joint graph carries one node where the forward
value crosses the module boundary *and* one node where its gradient crosses back. Propagation turns
the first into a redistribution to the planned layout and the second into its transpose (the
gradient returns to the layout the value had before the boundary, e.g. Megatron's ``f``/``g``
conjugate pair), and lowering replaces both by the collectives they need, or by nothing.

The key string names the constraint: ``"<module fqn>|in|<i>"``, ``"<module fqn>|kw|<name>"`` or
``"<module fqn>|out|<i>"``. Outside capture these ops are never called.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hyper_parallel::boundary", mutates_args=())
def boundary(x: torch.Tensor, key: str) -> torch.Tensor:
    """Identity (a copy: custom ops may not alias their inputs) marking a planned layout boundary."""
    return x.clone()


@boundary.register_fake
def _boundary_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("hyper_parallel::boundary_grad", mutates_args=())
def boundary_grad(grad: torch.Tensor, key: str) -> torch.Tensor:
    """Identity marking where the gradient of a ``boundary`` value crosses the boundary back."""
    return grad.clone()


@boundary_grad.register_fake
def _boundary_grad_fake(grad: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(grad)


def _boundary_backward(ctx, grad):
    return boundary_grad(grad, ctx.key), None


def _boundary_setup_context(ctx, inputs, output):
    ctx.key = inputs[1]


boundary.register_autograd(_boundary_backward, setup_context=_boundary_setup_context)

BOUNDARY = torch.ops.hyper_parallel.boundary.default
BOUNDARY_GRAD = torch.ops.hyper_parallel.boundary_grad.default


def boundary_key(module_fqn: str, kind: str, index) -> str:
    """Key of one boundary: kind is "in" (positional input), "kw" (keyword input) or "out"."""
    return f"{module_fqn}|{kind}|{index}"


def parse_boundary_key(key: str) -> tuple[str, str, str]:
    """Inverse of :func:`boundary_key`: (module fqn, kind, index-or-name)."""
    module_fqn, kind, index = key.rsplit("|", 2)
    return module_fqn, kind, index


@torch.library.custom_op("hyper_parallel::unshard", mutates_args=())
def unshard(x: torch.Tensor, param: str) -> torch.Tensor:
    """Marks where an FSDP-stored parameter is brought to its compute layout (the all-gather).

    Inserted into the joint graph after capture (propagation/unshard.py), never traced through
    autograd: the parameter's gradient goes straight to its storage layout (the reduce-scatter)."""
    return x.clone()


@unshard.register_fake
def _unshard_fake(x: torch.Tensor, param: str) -> torch.Tensor:
    return torch.empty_like(x)


UNSHARD = torch.ops.hyper_parallel.unshard.default
