"""Context-parallel attention: the local kernels for sequence-sharded SDPA.

Under context parallelism every activation is sharded on its sequence dim over the ``cp`` axis;
token-wise ops (embedding, norms, linear layers, the loss) need nothing new, but attention mixes
tokens. While it propagates a program, the compiler gives the SDPA ops (the CPU flash kernel and
the GPU flash, memory-efficient and cuDNN kernels, forward and backward:
``propagation/attention_rules.py``) one more strategy: query, key, value, output and log-sum-exp
all ``Shard(2)`` (the sequence dim) on an axis. No kernel computes that layout on its own, so
lowering asks :func:`local_kernel`, which computes it on the shards with the captured op's own
kernel family (``cp/attention_ops.py``):

* ring mode (``hp.ContextParallel(mode="ring")``): ``cp/ring.py``, K/V blocks passed around the cp
  ring and merged by log-sum-exp, optionally in the load-balanced order of ``cp/load_balance.py``;
  all-gather mode (``mode="all_gather"``) is the same computation with every block gathered at once;

* the hybrid (``ulysses_degree`` between 1 and cp): ``cp/hybrid.py``, an all-to-all inside each
  group of Ulysses ranks, then ring attention across the groups;

* all-to-all mode (DeepSpeed-Ulysses; ``hp.ContextParallel(mode="all_to_all")``): query, key and
  value move from sequence- to head-sharded (packed into one ``all_to_all_single`` when they share
  a dtype and shape, annotated as the ``Shard(2) -> Shard(1)`` redistribution it is), the ordinary
  kernel runs on whole sequences of ``heads / cp`` heads, and the output and log-sum-exp move back
  (``Shard(1) -> Shard(2)``; one all-to-all in fp32, two when the output is half precision).
  Backward moves the output, its gradient and the log-sum-exp, reuses forward's query, key and
  value (CSE merges the identical all-to-all), and sends the three gradients back in one. Exact:
  every head sees the whole sequence in order, so a causal mask means what it does on one device.

The output and the gradients keep the memory layout the one-device kernel gives (``[B, S, H, D]``
order), because the captured graph views their transposes as ``[B, S, H * D]``.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Shard

from .. import compat
from ..layout import format_placements
from .exchange import swap_sharded_dims
from .attention_ops import family_of, local_rng
from .hybrid import hybrid_kernels
from .ring import check_mask_gradient, ring_kernels

aten = torch.ops.aten

SEQ_DIM = 2  # of query / key / value / output [B, H, S, D] and log-sum-exp [B, H, S]
HEAD_DIM = 1


def sequence_axes(spec) -> tuple[int, ...]:
    """Mesh axes that shard ``spec``'s sequence dim (plain ``Shard(2)``)."""
    return tuple(
        i for i, p in enumerate(spec.placements)
        if isinstance(p, Shard) and not isinstance(p, compat.StridedShard) and p.dim == SEQ_DIM
    )


def local_kernel(op, layout, context=None, name: str = "", mask_within_causal: bool = False):
    """The local kernel for ``op`` when propagation chose sequence sharding, else None: ring
    attention (``cp/ring.py``) when ``context`` (the ``ContextPlan``) asks for it, else the
    all-to-all kernel below. ``op`` is any SDPA forward or backward op (``cp/attention_ops.py``);
    ``name`` is the node's, for the ring's tags and messages; ``mask_within_causal``: its mask
    hides every key after its query (``propagation/causal_mask.py``), so the ring skips those
    blocks."""
    ops = family_of(op)
    if ops is None or not layout.inputs:
        return None
    axes = sequence_axes(layout.inputs[0])
    if not axes:
        return None
    if len(axes) > 1:
        names = [layout.inputs[0].mesh.mesh_dim_names[i] for i in axes]
        raise ValueError(
            f"attention's sequence is sharded over several mesh axes {names}; context parallelism "
            "shards it over one: give the context_parallel entries one axis"
        )
    ring_modes = {"ring": ring_kernels, "all_gather": ring_kernels, "hybrid": hybrid_kernels}
    if context is not None and context.mode in ring_modes:
        forward, backward = ring_modes[context.mode](axes[0], context, name, ops, mask_within_causal)
        kernel = forward if op is ops.forward else backward
    else:
        kernel = functools.partial(_ulysses_forward if op is ops.forward else _ulysses_backward, ops, axes, name)
    return functools.partial(_as_dtensors, kernel, layout.output, op is ops.forward)


def _as_dtensors(kernel, specs, is_forward: bool, *args, **kwargs):
    """``kernel``'s local results as DTensors in the node's output layouts (``specs``); outputs
    with no layout (sequence lengths, absent tensors) as they are. The attention output and the
    gradients get the memory layout of one device's kernel (:func:`_one_device_strides`)."""
    results = []
    for i, (value, spec) in enumerate(zip(kernel(*args, **kwargs), specs)):
        if isinstance(value, torch.Tensor) and spec is not None:
            value = compat.dtensor_from_spec(value, spec)
            if i == 0 or not is_forward:
                value = _one_device_strides(value)
        results.append(value)
    return tuple(results)


def _swap(locals_, spec, axes, src_dim: int, dst_dim: int) -> list:
    """``locals_``, each split along ``src_dim`` over the one axis in ``axes``, as split along
    ``dst_dim`` (cp/exchange.py: those of one dtype and ``[B, H, S]`` in one all-to-all),
    annotated as that redistribution of ``spec``'s placements."""
    (axis,) = axes
    before, after = (tuple(Shard(d) if i == axis else p for i, p in enumerate(spec.placements))
                     for d in (src_dim, dst_dim))
    return swap_sharded_dims(list(locals_), spec.mesh.get_group(axis).group_name, spec.mesh.size(axis), src_dim,
                             dst_dim, f"{format_placements(before)} -> {format_placements(after)}")


def _heads_of_mask(mask, spec, axes, heads: int):
    """This rank's share of an additive mask once the heads are split over ``axes``: a mask with
    one entry per head keeps this rank's ``heads``, a broadcast one stays whole."""
    if mask is None:
        return None
    mask = compat.local_of(mask)
    if mask.dim() >= 4 and mask.shape[-3] > 1:
        (axis,) = axes
        mask = mask.narrow(-3, spec.mesh.get_local_rank(axis) * heads, heads)
    return mask


def _one_device_strides(dt):
    """``dt`` ([B, H, S, D]) laid out in memory as ``[B, S, H, D]``, as the CPU kernel returns its
    output (for inputs so laid out, as the models' transposed projections are) and always its
    gradients: the captured graph views their transposes, which only that layout allows."""
    local = compat.local_of(dt)
    if local.dim() == 4:
        local = local.transpose(1, 2).contiguous().transpose(1, 2)
    return compat.dtensor_from_spec(local, compat.spec_of(dt))


def _check_heads(x, axes, what: str) -> None:
    spec = compat.spec_of(x)
    heads = spec.tensor_meta.shape[HEAD_DIM]
    ranks = 1
    for i in axes:
        ranks *= spec.mesh.size(i)
    if heads % ranks:
        names = [spec.mesh.mesh_dim_names[i] for i in axes]
        raise ValueError(
            f"context parallelism in all-to-all mode splits the {what} heads over {names} "
            f"({ranks} ranks), but there are {heads}: use a cp degree that divides the heads and "
            "the key/value heads"
        )


def _ulysses_forward(ops, axes, name, *args, **kwargs):
    call = ops.bind(ops.forward, args, kwargs)
    for x, what in ((call.query, "query"), (call.key, "key/value")):
        _check_heads(x, axes, what)
    spec = compat.spec_of(call.query)
    q, k, v = _swap((compat.local_of(x) for x in (call.query, call.key, call.value)), spec, axes, SEQ_DIM, HEAD_DIM)
    mask = _heads_of_mask(call.mask, spec, axes, q.shape[HEAD_DIM])
    out, lse, others = ops.block_forward(q, k, v, call.is_causal, mask, call.scale, call.dropout_p)
    out, lse = _swap((out, lse), spec, axes, HEAD_DIM, SEQ_DIM)
    return ops.forward_outputs(out, lse, others, (q.shape[SEQ_DIM], k.shape[SEQ_DIM]), call.compute_lse)


def _ulysses_backward(ops, axes, name, *args, **kwargs):
    call = ops.bind(ops.backward, args, kwargs)
    check_mask_gradient(call, name)
    spec = compat.spec_of(call.query)
    grad_out, q, k, v, out = (compat.local_of(x) for x in (call.grad_out, call.query, call.key, call.value, call.out))
    lse = ops.lse_tokens(compat.local_of(call.lse), q.shape[SEQ_DIM])
    # Query, key and value move as forward moved them: the same nodes, which CSE merges with
    # forward's (so backward sends only the output, its gradient and the log-sum-exp).
    q, k, v = _swap((q, k, v), spec, axes, SEQ_DIM, HEAD_DIM)
    grad_out, out, lse = _swap((grad_out, out, lse), spec, axes, SEQ_DIM, HEAD_DIM)
    mask = _heads_of_mask(call.mask, spec, axes, q.shape[HEAD_DIM])
    rng = local_rng(call.rng)
    grads = ops.block_backward(grad_out, q, k, v, out, lse, call.is_causal, mask, call.scale, rng, call.dropout_p)
    return ops.backward_outputs(*_swap(grads, spec, axes, HEAD_DIM, SEQ_DIM))
