"""Resolution of fully sharded data parallelism: units, storage layouts, post-forward groups.

``FullyShard`` (``ParallelPlan.fully_shard``) and ``fully_shard(module, ...)`` (FSDP2-style, called
on each layer then on the root) say which modules are FSDP units. ``resolve_fully_shard`` turns that
into what the compiler reads: every parameter of a unit is *stored* sharded on dim 0 over the shard
axis (and replicated over the HSDP replicate axis), while it is *computed with* in its plain layout
(the tensor-parallel layout, Replicate over the data-parallel axes). Expert- and context-parallel
axes take other tokens, so they are data-parallel for every parameter not split over them: dense
parameters are stored sharded over shard axis x those axes (torchtitan's dense FSDP over dp_shard x
ep, and dp_shard x cp) and expert weights, which already differ per expert rank, over the shard
axis only. Propagation inserts the
storage → compute redistribution (the all-gather) before first use and sends each gradient back to
the storage layout (the reduce-scatter, plus the all-reduce over the replicate axis for HSDP); the
fsdp passes (reshard after forward, bucketing) schedule and fuse those collectives.

When tensor parallelism already shards dim 0 (a colwise weight), the shard axis splits each TP
shard further, which in DTensor terms is ``_StridedShard(0, split_factor=<tp degree>)`` — the same
placement PyTorch FSDP2 uses for 2-D parallelism; it unshards with one all-gather.

:func:`attach_post_forward_groups` then creates the process groups of units with
``reshard_after_forward=<k>`` (passes/reshard_after_forward.py gathers over them in backward); it
runs at ``parallelize`` time, on every rank, since creating a process group is collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from .. import compat
from ..layout import format_placements
from ..plan import ResolvedPlan, fqn_matches
from .plan import FsdpPlan, FsdpUnit, FullyShard, post_forward_size


def _fsdp_axes(spec: FullyShard, names: tuple[str, ...]) -> tuple[str | None, str]:
    if spec.mesh_axes is not None:
        for axis in spec.mesh_axes:
            if axis not in names:
                raise ValueError(
                    f"fully_shard.mesh_axes names {axis!r}, which the mesh does not have; the mesh "
                    f"axes are {list(names)}"
                )
        if len(spec.mesh_axes) == 1:
            return None, spec.mesh_axes[0]
        if len(spec.mesh_axes) == 2:
            return spec.mesh_axes[0], spec.mesh_axes[1]
        raise ValueError(
            f"fully_shard.mesh_axes must name 1 axis (FSDP) or 2 (HSDP: replicate, shard), "
            f"got {spec.mesh_axes}"
        )
    if "dp_replicate" in names and "dp_shard" in names:
        return "dp_replicate", "dp_shard"
    for axis in ("dp_shard", "fsdp", "dp"):
        if axis in names:
            return None, axis
    raise ValueError(
        f"fully_shard needs a data-parallel mesh axis to shard over, and the mesh axes are "
        f"{list(names)}: name one 'dp' (FSDP), 'dp_replicate' and 'dp_shard' (HSDP), or pass "
        "FullyShard(mesh_axes=...)"
    )


def _extra_shard_axes(spec: FullyShard, resolved: ResolvedPlan, shard_axis: str, replicate_axis) -> tuple[str, ...]:
    """The expert- and context-parallel axes FSDP shards parameters over too (every
    ``expert_parallel`` axis and the ``context_parallel`` sequence axis), unless the entry names
    its axes itself (``mesh_axes``), which is then taken literally."""
    if spec.mesh_axes is not None:
        return ()
    axes = {r.axis for r in resolved.experts.values() if r.axis is not None} | set(resolved.sequence_axes)
    return tuple(
        a for a in resolved.mesh_dim_names
        if a in axes and a not in (shard_axis, replicate_axis)
    )


def _assign_units(spec: FullyShard, model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> the innermost unit module that contains it."""
    module_fqns = [fqn for fqn, _ in model.named_modules()]
    unit_modules: list[str] = []
    for glob in spec.units:
        matched = [fqn for fqn in module_fqns if fqn_matches(glob, fqn)] if glob else [""]
        if not matched:
            raise ValueError(
                f"fully_shard unit {glob!r} matches no module of {type(model).__name__}; units are "
                "module-FQN globs matched segment by segment, e.g. 'model.layers.*', or '' for the root"
            )
        unit_modules.extend(m for m in matched if m not in unit_modules)

    def contains(unit: str, fqn: str) -> bool:
        return unit == "" or fqn == unit or fqn.startswith(unit + ".")

    owner: dict[str, str] = {}
    for fqn, _ in model.named_parameters(remove_duplicate=False):
        holders = [u for u in unit_modules if contains(u, fqn)]
        if not holders:
            continue
        innermost = max(holders, key=lambda u: (u != "", u.count(".")))
        owner[fqn] = innermost
    # A tensor shared by two units must have one unit that contains the other; otherwise no single
    # unit can own (gather and reduce) it.
    by_tensor: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if fqn in owner:
            by_tensor.setdefault(id(p), []).append(fqn)
    for fqns in by_tensor.values():
        units = sorted({owner[f] for f in fqns})
        if len(units) == 1:
            continue
        # The innermost unit that contains every name of the tensor owns it.
        common = [u for u in unit_modules if all(contains(u, f) for f in fqns)]
        if not common:
            raise ValueError(
                f"parameters {fqns} are one shared tensor owned by units {units}, which do not "
                "nest, so no unit can own it: add a unit that contains them all (e.g. the root '') "
                "or untie the parameters"
            )
        outer = max(common, key=lambda u: (u != "", u.count(".")))
        for f in fqns:
            owner[f] = outer
    return owner


def _storage_placements(compute: tuple, names, sizes, fsdp_axes: list[int], fqn: str, shape) -> tuple:
    """``compute`` with every FSDP axis in ``fsdp_axes`` (mesh indices, outermost first) that
    ``fqn`` is computed replicated over turned into a dim-0 shard. The first must be replicated (it
    is the unit's shard axis); the others are expert- or context-parallel axes, skipped where the parameter is
    an expert weight (computed sharded over them). Several FSDP axes shard dim 0 in mesh order, so
    together they are one shard over the flattened ranks."""
    placements = list(compute)
    shard_i = fsdp_axes[0]
    if not isinstance(placements[shard_i], Replicate):
        raise ValueError(
            f"parameter {fqn!r} has layout {format_placements(compute)}, which is not replicated "
            f"over the FSDP shard axis {names[shard_i]!r}; FSDP shards data-parallel replicas only"
        )
    if not shape:
        raise ValueError(
            f"parameter {fqn!r} is a scalar: FSDP shards dim 0, leave this module out of the units"
        )
    axes = [i for i in fsdp_axes if isinstance(compute[i], Replicate)]
    ranks = math.prod(sizes[j] for j in axes)
    # Dim-0 shards the parameter is computed with (tensor or expert parallel) are applied first;
    # the FSDP shards split each of those pieces further, which in DTensor terms is a strided shard
    # whose split factor is the number of computed dim-0 pieces after it in mesh order.
    computed0 = [i for i in range(len(names)) if isinstance(compute[i], Shard) and compute[i].dim == 0]
    local0 = shape[0] // math.prod(sizes[i] for i in computed0)
    if computed0 and local0 % ranks != 0:
        if _dim1_shardable(compute, shape, ranks):
            # What tensor/expert parallelism leaves of dim 0 does not divide over the FSDP ranks
            # (e.g. one expert per expert-parallel rank): shard dim 1 instead, as torchtitan does
            # for expert weights. Gathering it is one all-gather and a re-layout of its rows.
            for i in axes:
                placements[i] = Shard(1)
            return tuple(placements)
        over = " x ".join(f"{names[j]}={sizes[j]}" for j in axes)
        raise ValueError(
            f"parameter {fqn!r} of shape {tuple(shape)}: its dim 0 per tensor/expert-parallel shard "
            f"({local0}) does not divide over {over}, nor does its dim 1, and uneven FSDP shards "
            "nested inside tensor-parallel shards are not supported: use degrees that divide dim 0"
        )
    for i in axes:
        later = [j for j in computed0 if j > i]
        placements[i] = (
            compat.StridedShard(0, split_factor=math.prod(sizes[j] for j in later)) if later else Shard(0)
        )
    return tuple(placements)


def _dim1_shardable(compute: tuple, shape, ranks: int) -> bool:
    """Dim 1 exists, no computed placement splits it, and it divides over ``ranks``."""
    return (
        len(shape) >= 2 and shape[1] % ranks == 0
        and not any(isinstance(p, Shard) and p.dim == 1 for p in compute)
    )


def _reshard_value(value: Any, unit: str | None, shard_axis: str, size: int) -> bool | int:
    """``reshard_after_forward`` normalised as FSDP2 does: an int k must divide the shard-axis size;
    k == size means True and k == 1 means False, so an int result is always 1 < k < size.
    ``unit``: the unit's module FQN when the value was given per unit (``hp.fully_shard``)."""
    where = "fully_shard" if unit is None else f"fully_shard unit {unit or '<root>'!r}:"
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"{where} reshard_after_forward must be True, False or an int, got {value!r}")
    if value <= 0 or size % value != 0:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"{where} reshard_after_forward={value} must divide the shard axis {shard_axis}={size} "
            f"(it is the size of the smaller group parameters are resharded to after forward); "
            f"use one of {divisors}, or True/False"
        )
    return True if value == size else False if value == 1 else value


def resolve_fully_shard(value: Any, model: nn.Module, resolved: ResolvedPlan) -> ResolvedPlan:
    """Return ``resolved`` with FSDP storage layouts and ``resolved.fsdp`` set (module docstring)."""
    spec = FullyShard.from_value(value)
    names, sizes = tuple(resolved.mesh_dim_names), tuple(resolved.mesh_shape)
    replicate_axis, shard_axis = _fsdp_axes(spec, names)
    for axis in (replicate_axis, shard_axis):
        if axis is not None and axis not in resolved.data_parallel_axes:
            raise ValueError(
                f"fully_shard shards over {axis!r}, which is not a data-parallel axis (those are "
                f"{list(resolved.data_parallel_axes)}); name data-parallel axes 'dp*' or 'fsdp'"
            )
    shard_size = sizes[names.index(shard_axis)]
    per_unit_reshard = {  # hp.fully_shard calls: checked first, so an error names the unit
        unit: _reshard_value(value, unit, shard_axis, shard_size)
        for unit, value in getattr(spec, "_per_unit_reshard", {}).items()
    }
    default_reshard = _reshard_value(spec.reshard_after_forward, None, shard_axis, shard_size)
    owner = _assign_units(spec, model)
    params = dict(model.named_parameters(remove_duplicate=False))
    extra_axes = _extra_shard_axes(spec, resolved, shard_axis, replicate_axis)
    fsdp_axes = [names.index(shard_axis)] + sorted(names.index(a) for a in extra_axes)
    storage = dict(resolved.param_placements)
    compute = {}
    for fqn, unit in owner.items():
        compute[fqn] = resolved.param_placements[fqn]
        storage[fqn] = _storage_placements(compute[fqn], names, sizes, fsdp_axes, fqn, params[fqn].shape)
    units = []
    for unit in dict.fromkeys(owner.values()):
        members = tuple(f for f, u in owner.items() if u == unit)
        dtypes = {params[f].dtype for f in members}
        if len(dtypes) > 1 and (spec.mixed_precision is None or spec.mixed_precision.param_dtype is None):
            raise ValueError(
                f"FSDP unit {unit or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                "one fused all-gather needs one dtype: set mixed_precision=MixedPrecisionPolicy("
                "param_dtype=...) or split the unit"
            )
        units.append(FsdpUnit(unit, members, per_unit_reshard.get(unit, default_reshard)))
    fsdp = FsdpPlan(
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        units=tuple(units),
        unit_of=owner,
        compute_placements=compute,
        extra_shard_axes=extra_axes,
        comm_fusion=spec.comm_fusion,
        mixed_precision=spec.mixed_precision,
        offload_policy=spec.offload_policy,
    )
    return dataclasses.replace(resolved, param_placements=storage, fsdp=fsdp)


def attach_post_forward_groups(fsdp, mesh):
    """``fsdp`` (an FsdpPlan) with ``post_forward_group``/``post_forward_rank`` set on every unit
    with ``reshard_after_forward=<k>``: the shard axis of N ranks is split into N/k contiguous
    groups of k, one split per distinct k. Creates process groups, so every rank calls it."""
    if fsdp is None:
        return fsdp
    sizes = sorted({k for u in fsdp.units if (k := post_forward_size(u))})
    if not sizes:
        return fsdp
    axis = fsdp.shard_axis
    n = mesh.size(mesh.mesh_dim_names.index(axis))
    groups = {}
    for k in sizes:
        inner = f"{axis}_k{k}"
        split = compat.unflatten_mesh_axis(mesh, axis, (n // k, k), (f"{axis}_outer{k}", inner))
        group = split.get_group(inner)
        # The rank's index in the group is where its piece goes in the group's all-gather.
        groups[k] = (group.group_name, dist.get_rank(group))
    units = tuple(
        dataclasses.replace(u, post_forward_group=groups[k][0], post_forward_rank=groups[k][1])
        if (k := post_forward_size(u)) else u
        for u in fsdp.units
    )
    return dataclasses.replace(fsdp, units=units)
