"""bf16 references and gradient bounds for mixed-precision parity tests (docs/testing.md).

A step computing in bf16 somewhere (bf16 parameters with fp32 reduction, ``torch.autocast``) cannot
equal one fp32 device; it is held against one device computing in bf16 the same way: its loss within
bf16's tolerances, each gradient no further from the exact one (float64 at the same bf16 weights)
than DEVICE_ERRORS_ALLOWED times that device's own error. :class:`~hyper_parallel.testing.stepper.ParityStepper`
runs these for ``bf16_reference=True`` / ``grads="near_exact"``; they also work alone.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from hyper_parallel.testing.batches import model_loss


def bf16_copy(master: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``master`` with every parameter cast to bf16 (its buffers as they are): the one
    device computing in bf16 from fp32 master weights."""
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    return compute


def bf16_reference_step(master: torch.nn.Module, batch: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """One device computing in bf16 from fp32 master weights, as FSDP2's mixed precision does: a
    bf16 copy of ``master`` runs forward and backward on the whole ``batch``. Returns (the copy, its
    gradients in ``.grad``; its loss)."""
    compute = bf16_copy(master)
    loss = model_loss(compute(**batch))
    loss.backward()
    return compute, loss


def assert_matches_bf16_reference(model, loss, compute: torch.nn.Module, ref_loss, batch: dict, what: str = "") -> None:
    """A mixed-precision step (bf16 compute, fp32 reduction) against :func:`bf16_reference_step`'s
    ``compute`` copy and loss (on the global ``batch``): the loss within bf16's tolerances (the two
    runs round partial sums at different points), every fp32 gradient within DEVICE_ERRORS_ALLOWED
    times the bf16 device's own distance from the exact gradient (the bound of
    :func:`assert_bf16_gradients_near_exact`; the exact one computed in float64 at ``compute``'s bf16
    weights). A frozen parameter (a LoRA model's base) has no gradient on either side."""
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}loss: {m}")
    device = {n: p.grad for n, p in compute.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and name not in device, f"{what}frozen {name} got a gradient"
            continue
        assert p.grad.dtype == torch.float32, name
    weights = {n: p.detach() for n, p in compute.named_parameters()}
    _assert_near_exact(model, _gradients(compute, weights, batch, torch.float64), device, what)


def _gradients(structure: torch.nn.Module, weights: dict, batch: dict, dtype: torch.dtype) -> dict:
    """Float64 gradients of one step of a copy of ``structure`` on ``batch``, computing in ``dtype``
    at ``weights`` rounded to bf16."""
    copy_ = copy.deepcopy(structure)
    for name, p in copy_.named_parameters():
        p.data = weights[name].to(torch.bfloat16).to(dtype)
    if dtype == torch.float64:
        _float64_experts(copy_)
    return _copy_gradients(copy_, lambda m: model_loss(m(**batch)).backward())


def _float64_experts(module: torch.nn.Module) -> None:
    """transformers' grouped experts (Qwen2-MoE, Mixtral ... in bf16) call ``torch._grouped_mm``,
    which has no float64 kernel: a float64 copy runs their reference loop ("eager") instead, the
    same sums of the same products. ``module`` is a copy: its config is its own."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "eager"


def _copy_gradients(copy_: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> dict:
    """The gradients (as float64) that ``run(copy_)`` leaves on ``copy_``'s parameters, from none,
    outside any autocast region (the copy computes in its own dtype)."""
    for p in copy_.parameters():
        p.grad = None
    with torch.autocast("cpu", enabled=False):
        run(copy_)
    return {n: p.grad.double() for n, p in copy_.named_parameters() if p.grad is not None}


# How far from the exact gradient a mixed-precision step's gradients may be, in units of one bf16
# device's own error. Each rank rounds its partial gradient to bf16 before the fp32 reduction where
# one device rounds the whole sum once, so the roundings of several partials add up: measured 0.5-1.0x
# under Inductor on 2-rank FSDP, up to 2.2-2.7x on eager 2- and 4-rank FSDP, FSDP x TP and LoRA
# plans. A gradient 3% off (a wrong token count) still fails 4x (tests/testing/test_bf16_gradient_bound.py).
DEVICE_ERRORS_ALLOWED = 4
BF16_EPS = 2.0 ** -8  # bf16's relative rounding step (8 significant bits)


def _assert_near_exact(model, exact: dict, device: dict, what: str) -> None:
    """Each gradient of ``model`` no further from ``exact`` than DEVICE_ERRORS_ALLOWED times
    ``device``'s distance from it (floor: one bf16 rounding of the tensor's largest exact value)."""
    for name, p in model.named_parameters():
        if name not in exact:
            continue
        ours = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        our_error = (ours.double() - exact[name]).abs().max().item()
        device_error = (device[name].double() - exact[name]).abs().max().item()
        bound = max(DEVICE_ERRORS_ALLOWED * device_error, BF16_EPS * exact[name].abs().max().item())
        assert our_error <= bound, (f"{what}grad of {name}: {our_error:.3g} from the exact gradient, one bf16 "
                                    f"device {device_error:.3g} (bound {bound:.3g})")


def float64_gradients(module: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> dict:
    """The exact gradients at ``module``'s current weights: ``run(copy)`` does the forwards and
    backwards (the step's micro-batches, each loss scaled as the step scales it) on a float64 copy
    of ``module``, outside any autocast region. For :func:`assert_gradients_near_exact`."""
    copy_ = copy.deepcopy(module).double()
    _float64_experts(copy_)
    return _copy_gradients(copy_, run)


def assert_gradients_near_exact(model, exact: dict, device: dict, what: str = "") -> None:
    """Each gradient of ``model`` (a step computing in bf16 somewhere: autocast, bf16 parameters) no
    further from ``exact`` (:func:`float64_gradients`) than DEVICE_ERRORS_ALLOWED times the distance
    of ``device`` (one device's gradients, the same step computing in bf16 the same way) from it."""
    _assert_near_exact(model, {n: g.double() for n, g in exact.items()}, device, what)


def assert_bf16_gradients_near_exact(model, structure: torch.nn.Module, batch: dict, what: str = "") -> None:
    """Every gradient of a mixed-precision step (bf16 compute, fp32 reduction) is no further from
    the exact gradient than DEVICE_ERRORS_ALLOWED times one bf16 device's own error. The exact
    gradient and the device's are computed from the model's current weights rounded to bf16
    (``structure``: a module of the same architecture, copied; ``batch``: the global batch), one in
    float64, one in bf16.

    For kernels that round where eager bf16 does not (``codegen="inductor"`` computes a fused bf16
    chain in fp32 and rounds once), this is the meaningful bound: a fixed tolerance against the
    bf16 device alone measures that device's accumulation error as much as ours (an embedding's
    gradient summed over repeated tokens in bf16 is off by ~1 ulp of its partial sums), while a
    wrong gradient (a missing reduction or scale) is off by far more than either. A floor of one
    bf16 rounding of the tensor's largest exact value keeps a tensor the device gets nearly exact
    from failing on a single rounding."""
    weights = {n: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
               for n, p in model.named_parameters()}
    exact, device = (_gradients(structure, weights, batch, dtype) for dtype in (torch.float64, torch.bfloat16))
    _assert_near_exact(model, exact, device, what)
