"""Fully sharded data parallelism as a plan entry: units, storage layouts, policies.

``FullyShard`` (``ParallelPlan.fully_shard``) and ``fully_shard(module, ...)`` (FSDP2-style, called
on each layer then on the root) say which modules are FSDP units. ``resolve_fully_shard`` turns that
into what the compiler reads: every parameter of a unit is *stored* sharded on dim 0 over the shard
axis (and replicated over the HSDP replicate axis), while it is *computed with* in its plain layout
(the tensor-parallel layout, Replicate over the data-parallel axes). Propagation inserts the
storage → compute redistribution (the all-gather) before first use and sends each gradient back to
the storage layout (the reduce-scatter, plus the all-reduce over the replicate axis for HSDP); the
fsdp passes (reshard after forward, bucketing) schedule and fuse those collectives.

When tensor parallelism already shards dim 0 (a colwise weight), the shard axis splits each TP
shard further, which in DTensor terms is ``_StridedShard(0, split_factor=<tp degree>)`` — the same
placement PyTorch FSDP2 uses for 2-D parallelism; it unshards with one all-gather.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from . import compat
from .layout import format_placements
from .plan import ResolvedPlan, fqn_matches


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Gather parameters in ``param_dtype``, reduce gradients in ``reduce_dtype`` (seed/FSDP2 names)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and the optimizer step on the CPU."""

    pin_memory: bool = True


@dataclasses.dataclass(frozen=True)
class FullyShard:
    """FSDP/HSDP units (module-FQN globs, innermost first; "" is the root) and their options.

    ``mesh_axes``: ("dp_shard",) style for FSDP, (replicate_axis, shard_axis) for HSDP; by default
    the mesh's ("dp_replicate", "dp_shard") pair, else its "dp_shard", "fsdp" or "dp" axis.
    """

    units: tuple[str, ...] = ("",)
    mesh_axes: tuple[str, ...] | None = None
    reshard_after_forward: bool | int = True
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    comm_fusion: bool = True

    def __post_init__(self):
        if isinstance(self.units, str):
            object.__setattr__(self, "units", (self.units,))
        object.__setattr__(self, "units", tuple(self.units))
        if self.mesh_axes is not None:
            axes = (self.mesh_axes,) if isinstance(self.mesh_axes, str) else tuple(self.mesh_axes)
            object.__setattr__(self, "mesh_axes", axes)
        if isinstance(self.mixed_precision, dict):
            object.__setattr__(self, "mixed_precision", MixedPrecisionPolicy(**self.mixed_precision))
        if not isinstance(self.reshard_after_forward, (bool, int)):
            raise TypeError(
                f"FullyShard.reshard_after_forward must be True, False or an int, "
                f"got {self.reshard_after_forward!r}"
            )

    @classmethod
    def from_value(cls, value: Any) -> "FullyShard":
        """Accept a FullyShard or the same as a plain dict (plans read from YAML/JSON)."""
        from .plan import option_from_value

        return option_from_value(cls, value, "fully_shard")


@dataclasses.dataclass(frozen=True)
class FsdpUnit:
    """One unit: its module, the parameters it owns (FQNs) and whether it reshards after forward.

    ``reshard_after_forward``: True (keep only the shard), False (keep the gathered parameters), or
    an int 1 < k < shard-axis size (FSDP2's "world size to reshard to"): each rank keeps 1/k of the
    unit's parameters and backward gathers them over a group of k ranks, contiguous along the shard
    axis. For such a unit, ``parallelize`` sets ``post_forward_group`` (that group's process-group
    name on this rank) and ``post_forward_rank`` (this rank's position in it).
    """

    module_fqn: str
    params: tuple[str, ...]
    reshard_after_forward: bool | int
    post_forward_group: str | None = None
    post_forward_rank: int = 0


@dataclasses.dataclass(frozen=True)
class FsdpPlan:
    """The resolved FSDP entry the compiler reads (ResolvedPlan.fsdp)."""

    shard_axis: str
    replicate_axis: str | None
    units: tuple[FsdpUnit, ...]
    unit_of: dict[str, str] = dataclasses.field(hash=False)  # parameter FQN -> unit module FQN
    compute_placements: dict[str, tuple] = dataclasses.field(hash=False)
    comm_fusion: bool = True
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    # False while accumulating gradients (set_requires_gradient_sync(False)): each FSDP gradient
    # stays the unsharded partial sum of this rank's data, nothing is reduced.
    gradient_sync: bool = True
    # HSDP, set_requires_all_reduce(False): gradients are reduce-scattered over the shard axis but
    # stay partial sums over the replicate axis (accumulation with reduce-scatter only).
    all_reduce: bool = True
    # Gradients accumulated by earlier micro-steps that this program adds to its own before they
    # are reduced: None, or the GRADIENT_LAYOUTS name of their layout.
    accumulated: str | None = None
    # Units whose parameters the user gathered ahead (``unshard()``): the program takes them
    # gathered as inputs and all-gathers them only again in backward, when the unit reshards.
    pregathered: tuple[str, ...] = ()
    # set_reshard_after_backward(False): backward also returns the gathered parameters, kept for the
    # next forward (gradient accumulation micro-steps then skip the forward all-gathers).
    reshard_after_backward: bool = True
    # set_reduce_op_type: "avg" gives the gradient of the global mean loss (one device's numbers);
    # "sum" sums the data-parallel ranks' gradients instead, i.e. scales by the dp degree.
    reduce_op: str = "avg"

    def unit(self, module_fqn: str) -> FsdpUnit:
        return next(u for u in self.units if u.module_fqn == module_fqn)

    @property
    def gradient_layout(self) -> str:
        """Which of GRADIENT_LAYOUTS this program leaves FSDP gradients in."""
        if not self.gradient_sync:
            return "unsharded"
        if not self.all_reduce and self.replicate_axis is not None:
            return "reduce_scattered"
        return "reduced"

    def gradient_placements(self, param: str, layout: str, axis_names, storage: tuple) -> tuple:
        """Placements (one per mesh axis) of ``param``'s gradient in ``layout``; ``storage`` is the
        parameter's own (sharded) placements, which "reduced" gradients have."""
        if layout == "reduced":
            return storage
        if layout == "reduce_scattered":
            return tuple(Partial("sum") if name == self.replicate_axis else p for name, p in zip(axis_names, storage))
        if layout == "unsharded":
            dp_axes = {self.shard_axis, self.replicate_axis}
            return tuple(
                Partial("sum") if name in dp_axes else p
                for name, p in zip(axis_names, self.compute_placements[param])
            )
        raise ValueError(f"unknown gradient layout {layout!r}; expected one of {GRADIENT_LAYOUTS}")


# How an FSDP gradient leaves a compiled backward: "reduced" (sharded like its parameter, the final
# gradient), "reduce_scattered" (HSDP without the replicate all-reduce: sharded, a partial sum over
# the replicate axis) or "unsharded" (no communication: this rank's partial sum, whole on dp axes).
GRADIENT_LAYOUTS = ("reduced", "reduce_scattered", "unsharded")


# --- the FSDP2-style functional API ---------------------------------------------------------------

_RECORD_ATTR = "_hp_fully_shard"


class FullyShardedModule:
    """Methods ``hp.fully_shard`` adds to a unit module (FSDP2 / HSDPModule names).

    They record choices on the module; the parallelized root reads them when it compiles, and a
    change recompiles (once per setting)."""

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's parameters are gathered in forward, also issue these units' gathers."""
        _check_units("set_modules_to_forward_prefetch", modules)
        self._hp_forward_prefetch = list(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The same for backward (the units that run next in backward, i.e. earlier layers)."""
        _check_units("set_modules_to_backward_prefetch", modules)
        self._hp_backward_prefetch = list(modules)

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters for the next forward (see ParallelModule.unshard)."""
        root, fqn = self._parallel_root("unshard")
        return root._unshard_units(root._units(fqn, False, "unshard"), async_op)

    def reshard(self) -> None:
        """Free what :meth:`unshard` gathered for this unit and no forward used yet."""
        root, fqn = self._parallel_root("reshard")
        root._hp.gathered.pop(fqn, None)

    def _parallel_root(self, method: str):
        link = getattr(self, "_hp_parallel_root", None)
        root = link() if link is not None else None
        if root is None:
            raise RuntimeError(
                f"{method} needs the parallelized model: call hp.parallelize(model, None, mesh) on the "
                "root first (the unit's parameters are sharded only then)"
            )
        return root, self._hp_unit_fqn


def link_units_to_root(root: nn.Module) -> None:
    """Let each ``fully_shard`` unit of the parallelized ``root`` reach it (unshard/reshard)."""
    import weakref

    for fqn, module in root.named_modules():
        if isinstance(module, FullyShardedModule) and module is not root:
            module._hp_parallel_root = weakref.ref(root)
            module._hp_unit_fqn = fqn


def _check_units(method: str, modules) -> None:
    for m in modules:
        if not hasattr(m, _RECORD_ATTR):
            raise ValueError(
                f"{method}: {type(m).__name__} is not an FSDP unit; call hp.fully_shard on it first"
            )


def recorded_prefetch(model: nn.Module) -> dict:
    """{"forward"/"backward": {unit FQN: (unit FQNs to prefetch, ...)}} from the recorded calls."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    out: dict = {"forward": {}, "backward": {}}
    for fqn, module in model.named_modules():
        for phase in ("forward", "backward"):
            targets = getattr(module, f"_hp_{phase}_prefetch", None)
            if targets:
                out[phase][fqn] = tuple(fqn_of[id(t)] for t in targets)
    return out


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    comm_fusion: bool = True,
    mesh_axes: tuple[str, ...] | None = None,
) -> nn.Module:
    """Mark ``module`` as an FSDP unit, the way FSDP2 is called (each layer, then the root).

    Nothing changes in the module's computation: the call is recorded and ``hp.parallelize(model,
    None, mesh)`` compiles it. Options given on the root apply to every unit unless a unit set its own
    ``reshard_after_forward``.
    """
    setattr(
        module,
        _RECORD_ATTR,
        {
            "reshard_after_forward": reshard_after_forward,
            "mixed_precision": mp_policy,
            "offload_policy": offload_policy,
            "comm_fusion": comm_fusion,
            "mesh_axes": mesh_axes,
            "mesh": mesh,
        },
    )
    if not isinstance(module, FullyShardedModule):
        cls = type(module)
        module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
    return module


def collect_recorded_fully_shard(model: nn.Module) -> FullyShard | None:
    """The FullyShard entry equivalent to the ``fully_shard`` calls recorded on ``model``."""
    marked = [(fqn, getattr(m, _RECORD_ATTR)) for fqn, m in model.named_modules() if hasattr(m, _RECORD_ATTR)]
    if not marked:
        return None
    marked.sort(key=lambda item: -item[0].count(".") - (item[0] != ""))  # innermost first
    root_args = dict(marked[-1][1])
    per_unit_reshard = {fqn: args["reshard_after_forward"] for fqn, args in marked}
    spec = FullyShard(
        units=tuple(fqn for fqn, _ in marked),
        mesh_axes=root_args["mesh_axes"],
        reshard_after_forward=root_args["reshard_after_forward"],
        mixed_precision=root_args["mixed_precision"],
        offload_policy=root_args["offload_policy"],
        comm_fusion=root_args["comm_fusion"],
    )
    object.__setattr__(spec, "_per_unit_reshard", per_unit_reshard)
    return spec


# --- resolution -------------------------------------------------------------------------------------


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


def _storage_placements(compute: tuple, names, sizes, shard_i: int, fqn: str, shape) -> tuple:
    placements = list(compute)
    if not isinstance(placements[shard_i], Replicate):
        raise ValueError(
            f"parameter {fqn!r} has layout {format_placements(compute)}, which is not replicated "
            f"over the FSDP shard axis {names[shard_i]!r}; FSDP shards data-parallel replicas only"
        )
    # Dim-0 shards of the axes after the shard axis split each FSDP shard further: strided.
    later = [i for i in range(shard_i + 1, len(names)) if isinstance(compute[i], Shard) and compute[i].dim == 0]
    earlier = [i for i in range(shard_i) if isinstance(compute[i], Shard) and compute[i].dim == 0]
    local0 = shape[0] // math.prod(sizes[i] for i in later + earlier) if shape else 0
    if not shape:
        raise ValueError(
            f"parameter {fqn!r} is a scalar: FSDP shards dim 0, leave this module out of the units"
        )
    if local0 % sizes[shard_i] != 0 and later:
        raise ValueError(
            f"parameter {fqn!r} of shape {tuple(shape)}: its dim 0 per tensor-parallel shard ({local0}) "
            f"does not divide over {names[shard_i]}={sizes[shard_i]}, and uneven FSDP shards nested "
            "inside tensor-parallel shards are not supported: use degrees that divide dim 0"
        )
    if later:
        placements[shard_i] = compat.StridedShard(0, split_factor=math.prod(sizes[i] for i in later))
    else:
        placements[shard_i] = Shard(0)
    return tuple(placements)


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
    shard_i = names.index(shard_axis)
    storage = dict(resolved.param_placements)
    compute = {}
    for fqn, unit in owner.items():
        compute[fqn] = resolved.param_placements[fqn]
        storage[fqn] = _storage_placements(compute[fqn], names, sizes, shard_i, fqn, params[fqn].shape)
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
        comm_fusion=spec.comm_fusion,
        mixed_precision=spec.mixed_precision,
        offload_policy=spec.offload_policy,
    )
    return dataclasses.replace(resolved, param_placements=storage, fsdp=fsdp)
