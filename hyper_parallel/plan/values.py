"""The plan as the user writes it: :class:`ParallelPlan` and the helpers that normalise its values.

A :class:`ParallelPlan` is pure, mesh-agnostic data written by the user (or read from YAML/JSON via
:meth:`ParallelPlan.from_dict`): module-FQN globs mapped to tensor-parallel styles
(``tensor_parallel``) or to explicit shard_module-style layouts (``layouts``), plus input-layout
overrides and options for later stages (``fully_shard``, ``recompute``, ``swap``, ``pipeline``).
Nothing here looks at a model or a mesh; resolver.py does.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from hyper_parallel.layout import TensorLayout
from hyper_parallel.cp.style import parse_context_style
from hyper_parallel.moe.style import parse_expert_style
from hyper_parallel.tp.styles import ParallelStyle, parse_style

#: Keys of a layouts entry (the shard_module form) and of its "forward" part.
LAYOUT_ENTRY_KEYS = ("parameter", "forward")
FORWARD_KEYS = ("input", "output")


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
    * ``outputs``: returned-value name glob (``"logits"``, ``"loss"``, ``"0"`` for a tuple's first
      item, ``"*"``) -> placement on the non-data-parallel axes (one Placement for all of them, or
      ``{axis: Placement}``). By default an output keeps the sharding it was computed with on those
      axes and is returned as a DTensor over them (vocab-parallel logits stay sharded); an entry
      such as ``{"logits": Replicate()}`` returns it whole instead. Data-parallel axes always give
      this rank's part of the batch, as for inputs.
    * ``expert_parallel``: module-FQN glob of an experts module -> :class:`~hyper_parallel.moe.ExpertParallel`
      (its stacked weights spread over the expert axis, tokens dispatched by all-to-all).
    * ``context_parallel``: module-FQN glob of an attention module -> :class:`~hyper_parallel.cp.ContextParallel`
      (the sequence sharded over its axis, attention made exact around it).
    * ``fully_shard``, ``recompute``, ``swap``, ``pipeline``: options for later compiler stages,
      stored as given.

    None for the six dicts is stored as an empty dict; style names are turned into style objects.
    """

    tensor_parallel: dict[str, ParallelStyle] | None = None
    layouts: dict[str, dict[str, Any]] | None = None
    inputs: dict[str, Any] | None = None
    outputs: dict[str, Any] | None = None
    fully_shard: Any = None
    recompute: Any = None
    swap: Any = None
    pipeline: Any = None
    expert_parallel: dict[str, Any] | None = None
    context_parallel: dict[str, Any] | None = None
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
        outputs = self._checked_dict("outputs", self.outputs)
        object.__setattr__(self, "outputs", {k: _freeze(v) for k, v in outputs.items()})
        experts = self._checked_dict("expert_parallel", self.expert_parallel)
        object.__setattr__(
            self,
            "expert_parallel",
            {k: parse_expert_style(v, f"expert_parallel[{k!r}]") for k, v in experts.items()},
        )
        context = self._checked_dict("context_parallel", self.context_parallel)
        object.__setattr__(
            self,
            "context_parallel",
            {k: parse_context_style(v, f"context_parallel[{k!r}]") for k, v in context.items()},
        )
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
