"""Resolution of fully sharded data parallelism: units, storage layouts, post-forward groups.

``FullyShard`` (``ParallelPlan.fully_shard``) and ``fully_shard(module, ...)`` (FSDP2-style, called
on each layer then on the root) say which modules are FSDP units (a list of modules is one unit).
``resolve_fully_shard`` turns that into what the compiler reads: every parameter of a unit (but the
``ignored_params``, left replicated like parameters outside every unit) is *stored* sharded on dim
0, or the dim its unit's ``shard_placement_fn`` returns, over the shard axis (and replicated over
the HSDP replicate axis), while it is *computed with* in its plain layout
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
``reshard_after_forward=<k>`` (passes/reshard_after_forward.py gathers over them in backward), and
:func:`attach_joint_shard_group` the mesh flattened over the several axes dense parameters are
sharded over, so that each gather and reduce-scatter is one collective, not one per axis; both run
at ``parallelize`` time, on every rank, since creating a process group is collective.
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


def _unit_mesh_axes(spec: FullyShard, names: tuple[str, ...], sizes: tuple[int, ...]) -> FullyShard:
    """``spec`` with ``mesh_axes`` taken from the meshes passed to ``hp.fully_shard(mesh=...)``.

    A unit's mesh must be parallelize's mesh or a sub-mesh of it (``mesh["dp"]``, HSDP
    ``mesh["dp_replicate", "dp_shard"]``): its axes are then the FSDP axes, 1-D sharding and 2-D
    replicating over dim 0 and sharding over dim 1, as FSDP2. Every unit must shard over the same
    axes (one shard axis for the whole model here). That the mesh holds the same ranks as
    parallelize's is checked by :func:`attach_post_forward_groups`, which sees the mesh itself."""
    by_axes: dict[tuple, list[str]] = {}
    for unit, options in getattr(spec, "_per_unit", {}).items():
        mesh = options.get("mesh")
        if mesh is not None:
            by_axes.setdefault(_axes_of_unit_mesh(mesh, unit, names, sizes), []).append(unit or "<root>")
    if not by_axes:
        return spec
    if len(by_axes) > 1:
        listed = "; ".join(f"{list(axes)} for {units}" for axes, units in by_axes.items())
        raise ValueError(
            f"hp.fully_shard calls pass meshes over different axes ({listed}): here every unit shards "
            "over the same axes; pass the same (sub-)mesh to every call"
        )
    axes, units = next(iter(by_axes.items()))
    if spec.mesh_axes is not None and tuple(spec.mesh_axes) != axes:
        raise ValueError(
            f"hp.fully_shard: mesh_axes={list(spec.mesh_axes)} and the mesh= of {units} (axes {list(axes)}) "
            "disagree; pass one of them"
        )
    out = dataclasses.replace(spec, mesh_axes=axes)
    object.__setattr__(out, "_per_unit", spec._per_unit)
    object.__setattr__(out, "_axes_from_mesh", units)
    return out


def _axes_of_unit_mesh(mesh, unit: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[str, ...]:
    where = f"hp.fully_shard({unit or '<root>'}, mesh=...)"
    dim_names = getattr(mesh, "mesh_dim_names", None)
    if not dim_names:
        raise ValueError(
            f"{where}: the mesh has no dim names, so it cannot be matched to parallelize's mesh (axes "
            f"{list(names)}); pass a sub-mesh of that mesh, e.g. mesh['{names[0]}']"
        )
    dim_names = tuple(dim_names)
    if len(dim_names) not in (1, 2):
        raise ValueError(
            f"{where}: a {len(dim_names)}-D mesh {list(dim_names)}; as in FSDP2 the mesh is 1-D (FSDP) or 2-D "
            "(HSDP: replicate over dim 0, shard over dim 1): pass the data-parallel sub-mesh, e.g. "
            "mesh['dp'] or mesh['dp_replicate', 'dp_shard']"
        )
    for axis, size in zip(dim_names, mesh.mesh.shape):
        if axis not in names:
            raise ValueError(
                f"{where}: the mesh's axis {axis!r} is not an axis of the mesh given to hp.parallelize "
                f"(axes {list(names)}); FSDP shards over axes of that mesh: pass a sub-mesh of it, "
                f"e.g. mesh[{axis!r}] of the mesh with that axis, or mesh_axes=(...)"
            )
        if size != sizes[names.index(axis)]:
            raise ValueError(
                f"{where}: the mesh's axis {axis!r} has {size} ranks, parallelize's mesh {sizes[names.index(axis)]}: "
                "pass a sub-mesh of the mesh given to hp.parallelize"
            )
    return dim_names


def check_unit_meshes(fsdp, mesh) -> None:
    """Each ``hp.fully_shard(mesh=...)`` is the sub-mesh of parallelize's ``mesh`` over the same
    axes: the same ranks in the same order (a mesh named alike but laid out otherwise would shard
    other ranks' data). Raises ValueError naming the unit."""
    for unit, unit_mesh in fsdp.unit_meshes:
        axes = tuple(unit_mesh.mesh_dim_names)
        expected = mesh if axes == tuple(mesh.mesh_dim_names) else mesh[axes if len(axes) > 1 else axes[0]]
        if unit_mesh.mesh.tolist() != expected.mesh.tolist() or unit_mesh.device_type != expected.device_type:
            raise ValueError(
                f"hp.fully_shard({unit or '<root>'}, mesh=...): the mesh over {list(axes)} holds ranks "
                f"{unit_mesh.mesh.tolist()} on {unit_mesh.device_type}, but parallelize's mesh has "
                f"{expected.mesh.tolist()} on {expected.device_type} there: pass the sub-mesh of the mesh "
                f"given to hp.parallelize (mesh[{axes[0]!r}]{' ...' if len(axes) > 1 else ''})"
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


def _unit_groups(spec: FullyShard, model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(unit name, its module FQNs) per unit: each module a glob matches is a unit, and a list of
    globs is one unit over every module they match, named by the first (FSDP2's list form)."""
    module_fqns = [fqn for fqn, _ in model.named_modules()]

    def matches(glob: str) -> list[str]:
        matched = [fqn for fqn in module_fqns if fqn_matches(glob, fqn)] if glob else [""]
        if not matched:
            raise ValueError(
                f"fully_shard unit {glob!r} matches no module of {type(model).__name__}; units are "
                "module-FQN globs matched segment by segment, e.g. 'model.layers.*', or '' for the root"
            )
        return matched

    groups: list[tuple[str, tuple[str, ...]]] = []
    placed: dict[str, str] = {}  # module FQN -> the unit it is in
    for entry in spec.units:
        if isinstance(entry, str):  # a module matched again as its own unit is that unit
            new = [(m, (m,)) for m in matches(entry) if (m, (m,)) not in groups]
        else:
            members = list(dict.fromkeys(m for glob in entry for m in matches(glob)))
            # A member inside another member adds nothing (FSDP2 keeps the outer ones).
            members = [m for m in members if not any(o != m and (o == "" or m.startswith(o + ".")) for o in members)]
            new = [(members[0], tuple(members))]
        for name, members in new:
            for m in members:
                if m in placed:
                    raise ValueError(
                        f"module {m or '<root>'!r} is in two fully_shard units ({placed[m] or '<root>'!r} and "
                        f"{name or '<root>'!r}); a module belongs to one unit: drop it from one of them"
                    )
                placed[m] = name
            groups.append((name, members))
    return groups


def _depth(module_fqn: str) -> tuple[bool, int]:
    return module_fqn != "", module_fqn.count(".")


def _assign_units(groups: list[tuple[str, tuple[str, ...]]], model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> the innermost unit that contains it (by its module that contains it)."""

    def contains(module: str, fqn: str) -> bool:
        return module == "" or fqn == module or fqn.startswith(module + ".")

    def holding(fqn: str) -> dict[str, tuple]:
        """unit -> depth of its innermost module containing ``fqn``, for the units containing it."""
        out = {}
        for unit, members in groups:
            depths = [_depth(m) for m in members if contains(m, fqn)]
            if depths:
                out[unit] = max(depths)
        return out

    owner: dict[str, str] = {}
    for fqn, _ in model.named_parameters(remove_duplicate=False):
        holders = holding(fqn)
        if holders:
            owner[fqn] = max(holders, key=holders.__getitem__)
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
        each = [holding(f) for f in fqns]
        common = [u for u, _ in groups if all(u in h for h in each)]
        if not common:
            raise ValueError(
                f"parameters {fqns} are one shared tensor owned by units {units}, which do not "
                "nest, so no unit can own it: add a unit that contains them all (e.g. the root '') "
                "or untie the parameters"
            )
        outer = max(common, key=lambda u: min(h[u] for h in each))
        for f in fqns:
            owner[f] = outer
    return owner


def _ignored(spec: FullyShard, owner: dict[str, str], model: nn.Module) -> set[str]:
    """The parameters FSDP leaves alone: matched by the entry's ``ignored_params`` globs, or in the
    ``ignored_params`` of the ``fully_shard`` call of the unit that would own them (FSDP2: a
    parameter a nested unit owns stays with it). Every name of a tied tensor goes together."""
    per_unit = getattr(spec, "_per_unit", {})
    ignored = {f for f, unit in owner.items() if f in per_unit.get(unit, {}).get("ignored_params", ())}
    names = [fqn for fqn, _ in model.named_parameters(remove_duplicate=False)]
    for glob in spec.ignored_params:
        matched = [f for f in names if fqn_matches(glob, f)]
        if not matched:
            raise ValueError(
                f"fully_shard ignored_params {glob!r} matches no parameter of {type(model).__name__}; "
                "entries are parameter-FQN globs, e.g. 'model.layers.*.mlp.gate_proj.weight'"
            )
        ignored.update(f for f in matched if f in owner)
    by_tensor: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(fqn)
    for fqns in by_tensor.values():
        if ignored.intersection(fqns):
            ignored.update(f for f in fqns if f in owner)
    return ignored


def _shard_dim(fn, param, fqn: str, unit: str) -> int:
    """The dim ``shard_placement_fn`` stores ``param`` sharded on (0 without one, or for None)."""
    if fn is None:
        return 0
    result = fn(param)
    if result is None:
        return 0
    where = f"fully_shard unit {unit or '<root>'!r}: shard_placement_fn returned {result!r} for {fqn!r}"
    if type(result) is not Shard:
        raise TypeError(f"{where}; it must return Shard(dim) or None (the dim to store the parameter sharded on)")
    dim = result.dim + param.dim() if result.dim < 0 else result.dim
    if not 0 <= dim < param.dim():
        raise ValueError(f"{where}, but the parameter has {param.dim()} dims (shape {tuple(param.shape)})")
    return dim


def _storage_placements(compute: tuple, names, sizes, fsdp_axes: list[int], fqn: str, shape, dim: int = 0) -> tuple:
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
    if dim != 0:  # shard_placement_fn asked for another dim
        return _storage_on_dim(compute, placements, names, sizes, axes, fqn, shape, dim)
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
    if not computed0 and len(axes) > 1 and shape[0] % ranks != 0:
        # Uneven over several FSDP axes (a router's [experts, hidden] over dp_shard x ep). Over a
        # mesh flattened from those axes, which ParallelDims meshes have and
        # attach_joint_shard_group creates, DTensor (torch 2.13) gathers a nested uneven Shard(0)
        # as if it were one even chunking over all their ranks: silently wrong rows. So shards
        # over several axes stay even: on dim 1 when it divides, else over the shard axis alone.
        if _dim1_shardable(compute, shape, ranks):
            for i in axes:
                placements[i] = Shard(1)
        else:
            placements[shard_i] = Shard(0)
        return tuple(placements)
    for i in axes:
        later = [j for j in computed0 if j > i]
        placements[i] = (
            compat.StridedShard(0, split_factor=math.prod(sizes[j] for j in later)) if later else Shard(0)
        )
    return tuple(placements)


def _storage_on_dim(compute: tuple, placements: list, names, sizes, axes: list[int], fqn: str, shape, dim: int) -> tuple:
    """``shard_placement_fn``'s ``Shard(dim)``, dim != 0: every FSDP axis shards that dim. As in
    FSDP2 the shards must be even there; a dim tensor parallelism already splits is refused."""
    split = [i for i in range(len(names)) if isinstance(compute[i], Shard) and compute[i].dim == dim]
    if split:
        raise ValueError(
            f"shard_placement_fn: parameter {fqn!r} has layout {format_placements(compute)}, which already "
            f"splits dim {dim} over {names[split[0]]!r}; store it sharded on another dim (or return None "
            "for dim 0)"
        )
    ranks = math.prod(sizes[j] for j in axes)
    if shape[dim] % ranks != 0:
        over = " x ".join(f"{names[j]}={sizes[j]}" for j in axes)
        raise ValueError(
            f"shard_placement_fn: parameter {fqn!r} of shape {tuple(shape)} sharded on dim {dim}: {shape[dim]} "
            f"does not divide over {over}; as in FSDP2, shards on a dim other than 0 must be even: return "
            "Shard(0) or None for it"
        )
    for i in axes:
        placements[i] = Shard(dim)
    return tuple(placements)


def _dim1_shardable(compute: tuple, shape, ranks: int) -> bool:
    """Dim 1 exists, no computed placement splits it, and it divides over ``ranks``."""
    return (
        len(shape) >= 2 and shape[1] % ranks == 0
        and not any(isinstance(p, Shard) and p.dim == 1 for p in compute)
    )


def _reshard_value(value: Any, unit: str | None, shard_axis: str, size: int, is_root: bool = False) -> bool | int:
    """``reshard_after_forward`` normalised as FSDP2 does: an int k must divide the shard-axis size;
    k == size means True and k == 1 means False, so an int result is always 1 < k < size; None is
    False for the root unit and True for the others. ``unit``: the unit's module FQN when the value
    was given per unit (``hp.fully_shard``)."""
    where = "fully_shard" if unit is None else f"fully_shard unit {unit or '<root>'!r}:"
    if value is None:
        return not is_root
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
    spec = _unit_mesh_axes(spec, names, sizes)
    per_unit = getattr(spec, "_per_unit", {})
    replicate_axis, shard_axis = _fsdp_axes(spec, names)
    for axis in (replicate_axis, shard_axis):
        if axis is not None and axis not in resolved.data_parallel_axes:
            from_mesh = getattr(spec, "_axes_from_mesh", None)
            raise ValueError(
                f"fully_shard shards over {axis!r}, which is not a data-parallel axis (those are "
                f"{list(resolved.data_parallel_axes)}); name data-parallel axes 'dp*' or 'fsdp'"
                + (f". The axes come from the mesh= of {from_mesh}: as in FSDP2, a 2-D mesh means HSDP "
                   "(replicate over dim 0, shard over dim 1); pass the data-parallel sub-mesh, e.g. mesh['dp']"
                   if from_mesh else "")
            )
    shard_size = sizes[names.index(shard_axis)]
    per_unit_reshard = {  # hp.fully_shard calls: checked first, so an error names the unit
        unit: _reshard_value(options["reshard_after_forward"], unit, shard_axis, shard_size, unit == "")
        for unit, options in per_unit.items()
    }
    groups = _unit_groups(spec, model)
    members_of = dict(groups)
    owner = _assign_units(groups, model)
    for fqn in _ignored(spec, owner, model):
        del owner[fqn]
    params = dict(model.named_parameters(remove_duplicate=False))
    extra_axes = _extra_shard_axes(spec, resolved, shard_axis, replicate_axis)
    fsdp_axes = [names.index(shard_axis)] + sorted(names.index(a) for a in extra_axes)

    def option(unit: str, name: str):
        return per_unit[unit][name] if unit in per_unit else getattr(spec, name)

    storage = dict(resolved.param_placements)
    compute = {}
    for fqn, unit in owner.items():
        placements = resolved.param_placements[fqn]
        dim = _shard_dim(option(unit, "shard_placement_fn"), params[fqn], fqn, unit)
        if dim == 0 and any(isinstance(p, compat.StridedShard) and p.dim == 0 for p in placements):
            # A fused projection's split layout (GPT-2's c_attn bias: each third split over tp,
            # propagation/fused_projections.py): DTensor cannot nest an FSDP shard inside that
            # strided shard. Dim 1 where there is one; else the parameter (a bias) stays in its
            # unit (cast by its mixed-precision policy) but stored as computed, replicated over the
            # data-parallel axes: its gradient is all-reduced there instead of reduce-scattered.
            ranks = math.prod(sizes[j] for j in fsdp_axes if isinstance(placements[j], Replicate))
            if _dim1_shardable(placements, params[fqn].shape, ranks):
                dim = 1
            else:
                compute[fqn] = storage[fqn] = placements
                continue
        compute[fqn] = placements
        storage[fqn] = _storage_placements(compute[fqn], names, sizes, fsdp_axes, fqn, params[fqn].shape, dim)
    units = []
    for unit in dict.fromkeys(owner.values()):
        members = tuple(f for f, u in owner.items() if u == unit)
        policy = option(unit, "mixed_precision")
        dtypes = {params[f].dtype for f in members}
        if len(dtypes) > 1 and (policy is None or policy.param_dtype is None):
            raise ValueError(
                f"FSDP unit {unit or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                "one fused all-gather needs one dtype: set mixed_precision=MixedPrecisionPolicy("
                "param_dtype=...) or split the unit (or leave some out with ignored_params)"
            )
        reshard = per_unit_reshard[unit] if unit in per_unit_reshard else _reshard_value(
            spec.reshard_after_forward, None, shard_axis, shard_size, unit == "")
        modules = members_of[unit]
        units.append(FsdpUnit(
            unit, members, reshard, members=modules if len(modules) > 1 else (),
            mixed_precision=policy, offload_policy=option(unit, "offload_policy"),
        ))
    fsdp = FsdpPlan(
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        units=tuple(units),
        unit_of=owner,
        compute_placements=compute,
        extra_shard_axes=extra_axes,
        comm_fusion=spec.comm_fusion,
        unit_meshes=tuple((u, o["mesh"]) for u, o in per_unit.items() if o.get("mesh") is not None),
    )
    return dataclasses.replace(resolved, param_placements=storage, fsdp=fsdp)


def attach_post_forward_groups(fsdp, mesh):
    """``fsdp`` (an FsdpPlan) with ``post_forward_group``/``post_forward_rank`` set on every unit
    with ``reshard_after_forward=<k>``: the shard axis of N ranks is split into N/k contiguous
    groups of k, one split per distinct k. Creates process groups, so every rank calls it. Being
    the FSDP step that sees parallelize's mesh, it first checks the units' own meshes against it
    (:func:`check_unit_meshes`)."""
    if fsdp is None:
        return fsdp
    check_unit_meshes(fsdp, mesh)
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


def attach_joint_shard_group(fsdp, mesh):
    """``fsdp`` (an FsdpPlan) with ``joint_axes`` / ``joint_group`` set when dense parameters are
    sharded over several mesh axes (the shard axis and an expert- or context-parallel axis).

    DTensor gathers a parameter stored nested-sharded over those axes with one all-gather per axis,
    unless the mesh's root has a mesh flattened over them; then it runs one over the flattened
    group, and so does each gradient's reduce-scatter (and the loss's reduction over the same
    axes). A ``ParallelDims`` mesh has such aliases; on any other mesh this creates one, named as
    torch names a flattened axis (``dp_shard_cp``). Collective: every rank calls it."""
    if fsdp is None or not fsdp.extra_shard_axes:
        return fsdp
    names = tuple(mesh.mesh_dim_names)
    axes = tuple(a for a in names if a in fsdp.data_axes and a != fsdp.replicate_axis
                 and mesh.size(names.index(a)) > 1)
    if len(axes) < 2:
        return fsdp
    flat = compat.flattened_mesh_over(mesh, axes)
    if flat is None:
        taken = set(compat.mesh_root_dim_names(mesh)) | set(compat.flattened_meshes(mesh))
        name = base = "_".join(axes)
        suffix = 1
        while name in taken:  # another alias (or axis) of the root already has this name
            suffix += 1
            name = f"{base}_{suffix}"
        flat = compat.flatten_mesh(mesh, axes, name)
    return dataclasses.replace(fsdp, joint_axes=axes, joint_group=flat.get_group(0).group_name)
