"""Sharding rules for the SDPA kernels: batch, heads and, while the compiler propagates, the sequence.

Attention is independent per batch row and per head, so batch (dim 0) and head (dim 1) sharding are
exact for every SDPA kernel. Sharding the *sequence* (dim 2) is not: each query needs every key. It
is exact only because lowering replaces the kernel with context-parallel attention
(``cp/attention.py``: all-to-all, ring or both) for that layout. So the sequence strategy exists
only inside :func:`sequence_sharded_attention`, which the propagation engine enters for the time it
propagates a program. Outside it, DTensor's eager dispatch (a user's own DTensor code) never sees
the strategy: with it, DTensor would run the plain kernel on sequence shards, each query attending
to its own rank's keys only, silently wrong. (torch's experimental ``context_parallel`` installs
its sequence rules the same way, for the same reason.)

* The CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and backward): DTensor has
  no rule; ours is registered once (:func:`register`) and gives the sequence row only in the scope.
* The GPU kernels (flash, memory-efficient, cuDNN, forward and backward): DTensor has batch and
  heads rules; in the scope ours replace them (the same rows plus the sequence) and DTensor's are
  put back on exit.

DTensor caches sharding decisions per op schema, so the propagation engine decides these ops
without its cache (``rules.propagate_op``): a decision made with the sequence row must not reach
eager dispatch, nor one made without it reach propagation. (Clearing the caches on entering and
leaving the scope instead made every compile's lowering decide every op again: 15-20% slower.)

Rows are written per op (:data:`_OUTPUTS`: what each output is; inputs by argument name), so a
mask or bias follows batch or head sharding only where it is not broadcast, and is read whole
when the sequence is sharded (the context-parallel kernels slice it).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import Replicate, Shard

from .. import compat

aten = torch.ops.aten

# What each output of an op is: "x" data (query-like: output, gradients), "lse" the log-sum-exp
# (replicated, i.e. empty, when not computed), "-" not a tensor or absent (no layout), "r" a
# replicated tensor that is not data (the flash kernel's RNG state), "debug" the debug mask (data
# when asked for; else replicated for flash, absent for cuDNN, as DTensor's own rules have them),
# "bias" the attention bias's gradient (laid out as the bias).
_OUTPUTS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("x", "lse"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("x", "x", "x"),
    aten._scaled_dot_product_flash_attention.default: ("x", "lse", "-", "-", "-", "-", "r", "-", "debug"),
    aten._scaled_dot_product_flash_attention_backward.default: ("x", "x", "x"),
    aten._scaled_dot_product_efficient_attention.default: ("x", "lse", "-", "-"),
    aten._scaled_dot_product_efficient_attention_backward.default: ("x", "x", "x", "bias"),
    aten._scaled_dot_product_cudnn_attention.default: ("x", "lse", "-", "-", "-", "-", "-", "-", "debug"),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("x", "x", "x"),
}
ATTENTION_OPS = frozenset(_OUTPUTS)
CPU_OPS = tuple(op for op in _OUTPUTS if "for_cpu" in str(op))
GPU_OPS = tuple(op for op in _OUTPUTS if op not in CPU_OPS)
# Tensor inputs laid out as the query (the sequence-long data); the mask as below; the rest
# (varlen offsets, RNG state) replicated.
_DATA_INPUTS = {"query", "key", "value", "grad_out", "grad_out_", "out", "logsumexp"}
_MASK_INPUTS = {"attn_mask", "attn_bias"}
_SEQUENCE = False  # inside sequence_sharded_attention()


def _named_args(op_schema) -> list[tuple[str, object]]:
    """(argument name, its schema entry) for the op's positional then keyword arguments."""
    names = [a.name for a in op_schema.op._schema.arguments]
    positional = list(zip(names, op_schema.args_schema))
    return positional + [(k, v) for k, v in op_schema.kwargs_schema.items()]


def _mask_placement(p, dim: int | None, shape) -> object:
    """The mask's placement when the query's is ``p`` on sharded dim ``dim``: sharded with it on
    the batch or heads dim the mask has (right-aligned to ``[B, H, L, S]``, not broadcast), else
    read whole."""
    if dim not in (0, 1):
        return Replicate()
    index = dim - (4 - len(shape))
    return p if index >= 0 and shape[index] > 1 else Replicate()


def attention_strategy(op_schema):
    """The op's strategies: replicated, batch-sharded, head-sharded and, inside
    :func:`sequence_sharded_attention`, sequence-sharded; expanded to every mesh axis by DTensor
    (which also prices each combination's redistribution)."""
    op = op_schema.op
    args = _named_args(op_schema)
    tensors = [(name, s) for name, s in args if isinstance(s, compat.OpStrategy)]
    values = dict(args)
    compute_lse = values.get("compute_log_sumexp", True)
    debug = bool(values.get("return_debug_mask", False))
    cudnn = op is aten._scaled_dot_product_cudnn_attention.default
    mask = next((s for name, s in tensors if name in _MASK_INPUTS), None)

    def row(p, dim):
        mask_p = None if mask is None else _mask_placement(p, dim, mask.shape)
        outputs = {
            "x": p, "lse": p if compute_lse else Replicate(), "-": None, "r": Replicate(), "bias": mask_p,
            "debug": p if debug else (None if cudnn else Replicate()),
        }
        placements = [outputs[what] for what in _OUTPUTS[op]]
        for name, _ in tensors:
            placements.append(p if name in _DATA_INPUTS else mask_p if name in _MASK_INPUTS else Replicate())
        return placements

    rows = [row(Replicate(), None), row(Shard(0), 0), row(Shard(1), 1)]
    if _SEQUENCE:
        rows.append(row(Shard(2), 2))
    mesh = op_schema.get_mesh_from_args(validate=False)
    return compat.expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=len(_OUTPUTS[op]))


_SCHEMA_INFO = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: compat.RuntimeSchemaInfo(3, static_kwargkey=["scale"]),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: compat.RuntimeSchemaInfo(6, static_kwargkey=["scale"]),
}


def register(propagator) -> None:
    """Give DTensor our rule for the CPU kernels, which it has none for (batch and heads only,
    outside the scope below)."""
    for op in CPU_OPS:
        if op not in propagator.op_strategy_funcs:
            propagator.register_op_strategy(op, attention_strategy, _SCHEMA_INFO[op])


@contextlib.contextmanager
def sequence_sharded_attention():
    """While active, the SDPA ops may be sharded on the sequence (module docstring). Re-entrant."""
    global _SEQUENCE
    if _SEQUENCE:
        yield
        return
    propagator = compat.sharding_propagator()
    register(propagator)
    saved = {op: propagator.op_strategy_funcs.get(op) for op in GPU_OPS}
    _SEQUENCE = True
    try:
        for op in GPU_OPS:
            propagator.op_strategy_funcs[op] = attention_strategy
        yield
    finally:
        for op, fn in saved.items():
            if fn is None:
                propagator.op_strategy_funcs.pop(op, None)
            else:
                propagator.op_strategy_funcs[op] = fn
        _SEQUENCE = False
