"""Plan entries recorded on modules by the seed API, and merging plans.

:func:`shard_module` and :func:`parallelize_module` do not touch the module's computation: they
record plan entries on the module, which :func:`collect_recorded_plan` gathers into a plan and
:func:`merge_plans` combines with an explicit one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from hyper_parallel.distributed.mesh import mesh_shape
from hyper_parallel.tp.styles import ParallelStyle, parse_style

from .match import (
    _direct_tensors,
    _join_fqn,
    _missing_param_error,
    _module_fqns,
    _no_match_error,
    match_module_fqns,
)
from .values import ParallelPlan, _as_plan, _normalize_layout_entry

#: Attribute on a module holding the entries recorded by shard_module / parallelize_module.
RECORDED_ATTR = "_hp_plan_entries"


def _merge_layout_entries(
    key: str, a: dict[str, Any], b: dict[str, Any], source_a: str, source_b: str
) -> dict[str, Any]:
    """Combine two layouts entries for one glob; the same slot set differently is an error."""
    merged: dict[str, Any] = {}
    params_a, params_b = a.get("parameter", {}), b.get("parameter", {})
    for name in params_a.keys() & params_b.keys():
        if params_a[name] != params_b[name]:
            raise ValueError(
                f"layouts[{key!r}]['parameter'][{name!r}] is given twice with different layouts: "
                f"{params_a[name]!r} ({source_a}) and {params_b[name]!r} ({source_b}); keep one"
            )
    if params_a or params_b:
        merged["parameter"] = {**params_a, **params_b}
    fwd_a, fwd_b = a.get("forward", {}), b.get("forward", {})
    for slot in fwd_a.keys() & fwd_b.keys():
        if fwd_a[slot] != fwd_b[slot]:
            raise ValueError(
                f"layouts[{key!r}]['forward'][{slot!r}] is given twice with different layouts: "
                f"{fwd_a[slot]!r} ({source_a}) and {fwd_b[slot]!r} ({source_b}); keep one"
            )
    if fwd_a or fwd_b:
        merged["forward"] = {**fwd_a, **fwd_b}
    return merged


def merge_plans(a: Any, b: Any) -> ParallelPlan:
    """Combine two plans (ParallelPlan, dict or None); entries both give differently raise ValueError.

    Typical use: ``merge_plans(collect_recorded_plan(model), plan)``. ``tp_axis`` must agree unless
    only one plan has tensor_parallel entries (or only one differs from the default ``"tp"``).
    """
    a, b = _as_plan(a), _as_plan(b)
    tensor_parallel = dict(a.tensor_parallel)
    for key, style in b.tensor_parallel.items():
        if key in tensor_parallel and tensor_parallel[key] != style:
            raise ValueError(
                f"tensor_parallel[{key!r}] is given twice with different styles: "
                f"{tensor_parallel[key]!r} and {style!r}; keep one"
            )
        tensor_parallel[key] = style
    layouts = dict(a.layouts)
    for key, entry in b.layouts.items():
        layouts[key] = (
            _merge_layout_entries(key, layouts[key], entry, "first plan", "second plan")
            if key in layouts
            else entry
        )
    inputs, outputs = _merged_layouts("inputs", a.inputs, b.inputs), _merged_layouts("outputs", a.outputs, b.outputs)
    expert_parallel = _merged_layouts("expert_parallel", a.expert_parallel, b.expert_parallel, "styles")
    context_parallel = _merged_layouts("context_parallel", a.context_parallel, b.context_parallel, "styles")
    options = {}
    for name in ("fully_shard", "recompute", "swap", "pipeline"):
        value_a, value_b = getattr(a, name), getattr(b, name)
        if value_a is not None and value_b is not None and value_a != value_b:
            raise ValueError(
                f"{name} is given twice with different values: {value_a!r} and {value_b!r}; keep one"
            )
        options[name] = value_a if value_a is not None else value_b
    if a.tp_axis == b.tp_axis:
        tp_axis = a.tp_axis
    elif a.tensor_parallel and b.tensor_parallel:
        raise ValueError(
            f"the plans apply tensor_parallel on different mesh axes, {a.tp_axis!r} and "
            f"{b.tp_axis!r}; use one tp_axis"
        )
    elif a.tensor_parallel or b.tensor_parallel:
        tp_axis = a.tp_axis if a.tensor_parallel else b.tp_axis
    else:
        tp_axis = a.tp_axis if a.tp_axis != "tp" else b.tp_axis
    return ParallelPlan(
        tensor_parallel=tensor_parallel, layouts=layouts, inputs=inputs, outputs=outputs, tp_axis=tp_axis,
        expert_parallel=expert_parallel, context_parallel=context_parallel, **options,
    )


def _merged_layouts(key: str, a: dict, b: dict, what: str = "layouts") -> dict:
    """``inputs``, ``outputs`` or ``expert_parallel`` of two plans; a name both give differently is
    a ValueError."""
    merged = dict(a)
    for name, spec in b.items():
        if name in merged and merged[name] != spec:
            raise ValueError(
                f"{key}[{name!r}] is given twice with different {what}: {merged[name]!r} and "
                f"{spec!r}; keep one"
            )
        merged[name] = spec
    return merged


@dataclass(frozen=True)
class _RecordedEntry:
    """One plan entry recorded on a module; ``glob`` is relative to that module."""

    kind: str  # "tensor_parallel" or "layouts"
    glob: str
    value: Any
    tp_axis: str | None = None


def _record(module: nn.Module, entry: _RecordedEntry) -> None:
    entries = module.__dict__.get(RECORDED_ATTR)
    if entries is None:
        entries = []
        # A plain attribute: nn.Module.__setattr__ stores non-tensor values in __dict__.
        setattr(module, RECORDED_ATTR, entries)
    entries.append(entry)


def shard_module(module: nn.Module, sharding_plan: Mapping[str, Any]) -> nn.Module:
    """Record explicit layouts for ``module`` (seed API) and return it unchanged.

    ``sharding_plan`` is ``{"parameter": {name: layout}, "forward": {"input": (layout|None, ...),
    "output": (...)}}`` with full-mesh layouts. Nothing is sharded now: the entry is stored on the
    module and honoured when the model is compiled by ``hp.parallelize``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard_module expects an nn.Module, got {type(module).__name__}")
    entry = _normalize_layout_entry("shard_module(sharding_plan)", sharding_plan)
    own = _direct_tensors(module)
    for name in entry.get("parameter", {}):
        if name not in own:
            raise _missing_param_error("shard_module(sharding_plan)['parameter']", "", module, name)
    _record(module, _RecordedEntry("layouts", "", entry))
    return module


def _tp_axis_of(device_mesh: Any) -> str | None:
    """The mesh axis a parallelize_module call targets: a 1-D mesh's name, an axis name, or None."""
    if device_mesh is None:
        return None
    if isinstance(device_mesh, str):
        return device_mesh
    shape = mesh_shape(device_mesh)
    if len(shape) != 1:
        names = getattr(device_mesh, "mesh_dim_names", None)
        raise ValueError(
            f"parallelize_module needs the 1-D tensor-parallel (sub-)mesh, got a {len(shape)}-D mesh "
            f"with axes {names}; pass mesh['tp'] (or the axis name 'tp')"
        )
    names = getattr(device_mesh, "mesh_dim_names", None)
    return names[0] if names else None


def parallelize_module(
    module: nn.Module,
    device_mesh: Any = None,
    parallelize_plan: Any = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Record tensor-parallel styles for ``module`` and its submodules (seed API); return it unchanged.

    ``parallelize_plan`` is a style (or style name) for ``module`` itself, or a dict
    ``{glob relative to module: style}``. ``device_mesh`` is the 1-D tensor-parallel mesh (its axis
    name becomes the plan's ``tp_axis``), an axis name, or None (use the plan's ``tp_axis``).
    ``src_data_rank``: the rank whose values the parameters start from. ``hp.parallelize`` always
    distributes them from rank 0's values (torch's default, 0, which is what is honoured here); any
    other value raises ValueError rather than being ignored.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
    _check_src_data_rank(src_data_rank)
    axis = _tp_axis_of(device_mesh)
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module got no parallelize_plan, so it records nothing", stacklevel=2
        )
        return module
    if isinstance(parallelize_plan, (ParallelStyle, str)):
        parallelize_plan = {"": parallelize_plan}
    if not isinstance(parallelize_plan, Mapping):
        raise TypeError(
            "parallelize_plan must be a ParallelStyle, a style name, or a dict {module glob: style}, "
            f"got {type(parallelize_plan).__name__}"
        )
    fqns = _module_fqns(module)
    for glob, spec in parallelize_plan.items():
        style = parse_style(spec, f"parallelize_plan[{glob!r}]")
        if not match_module_fqns(glob, fqns):
            raise _no_match_error("parallelize_plan", glob, fqns, module)
        _record(module, _RecordedEntry("tensor_parallel", glob, style, axis))
    return module


def _check_src_data_rank(src_data_rank) -> None:
    """Only torch's default is what ``hp.parallelize`` does: every parameter starts from rank 0's values."""
    if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)):
        raise TypeError(f"parallelize_module(src_data_rank=) takes an int or None, got {src_data_rank!r}")
    if src_data_rank != 0:
        raise ValueError(
            f"parallelize_module(src_data_rank={src_data_rank!r}) is not supported: hp.parallelize distributes "
            "every parameter from rank 0's values (src_data_rank=0, torch's default), one rule for the whole "
            "model. Leave src_data_rank at 0; to skip that communication (what src_data_rank=None is for), "
            "build the model under hp.init_empty_weights(): each rank then initialises only its own shards "
            "and no parameter values are sent"
        )


def collect_recorded_plan(model: nn.Module) -> ParallelPlan:
    """Gather the entries recorded by shard_module / parallelize_module anywhere in ``model`` into one plan.

    Globs recorded on a submodule are prefixed with its FQN. Conflicting entries raise ValueError.
    """
    tensor_parallel: dict[str, ParallelStyle] = {}
    tp_sources: dict[str, str] = {}
    layouts: dict[str, dict[str, Any]] = {}
    layout_sources: dict[str, str] = {}
    axes: dict[str, str] = {}
    for module_fqn, module in model.named_modules():
        for entry in module.__dict__.get(RECORDED_ATTR, ()):
            key = _join_fqn(module_fqn, entry.glob)
            if entry.kind == "tensor_parallel":
                source = f"parallelize_module on {module_fqn or '<root>'!r}"
                if key in tensor_parallel and tensor_parallel[key] != entry.value:
                    raise ValueError(
                        f"tensor_parallel[{key!r}] is recorded twice with different styles: "
                        f"{tensor_parallel[key]!r} ({tp_sources[key]}) and {entry.value!r} "
                        f"({source}); keep one"
                    )
                tensor_parallel[key] = entry.value
                tp_sources[key] = source
                if entry.tp_axis is not None:
                    axes.setdefault(entry.tp_axis, source)
            else:
                source = f"shard_module on {module_fqn or '<root>'!r}"
                if key in layouts:
                    layouts[key] = _merge_layout_entries(
                        key, layouts[key], entry.value, layout_sources[key], source
                    )
                else:
                    layouts[key] = entry.value
                layout_sources[key] = source
    if len(axes) > 1:
        raise ValueError(
            "parallelize_module was called with meshes on different axes: "
            + ", ".join(f"{a!r} ({s})" for a, s in axes.items())
            + "; use one tensor-parallel axis"
        )
    tp_axis = next(iter(axes), "tp")
    return ParallelPlan(tensor_parallel=tensor_parallel, layouts=layouts, tp_axis=tp_axis)
