"""The rule database: DTensor's sharding-strategy registry behind one adapter, plus our own rules.

``propagate_op`` answers, for one aten op and the layouts of its tensor arguments, which layouts the
arguments must be redistributed to and which layout the result has. PyTorch's DTensor already knows
~1,100 aten ops; we ask its propagator (which picks, among an op's strategies, the one with the
least alpha-beta redistribution cost) and add rules only where it has none:

* elementwise ops it has none for (``elementwise_rules.py``): the functional ``copy`` (what
  functionalization makes of a write into a slice), ``fill``, activation backward kernels ...;
* the SDPA kernels (``attention_rules.py``): the CPU flash kernel, which DTensor has no rule for,
  and, while a program is propagated, the sequence-sharded layout of every SDPA kernel (context
  parallelism).
* The vocab-parallel cross-entropy ("loss parallel"): ``_log_softmax``,
  ``_log_softmax_backward_data``, ``nll_loss_forward`` and ``nll_loss_backward`` on a class dim
  sharded over mesh axes (the logits of a column-parallel ``lm_head``). See below.

An op with no rule at all raises :class:`NoShardingRule`; the engine then falls back to replicated
execution with explicit redistribution and lists the op in the compile report.

Vocab-parallel cross-entropy
----------------------------
``F.cross_entropy`` reaches the joint graph as ``_log_softmax`` + ``nll_loss_forward`` (``loss_reduction``
makes a mean ``sum / total_weight``), and backward as ``nll_loss_backward`` +
``_log_softmax_backward_data``. DTensor's rules for all four replicate the class dim, so vocab-sharded
logits were all-gathered (a ``[tokens, vocab]`` buffer per rank) before the loss. When the class dim
of the logits (for the backward ops: of the saved ``log_softmax`` output / ``self``) is sharded
(plain ``Shard``) over some mesh axes, our rule keeps it sharded instead and the op is computed on
the shard by :func:`local_kernel`, with only ``[tokens]``-sized communication:

* ``_log_softmax``: local max, all-reduced as ``Partial("max") -> Replicate``; the sum of
  ``exp(x - max)``, all-reduced as ``Partial("sum") -> Replicate``; ``x - max - log(sum)`` is the
  local shard of the global log-softmax (the same arithmetic as the fused kernel).
* ``_log_softmax_backward_data``: ``g - exp(out) * sum(g)``, the class-dim sum all-reduced.
* ``nll_loss_forward``: each rank picks the targets that fall in its vocabulary range (the target
  shifted by the shard's offset; others, and ``ignore_index``, become a negative "ignore" for the
  local kernel, class weights sliced to the shard) and the local kernel sums (or, for
  ``reduction="none"``, returns per token) the picked values: one all-reduce over the class axes of
  a scalar (per token for "none") makes the result. The total weight depends only on the targets
  (and class weights), so each rank computes it whole for its rows. Both outputs then have the
  layouts DTensor's rule gives on replicated classes, so everything after the loss (the
  token-mean's partial sums over the data-parallel axes, reduced in one collective over their
  flattened group) is as before. (Leaving the loss ``Partial`` over the class axes too would
  merge the two reductions, but DTensor then all-reduces each axis in turn.)
* ``nll_loss_backward``: the local kernel with the same shifted targets gives the local slice of
  the one-hot gradient (the global total weight divides it for "mean"); no communication.

Why here and not a rewrite before propagation: whether the logits are sharded over the vocabulary
is only known once layouts are (the plan, SP, FSDP and DP change it), and a rewrite into explicit
ops would need a one-hot ``[tokens, vocab]`` mask or a scatter with no sharded rule. As a rule the
decision is made per node from its inputs' layouts, composes with data-parallel row sharding
(``Partial`` sums over the batch axes) and the token-mean rewrite unchanged, and falls back to
DTensor's rule (replicate the class dim) for anything else: ``_StridedShard`` class dims, a "mean"
``nll_loss_forward`` on sharded rows (``loss_reduction`` never leaves one), 2-d/N-d ``nll_loss2d``.
Lowering asks :func:`local_kernel` for every node: it returns our shard computation exactly when
the layout propagation chose is one only our rule gives (the class dim sharded), else None. (torch's
``loss_parallel()`` context installs handlers in DTensor's global dispatcher instead, which would
also change users' eager DTensor code, and its log-softmax backward skips the computation on the
assumption that the nll loss is the log-softmax's only consumer; here each op is exact on its own,
whatever else reads the log-probabilities.)
"""

from __future__ import annotations

import functools

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import Partial, Replicate, Shard

from ..compat import pytree
from .. import compat
from ..cp import attention as cp_attention
from . import attention_rules, decision_cache, elementwise_rules, fused_projections, strided_views
from ..ir import meta
from ..layout import format_placements

aten = torch.ops.aten


class NoShardingRule(Exception):
    """Raised when neither DTensor's registry nor our own rules know an op."""


_registered = False


def register_own_rules() -> None:
    """Add our rules to DTensor's registry (idempotent), so DTensor dispatch uses them as well."""
    global _registered
    if _registered:
        return
    propagator = compat.sharding_propagator()
    attention_rules.register(propagator)
    for op in elementwise_rules.OPS:  # only where DTensor has none: a torch that adds its own keeps it
        if not has_rule(op):
            propagator.register_op_strategy(op, elementwise_rules.elementwise_strategy, elementwise_rules.SCHEMA_INFO)
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
    if op is aten.expand.default and args_schema and has_partial(args_schema[0]):
        return _reduce_before_expand(op, args_schema, kwargs_schema)
    if op in elementwise_rules.TRIANGLES and isinstance(args_schema[0], compat.DTensorSpec):
        decided = elementwise_rules.propagate_batched_triangle(args_schema)
        if decided is not None:
            return decided
    if op is aten.slice_scatter.default and not kwargs_schema:
        decided = _slice_scatter_following_source(op, args_schema)
        if decided is not None:
            return decided
    if op in _VOCAB_PARALLEL_RULES and not kwargs_schema and len(args_schema) == _ARITY[op]:
        decided = _VOCAB_PARALLEL_RULES[op](args_schema)
        if decided is not None:
            return decided
    decided = fused_projections.rule(op, args_schema, kwargs_schema)  # q, k, v of one fused weight
    if decided is not None:
        return decided
    if not has_rule(op):
        # DTensor would derive a strategy from a decomposition but still run the original kernel on
        # the shards; kernels with implicit global sizes (mean reductions) would then be wrong.
        raise NoShardingRule(f"no sharding rule for {op}")
    propagator = compat.sharding_propagator()
    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = compat.OpSchema(op, tuple(args_schema), dict(kwargs_schema), schema_info=info)
    if any(isinstance(v, compat.DTensorSpec) for v in kwargs_schema.values()) and op in propagator.op_strategy_funcs:
        return _select_with_tensor_kwargs(propagator, schema)
    # Decisions kept across compiles and meshes of one shape (decision_cache.decide): repeated
    # layers and recompiles reuse them. Not for the attention ops, whose strategies differ inside
    # the propagation scope (attention_rules.py): a decision kept there must not reach eager
    # dispatch, nor one kept outside reach propagation.
    if op in attention_rules.ATTENTION_OPS:
        decide = compat.fresh_sharding_decision
    else:
        decide = decision_cache.decide
    try:
        sharding = decide(schema)
    except NoShardingRule as exc:
        raise exc
    except NotImplementedError as exc:
        raise NoShardingRule(str(exc)) from exc
    except (RuntimeError, AssertionError, ValueError):
        decided = strided_views.unflatten_rule(op, args_schema)  # [b * s] back to [b, s] over dp x cp
        if decided is None:
            raise
        return decided
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


def has_partial(spec) -> bool:
    """Whether ``spec`` (a DTensorSpec; anything else is not) is a partial result on some axis."""
    return isinstance(spec, compat.DTensorSpec) and any(p.is_partial() for p in spec.placements)


def _reduce_before_expand(op, args_schema: tuple, kwargs_schema: dict):
    """An expand of a Partial value reduces the small input, not the expanded result: DTensor's
    rule keeps the Partial, which then costs a reduction of the broadcast tensor (the backward of a
    sum over batch-sharded rows, e.g. a mean over tokens, became a reduce-scatter of
    [global tokens, ...] instead of an all-reduce of the reduced row)."""
    x = args_schema[0]
    reduced = _spec(x, tuple(Replicate() if p.is_partial() else p for p in x.placements))
    output, _ = propagate_op(op, (reduced, *args_schema[1:]), kwargs_schema)
    return output, [reduced]


def _slice_scatter_following_source(op, args_schema: tuple):
    """A buffer filled slice by slice (``buf[..., d:] = x``: DeepSeek-V3's key with its shared RoPE
    part) is a replicated ``slice_scatter`` input with a sharded source.
    DTensor's rule follows the input only, so the source was all-gathered (over the batch axes,
    where the plan-boundary warning does not look: activations, every layer). On each mesh axis
    where the input is replicated and the source is sharded on another dim than the scattered
    one, the input takes the source's shard instead (a local slice) and the scatter stays local.
    None where nothing changes."""
    inp, src, *rest = args_schema
    if not (isinstance(inp, compat.DTensorSpec) and isinstance(src, compat.DTensorSpec)):
        return None
    dim = _norm_dim(rest[0] if rest else 0, len(inp.tensor_meta.shape))
    placements = tuple(
        s if p.is_replicate() and type(s) is Shard and s.dim != dim else p
        for p, s in zip(inp.placements, src.placements)
    )
    if placements == tuple(inp.placements):
        return None
    sliced = _spec(inp, placements)
    output, wanted = propagate_op(op, (sliced, src, *rest), {})
    return output, wanted if wanted is not None else [sliced, src]


def propagate_token_mean(op, args_schema: tuple, kwargs_schema: dict):
    """The division ``sum / count`` of a token-mean loss (``hp_loss_mean``, loss_reduction.py) with
    partial-sum inputs reduces *both* first. DTensor's rule reduces only the count and leaves the
    quotient partial, so the loss then needs a second all-reduce that waits for the first; reduced
    together, the two scalars are independent (fuse_small_reductions packs them into one
    collective) and the division is one device's ``sum / count``, not a sum of per-rank quotients."""
    reduced = tuple(
        _spec(a, tuple(Replicate() if p.is_partial() else p for p in a.placements))
        if isinstance(a, compat.DTensorSpec) else a for a in args_schema
    )
    output, _ = propagate_op(op, reduced, kwargs_schema)
    return output, [a for a in reduced if isinstance(a, compat.DTensorSpec)]


def _select_with_tensor_kwargs(propagator, schema):
    # DTensor's suggested schema (and its dispatch) redistribute positional tensors only, so an op
    # with a tensor keyword argument (SDPA's attn_mask) would run with that tensor unsharded. Pick
    # the strategy here and return the layout of every input; lowering moves them all.
    strategy = propagator.op_strategy_funcs[schema.op](compat.wrap_with_op_strategy(schema))
    chosen = compat.select_min_cost_strategy(strategy, schema)
    return chosen.output_specs, list(chosen.input_specs)


# --- vocab-parallel cross-entropy (module docstring) ------------------------------------------------

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction enum values
# Target value the local nll kernels ignore: negative, so never a class index of any shard (the
# user's ignore_index may be a valid class, e.g. a padding token id).
_LOCAL_IGNORE = -100


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _class_axes(spec, class_dim: int) -> tuple[int, ...]:
    """Mesh axes that shard ``class_dim`` with a plain ``Shard`` (contiguous vocabulary ranges)."""
    return tuple(
        i for i, p in enumerate(spec.placements)
        if isinstance(p, Shard) and not isinstance(p, compat.StridedShard) and p.dim == class_dim
    )


def _row_safe(spec, class_dim: int, row_dims: tuple[int, ...] | None) -> tuple | None:
    """The placements the op computes with: ``spec``'s, with Partial made Replicate (the op is not
    linear in its input). None when a placement is one the local kernels cannot take: a strided
    shard, or a shard of a dim that is not a row dim (``row_dims`` None: any non-class dim)."""
    out = []
    for p in spec.placements:
        if isinstance(p, compat.StridedShard):
            return None
        if isinstance(p, Shard) and p.dim != class_dim and row_dims is not None and p.dim not in row_dims:
            return None
        out.append(Replicate() if p.is_partial() else p)
    return tuple(out)


def _spec(like, placements):
    return compat.respec(like, placements)


def _replicated(like):
    return _spec(like, (Replicate(),) * like.mesh.ndim)


def _log_softmax_rule(args):
    x, dim = args[0], args[1]
    dim = _norm_dim(dim, len(x.tensor_meta.shape))
    placements = _row_safe(x, dim, None)
    if not _class_axes(x, dim) or placements is None:
        return None
    wanted = _spec(x, placements)
    return wanted, [wanted]


def _log_softmax_backward_rule(args):
    grad, out, dim = args[0], args[1], args[2]
    dim = _norm_dim(dim, len(out.tensor_meta.shape))
    placements = _row_safe(out, dim, None)
    if not _class_axes(out, dim) or placements is None:
        return None
    return _spec(out, placements), [_spec(grad, placements), _spec(out, placements)]


def _nll_placements(x):
    """(class dim, placements of the logits, placements of the targets: the logits' rows) for the
    input of nll_loss_forward/backward, or None when our rule does not apply."""
    ndim = len(x.tensor_meta.shape)
    if ndim not in (1, 2):
        return None
    class_dim = ndim - 1
    placements = _row_safe(x, class_dim, (0,) if ndim == 2 else ())
    if not _class_axes(x, class_dim) or placements is None:
        return None
    rows = tuple(p if isinstance(p, Shard) and p.dim != class_dim else Replicate() for p in placements)
    return class_dim, placements, rows


def _row_sums(rows) -> tuple:
    """Placements of a sum over the rows: Partial over the axes that shard them."""
    return tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in rows)


def _nll_forward_rule(args):
    x, target, weight, reduction = args[0], args[1], args[2], args[3]
    decided = _nll_placements(x)
    if decided is None:
        return None
    class_dim, placements, rows = decided
    row_sharded = any(isinstance(p, Shard) for p in rows)
    if reduction == _MEAN and row_sharded:
        return None  # a per-rank mean; loss_reduction rewrites every mean before propagation
    wanted = [_spec(x, placements), _spec(target, rows)]
    if isinstance(weight, compat.DTensorSpec):
        wanted.append(_replicated(weight))
    # The layouts DTensor's rule gives (its partial sums over the batch axes reduce as before).
    loss = rows if reduction == _NONE else _row_sums(rows)
    total = _row_sums(rows) if (reduction != _NONE or class_dim == 0) else (Replicate(),) * len(rows)
    mesh = x.mesh
    return (compat.DTensorSpec(mesh, loss), compat.DTensorSpec(mesh, total)), wanted


def _nll_backward_rule(args):
    grad, x, target, weight, reduction, _, total_weight = args
    decided = _nll_placements(x)
    if decided is None:
        return None
    _, placements, rows = decided
    wanted = [_spec(grad, rows) if reduction == _NONE else _replicated(grad), _spec(x, placements),
              _spec(target, rows)]
    if isinstance(weight, compat.DTensorSpec):
        wanted.append(_replicated(weight))
    # "mean" divides by the global total weight; the other reductions never read it.
    wanted.append(_replicated(total_weight) if reduction == _MEAN else total_weight)
    return _spec(x, placements), wanted


_ARITY = {
    aten._log_softmax.default: 3,
    aten._log_softmax_backward_data.default: 4,
    aten.nll_loss_forward.default: 5,
    aten.nll_loss_backward.default: 7,
}
_VOCAB_PARALLEL_RULES = {
    aten._log_softmax.default: _log_softmax_rule,
    aten._log_softmax_backward_data.default: _log_softmax_backward_rule,
    aten.nll_loss_forward.default: _nll_forward_rule,
    aten.nll_loss_backward.default: _nll_backward_rule,
}


# Which tensor input carries the class dim, and how to find the dim from the node's arguments.
def _class_dim_of(op, args, specs) -> tuple[int, int] | None:
    if op is aten._log_softmax.default:
        return 0, _norm_dim(args[1], len(specs[0].tensor_meta.shape))
    if op is aten._log_softmax_backward_data.default:
        return 1, _norm_dim(args[2], len(specs[1].tensor_meta.shape))
    if op is aten.nll_loss_forward.default:
        return 0, len(specs[0].tensor_meta.shape) - 1
    if op is aten.nll_loss_backward.default:
        return 1, len(specs[1].tensor_meta.shape) - 1
    return None


def local_kernel(op, args: tuple, layout, context=None, name: str = "", mask_within_causal: bool = False):
    """For lowering: the function that computes ``op`` on local shards when propagation chose the
    vocab-parallel layout for this node (its class dim sharded), else None (DTensor's dispatch runs
    the op). ``args`` are the node's arguments, ``layout`` its ``NodeLayout``. The function takes
    the node's arguments as DTensors already in ``layout.inputs`` and returns DTensors in
    ``layout.output``. ``context`` (the plan's ``ContextPlan``) picks the sequence-parallel
    attention kernel; ``name`` is the node's, ``mask_within_causal`` its ``hp_mask_within_causal``
    (ring attention may skip the blocks after the queries)."""
    sequence_parallel = cp_attention.local_kernel(op, layout, context, name, mask_within_causal)
    if sequence_parallel is not None:
        return sequence_parallel
    view = (strided_views.local_kernel(op, layout) or fused_projections.local_kernel(op, args, layout)
            or elementwise_rules.local_kernel(op, layout))
    if view is not None:
        return view
    if op not in _VOCAB_PARALLEL_RULES or not layout.inputs or len(args) != _ARITY[op]:
        return None
    found = _class_dim_of(op, args, layout.inputs)
    if found is None:
        return None
    index, class_dim = found
    axes = _class_axes(layout.inputs[index], class_dim)
    if not axes:
        return None
    return functools.partial(_LOCAL_KERNELS[op], layout.output, class_dim, axes)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # As the eager kernels: half-precision inputs accumulate in fp32.
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _all_reduce(local: torch.Tensor, spec, class_dim: int, axes, op: str) -> torch.Tensor:
    """All-reduce a keepdim class-dim reduction of a tensor laid out as ``spec`` over the class
    axes (a ``[tokens]``-sized collective)."""
    shape = list(spec.tensor_meta.shape)
    shape[class_dim] = 1
    return _reduce_over(local, shape, spec.mesh, spec.placements, axes, op)


def _reduce_over(local: torch.Tensor, shape, mesh, placements, axes, op: str) -> torch.Tensor:
    """``Partial(op) -> Replicate`` over mesh ``axes`` of a value of global ``shape`` laid out as
    ``placements`` elsewhere, traced as a redistribution (so dumps, summaries and the SPMD check
    see it as every other collective)."""
    shape = list(shape)
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    tmeta = compat.TensorMeta(tuple(shape), tuple(stride), local.dtype)
    src = tuple(Partial(op) if i in axes else p for i, p in enumerate(placements))
    dst = tuple(Replicate() if i in axes else p for i, p in enumerate(placements))
    annotation = {meta.ROLE: meta.ROLE_REDISTRIBUTE,
                  meta.REDISTRIBUTE: f"{format_placements(src)} -> {format_placements(dst)}"}
    with fx_traceback.annotate(annotation):
        return compat.redistribute_local_tensor(
            local, compat.DTensorSpec(mesh, src, tensor_meta=tmeta),
            compat.DTensorSpec(mesh, dst, tensor_meta=tmeta),
        )


def _local_log_softmax(out_spec, class_dim, axes, x, dim, half_to_float):
    spec, local = compat.spec_of(x), compat.local_of(x)
    xc = local.to(_compute_dtype(local))
    top = _all_reduce(torch.amax(xc, class_dim, keepdim=True), spec, class_dim, axes, "max")
    shifted = xc - top
    total = _all_reduce(torch.sum(torch.exp(shifted), class_dim, keepdim=True), spec, class_dim, axes, "sum")
    result = shifted - torch.log(total)
    return compat.dtensor_from_spec(result.to(torch.float32 if half_to_float else local.dtype), out_spec)


def _local_log_softmax_backward(out_spec, class_dim, axes, grad, output, dim, input_dtype):
    spec = compat.spec_of(output)
    g, out = compat.local_of(grad), compat.local_of(output)
    gc = g.to(_compute_dtype(g))
    total = _all_reduce(torch.sum(gc, class_dim, keepdim=True), spec, class_dim, axes, "sum")
    result = gc - torch.exp(out.to(gc.dtype)) * total
    return compat.dtensor_from_spec(result.to(input_dtype), out_spec)


def _shard_range(spec, dim: int) -> tuple[int, int]:
    """(first index, length) of this rank's piece of ``dim``, sharded by plain ``Shard``s in mesh
    order as ``torch.chunk`` cuts (DTensor's convention). Plain ints from the rank's mesh
    coordinate: DTensor's own helper builds index tensors, which lowering's fake mode cannot read."""
    coordinate = spec.mesh.get_coordinate()
    first, size = 0, spec.tensor_meta.shape[dim]
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim == dim:
            n = spec.mesh.size(axis)
            chunk = -(-size // n)
            start = min(coordinate[axis] * chunk, size)
            first, size = first + start, min(size, start + chunk) - start
    return first, size


def _local_targets(x, target, ignore_index, class_dim):
    """(whether each target counts, this shard's class index of each target or ``_LOCAL_IGNORE``,
    the shard's first class, its number of classes)."""
    first, size = _shard_range(compat.spec_of(x), class_dim)
    t = compat.local_of(target)
    counted = t != ignore_index
    shifted = t - first
    here = counted & (shifted >= 0) & (shifted < size)
    return counted, torch.where(here, shifted, _LOCAL_IGNORE), first, size


def _local_weight(weight, first: int, size: int):
    return None if weight is None else compat.local_of(weight).narrow(0, first, size)


def _local_nll_forward(out_spec, class_dim, axes, x, target, weight, reduction, ignore_index):
    local = compat.local_of(x)
    counted, local_target, first, size = _local_targets(x, target, ignore_index, class_dim)
    loss, _ = aten.nll_loss_forward(local, local_target, _local_weight(weight, first, size),
                                    _NONE if reduction == _NONE else _SUM, _LOCAL_IGNORE)
    # Each token's loss is on the one shard holding its target (0 elsewhere): the sum over the
    # class axes, of one value per token (a scalar for "sum" / "mean"), before anything else.
    loss = _reduce_over(loss, out_spec[0].tensor_meta.shape, out_spec[0].mesh, out_spec[0].placements,
                        axes, "sum")
    if reduction == _NONE and class_dim == 1:
        total = local.new_zeros(())  # as the kernel: no total weight without a reduction
    elif weight is None:
        total = counted.sum().to(local.dtype)
    else:
        t = compat.local_of(target)
        w = compat.local_of(weight)
        safe = torch.where(counted, t, 0)
        picked = torch.index_select(w, 0, safe.reshape(-1)).reshape(safe.shape)
        total = torch.where(counted, picked, 0).sum().to(local.dtype)
    if reduction == _MEAN:  # rows unsharded here (the rule): total is the global weight
        loss = loss / total
    return (compat.dtensor_from_spec(loss, out_spec[0]), compat.dtensor_from_spec(total, out_spec[1]))


def _local_nll_backward(out_spec, class_dim, axes, grad, x, target, weight, reduction, ignore_index,
                        total_weight):
    _, local_target, first, size = _local_targets(x, target, ignore_index, class_dim)
    result = aten.nll_loss_backward(
        compat.local_of(grad), compat.local_of(x), local_target, _local_weight(weight, first, size),
        reduction, _LOCAL_IGNORE, compat.local_of(total_weight),
    )
    return compat.dtensor_from_spec(result, out_spec)


_LOCAL_KERNELS = {
    aten._log_softmax.default: _local_log_softmax,
    aten._log_softmax_backward_data.default: _local_log_softmax_backward,
    aten.nll_loss_forward.default: _local_nll_forward,
    aten.nll_loss_backward.default: _local_nll_backward,
}
