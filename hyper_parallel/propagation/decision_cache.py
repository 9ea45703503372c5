"""The sharding decisions DTensor makes, kept: across meshes of one shape, while lowering traces.

:func:`decide` keeps DTensor's strategy search results for the process, by what they depend on
and without the mesh (process groups) they were made on; propagation and lowering both decide
through it. Lowering runs every op of the joint graph through DTensor's dispatch under
``make_fx``, and tracing makes DTensor bypass its caches; :func:`cached_sharding_decisions` puts
them back wherever the sizes are plain integers. DTensor keys its own caches on a mesh's shape and
axis names, not on its process groups; :func:`sharding_caches_for` clears them when a compile
lowers onto another mesh. The private DTensor hooks all three use are in ``compat.dtensor``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from .. import compat
from ..compat import DTensorSpec, pytree


@contextlib.contextmanager
def cached_sharding_decisions(uncached_ops=frozenset()):
    """While active, DTensor's dispatch under tracing reuses its sharding decisions and
    redistribution plans wherever the sizes involved are plain integers.

    Why: lowering runs every op of the joint graph through DTensor's dispatch under ``make_fx``.
    Tracing makes DTensor bypass its caches (a schema with symbolic sizes is not hashable), so every
    op re-ran the full strategy search, each candidate priced by a shortest-path search over
    redistributions: three quarters of a small tp x cp compile. The decision for a schema of
    concrete sizes does not depend on tracing, so a kept one is the one DTensor would compute:
    op decisions come from :func:`decide` (propagation made most of the same ones; repeated layers
    repeat them), redistribution plans from a table kept for the duration. A schema with a
    symbolic size or a tensor argument, and ``uncached_ops`` (ops whose strategies differ between
    scopes), are decided afresh as before."""
    fresh_plan = compat.redistribution_planner()
    plans: dict = {}

    def decide_traced(op_schema):
        if op_schema.op in uncached_ops:
            return compat.fresh_sharding_decision(op_schema)
        return decide(op_schema)

    def plan(src_spec, dst_spec, use_graph_based_transform=None):
        if not (_concrete_spec(src_spec) and _concrete_spec(dst_spec)):
            return fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        key = (src_spec, dst_spec, use_graph_based_transform)
        if key not in plans:
            plans[key] = fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        return list(plans[key])

    with compat.sharding_decisions_replaced(decide_traced, plan):
        yield


# --- decisions kept for the process, without their mesh ---------------------------------------------

MAX_KEPT_DECISIONS = 50_000
"""Bound on :func:`decide`'s table (emptied when full): a large model's compile makes a few
thousand distinct decisions."""

_decisions: dict = {}
_counts = {"kept": 0, "made": 0}


@dataclasses.dataclass(frozen=True)
class _UnboundSpec:
    """A DTensorSpec without its mesh: what a kept decision stores in its place."""
    placements: tuple
    tensor_meta: object
    shard_order: object
    use_strided_shard_as_shard_order: object


@dataclasses.dataclass(frozen=True)
class _UnboundSchema:
    """An OpSchema (a decision's redistribution target) with its specs unbound."""
    op: object
    args_schema: object
    kwargs_schema: object
    schema_info: object


class _NotKept(Exception):
    """A decision (or schema) that :func:`decide` does not keep: it is made afresh."""


def decide(op_schema):
    """DTensor's sharding decision (an OutputSharding) for ``op_schema``, whose tensor arguments
    are DTensorSpecs; a decision made before for an equivalent schema is reused.

    Why: DTensor's own caches hold the mesh a decision was made on (and its process groups), so
    they are emptied whenever a mesh is created (``compat.clear_sharding_caches``), and every
    compile onto a new mesh ran the full strategy search again. On a 2-D mesh that search prices
    each candidate by a shortest-path search over redistributions: 40% of a small Llama's dp x cp
    compile, repeated by every test, benchmark candidate and planner probe of that shape.

    A decision is a function of the op, the rules DTensor's registry holds for it, each tensor
    argument's placements, shard order and tensor metadata, the other arguments' values and the
    mesh's device type, shape, axis names and whether this rank is in it (DTensor's strategies and
    redistribution costs read nothing else of a mesh: not its ranks' identities nor its process
    groups). That is the key here; the decision is kept without its mesh and bound to the schema's
    mesh when reused, so no mesh is held alive. Schemas with symbolic sizes, tensors or unhashable
    values among their arguments, or specs on more than one mesh, are decided afresh."""
    try:
        key, mesh = _schema_key(op_schema)
    except _NotKept:
        return compat.fresh_sharding_decision(op_schema)
    entry = _decisions.get(key)
    if entry is not None:
        _counts["kept"] += 1
    else:
        decision = compat.fresh_sharding_decision(op_schema)
        try:
            kept = _unbind(decision, mesh)
        except _NotKept:
            return decision
        _counts["made"] += 1
        if len(_decisions) >= MAX_KEPT_DECISIONS:
            _decisions.clear()
        # The rules are keyed by identity (some are unhashable) and held by the entry, so no later
        # rule object can take the identity of one a kept decision was made with.
        entry = _decisions[key] = (kept, compat.strategy_rules_of(op_schema.op))
    return _bind(entry[0], mesh)


def forget_decisions() -> None:
    """Empty :func:`decide`'s table and its counts (a rule registered for an op replaces its key
    anyway)."""
    _decisions.clear()
    _counts.update(kept=0, made=0)


def decision_counts() -> dict:
    """``{"kept": decisions reused, "made": decisions searched for and kept}`` since the last
    :func:`forget_decisions`; schemas :func:`decide` does not keep are not counted."""
    return dict(_counts)


def _schema_key(op_schema):
    leaves, tree = pytree.tree_flatten((op_schema.args_schema, op_schema.kwargs_schema),
                                       is_leaf=lambda x: isinstance(x, DTensorSpec))
    mesh, parts = None, []
    for leaf in leaves:
        if isinstance(leaf, DTensorSpec):
            if not _concrete_spec(leaf) or (mesh is not None and leaf.mesh is not mesh):
                raise _NotKept
            mesh = leaf.mesh
            parts.append(_unbind(leaf, mesh))
        elif isinstance(leaf, _SYMBOLIC):
            raise _NotKept
        elif isinstance(leaf, float):
            parts.append((float, repr(leaf)))  # -0.0 and 0.0, nan: told apart
        else:
            try:
                hash(leaf)
            except TypeError:
                raise _NotKept from None
            parts.append((type(leaf), leaf))
    if mesh is None:
        raise _NotKept
    where = (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names, compat.rank_in_mesh(mesh))
    rules = tuple(id(rule) for rule in compat.strategy_rules_of(op_schema.op))
    return (op_schema.op, rules, where, tree, tuple(parts)), mesh


def _unbind(value, mesh):
    """``value`` (a decision, schema, spec or container of them) with every spec's mesh taken out;
    a spec on another mesh than ``mesh`` is not kept."""
    if isinstance(value, DTensorSpec):
        if value.mesh is not mesh:
            raise _NotKept
        return _UnboundSpec(value.placements, value.tensor_meta, value.shard_order,
                            value.use_strided_shard_as_shard_order)
    if isinstance(value, compat.OutputSharding):
        return dataclasses.replace(value, output_spec=_unbind(value.output_spec, mesh),
                                   redistribute_schema=_unbind(value.redistribute_schema, mesh))
    if isinstance(value, compat.OpSchema):
        return _UnboundSchema(value.op, _unbind(value.args_schema, mesh), _unbind(value.kwargs_schema, mesh),
                              value.schema_info)
    if isinstance(value, (tuple, list)):
        return type(value)(_unbind(v, mesh) for v in value)
    if isinstance(value, dict):
        return {k: _unbind(v, mesh) for k, v in value.items()}
    if isinstance(value, (torch.Tensor, compat.OpStrategy)):
        raise _NotKept
    return value


def _bind(value, mesh):
    """The inverse of :func:`_unbind` onto ``mesh``: fresh specs, schemas and containers."""
    if isinstance(value, _UnboundSpec):
        return DTensorSpec(mesh, value.placements, tensor_meta=value.tensor_meta, shard_order=value.shard_order,
                           use_strided_shard_as_shard_order=value.use_strided_shard_as_shard_order)
    if isinstance(value, compat.OutputSharding):
        return dataclasses.replace(value, output_spec=_bind(value.output_spec, mesh),
                                   redistribute_schema=_bind(value.redistribute_schema, mesh))
    if isinstance(value, _UnboundSchema):
        return compat.OpSchema(value.op, _bind(value.args_schema, mesh), _bind(value.kwargs_schema, mesh),
                               schema_info=value.schema_info)
    if isinstance(value, (tuple, list)):
        return type(value)(_bind(v, mesh) for v in value)
    if isinstance(value, dict):
        return {k: _bind(v, mesh) for k, v in value.items()}
    return value


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)


def _concrete_spec(spec) -> bool:
    meta = spec.tensor_meta
    return meta is not None and not any(isinstance(v, _SYMBOLIC) for v in (*meta.shape, *meta.stride))


_LAST_LOWERED_MESH = None  # a weak reference to the mesh the previous compile lowered onto


def sharding_caches_for(mesh) -> None:
    """Make DTensor's caches safe for a compile that lowers onto ``mesh``: cleared unless the
    previous compile lowered onto this very mesh. Two equal meshes (the same ranks, shape and axis
    names) may both be alive, created before either compiled; a decision cached for the other one
    would run this compile's collectives on that mesh's process groups, which its labels, passes
    and SPMD check do not know. Reusing the caches for the same mesh keeps repeated compiles fast."""
    global _LAST_LOWERED_MESH
    if _LAST_LOWERED_MESH is None or _LAST_LOWERED_MESH() is not mesh:
        compat.clear_sharding_caches()
        _LAST_LOWERED_MESH = weakref.ref(mesh)
