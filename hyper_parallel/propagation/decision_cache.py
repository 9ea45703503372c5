"""The sharding decisions DTensor caches: reused while lowering traces, cleared between meshes.

Lowering runs every op of the joint graph through DTensor's dispatch under ``make_fx``, and
tracing makes DTensor bypass its caches; :func:`cached_sharding_decisions` puts them back wherever
the sizes are plain integers. DTensor keys its caches on a mesh's shape and axis names, not on
its process groups; :func:`sharding_caches_for` clears them when a compile lowers onto another
mesh. The private DTensor hooks both use are in ``compat.dtensor``.
"""

from __future__ import annotations

import contextlib
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
    concrete sizes does not depend on tracing, so a cached one is the one DTensor would compute:
    op decisions come from the per-schema cache eager DTensor uses (propagation filled it for many
    of the same schemas; repeated layers repeat them), redistribution plans from a table kept for
    the duration. A schema with a symbolic size or a tensor argument, and ``uncached_ops`` (ops
    whose strategies differ between scopes), are decided afresh as before."""
    propagator = compat.sharding_propagator()
    fresh, cached = propagator.propagate_op_sharding_non_cached, propagator.propagate_op_sharding
    fresh_plan = compat.redistribution_planner()
    plans: dict = {}

    def decide(op_schema):
        if op_schema.op in uncached_ops or not _concrete(op_schema):
            return fresh(op_schema)
        return cached(op_schema)

    def plan(src_spec, dst_spec, use_graph_based_transform=None):
        if not (_concrete_spec(src_spec) and _concrete_spec(dst_spec)):
            return fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        key = (src_spec, dst_spec, use_graph_based_transform)
        if key not in plans:
            plans[key] = fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        return list(plans[key])

    with compat.sharding_decisions_replaced(decide, plan):
        yield


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)


def _concrete(op_schema) -> bool:
    """Whether every size in ``op_schema`` is a plain number (it hashes by value)."""
    for leaf in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema)):
        if isinstance(leaf, DTensorSpec):
            if not _concrete_spec(leaf):
                return False
        elif isinstance(leaf, _SYMBOLIC):
            return False
    return True


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
