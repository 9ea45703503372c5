"""The parallel plan and its resolution into constraints for the compiler.

A :class:`ParallelPlan` is pure, mesh-agnostic data written by the user (or read from YAML/JSON via
:meth:`ParallelPlan.from_dict`): module-FQN globs mapped to tensor-parallel styles
(``tensor_parallel``) or to explicit shard_module-style layouts (``layouts``), plus input-layout
overrides and options for later stages (``fully_shard``, ``recompute``, ``swap``, ``pipeline``).

:func:`resolve_plan` matches the globs against a concrete model and mesh and produces a
:class:`ResolvedPlan`: the full-mesh placement of every parameter and buffer, and the layouts
activations must have at module boundaries. It validates everything it can and names the culprit
plan key, module, parameter and layouts in its errors.

The seed entry points :func:`shard_module` and :func:`parallelize_module` do not touch the module's
computation: they record plan entries on the module, which :func:`collect_recorded_plan` gathers
into a plan and :func:`merge_plans` combines with an explicit one.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from dataclasses import dataclass, field, fields
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping

from torch import nn

from hyper_parallel.layout import (
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorLayout,
    format_placements,
    normalize_placements,
    to_placements,
)
from hyper_parallel.mesh import (
    axis_size,
    data_parallel_axes,
    is_data_parallel_axis,
    mesh_axis_names,
    mesh_shape,
)
from hyper_parallel.styles import ParallelStyle, parse_style

__all__ = [
    "ParallelPlan",
    "ActivationConstraint",
    "ModuleConstraints",
    "ResolvedPlan",
    "resolve_plan",
    "merge_plans",
    "shard_module",
    "parallelize_module",
    "collect_recorded_plan",
    "fqn_matches",
    "match_module_fqns",
    "default_input_placements",
    "PLAN_KEYS",
]

#: Keys of a layouts entry (the shard_module form) and of its "forward" part.
LAYOUT_ENTRY_KEYS = ("parameter", "forward")
FORWARD_KEYS = ("input", "output")

#: Attribute on a module holding the entries recorded by shard_module / parallelize_module.
RECORDED_ATTR = "_hp_plan_entries"


# --------------------------------------------------------------------------------------------
# Glob matching
# --------------------------------------------------------------------------------------------


def fqn_matches(glob: str, fqn: str) -> bool:
    """True if module FQN ``fqn`` matches ``glob`` segment by segment (fnmatch per segment).

    ``"model.layers.*"`` matches ``"model.layers.0"`` but not ``"model.layers.0.mlp"``; ``""`` is
    the root module only.
    """
    if glob == "" or fqn == "":
        return glob == fqn
    glob_parts = glob.split(".")
    fqn_parts = fqn.split(".")
    return len(glob_parts) == len(fqn_parts) and all(
        fnmatchcase(part, pattern) for part, pattern in zip(fqn_parts, glob_parts)
    )


def match_module_fqns(glob: str, fqns: Iterable[str]) -> list[str]:
    """The FQNs among ``fqns`` that ``glob`` matches (see :func:`fqn_matches`), in the given order."""
    return [fqn for fqn in fqns if fqn_matches(glob, fqn)]


def _module_fqns(model: nn.Module) -> dict[str, nn.Module]:
    # remove_duplicate=False: a module reachable under two names matches a glob through either.
    return dict(model.named_modules(remove_duplicate=False))


def _generalize(fqn: str) -> str:
    """'model.layers.3.mlp' -> 'model.layers.*.mlp' (for "did you mean" suggestions)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _no_match_error(
    where: str, key: str, modules: dict[str, nn.Module], model: nn.Module
) -> ValueError:
    """The ValueError for a plan key that matches no module, with the likeliest intended keys."""
    names = [f for f in modules if f]
    # Suggest globs for a glob key, concrete names for a concrete one: both read more naturally.
    if any(ch in key for ch in "*?["):
        candidates = sorted({_generalize(f) for f in names})
    else:
        candidates = sorted(set(names))
    close = difflib.get_close_matches(key, candidates, n=len(candidates), cutoff=0.5)
    # Rank what users most often mean first: the key missing a prefix ('layers.*' for
    # 'model.layers.*'), then the same leaf name under another path; difflib order otherwise.
    suffix = [c for c in candidates if c.endswith("." + key)]
    leaf = key.rsplit(".", 1)[-1]
    close = suffix + sorted(
        (c for c in close if c not in suffix), key=lambda c: c.rsplit(".", 1)[-1] != leaf
    )
    close = close[:5]
    owner, _, leaf = key.rpartition(".")
    owners = match_module_fqns(owner, modules) if owner else []
    if any(leaf in modules[o]._parameters for o in owners):
        hint = (
            f"the key names a parameter, but plan keys are module FQNs: use {owner!r} "
            "(styles and layouts say which of its parameters to shard)"
        )
    elif close:
        hint = "did you mean " + ", ".join(repr(c) for c in close) + "?"
    else:
        top = [f for f in names if "." not in f][:5]
        hint = f"the top-level modules are {top}"
    return ValueError(
        f"{where}[{key!r}] matches no module of {type(model).__name__}; globs match module FQNs "
        f"segment by segment ('model.layers.*' matches 'model.layers.0' but not "
        f"'model.layers.0.mlp'; '' is the root module); {hint}"
    )


def _join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def _freeze(spec: Any) -> Any:
    """Lists -> tuples, recursively, so YAML lists compare equal to the tuples users write."""
    if isinstance(spec, (list, tuple)):
        return tuple(_freeze(s) for s in spec)
    if isinstance(spec, Mapping):
        return {k: _freeze(v) for k, v in spec.items()}
    return spec


def _normalize_layout_entry(where: str, entry: Any) -> dict[str, Any]:
    """Check the structure of one shard_module-form entry and normalise it.

    Result: ``{"parameter": {name: spec}, "forward": {"input": (spec|None, ...), "output": ...}}``
    with only the parts that were given. Specs stay mesh-agnostic; resolve_plan converts them.
    """
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"{where}: expected a dict with keys {list(LAYOUT_ENTRY_KEYS)} (shard_module form), "
            f"got {entry!r}"
        )
    unknown = [k for k in entry if k not in LAYOUT_ENTRY_KEYS]
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; a layouts entry has keys "
            f"{list(LAYOUT_ENTRY_KEYS)}, e.g. {{'parameter': {{'weight': layout('tp', 'None')}}, "
            "'forward': {'input': (x_layout,), 'output': (y_layout,)}}"
        )
    result: dict[str, Any] = {}
    params = entry.get("parameter")
    if params is not None:
        if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
            raise TypeError(
                f"{where}['parameter']: expected a dict parameter name -> layout, got {params!r}"
            )
        result["parameter"] = {k: _freeze(v) for k, v in params.items()}
    forward = entry.get("forward")
    if forward is not None:
        if not isinstance(forward, Mapping):
            raise TypeError(
                f"{where}['forward']: expected a dict with keys {list(FORWARD_KEYS)}, got {forward!r}"
            )
        unknown = [k for k in forward if k not in FORWARD_KEYS]
        if unknown:
            raise ValueError(
                f"{where}['forward']: unknown key {unknown[0]!r}; valid keys are {list(FORWARD_KEYS)}"
            )
        norm_forward = {}
        for key in FORWARD_KEYS:
            value = forward.get(key)
            if value is None:
                continue
            if isinstance(value, (TensorLayout, Mapping)):
                value = (value,)  # one layout for the only input/output
            if not isinstance(value, (tuple, list)):
                raise TypeError(
                    f"{where}['forward'][{key!r}]: expected a tuple with one layout (or None) per "
                    f"forward {key}, got {value!r}"
                )
            if any(isinstance(v, str) for v in value) and all(
                v is None or isinstance(v, str) for v in value
            ):
                # ["dp", None] is one per-dim layout, not one layout per input: say so now.
                raise TypeError(
                    f"{where}['forward'][{key!r}] = {value!r} looks like a single layout, but "
                    f"{key!r} takes one layout (or None) per forward {key}: write ({list(value)!r},)"
                )
            norm_forward[key] = _freeze(value)
        result["forward"] = norm_forward
    return result


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



def option_from_value(cls, value: Any, name: str):
    """A plan option as ``cls``: an instance, or the same as a plain dict of its fields (plans read
    from YAML/JSON); ``name`` is the plan key the messages name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        valid = [f.name for f in fields(cls)]
        unknown = set(value) - set(valid)
        if unknown:
            raise ValueError(f"{name} has unknown keys {sorted(unknown)}; valid keys are {valid}")
        return cls(**value)
    raise TypeError(f"{name} must be a {cls.__name__} or a dict, got {type(value).__name__}")

@dataclass(frozen=True)
class ParallelPlan:
    """What to parallelize and how; mesh-agnostic data (see docs/architecture.md §1).

    * ``tensor_parallel``: module-FQN glob -> :class:`ParallelStyle` (or a style name such as
      ``"colwise"``); styles apply on mesh axis ``tp_axis``.
    * ``layouts``: module-FQN glob -> ``{"parameter": {name: layout}, "forward": {"input":
      (layout|None, ...), "output": (...)}}`` (shard_module form); layouts cover the full mesh
      (TensorLayout, Placements per mesh axis, or a list of axis names per tensor dim). A dict
      ``{axis: placement}`` is also accepted: for a parameter the axes it leaves out are
      Replicate; for a forward input/output they are left as propagated.
    * ``inputs``: forward argument name -> layout, overriding the default input layout (Shard(0)
      on the data-parallel axes, Replicate elsewhere).
    * ``fully_shard``, ``recompute``, ``swap``, ``pipeline``: options for later compiler stages,
      stored as given.

    None for the three dicts is stored as an empty dict; style names are turned into style objects.
    """

    tensor_parallel: dict[str, ParallelStyle] | None = None
    layouts: dict[str, dict[str, Any]] | None = None
    inputs: dict[str, Any] | None = None
    fully_shard: Any = None
    recompute: Any = None
    swap: Any = None
    pipeline: Any = None
    tp_axis: str = "tp"

    def __post_init__(self) -> None:
        tensor_parallel = self._checked_dict("tensor_parallel", self.tensor_parallel)
        object.__setattr__(
            self,
            "tensor_parallel",
            {k: parse_style(v, f"tensor_parallel[{k!r}]") for k, v in tensor_parallel.items()},
        )
        layouts = self._checked_dict("layouts", self.layouts)
        object.__setattr__(
            self,
            "layouts",
            {k: _normalize_layout_entry(f"layouts[{k!r}]", v) for k, v in layouts.items()},
        )
        inputs = self._checked_dict("inputs", self.inputs)
        object.__setattr__(self, "inputs", {k: _freeze(v) for k, v in inputs.items()})
        if not isinstance(self.tp_axis, str) or not self.tp_axis:
            raise TypeError(f"ParallelPlan(tp_axis=...) must be a mesh axis name, got {self.tp_axis!r}")

    @staticmethod
    def _checked_dict(name: str, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise TypeError(f"ParallelPlan({name}=...) must be a dict keyed by module FQN glob, got {value!r}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"ParallelPlan({name}=...): keys must be strings, got {bad[0]!r}")
        return dict(value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "ParallelPlan") -> "ParallelPlan":
        """Build a plan from a plain nested dict (e.g. loaded from YAML); a ParallelPlan is returned as is.

        Unknown top-level keys raise ValueError listing the valid ones.
        """
        if isinstance(d, ParallelPlan):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"a plan must be a ParallelPlan or a dict, got {type(d).__name__}: {d!r}")
        unknown = [k for k in d if k not in PLAN_KEYS]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), PLAN_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown plan key {unknown[0]!r}{hint}; valid keys are {list(PLAN_KEYS)}"
            )
        return cls(**d)

    def is_empty(self) -> bool:
        """True if the plan asks for nothing (every field empty/None, tp_axis aside)."""
        return not any(getattr(self, f.name) for f in fields(self) if f.name != "tp_axis")

    def __repr__(self) -> str:
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "tp_axis" and getattr(self, f.name)
        ]
        if self.tp_axis != "tp":
            parts.append(f"tp_axis={self.tp_axis!r}")
        return f"ParallelPlan({', '.join(parts)})"


#: The valid top-level keys of a plan dict (the ParallelPlan field names).
PLAN_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ParallelPlan))


def _as_plan(plan: Any) -> ParallelPlan:
    if plan is None:
        return ParallelPlan()
    return ParallelPlan.from_dict(plan)


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
    inputs = dict(a.inputs)
    for name, spec in b.inputs.items():
        if name in inputs and inputs[name] != spec:
            raise ValueError(
                f"inputs[{name!r}] is given twice with different layouts: {inputs[name]!r} and "
                f"{spec!r}; keep one"
            )
        inputs[name] = spec
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
        tensor_parallel=tensor_parallel, layouts=layouts, inputs=inputs, tp_axis=tp_axis, **options
    )


# --------------------------------------------------------------------------------------------
# Recorded entries: shard_module / parallelize_module
# --------------------------------------------------------------------------------------------


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


def _direct_tensors(module: nn.Module) -> dict[str, Any]:
    """The module's own (non-recursive) parameters and buffers, by local name."""
    tensors = {n: p for n, p in module._parameters.items() if p is not None}
    tensors.update({n: b for n, b in module._buffers.items() if b is not None})
    return tensors


def _missing_param_error(where: str, module_fqn: str, module: nn.Module, name: str) -> ValueError:
    own = list(module._parameters) + list(module._buffers)
    own = [n for n in own if getattr(module, n, None) is not None]
    return ValueError(
        f"{where}: module {module_fqn or '<root>'!r} ({type(module).__name__}) has no parameter or "
        f"buffer {name!r}; its own parameters/buffers are {own}. Name a direct parameter; for a "
        "submodule's parameter, add an entry for that submodule's FQN"
    )


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
    ``src_data_rank`` is accepted for API parity; the compiler distributes parameters itself.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
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


# --------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationConstraint:
    """Layout an activation must have at a module boundary: mesh axis -> placement.

    Axes not named are left as propagated. Shard dims may be negative (count from the last dim of
    the activation). ``source`` says which plan entry asked for it, for messages and dumps.
    """

    placements: dict[str, Placement] = field(hash=False)
    source: str = ""

    def __repr__(self) -> str:
        inner = ", ".join(f"{axis}={p}" for axis, p in self.placements.items())
        return f"ActivationConstraint({inner})"


@dataclass(frozen=True)
class ModuleConstraints:
    """Boundary layouts of one module: per positional input, per keyword input, per output (None = free)."""

    module_fqn: str
    inputs: tuple[ActivationConstraint | None, ...] = ()
    kwarg_inputs: dict[str, ActivationConstraint] = field(default_factory=dict, hash=False)
    outputs: tuple[ActivationConstraint | None, ...] = ()


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan matched against a model and a mesh; what the compiler consumes.

    * ``param_placements``: every parameter and buffer FQN (tied aliases included) -> one placement
      per mesh axis in mesh order, non-negative Shard dims, never Partial; Replicate by default.
    * ``param_sources``: FQN -> the plan entry that set it (only FQNs a plan entry set).
    * ``modules``: module FQN -> :class:`ModuleConstraints` (only modules with a constraint).
    * ``inputs``: forward argument name -> full-mesh placements overriding the default input layout
      (see :meth:`input_placements`).
    * ``data_parallel_axes``: mesh axes along which inputs are batch-sharded by default.
    * ``tp_axis``: the axis tensor-parallel styles applied on (None if the plan has none and the
      mesh has no such axis).
    """

    param_placements: dict[str, tuple[Placement, ...]] = field(hash=False)
    param_sources: dict[str, str] = field(hash=False)
    modules: dict[str, ModuleConstraints] = field(hash=False)
    inputs: dict[str, tuple[Placement, ...]] = field(hash=False)
    data_parallel_axes: tuple[str, ...]
    tp_axis: str | None
    mesh_dim_names: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    fsdp: Any = None  # fully_shard.FsdpPlan when the plan shards parameters over data-parallel axes

    def input_placements(self, name: str, ndim: int) -> tuple[Placement, ...]:
        """Placements of forward input ``name`` with ``ndim`` dims: the plan's override or the default."""
        override = self.inputs.get(name)
        if override is None:
            return default_input_placements(self.mesh_dim_names, ndim)
        return normalize_placements(override, ndim, f"inputs[{name!r}]")

    def describe(self) -> str:
        """A readable table of the resolved plan (for dumps and debugging)."""
        lines = [f"mesh {dict(zip(self.mesh_dim_names, self.mesh_shape))}, tp_axis={self.tp_axis!r}, "
                 f"data_parallel_axes={list(self.data_parallel_axes)}"]
        lines.append("parameters:")
        for fqn, placements in self.param_placements.items():
            source = self.param_sources.get(fqn, "default")
            lines.append(f"  {fqn}: {format_placements(placements)}  <- {source}")
        if self.modules:
            lines.append("module boundaries:")
            for fqn, mc in self.modules.items():
                lines.append(f"  {fqn or '<root>'}: inputs={list(mc.inputs)} "
                             f"kwarg_inputs={mc.kwarg_inputs} outputs={list(mc.outputs)}")
        if self.inputs:
            lines.append("inputs:")
            for name, placements in self.inputs.items():
                lines.append(f"  {name}: {format_placements(placements)}")
        return "\n".join(lines)


def default_input_placements(mesh_dim_names: Iterable[str], ndim: int) -> tuple[Placement, ...]:
    """Default layout of a forward input: Shard(0) on data-parallel axes, Replicate elsewhere; 0-d replicated."""
    return tuple(
        Shard(0) if ndim > 0 and is_data_parallel_axis(axis) else Replicate()
        for axis in mesh_dim_names
    )


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
                axes = [a for a, p in zip(self.names, placements) if isinstance(p, Shard) and p.dim == dim]
                if not axes:
                    continue
                sizes = [axis_size(self.mesh, a) for a in axes]
                num_shards = 1
                for s in sizes:
                    num_shards *= s
                if shape[dim] % num_shards:
                    raise ValueError(
                        f"parameter {fqn!r} with shape {shape} cannot be sharded on dim {dim} over "
                        f"mesh axes {axes} (sizes {sizes}, {num_shards} shards): {shape[dim]} is not "
                        f"divisible by {num_shards} (set by {self.param_sources[fqn]}); use a "
                        f"parallel degree that divides {shape[dim]}, or a layout that shards "
                        "another dim or fewer axes"
                    )

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
    resolver.apply_ties()
    resolver.check_divisibility()
    inputs = resolver.resolve_inputs()
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
        data_parallel_axes=data_parallel_axes(mesh),
        tp_axis=tp_axis,
        mesh_dim_names=resolver.names,
        mesh_shape=resolver.shape,
    )
