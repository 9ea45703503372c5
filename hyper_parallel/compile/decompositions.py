"""The aten ops capture decomposes, because their fused kernels hide a reduction over the batch.

Sharding rules see an op whole; a kernel that reduces over the batch dim inside itself computes a
per-shard answer on a batch-sharded input. Captured decomposed into explicit ops, the reduction is a
sum whose layout propagation gets right (a Partial reduced once), with constants that are the global
sizes. Read by capture.py (``capture_decompositions``); writes nothing.
"""

from __future__ import annotations

import math

import torch

from .. import compat

aten = torch.ops.aten

# Loss kernels whose "mean" reduction divides by the numel of the tensor they run on. On a shard
# that is the local numel, so they are captured decomposed into explicit ops (whose constants are
# the global sizes) instead of trusted to a sharding rule.
IMPLICIT_MEAN_OPS = (
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default,
    aten.huber_loss_backward.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.soft_margin_loss.default,
    aten.soft_margin_loss_backward.default,
)

# Batch normalisation's kernels reduce over the batch dim (mean and variance per
# channel), and DTensor's rules for them only shard channels: a batch-sharded input would be
# all-gathered before every BatchNorm and the layers after it would run replicated. Captured
# decomposed (batch_norm_decompositions below), the statistics are sums over the batch: on shards
# each is one all-reduce of a [C] vector, i.e. SyncBatchNorm's global statistics (two per layer
# forward, two backward), and the running statistics BatchNorm updates in forward are computed
# from them, so they are the single-device values on every rank.


# --- batch normalisation, captured as sums over the batch (see the note by IMPLICIT_MEAN_OPS) ------

def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself (``clamp`` with no bound that binds: exact, NaN and inf included), through an op
    whose sharding rule needs its input whole. A per-channel sum over a batch-sharded tensor is
    Partial; linear ops (views, scaling, the running-statistics update) would carry the Partial on
    and each consumer would all-reduce it again. Here it is all-reduced once, and every later use
    reads the reduced value."""
    return torch.clamp(t, min=-math.inf)


def _channel_shape(input: torch.Tensor) -> list[int]:
    return [1, input.shape[1]] + [1] * (input.dim() - 2)  # a per-channel vector, broadcast


def _compute_dtype(input: torch.Tensor) -> torch.dtype:
    # As the eager kernels and torch's decompositions: half-precision inputs accumulate in fp32.
    return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype


def _batch_norm(input, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float):
    """``(output, save_mean, save_rstd, new_running_mean, new_running_var)`` of batch norm (the
    contract of ``aten._native_batch_norm_legit_functional``), from explicit ops.

    Training: the mean and the biased variance over every dim but 1 as two-pass sums (mean first,
    then the sum of squared deviations: stable as the eager kernel's, and both sums are linear in
    the batch, so on shards each is one all-reduce of a [C] vector). The element count is the
    capture's, i.e. the global batch's. Running statistics get ``momentum * batch statistic +
    (1 - momentum) * running`` with the unbiased variance, as ``nn.BatchNorm``. Eval: normalise
    with the running statistics (elementwise, no reduction)."""
    dims = [0, *range(2, input.dim())]
    shape = _channel_shape(input)
    compute = _compute_dtype(input)
    x = input.to(compute)
    new_mean, new_var = running_mean, running_var
    if training:
        count = input.numel() // input.shape[1]
        mean = _whole(torch.sum(x, dims) / count)
        centered = x - mean.view(shape)
        var = _whole(torch.sum(centered * centered, dims) / count)
        rstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            new_mean = (momentum * mean + (1 - momentum) * running_mean).to(running_mean.dtype)
        if running_var is not None:
            unbiased = var * (count / max(count - 1, 1))
            new_var = (momentum * unbiased + (1 - momentum) * running_var).to(running_var.dtype)
        save_mean, save_rstd = mean, rstd
    else:
        mean, rstd = running_mean.to(compute), torch.rsqrt(running_var.to(compute) + eps)
        centered = x - mean.view(shape)
        # As the eager kernels: the CPU one saves nothing in eval mode, the others the statistics.
        save_mean, save_rstd = (input.new_zeros((0,)), input.new_zeros((0,))) if input.device.type == "cpu" \
            else (mean, rstd)
    output = centered * rstd.view(shape)
    if weight is not None:
        output = output * weight.view(shape)
    if bias is not None:
        output = output + bias.view(shape)
    if input.device.type == "cpu":  # the CPU kernel returns its statistics in the input's dtype
        save_mean, save_rstd = save_mean.to(input.dtype), save_rstd.to(input.dtype)
    return output.to(input.dtype), save_mean, save_rstd, new_mean, new_var


def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                         train: bool, eps: float, output_mask):
    """``aten.native_batch_norm_backward`` from explicit ops, as SyncBatchNorm's backward: the two
    per-channel sums (of the output gradient, and of it times the centred input) are reduced once
    each, then everything is elementwise. (torch's decomposition leaves them Partial and the
    sharding rules then gather the centred input to multiply it by a Partial scale.)"""
    dims = [0, *range(2, input.dim())]
    shape = _channel_shape(input)
    compute = _compute_dtype(input)
    dy, x = grad_out.to(compute), input.to(compute)
    if train:
        mean, invstd = save_mean.to(compute), save_invstd.to(compute)
    else:
        mean, invstd = running_mean.to(compute), torch.rsqrt(running_var.to(compute) + eps)
    centered = x - mean.view(shape)
    sum_dy = _whole(torch.sum(dy, dims)) if output_mask[0] and train or output_mask[2] else None
    sum_dy_xmu = _whole(torch.sum(dy * centered, dims)) if output_mask[0] and train or output_mask[1] else None
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        scale = invstd if weight is None else invstd * weight.to(compute)
        if train:
            count = input.numel() // input.shape[1]
            proj = sum_dy_xmu / count * invstd * invstd
            grad_input = (dy - centered * proj.view(shape) - (sum_dy / count).view(shape)) * scale.view(shape)
        else:
            grad_input = dy * scale.view(shape)
        grad_input = grad_input.to(input.dtype)
    param_dtype = weight.dtype if weight is not None else input.dtype
    if output_mask[1]:
        grad_weight = (sum_dy_xmu * invstd).to(param_dtype)
    if output_mask[2]:
        grad_bias = sum_dy.to(param_dtype)
    return grad_input, grad_weight, grad_bias


def _no_reserve(input):
    # cuDNN's workspace, for its own backward; the backward we capture (decomposed) never reads it.
    return input.new_empty((0,), dtype=torch.uint8)


def batch_norm_decompositions() -> dict:
    """Every batch-norm variant autograd and functionalization may leave in the joint graph, as
    :func:`_batch_norm` and :func:`_batch_norm_backward`."""
    def legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
        return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)

    def legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
        out, mean, rstd, new_mean, new_var = _batch_norm(
            input, weight, bias, running_mean, running_var, training, momentum, eps)
        if training:  # the in-place variant (functionalization normally leaves the functional one)
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
        return out, mean, rstd

    def no_stats(input, weight, bias, training, momentum, eps):
        return _batch_norm(input, weight, bias, None, None, training, momentum, eps)[:3]

    def no_training(input, weight, bias, running_mean, running_var, momentum, eps):
        return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]

    def with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
        out, mean, rstd, new_mean, new_var = _batch_norm(
            input, weight, bias, running_mean, running_var, True, momentum, eps)
        return out, mean, rstd, _no_reserve(input), new_mean, new_var

    def no_update(input, weight, bias, running_mean, running_var, momentum, eps):
        return (*_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3],
                _no_reserve(input))

    def backward_with_reserve(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                              train, eps, output_mask, reserve):
        return _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                                    save_invstd, train, eps, output_mask)

    return {
        aten._native_batch_norm_legit_functional.default: legit_functional,
        aten._native_batch_norm_legit.default: legit,
        aten._native_batch_norm_legit.no_stats: no_stats,
        aten._native_batch_norm_legit_no_training.default: no_training,
        aten._batch_norm_with_update_functional.default: with_update_functional,
        aten._batch_norm_no_update.default: no_update,
        aten.native_batch_norm_backward.default: _batch_norm_backward,
        aten.batch_norm_backward.default: backward_with_reserve,
    }


def capture_decompositions() -> dict:
    """The ops captured decomposed: implicit-mean losses and batch normalisation."""
    return {**compat.decompositions_for(IMPLICIT_MEAN_OPS), **batch_norm_decompositions()}
