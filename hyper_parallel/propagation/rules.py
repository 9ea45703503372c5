"""The rule database: DTensor's sharding-strategy registry behind one adapter, plus our own rules.

``propagate_op`` answers, for one aten op and the layouts of its tensor arguments, which layouts the
arguments must be redistributed to and which layout the result has. PyTorch's DTensor already knows
~1,100 aten ops; we ask its propagator (which picks, among an op's strategies, the one with the
least alpha-beta redistribution cost) and add rules only where it has none:

* ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward): the CPU SDPA kernels; attention is
  independent per batch row and per head, so batch (dim 0) and head (dim 1) sharding are exact.

An op with no rule at all raises :class:`NoShardingRule`; the engine then falls back to replicated
execution with explicit redistribution and lists the op in the compile report.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ..compat import pytree
from .. import compat

aten = torch.ops.aten


class NoShardingRule(Exception):
    """Raised when neither DTensor's registry nor our own rules know an op."""


def _sdpa_cpu_strategy(op_schema, num_outputs: int, num_qkv_like: int):
    # One single-mesh-axis strategy per row: [outputs..., tensor inputs...]; the expansion to every
    # mesh-axis combination (and the redistribution cost of each) is DTensor's. An attention mask
    # (B or 1, H or 1, L, S) follows batch/head sharding only where it is not broadcast.
    mesh = op_schema.get_mesh_from_args()
    mask = op_schema.kwargs_schema.get("attn_mask")
    mask_shape = mask.shape if isinstance(mask, compat.OpStrategy) else None

    def row(p, dim):
        mask_p = [] if mask_shape is None else [
            p if dim is None or mask_shape[dim] > 1 else Replicate()
        ]
        return [p] * (num_outputs + num_qkv_like) + mask_p

    strategies = [row(Replicate(), None), row(Shard(0), 0), row(Shard(1), 1)]  # batch, heads
    return compat.expand_to_full_mesh_op_strategy(
        mesh, op_schema, strategies, input_index=num_outputs
    )


def _sdpa_cpu_forward_strategy(op_schema):
    # (B, H, L, E) q/k/v and output; logsumexp (B, H, L): batch and heads are independent.
    return _sdpa_cpu_strategy(op_schema, 2, 3)


def _sdpa_cpu_backward_strategy(op_schema):
    # grad_out, q, k, v, out, logsumexp -> grad_q, grad_k, grad_v
    return _sdpa_cpu_strategy(op_schema, 3, 6)


_OWN_RULES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        _sdpa_cpu_forward_strategy,
        compat.RuntimeSchemaInfo(3, static_kwargkey=["scale"]),
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        _sdpa_cpu_backward_strategy,
        compat.RuntimeSchemaInfo(6, static_kwargkey=["scale"]),
    ),
}
_registered = False


def register_own_rules() -> None:
    """Add our rules to DTensor's registry (idempotent), so DTensor dispatch uses them as well."""
    global _registered
    if _registered:
        return
    propagator = compat.sharding_propagator()
    for op, (fn, info) in _OWN_RULES.items():
        if op not in propagator.op_strategy_funcs:
            propagator.register_op_strategy(op, fn, info)
    _registered = True


def has_rule(op) -> bool:
    """Whether some rule (DTensor's or ours) covers ``op``."""
    p = compat.sharding_propagator()
    return (
        op in p.op_strategy_funcs
        or op in p.op_single_dim_strategy_funcs
        or op in p.op_to_rules
    )


def propagate_op(op, args_schema: tuple, kwargs_schema: dict):
    """Sharding propagation for one op; tensors are given as DTensorSpecs (with tensor meta).

    Returns ``(output_spec, input_specs)``: the result's layout (a tuple for multi-output ops) and
    the layout every tensor argument must have when the op runs, in pytree order of (args, kwargs),
    or None when the arguments can stay as they are.
    """
    register_own_rules()
    if not has_rule(op):
        # DTensor would derive a strategy from a decomposition but still run the original kernel on
        # the shards; kernels with implicit global sizes (mean reductions) would then be wrong.
        raise NoShardingRule(f"no sharding rule for {op}")
    propagator = compat.sharding_propagator()
    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = compat.OpSchema(op, tuple(args_schema), dict(kwargs_schema), schema_info=info)
    if any(isinstance(v, compat.DTensorSpec) for v in kwargs_schema.values()) and op in propagator.op_strategy_funcs:
        return _select_with_tensor_kwargs(propagator, schema)
    try:
        # The cached entry point, as eager DTensor uses it: repeated layers hit the cache.
        sharding = propagator.propagate_op_sharding(schema)
    except NoShardingRule as exc:
        raise exc
    except NotImplementedError as exc:
        raise NoShardingRule(str(exc)) from exc
    wanted = None
    if sharding.redistribute_schema is not None:
        suggested = sharding.redistribute_schema
        wanted = [
            s for s in pytree.tree_leaves(
                (suggested.args_schema, suggested.kwargs_schema),
                is_leaf=lambda x: isinstance(x, compat.DTensorSpec),
            )
            if isinstance(s, compat.DTensorSpec)
        ]
    return sharding.output_spec, wanted


def _select_with_tensor_kwargs(propagator, schema):
    # DTensor's suggested schema (and its dispatch) redistribute positional tensors only, so an op
    # with a tensor keyword argument (SDPA's attn_mask) would run with that tensor unsharded. Pick
    # the strategy here and return the layout of every input; lowering moves them all.
    strategy = propagator.op_strategy_funcs[schema.op](compat.wrap_with_op_strategy(schema))
    chosen = compat.select_min_cost_strategy(strategy, schema)
    return chosen.output_specs, list(chosen.input_specs)
