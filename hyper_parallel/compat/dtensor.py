"""DTensor internals: specs, schemas, the sharding-strategy registry, local redistribution and the
caches DTensor keeps of its decisions.

Why private: DTensor's sharding-strategy registry (``DTensor._op_dispatcher.sharding_propagator``,
about 1,100 aten op strategies) is the compiler's rule database; propagation builds the specs and
schemas it takes (``_dtensor_spec``, ``_op_schema``), lowering redistributes local shards with
``_redistribute`` and reads local shapes with ``_utils``, and ``_StridedShard`` is the placement
DTensor's view rules make (a ``[batch, sequence]`` flatten with the sequence sharded). The
caches DTensor keeps per schema and per mesh are cleared and shadowed here; what is cached when
(the decisions lowering reuses, per mesh) is decided in propagation/decision_cache.py.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpStrategy,
    OutputSharding,
    RuntimeSchemaInfo,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy  # noqa: F401
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: F401
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "RuntimeSchemaInfo",
    "expand_to_full_mesh_op_strategy",
    "redistribute_local_tensor",
    "compute_local_shape_and_global_offset",
    "StridedShard",
    "sharding_propagator",
    "fresh_sharding_decision",
    "strategy_rules_of",
    "rank_in_mesh",
    "select_min_cost_strategy",
    "wrap_with_op_strategy",
    "redistribution_planner",
    "sharding_decisions_replaced",
    "clear_propagation_caches",
    "clear_sharding_caches",
    "respec",
    "dtensor_from_spec",
    "spec_of",
    "local_of",
    "plain_tensor",
    "split_by_placement",
    "eager_strided_shard_sizes",
]


# --- the sharding-strategy registry and its caches -------------------------------------------------


def sharding_propagator():
    """DTensor's global sharding propagator: the registry of ~1,100 aten op strategies."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def fresh_sharding_decision(op_schema):
    """DTensor's full strategy search for ``op_schema`` (an OutputSharding), bypassing its caches
    and any replacement ``sharding_decisions_replaced`` installed on the propagator instance."""
    propagator = sharding_propagator()
    return type(propagator).propagate_op_sharding_non_cached(propagator, op_schema)


def strategy_rules_of(op) -> tuple:
    """The rule objects DTensor's registry holds for ``op`` (strategy function, single-dim strategy,
    propagation rule; None where absent): a decision is a function of these, so they key it."""
    propagator = sharding_propagator()
    return (propagator.op_strategy_funcs.get(op), propagator.op_single_dim_strategy_funcs.get(op),
            propagator.op_to_rules.get(op))


def rank_in_mesh(mesh) -> bool:
    """Whether this process is one of ``mesh``'s ranks (DTensor prices no redistribution on a mesh
    it is not part of)."""
    return mesh._is_current_rank_part_of_mesh()


def select_min_cost_strategy(strategy, op_schema):
    """DTensor's own choice among an OpStrategy's candidates (least redistribution cost)."""
    from torch.distributed.tensor._sharding_prop import _select_min_cost_strategy

    return _select_min_cost_strategy(strategy, op_schema)


def wrap_with_op_strategy(op_schema):
    """An OpSchema whose DTensorSpec arguments are turned into single-candidate OpStrategies."""
    return sharding_propagator()._wrap_with_op_strategy(op_schema)


def redistribution_planner():
    """The redistribution planner DTensor calls now where its plan cache does not apply (under
    tracing): ``(src_spec, dst_spec, use_graph_based_transform) -> transform steps``."""
    from torch.distributed.tensor import _redistribute

    return _redistribute._gen_transform_infos_non_cached


@contextlib.contextmanager
def sharding_decisions_replaced(decide, plan):
    """While active, DTensor's dispatch decides an op's sharding with ``decide(op_schema)`` where it
    would decide afresh (``propagate_op_sharding_non_cached``: what it calls under tracing, which
    bypasses its caches) and plans a redistribution with ``plan(src_spec, dst_spec,
    use_graph_based_transform)`` (``_gen_transform_infos_non_cached``). Both are restored on exit,
    also when nested (the enclosing replacement comes back)."""
    from torch.distributed.tensor import _redistribute

    propagator = sharding_propagator()
    fresh_plan = _redistribute._gen_transform_infos_non_cached
    shadowed = propagator.__dict__.get("propagate_op_sharding_non_cached")  # set by an enclosing use
    propagator.propagate_op_sharding_non_cached = decide  # shadows the method on this instance
    _redistribute._gen_transform_infos_non_cached = plan  # looked up by name at every call
    try:
        yield
    finally:
        if shadowed is None:
            del propagator.propagate_op_sharding_non_cached
        else:
            propagator.propagate_op_sharding_non_cached = shadowed
        _redistribute._gen_transform_infos_non_cached = fresh_plan


def clear_propagation_caches() -> None:
    """Forget DTensor's cached sharding decisions per op schema (Python LRU and the C++ dispatch
    cache): needed whenever the strategies an op has change."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions (Python LRU and the C++ dispatch cache).

    DTensor keys those caches on a mesh's shape and axis names, not on its process groups, so a
    decision cached for one mesh can hand a later mesh of the same shape the first one's (possibly
    destroyed) groups. Called whenever a mesh is created, and by
    ``propagation.decision_cache.sharding_caches_for`` when a compile lowers onto another mesh
    than the previous compile did.

    Also DTensor's redistribution planners and transform plans: torch keys the planner cache on a
    weak reference to the mesh but the planner holds the mesh itself, so every mesh a compile
    lowered through stays alive, and with it its process groups: destroying a gloo group then
    leaves its threads running (a test worker kept over a hundred)."""
    clear_propagation_caches()
    from torch.distributed.tensor import _collective_utils, _redistribute

    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    topology = getattr(_collective_utils, "MeshTopoInfo", None)  # cached per mesh, by its hash
    for cached in (getattr(_redistribute, "_gen_transform_infos", None), getattr(topology, "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


# --- specs, DTensors and placements ----------------------------------------------------------------


def respec(spec, placements=None, *, mesh=None, tensor_meta=None) -> DTensorSpec:
    """``spec`` with other placements, mesh or tensor meta, reading ``_StridedShard`` as it does.

    A DTensorSpec reads a ``_StridedShard`` in one of two ways (its
    ``use_strided_shard_as_shard_order``): as the order in which mesh axes shard one dim (the
    default for a spec built from placements alone) or as a strided shard of its own (what DTensor's
    view rules produce, e.g. flattening ``[batch, heads]`` with heads sharded). A spec rebuilt from
    placements alone silently switches to the first reading, and DTensor's rules then match the
    two as different shardings (an HF GPT-2 attention backward ``bmm`` fell back to replicated).
    Every spec rebuilt from another keeps its reading here; a spec made fresh from plan placements
    gets DTensor's default."""
    placements = spec.placements if placements is None else tuple(placements)
    as_order = spec.use_strided_shard_as_shard_order
    order = spec.shard_order if not as_order and placements == spec.placements else None
    return DTensorSpec(spec.mesh if mesh is None else mesh, placements,
                       tensor_meta=spec.tensor_meta if tensor_meta is None else tensor_meta,
                       shard_order=order, use_strided_shard_as_shard_order=as_order)


def dtensor_from_spec(local: torch.Tensor, spec) -> "torch.distributed.tensor.DTensor":
    """Wrap a local shard as a DTensor of ``spec`` without autograd or a consistency check."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def spec_of(dt) -> DTensorSpec:
    """A DTensor's spec (mesh, placements, global tensor meta)."""
    return dt._spec


def local_of(dt) -> torch.Tensor:
    """A DTensor's local shard, without going through autograd (``to_local`` is differentiable)."""
    return dt._local_tensor


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no autograd), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def split_by_placement(placement, tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """The pieces a ``Shard`` / ``_StridedShard`` placement cuts ``tensor`` into over ``num_chunks``
    ranks, as ``distribute_tensor`` cuts it (no padding, views where possible)."""
    pieces, _ = placement._split_tensor(tensor, num_chunks, with_padding=False, contiguous=False)
    return pieces


def eager_strided_shard_sizes() -> None:
    """Compute ``_StridedShard``'s local sizes and offsets eagerly (idempotent).

    DTensor derives them from ``torch.arange(size)`` split and read back with ``tolist()``: integers
    in, integers out. Under lowering's ``make_fx`` over fake tensors every one of those ops is traced
    and each element read back goes through the fake-tensor dispatcher, so a sequence-sharded model
    (the flatten of ``[batch, sequence]`` gives a strided shard) took ~50 s to lower on a 2-D mesh
    instead of ~2. With plain-int sizes the computation runs outside fake mode and tracing instead;
    the result is the same integers, remembered per (placement, size, chunks, rank, mode): a long
    sequence's ``arange`` costs milliseconds, and one compile asks the same question hundreds of
    times (a third of a 1M-token context-parallel compile went there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    original = StridedShard.local_shard_size_and_offset
    if getattr(original, "_hp_eager", False):
        return

    known: dict = {}

    def local_shard_size_and_offset(self, curr_local_size, *args, **kwargs):
        if type(curr_local_size) is not int:
            return original(self, curr_local_size, *args, **kwargs)
        key = (self.dim, self.split_factor, curr_local_size, args, tuple(sorted(kwargs.items())))
        try:
            size, offset = known[key]
        except (KeyError, TypeError):  # TypeError: an argument that is not hashable
            with unset_fake_temporarily(), disable_proxy_modes_tracing():
                size, offset = original(self, curr_local_size, *args, **kwargs)
            try:
                known[key] = (size, offset)
            except TypeError:
                return size, offset
        return size, list(offset) if isinstance(offset, list) else offset

    local_shard_size_and_offset._hp_eager = True
    local_shard_size_and_offset.__doc__ = original.__doc__
    StridedShard.local_shard_size_and_offset = local_shard_size_and_offset
