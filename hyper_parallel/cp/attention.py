"""Context-parallel attention: the local kernels for sequence-sharded SDPA.

Under context parallelism every activation is sharded on its sequence dim over the ``cp`` axis;
token-wise ops (embedding, norms, linear layers, the loss) need nothing new, but attention mixes
tokens. Propagation gives the SDPA ops (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, ``rules.py``) one more strategy: query, key, value, output and log-sum-exp all
``Shard(2)`` (the sequence dim) on an axis. DTensor has no kernel for that layout, so lowering asks
:func:`local_kernel`, which computes it on the shards:

* ring mode (``hp.ContextParallel(mode="ring")``): ``cp/ring.py``, K/V blocks passed around the cp
  ring and merged by log-sum-exp, optionally in the load-balanced order of ``cp/load_balance.py``;

* the hybrid (``ulysses_degree`` between 1 and cp): ``cp/hybrid.py``, an all-to-all inside each
  group of Ulysses ranks, then ring attention across the groups;

* all-to-all mode (DeepSpeed-Ulysses; ``hp.ContextParallel(mode="all_to_all")``): query, key and
  value move from sequence- to head-sharded (one ``all_to_all_single`` each, annotated as the
  ``Shard(2) -> Shard(1)`` redistribution it is), the ordinary kernel runs on whole sequences of
  ``heads / cp`` heads, and the output and log-sum-exp move back (``Shard(1) -> Shard(2)``). Backward does the same with
  the gradient, saved inputs and outputs, and sends the three gradients back. Exact: every head
  sees the whole sequence in order, so a causal mask means what it does on one device.

The output and the gradients keep the memory layout the one-device kernel gives (``[B, S, H, D]``
order), because the captured graph views their transposes as ``[B, S, H * D]``.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Shard

from .. import compat
from ..layout import format_placements
from .exchange import swap_sharded_dim
from .hybrid import hybrid_kernels
from .ring import ring_kernels

aten = torch.ops.aten

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # of query / key / value / output [B, H, S, D] and log-sum-exp [B, H, S]
HEAD_DIM = 1


def sequence_axes(spec) -> tuple[int, ...]:
    """Mesh axes that shard ``spec``'s sequence dim (plain ``Shard(2)``)."""
    return tuple(
        i for i, p in enumerate(spec.placements)
        if isinstance(p, Shard) and not isinstance(p, compat.StridedShard) and p.dim == SEQ_DIM
    )


def local_kernel(op, layout, context=None, name: str = ""):
    """The local kernel for ``op`` when propagation chose sequence sharding, else None: ring
    attention (``cp/ring.py``) when ``context`` (the ``ContextPlan``) asks for it, else the
    all-to-all kernel below. ``name`` is the node's, for the ring's tags and messages."""
    if op not in (SDPA, SDPA_BACKWARD) or not layout.inputs:
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
    ring_modes = {"ring": ring_kernels, "hybrid": hybrid_kernels}
    if context is not None and context.mode in ring_modes:
        forward, backward = ring_modes[context.mode](axes[0], context, name)
        if op is SDPA:
            return functools.partial(_ring_forward, forward, layout.output)
        return functools.partial(_ring_backward, backward, layout.output)
    kernel = _ulysses_forward if op is SDPA else _ulysses_backward
    return functools.partial(kernel, axes)


def _ring_forward(kernel, specs, *args, **kwargs):
    out, lse = kernel(*args, **kwargs)
    return _one_device_strides(compat.dtensor_from_spec(out, specs[0])), compat.dtensor_from_spec(lse, specs[1])


def _ring_backward(kernel, specs, *args, **kwargs):
    return tuple(_one_device_strides(compat.dtensor_from_spec(g, s)) for g, s in zip(kernel(*args, **kwargs), specs))


def _move(dt, axes, src_dim: int, dst_dim: int):
    """DTensor ``dt`` (``[B, H, S, ...]``) from ``Shard(src_dim)`` to ``Shard(dst_dim)`` on the one
    axis in ``axes`` (cp/exchange.py), annotated as that redistribution."""
    (axis,) = axes
    spec = compat.spec_of(dt)
    target = tuple(Shard(dst_dim) if i == axis else p for i, p in enumerate(spec.placements))
    dst = compat.DTensorSpec(spec.mesh, target, tensor_meta=spec.tensor_meta)
    whole = swap_sharded_dim(compat.local_of(dt), spec.mesh.get_group(axis).group_name, spec.mesh.size(axis),
                             src_dim, dst_dim, f"{format_placements(spec.placements)} -> {format_placements(target)}")
    return compat.dtensor_from_spec(whole, dst)


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


def _ulysses_forward(axes, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    for x, what in ((query, "query"), (key, "key/value")):
        _check_heads(x, axes, what)
    q, k, v = (_move(x, axes, SEQ_DIM, HEAD_DIM) for x in (query, key, value))
    out, lse = SDPA(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return _one_device_strides(_move(out, axes, HEAD_DIM, SEQ_DIM)), _move(lse, axes, HEAD_DIM, SEQ_DIM)


def _ulysses_backward(axes, grad_out, query, key, value, out, lse, dropout_p, is_causal, *,
                      attn_mask=None, scale=None):
    moved = [_move(x, axes, SEQ_DIM, HEAD_DIM) for x in (grad_out, query, key, value, out, lse)]
    grads = SDPA_BACKWARD(*moved, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return tuple(_one_device_strides(_move(g, axes, HEAD_DIM, SEQ_DIM)) for g in grads)
