"""Sharding rules for elementwise ops DTensor's registry lacks, so they stop running replicated.

An op with no rule runs replicated (the engine's fallback): under data parallelism its operands
are all-gathered over the batch and its result sliced back, in every layer. The ops here are
elementwise (each result element reads the operands' elements at its own index, operands broadcast
from the right), so any dim of the result may be sharded, with each operand sharded on the dim
broadcast to it, or read whole where it is broadcast there:

* ``copy``: functionalization turns every write into a slice of a tensor (``buf[:, i] = x``,
  ``out.add_(b)`` on a view, the index updates autograd's backward makes) into ``copy(self, src)``
  and a scatter. DTensor has strategies for the in-place ``copy_`` only. Seen: GPT-OSS's experts'
  backward, Qwen3-Next's linear attention, DeepSeek-V3's ``expand_kv``, T5's ``_shift_right``.
  ``self``'s values are never read, so a ``Partial`` ``src`` of ``self``'s shape may stay partial
  with ``self`` replicated (each rank copies its partial value, their sum is the copied value),
  unless the copy casts: the sum of rounded partial values is not the rounded sum.
* ``fill`` (``x.fill_(v)``, ``x[...] = v`` after functionalization) and ``masked_fill`` with a
  tensor value, ``where`` with a scalar branch.
* the backward kernels of activations DTensor knows forward only (``softplus``: Qwen3-Next's
  gates; ``elu``, ``leaky_relu``, ``hardswish``, ``hardsigmoid``, ``hardtanh``, ``mish``,
  ``softshrink``, ``hardshrink``) and ``hardswish`` itself.

``tril`` / ``triu`` are elementwise in every dim but the last two (a batch of matrices: Qwen3-Next's
chunked delta rule masks one per batch, head and chunk), and linear. DTensor replicates them (its
linear-algebra fallback): under data parallelism an all-gather of the batch. Inside propagation
(:func:`propagate_batched_triangle`) they keep any leading dim sharded, or a partial sum partial,
and their local kernel runs them on the shard.

The other ops are not linear in all their operands, so none keeps a ``Partial`` operand partial:
the engine reduces it first, as for any non-linear op.

Five backward kernels (``softplus``, ``elu``, ``hardswish``, ``hardsigmoid``, ``hardtanh``) lay
their result out like ``grad_output`` (torch's elementwise kernels follow their first operand),
while fake tensors (what the program was captured and lowered with) lay it out like ``self``. Where
the two differ, a later ``view`` that fits the captured layout failed at run time ("view size is not
compatible", Qwen3-Next's backward). Their local kernel (:func:`local_kernel`) runs the op on the
operands as they are (the CPU kernel's rounding depends on their layout: its values stay eager's)
and copies the result into ``self``'s memory order; nothing is copied where the orders match.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import compat
from ..layout import dims_by_stride

aten = torch.ops.aten
OPS = (
    aten.copy.default, aten.fill.Scalar, aten.fill.Tensor, aten.masked_fill.Tensor,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.lift_fresh_copy.default,
    aten.softplus_backward.default, aten.elu_backward.default, aten.leaky_relu_backward.default,
    aten.hardswish.default, aten.hardswish_backward.default, aten.hardsigmoid_backward.default,
    aten.hardtanh_backward.default, aten.mish_backward.default, aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
)
# Every argument after the first is part of the cache key (scalars included: harmless, exact).
SCHEMA_INFO = compat.RuntimeSchemaInfo(1)


def _dtype(strategy) -> torch.dtype | None:
    meta = strategy.strategies[0].output_spec.tensor_meta
    return None if meta is None else meta.dtype


def elementwise_strategy(op_schema):
    """Rows [result, *tensor operands] for one mesh axis, expanded to the whole mesh by DTensor
    (which prices each combination's redistribution)."""
    operands = [a for a in op_schema.args_schema if isinstance(a, compat.OpStrategy)]
    shapes = [tuple(a.shape) for a in operands]
    shape = tuple(torch.broadcast_shapes(*shapes))
    rows = [[Replicate()] * (1 + len(operands))]
    for d in range(len(shape)):
        row = [Shard(d)]
        for s in shapes:
            k = d - (len(shape) - len(s))  # operands broadcast from the right
            row.append(Replicate() if k < 0 or (s[k] == 1 and shape[d] != 1) else Shard(k))
        rows.append(row)
    if op_schema.op is aten.copy.default:
        self_s, src_s = operands
        if _dtype(self_s) == _dtype(src_s) and tuple(src_s.shape) == shape:
            rows.append([Partial(), Replicate(), Partial()])
    mesh = op_schema.get_mesh_from_args(validate=False)
    return compat.expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=1)


TRIANGLES = (aten.tril.default, aten.triu.default)


def propagate_batched_triangle(args_schema: tuple):
    """(result, wanted input layouts) of ``tril`` / ``triu`` on a DTensorSpec: it stays as it is
    where its sharded dims are all leading (or it is partial), else None (DTensor's rule decides)."""
    x = args_schema[0]
    ndim = len(x.tensor_meta.shape)
    if any(p.is_shard() and p.dim >= ndim - 2 for p in x.placements) or all(p.is_replicate() for p in x.placements):
        return None
    if not all(p.is_replicate() or p.is_partial() or type(p) is Shard for p in x.placements):
        return None
    return x, None


# Backward kernel -> the index of ``self`` (fake tensors lay the result out like it; module docstring).
_LAYOUT_OF_SELF = {
    aten.softplus_backward.default: 1, aten.elu_backward.default: 5, aten.hardswish_backward.default: 1,
    aten.hardsigmoid_backward.default: 1, aten.hardtanh_backward.default: 1,
}


def local_kernel(op, layout):
    """For lowering: the kernel of ``op`` on local shards where DTensor's dispatch would not run it
    as propagated (``tril`` / ``triu`` on a sharded batch of matrices, which it replicates) or the
    real kernel's result layout differs from the captured one; else None. Takes DTensors in
    ``layout.inputs``, returns one in ``layout.output``."""
    if op in TRIANGLES and layout.inputs and not all(p.is_replicate() for p in layout.inputs[0].placements):
        return functools.partial(_on_shard, op, layout.output)
    index = _LAYOUT_OF_SELF.get(op)
    if index is None or layout.output is None:
        return None
    return functools.partial(_with_result_laid_out_as_self, op, index, layout.output)


def _with_result_laid_out_as_self(op, index, out_spec, *args):
    local = [compat.local_of(a) if isinstance(a, DTensor) else a for a in args]
    out = op(*local)
    grad, like = local[0], local[index]
    if dims_by_stride(grad.stride(), grad.shape) != dims_by_stride(like.stride(), like.shape):
        # The kernel ran as eager runs it (same values); its result is laid out like ``grad``, the
        # captured one like ``like``: copy it into that order (a clone is always traced, where
        # ``contiguous()`` would trace nothing: the traced value already has the captured layout).
        wanted = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
        inverse = sorted(range(like.dim()), key=wanted.__getitem__)
        out = out.permute(wanted).clone(memory_format=torch.contiguous_format).permute(inverse)
    return compat.dtensor_from_spec(out, out_spec)


def _on_shard(op, out_spec, x, *rest):
    return compat.dtensor_from_spec(op(compat.local_of(x), *rest), out_spec)
