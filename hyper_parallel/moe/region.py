"""Expert regions in the captured graph: each planned experts module becomes two opaque ops.

While the model is exported (compile/capture.py), the forward of every module named by an
``expert_parallel`` entry is replaced by one call of ``hyper_parallel::experts(x, top_k_index,
top_k_weights, params, key)``; its autograd formula is one ``hyper_parallel::experts_backward``.
So the joint graph holds one forward and one backward node per MoE layer instead of the module's
body, whose per-expert row counts are data-dependent and have no single-device shape to capture.
Propagation gives the two ops their layouts (moe/propagation.py) and lowering replaces them by the
dispatch all-to-all, the module's own forward traced on this rank's received rows and local expert
weights, and the combine all-to-all, with the transposes in backward (moe/lowering.py).

The ``key`` is ``"<module fqn>"``; a module called twice in one forward is refused (the second call
would need its own routing state). Outside capture the ops are never run: their eager kernels raise.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

from .resolve import ExpertRegionPlan


@torch.library.custom_op("hyper_parallel::experts", mutates_args=())
def experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            params: list[torch.Tensor], key: str) -> torch.Tensor:
    """An expert-parallel experts module's forward (placeholder for lowering; never run eagerly)."""
    raise RuntimeError(f"hyper_parallel::experts ({key}) only exists inside a compiled program")


@experts.register_fake
def _experts_fake(x, top_k_index, top_k_weights, params, key):
    return torch.empty_like(x)


@torch.library.custom_op("hyper_parallel::experts_backward", mutates_args=())
def experts_backward(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, params: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Gradients of :func:`experts`: ``[d x, d top_k_weights, *d params]``."""
    raise RuntimeError(f"hyper_parallel::experts_backward ({key}) only exists inside a compiled program")


@experts_backward.register_fake
def _experts_backward_fake(grad, x, top_k_index, top_k_weights, params, key):
    return [torch.empty_like(x), torch.empty_like(top_k_weights)] + [torch.empty_like(p) for p in params]


def _setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, params, key = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, *params)
    ctx.key = key


def _backward(ctx, grad):
    x, top_k_index, top_k_weights, *params = ctx.saved_tensors
    grads = experts_backward(grad, x, top_k_index, top_k_weights, params, ctx.key)
    return grads[0], None, grads[1], list(grads[2:]), None


experts.register_autograd(_backward, setup_context=_setup_context)

EXPERTS = torch.ops.hyper_parallel.experts.default
EXPERTS_BACKWARD = torch.ops.hyper_parallel.experts_backward.default


@contextlib.contextmanager
def expert_regions(model: nn.Module, regions: Mapping[str, ExpertRegionPlan]):
    """For the duration of an export: every planned experts module calls :func:`experts` instead of
    its body. Its inputs are checked against the interface the lowering relies on."""
    patched = []
    for fqn, region in regions.items():
        module = model.get_submodule(fqn)
        calls = {"n": 0}

        def forward(x, top_k_index, top_k_weights, *rest, _module=module, _region=region, _calls=calls, **kw):
            where = f"expert_parallel module {_region.module_fqn!r} ({type(_module).__name__})"
            if rest or kw:
                raise TypeError(
                    f"{where} is called with {len(rest) + 3} positional / {len(kw)} keyword arguments; "
                    "an expert region takes exactly (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])"
                )
            if x.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
                    or top_k_index.shape[0] != x.shape[0] or top_k_index.dtype.is_floating_point:
                raise TypeError(
                    f"{where} got hidden {tuple(x.shape)}, top_k_index {tuple(top_k_index.shape)} "
                    f"({top_k_index.dtype}), top_k_weights {tuple(top_k_weights.shape)}; an expert region "
                    "takes (hidden [T, H], integer top_k_index [T, k], top_k_weights [T, k])"
                )
            _calls["n"] += 1
            if _calls["n"] > 1:
                raise ValueError(
                    f"{where} is called twice in one forward; expert parallelism needs one call per "
                    "experts module (give each MoE layer its own experts module)"
                )
            params = [p for _, p in _module.named_parameters()]
            return experts(x, top_k_index, top_k_weights, params, _region.module_fqn)

        patched.append((module, module.__dict__.get("forward")))  # an instance-level forward to restore
        module.forward = forward
    try:
        yield
    finally:
        for module, own_forward in patched:
            if own_forward is None:
                del module.forward
            else:
                module.forward = own_forward
