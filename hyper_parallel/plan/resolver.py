"""Resolving a plan against a model and a mesh: :func:`resolve_plan`.

:func:`resolve_plan` matches the plan's globs against a concrete model and mesh and produces a
:class:`~hyper_parallel.plan.resolved.ResolvedPlan`: the full-mesh placement of every parameter and
buffer, and the layouts activations must have at module boundaries. It validates everything it can
and names the culprit plan key, module, parameter and layouts in its errors. The other plan options
(fully_shard, recompute, swap, pipeline) are resolved by their own stages; resolution.py runs them
all in order.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from torch import nn

from hyper_parallel import compat
from hyper_parallel.layout import (
    Partial,
    Placement,
    Replicate,
    Shard,
    format_placements,
    normalize_placements,
    split_per_part,
    to_placements,
)
from hyper_parallel.distributed.mesh import (
    axis_size,
    data_parallel_axes,
    is_data_parallel_axis,
    mesh_axis_names,
    mesh_shape,
)

from .match import (
    _direct_tensors,
    _join_fqn,
    _missing_param_error,
    _module_fqns,
    _no_match_error,
    match_module_fqns,
)
from ..cp.resolve import resolve_context_parallel
from ..moe.resolve import resolve_expert_parallel
from .resolved import ActivationConstraint, ModuleConstraints, ResolvedPlan
from .values import ParallelPlan, _as_plan


def _resolve_tp_axis(plan: ParallelPlan, names: tuple[str, ...]) -> str | None:
    if plan.tp_axis in names:
        return plan.tp_axis
    if not plan.tensor_parallel:
        return None
    if len(names) == 1 and not is_data_parallel_axis(names[0]):
        return names[0]
    if len(names) == 1:
        raise ValueError(
            f"tensor_parallel styles apply on mesh axis {plan.tp_axis!r}, but the mesh's only axis "
            f"is the data-parallel axis {names[0]!r} (inputs are batch-sharded on it); name the mesh "
            f"axis {plan.tp_axis!r}, or set tp_axis={names[0]!r} if you really mean it"
        )
    raise ValueError(
        f"tensor_parallel styles apply on mesh axis {plan.tp_axis!r}, which the mesh does not have "
        f"(axes {list(names)}); add a {plan.tp_axis!r} axis to the mesh or set ParallelPlan(tp_axis=...) "
        "to one of its axes"
    )


class _Resolver:
    """Accumulates parameter placements and module constraints while walking the plan."""

    def __init__(self, plan: ParallelPlan, model: nn.Module, mesh: Any):
        self.plan = plan
        self.model = model
        self.names = mesh_axis_names(mesh)
        self.shape = mesh_shape(mesh)
        self.mesh = mesh
        self.modules = _module_fqns(model)
        self.tensors = dict(model.named_parameters(remove_duplicate=False))
        self.tensors.update(dict(model.named_buffers(remove_duplicate=False)))
        self.param_placements: dict[str, tuple[Placement, ...]] = {}
        self.param_sources: dict[str, str] = {}
        # module fqn -> {"inputs": {pos: AC}, "kwarg_inputs": {name: AC}, "outputs": {pos: AC}}
        self.boundaries: dict[str, dict[str, dict[Any, ActivationConstraint]]] = {}

    def matched(self, where: str, key: str) -> list[str]:
        fqns = match_module_fqns(key, self.modules)
        if not fqns:
            raise _no_match_error(where, key, self.modules, self.model)
        return fqns

    def set_param(self, fqn: str, placements: tuple[Placement, ...], source: str) -> None:
        old = self.param_placements.get(fqn)
        if old is not None and old != placements:
            raise ValueError(
                f"parameter {fqn!r} gets two different layouts: {format_placements(old)} from "
                f"{self.param_sources[fqn]} and {format_placements(placements)} from {source} "
                f"(mesh axes {list(self.names)}); remove one of the entries or make them agree"
            )
        if old is None:
            self.param_placements[fqn] = placements
            self.param_sources[fqn] = source

    def add_activation(self, module_fqn: str, slot: str, index: Any, ac: ActivationConstraint) -> None:
        slots = self.boundaries.setdefault(
            module_fqn, {"inputs": {}, "kwarg_inputs": {}, "outputs": {}}
        )
        old = slots[slot].get(index)
        if old is None:
            slots[slot][index] = ac
            return
        for axis in old.placements.keys() & ac.placements.keys():
            if old.placements[axis] != ac.placements[axis]:
                what = f"{slot[:-1]} {index!r}" if slot != "kwarg_inputs" else f"kwarg input {index!r}"
                raise ValueError(
                    f"module {module_fqn or '<root>'!r} {what} is constrained twice on mesh axis "
                    f"{axis!r}: {old.placements[axis]} by {old.source} and {ac.placements[axis]} "
                    f"by {ac.source}; remove one of the entries or make them agree"
                )
        merged = {**old.placements, **ac.placements}
        ordered = {a: merged[a] for a in self.names if a in merged}
        sources = old.source if ac.source in old.source.split(" + ") else f"{old.source} + {ac.source}"
        slots[slot][index] = ActivationConstraint(ordered, sources)

    def full_mesh(self, spec: Any, ndim: int | None, where: str) -> tuple[Placement, ...]:
        return to_placements(spec, self.names, ndim, mesh_shape=self.shape, where=where)

    # -- plan sections ------------------------------------------------------------------------

    def apply_tensor_parallel(self, tp_axis: str | None) -> None:
        for key, style in self.plan.tensor_parallel.items():
            assert tp_axis is not None, "_resolve_tp_axis returns an axis whenever tensor_parallel has entries"
            where = f"tensor_parallel[{key!r}]"
            source = f"{where} {type(style).__name__}"
            for module_fqn in self.matched("tensor_parallel", key):
                module = self.modules[module_fqn]
                try:
                    sc = style.resolve(module_fqn, module, tp_axis)
                except TypeError as exc:
                    raise TypeError(f"{where}: {exc}") from exc
                for name, placement in sc.params.items():
                    fqn = _join_fqn(module_fqn, name)
                    tensor = self.tensors[fqn]
                    placements = tuple(
                        placement if axis == tp_axis else Replicate() for axis in self.names
                    )
                    placements = normalize_placements(placements, tensor.ndim, f"{source} on {fqn!r}")
                    self.set_param(fqn, placements, source)
                for i, p in enumerate(sc.inputs):
                    if p is not None:
                        ac = ActivationConstraint({tp_axis: p}, f"{source} input {i}")
                        self.add_activation(module_fqn, "inputs", i, ac)
                for kw, p in sc.kwarg_inputs.items():
                    ac = ActivationConstraint({tp_axis: p}, f"{source} kwarg input {kw!r}")
                    self.add_activation(module_fqn, "kwarg_inputs", kw, ac)
                for i, p in enumerate(sc.outputs):
                    if p is not None:
                        ac = ActivationConstraint({tp_axis: p}, f"{source} output {i}")
                        self.add_activation(module_fqn, "outputs", i, ac)

    def apply_layouts(self) -> None:
        for key, entry in self.plan.layouts.items():
            where = f"layouts[{key!r}]"
            for module_fqn in self.matched("layouts", key):
                module = self.modules[module_fqn]
                own = _direct_tensors(module)
                for name, spec in entry.get("parameter", {}).items():
                    param_where = f"{where}['parameter'][{name!r}]"
                    if name not in own:
                        raise _missing_param_error(param_where, module_fqn, module, name)
                    fqn = _join_fqn(module_fqn, name)
                    placements = self.full_mesh(spec, own[name].ndim, f"{param_where} ({fqn!r})")
                    if any(isinstance(p, Partial) for p in placements):
                        raise ValueError(
                            f"{param_where} ({fqn!r}): a parameter cannot be partial "
                            f"({format_placements(placements)}); use Shard or Replicate"
                        )
                    self.set_param(fqn, placements, param_where)
                for slot, label in (("inputs", "input"), ("outputs", "output")):
                    for i, spec in enumerate(entry.get("forward", {}).get(label, ())):
                        if spec is None:
                            continue
                        act_where = f"{where}['forward'][{label!r}][{i}]"
                        placements = self.full_mesh(spec, None, act_where)
                        by_axis = dict(zip(self.names, placements))
                        if isinstance(spec, Mapping):
                            # {axis: placement} constrains only the axes it names.
                            by_axis = {a: p for a, p in by_axis.items() if a in spec}
                        ac = ActivationConstraint(by_axis, act_where)
                        self.add_activation(module_fqn, slot, i, ac)

    def apply_ties(self) -> None:
        """Give tied aliases (one tensor under several FQNs) the same placements, or fail."""
        groups: dict[int, list[str]] = {}
        for fqn, tensor in self.tensors.items():
            groups.setdefault(id(tensor), []).append(fqn)
        for aliases in groups.values():
            placed = [f for f in aliases if f in self.param_placements]
            if len(aliases) < 2 or not placed:
                continue
            first = placed[0]
            for other in placed[1:]:
                if self.param_placements[other] != self.param_placements[first]:
                    raise ValueError(
                        f"parameters {first!r} and {other!r} are the same tied tensor but get "
                        f"different layouts: {format_placements(self.param_placements[first])} from "
                        f"{self.param_sources[first]} and "
                        f"{format_placements(self.param_placements[other])} from "
                        f"{self.param_sources[other]}; give both the same layout"
                    )
            for other in aliases:
                if other not in self.param_placements:
                    self.param_placements[other] = self.param_placements[first]
                    self.param_sources[other] = f"{self.param_sources[first]} (tied with {first!r})"

    def check_divisibility(self) -> None:
        for fqn, placements in self.param_placements.items():
            shape = tuple(self.tensors[fqn].shape)
            for dim in range(len(shape)):
                # A strided shard (ColwiseParallel(parts=n)) splits each of its n parts over its axis.
                axes = [a for a, p in zip(self.names, placements)
                        if isinstance(p, (Shard, compat.StridedShard)) and p.dim == dim]
                if not axes:
                    continue
                sizes = [axis_size(self.mesh, a) for a in axes]
                num_shards = 1
                for s in sizes:
                    num_shards *= s
                parts = 1
                for i in split_per_part(placements):
                    if placements[i].dim == dim:
                        parts *= placements[i].split_factor
                num_shards *= parts
                if shape[dim] % num_shards:
                    each = f", each of its {parts} parts split" if parts > 1 else ""
                    raise ValueError(
                        f"parameter {fqn!r} with shape {shape} cannot be sharded on dim {dim} over "
                        f"mesh axes {axes} (sizes {sizes}{each}, {num_shards} shards): {shape[dim]} is not "
                        f"divisible by {num_shards} (set by {self.param_sources[fqn]}); use a "
                        f"parallel degree that divides {shape[dim]}, or a layout that shards "
                        "another dim or fewer axes"
                    )

    def apply_expert_parallel(self) -> dict:
        regions = resolve_expert_parallel(self.plan.expert_parallel, self.matched, self.modules, self.names, self.shape)
        for region in regions.values():
            for name, placements in region.placements:
                self.set_param(_join_fqn(region.module_fqn, name), placements, region.source)
        return regions

    def apply_context_parallel(self):
        return resolve_context_parallel(self.plan.context_parallel, self.matched, self.modules, self.names, self.shape)

    def resolve_inputs(self) -> dict[str, tuple[Placement, ...]]:
        if not self.plan.inputs:
            return {}
        try:
            signature = inspect.signature(self.model.forward)
            params = signature.parameters
            accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):  # builtins / odd callables: cannot check names
            params, accepts_any = {}, True
        result = {}
        for name, spec in self.plan.inputs.items():
            if name not in params and not accepts_any:
                raise ValueError(
                    f"inputs[{name!r}]: {type(self.model).__name__}.forward has no argument "
                    f"{name!r}; its arguments are {list(params)}"
                )
            result[name] = self.full_mesh(spec, None, f"inputs[{name!r}]")
        return result

    def resolve_outputs(self, dp_axes: tuple[str, ...]) -> dict[str, dict[str, Placement]]:
        """``plan.outputs``: name glob -> {non-data-parallel axis: placement}. The names are checked
        against the model's returned values when it is captured (propagation), not here."""
        result = {}
        free_axes = [a for a in self.names if a not in dp_axes]
        for name, spec in self.plan.outputs.items():
            where = f"outputs[{name!r}]"
            by_axis = dict(spec) if isinstance(spec, Mapping) else {a: spec for a in free_axes}
            placements = {}
            for axis, p in by_axis.items():
                if axis in dp_axes:
                    raise ValueError(
                        f"{where}: {axis!r} is a data-parallel axis; outputs are always this rank's "
                        f"part of the batch there (as inputs). Name only the other axes {free_axes}"
                    )
                placement = to_placements(p, self.names, axis=axis, where=where)[self.names.index(axis)]
                if placement.is_partial():
                    raise ValueError(
                        f"{where}: a returned value cannot be Partial on {axis!r} (the caller would "
                        "get an unreduced sum); use Replicate() or Shard(dim)"
                    )
                placements[axis] = placement
            result[name] = placements
        return result

    def module_constraints(self) -> dict[str, ModuleConstraints]:
        result = {}
        # Model order (not plan order), so dumps read top-down like the model.
        for module_fqn in self.modules:
            slots = self.boundaries.get(module_fqn)
            if slots is None:
                continue

            def as_tuple(by_index: dict[int, ActivationConstraint]) -> tuple:
                if not by_index:
                    return ()
                return tuple(by_index.get(i) for i in range(max(by_index) + 1))

            result[module_fqn] = ModuleConstraints(
                module_fqn=module_fqn,
                inputs=as_tuple(slots["inputs"]),
                kwarg_inputs=dict(slots["kwarg_inputs"]),
                outputs=as_tuple(slots["outputs"]),
            )
        return result


def resolve_plan(plan: Any, model: nn.Module, mesh: Any) -> ResolvedPlan:
    """Match ``plan`` (ParallelPlan, dict or None) against ``model`` and ``mesh`` and return the constraints.

    ``mesh`` is a DeviceMesh or a :class:`~hyper_parallel.layout.Layout` (shape + axis names; no
    process group needed). Entries recorded by shard_module / parallelize_module are not included:
    merge them first with ``merge_plans(collect_recorded_plan(model), plan)``. Raises ValueError /
    TypeError naming the plan key, module, parameter, layouts and a fix for: globs matching no
    module, unknown mesh axes, non-divisible parameter dims, conflicting entries, styles on modules
    they cannot apply to, and parameters a module does not have.
    """
    plan = _as_plan(plan)
    resolver = _Resolver(plan, model, mesh)
    tp_axis = _resolve_tp_axis(plan, resolver.names)
    resolver.apply_tensor_parallel(tp_axis)
    resolver.apply_layouts()
    experts = resolver.apply_expert_parallel()
    context = resolver.apply_context_parallel()
    resolver.apply_ties()
    resolver.check_divisibility()
    inputs = resolver.resolve_inputs()
    # An expert-parallel axis is data-parallel for everything but the experts (its ranks take
    # different batch rows), as torchtitan borrows expert-parallel ranks from data parallelism.
    expert_axes = {r.axis for r in experts.values() if r.axis is not None}
    dp_axes = tuple(a for a in resolver.names if a in data_parallel_axes(mesh) or a in expert_axes)
    if context is not None:
        check_sequence_axis_order(context, resolver.names, resolver.shape, dp_axes)
    outputs = resolver.resolve_outputs(dp_axes)
    # fully_shard / recompute / swap / pipeline are not resolved here: later compiler stages read
    # them from the plan (and reject what they do not support yet).
    param_placements = {
        fqn: resolver.param_placements.get(fqn, tuple(Replicate() for _ in resolver.names))
        for fqn in resolver.tensors
    }
    param_sources = {fqn: resolver.param_sources[fqn] for fqn in resolver.tensors if fqn in resolver.param_sources}
    return ResolvedPlan(
        param_placements=param_placements,
        param_sources=param_sources,
        modules=resolver.module_constraints(),
        inputs=inputs,
        outputs=outputs,
        data_parallel_axes=dp_axes,
        tp_axis=tp_axis,
        mesh_dim_names=resolver.names,
        mesh_shape=resolver.shape,
        experts=experts,
        context=context,
    )


def check_sequence_axis_order(context, names: tuple[str, ...], shape: tuple[int, ...], dp_axes) -> None:
    """The sequence axis comes after every data-parallel axis of size > 1, as ``ParallelDims``
    orders them. With the sequence axis first, DTensor's layout of the ``[batch * sequence]``
    flatten of the loss (a ``_StridedShard`` over cp, ``Shard`` over dp) gave a wrong loss in both
    context-parallel modes; the order is refused rather than run."""
    position = names.index(context.axis)
    later = [a for a in dp_axes if names.index(a) > position and shape[names.index(a)] > 1]
    if later:
        raise ValueError(
            f"{context.source}: mesh axis {context.axis!r} comes before the data-parallel "
            f"axis{'es' if len(later) > 1 else ''} {later} (mesh {list(names)}); put the sequence axis after "
            "the data-parallel ones, e.g. ('dp', 'cp') as hp.ParallelDims builds it"
        )


def check_mesh_axes_used(resolved: ResolvedPlan, plan: ParallelPlan) -> None:
    """Every mesh axis of size > 1 is data-parallel or sharded on by some plan entry: an axis
    nothing uses would only repeat the same computation on each of its ranks (raises ValueError
    naming the axis and the entry that would use it). Run after FSDP resolution, whose own
    message about its axes is more precise."""
    used = set(resolved.data_parallel_axes) | set(resolved.sequence_axes)
    names = resolved.mesh_dim_names
    placements = list(resolved.param_placements.values()) + list(resolved.inputs.values())
    used.update(a for ps in placements for a, p in zip(names, ps) if not isinstance(p, Replicate))
    for cons in resolved.modules.values():
        for ac in (*cons.inputs, *cons.kwarg_inputs.values(), *cons.outputs):
            if ac is not None:
                used.update(a for a, p in ac.placements.items() if not isinstance(p, Replicate))
    for axis, size in zip(names, resolved.mesh_shape):
        if axis in used or size == 1:
            continue
        if axis == "cp":
            fix = ("add context_parallel={'model.layers.*.self_attn': hp.ContextParallel()} to shard "
                   "the sequence over it, or give its ranks to dp_shard")
        elif axis == "ep" or any(style.axis == axis for style in plan.expert_parallel.values()):
            fix = ("add expert_parallel={'model.layers.*.mlp.experts': hp.ExpertParallel()} naming "
                   "the module that holds the stacked expert weights")
        elif axis == "pp":
            fix = "add pipeline=hp.PipelinePlan(...) to split the model into stages over it"
        elif axis == plan.tp_axis:
            fix = (f"add tensor_parallel entries (e.g. hp.models.llama_tp_plan()) or layouts that "
                   f"shard on {axis!r}")
        else:
            fix = ("shard on it in a plan entry, or name it 'dp_shard' / 'dp_replicate' (a "
                   "data-parallel axis: each of its ranks takes different batch rows)")
        raise ValueError(
            f"mesh axis {axis!r} (size {size}) is used by no plan entry and is not a data-parallel "
            f"axis, so its {size} ranks would all compute the same thing; {fix}"
        )
