"""``ParallelPlan.pipeline``: where the model is cut into stages and how micro-batches flow.

:class:`PipelinePlan` is pure data with validation; :func:`resolve_pipeline` checks it against the
model and the mesh (the pp axis exists, the stage count matches it, every split point is a module
the model has) and returns the :class:`ResolvedPipeline` the compiler and runtime read.
:class:`BatchDimSpec` names the dim an input's batch is on, where micro-batches are cut
(``PipelinePlan.batch_dims``; the cut itself is api.micro_batches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.nn as nn

from .. import compat
from ..plan.values import option_from_value
from .schedules import SCHEDULES, CustomSchedule, build_schedule

AUTO = "auto"
DEFAULT_INPUT = "*"  # PipelinePlan.batch_dims key for every input not named
TARGETS = "targets"  # PipelinePlan.batch_dims key for step()'s targets


@dataclasses.dataclass(frozen=True)
class BatchDimSpec:
    """The dim of an input its batch is on: micro-batches are cut along ``batch_dim``; ``None``:
    not cut, every micro-batch gets the whole tensor. Negative dims are refused (``-1`` would read
    as the last dim here but as "not cut" in other pipeline APIs: write the dim, or None)."""

    batch_dim: int | None

    def __post_init__(self):
        dim = self.batch_dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"BatchDimSpec(batch_dim={dim!r}) must be an int >= 0 or None")
        if dim is not None and dim < 0:
            raise ValueError(
                f"BatchDimSpec(batch_dim={dim}): give the dim counted from the front (>= 0), or "
                "BatchDimSpec(None) for an input every micro-batch gets whole"
            )

    def __repr__(self):
        return f"BatchDimSpec({self.batch_dim})"

    @classmethod
    def of(cls, value: Any) -> "BatchDimSpec":
        """A BatchDimSpec, or the same as its ``batch_dim`` (an int or None)."""
        return value if isinstance(value, cls) else cls(value)

    @staticmethod
    def from_tuple(batch_dims: tuple) -> tuple:
        """``(1, None, ...)`` -> ``(BatchDimSpec(1), BatchDimSpec(None), ...)``."""
        if not isinstance(batch_dims, tuple):
            raise TypeError(f"BatchDimSpec.from_tuple takes a tuple, got {type(batch_dims).__name__}")
        return tuple(BatchDimSpec.of(d) for d in batch_dims)

    @staticmethod
    def from_dict(batch_dims: Mapping) -> dict:
        """``{"x": 1, ...}`` -> ``{"x": BatchDimSpec(1), ...}``."""
        if not isinstance(batch_dims, Mapping):
            raise TypeError(f"BatchDimSpec.from_dict takes a dict, got {type(batch_dims).__name__}")
        return {k: BatchDimSpec.of(v) for k, v in batch_dims.items()}


def normalize_batch_dims(value: Any, where: str) -> dict[str, BatchDimSpec]:
    """``PipelinePlan.batch_dims`` as {input name: BatchDimSpec}: a dict of specs (or ints / None),
    or one spec (or int) for every input (the ``"*"`` entry)."""
    if value is None:
        return {}
    if isinstance(value, (BatchDimSpec, int)) and not isinstance(value, bool):
        value = {DEFAULT_INPUT: value}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}={value!r} must map input names to BatchDimSpec (or an int dim), e.g. "
            "{'input_ids': hp.BatchDimSpec(1)}, or be one BatchDimSpec for every input"
        )
    out = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: keys are input names (str), got {name!r}")
        try:
            out[name] = BatchDimSpec.of(spec)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}[{name!r}]: {exc}") from None
    return out


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Pipeline parallelism over mesh axis ``axis``.

    ``split_points``: module FQNs where a new stage begins (``"model.layers.4"``: layers 0-3 in one
    stage, 4 onwards in the next), one fewer than the number of stages; or ``"auto"`` to place the
    cuts with the cost model. ``schedule``: "GPipe", "1F1B", "Interleaved1F1B" or "ZBH1" (zero
    bubble: each backward split into an input-gradient and a weight-gradient step, the weight
    gradients delayed into 1F1B's cooldown bubble at 1F1B's activation memory; one stage per rank),
    or a hand-written :class:`~hyper_parallel.pipeline.schedules.CustomSchedule` (a
    ``{pp_rank: [MetaStep, ...]}`` dict is taken as one), checked here like the built-in ones;
    ``num_microbatches``: micro-batches each step's local batch is split into;
    ``stages_per_rank``: stages each pp rank holds (2+ for Interleaved1F1B); ``overlap_p2p``:
    post the next compute step's receives before the current one runs; ``batch_dims``: {input
    name: :class:`BatchDimSpec`} for inputs whose batch is not on dim 0, an int standing for its
    BatchDimSpec. The names: a keyword input's name, the ``forward`` parameter a positional input
    binds to, ``"targets"`` for ``step``'s targets, ``"*"`` for every input not named (one
    BatchDimSpec or int alone: every input). Every tensor under a named input is cut along its dim.
    """

    axis: str = "pp"
    split_points: Any = AUTO
    schedule: str | CustomSchedule = "1F1B"
    num_microbatches: int = 2
    stages_per_rank: int = 1
    overlap_p2p: bool = False
    batch_dims: Any = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"PipelinePlan(axis={self.axis!r}) must be a mesh axis name such as 'pp'")
        if self.split_points != AUTO:
            points = self.split_points
            if isinstance(points, str) or not isinstance(points, (list, tuple)) or not all(
                isinstance(p, str) and p for p in points
            ):
                raise TypeError(
                    f"PipelinePlan(split_points={points!r}) must be 'auto' or a list of module FQNs "
                    "where stages begin, e.g. ['model.layers.2']"
                )
            if len(set(points)) != len(points):
                raise ValueError(f"PipelinePlan(split_points={list(points)!r}) names a module twice")
            object.__setattr__(self, "split_points", tuple(points))
        object.__setattr__(self, "batch_dims", normalize_batch_dims(self.batch_dims, "PipelinePlan(batch_dims)"))
        if isinstance(self.schedule, (dict, list, tuple)):  # {pp_rank: [MetaStep, ...]}
            object.__setattr__(self, "schedule", CustomSchedule(self.schedule))
        custom = isinstance(self.schedule, CustomSchedule)
        if not custom and (not isinstance(self.schedule, str) or self.schedule not in SCHEDULES):
            raise ValueError(f"PipelinePlan(schedule={self.schedule!r}) is not a schedule; choose one of {SCHEDULES}, "
                             "or write one: hp.CustomSchedule({pp_rank: [MetaStep, ...]})")
        for name in ("num_microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelinePlan({name}={value!r}) must be a positive integer")
        if custom:
            self._check_custom_schedule()
            return
        if self.schedule == "Interleaved1F1B" and self.stages_per_rank < 2:
            raise ValueError("PipelinePlan(schedule='Interleaved1F1B') needs stages_per_rank >= 2")
        if self.schedule != "Interleaved1F1B" and self.stages_per_rank != 1:
            raise ValueError(
                f"PipelinePlan(schedule={self.schedule!r}) runs one stage per rank; use "
                "schedule='Interleaved1F1B' for stages_per_rank > 1"
            )

    def _check_custom_schedule(self) -> None:
        """The checks of a built schedule (schedules.check_schedule), without a mesh: the custom
        schedule's ranks are the pp ranks."""
        schedule: CustomSchedule = self.schedule
        steps = [sub for rank in schedule.steps for step in rank for sub in (step.sub_steps or (step,))]
        micro = 1 + max((s.micro_batch for s in steps), default=-1)
        if micro > self.num_microbatches:
            raise ValueError(f"PipelinePlan(num_microbatches={self.num_microbatches}): the schedule "
                             f"{schedule.name!r} runs micro-batches 0..{micro - 1}; set num_microbatches={micro}")
        stages, ranks = 1 + max((s.stage for s in steps), default=-1), schedule.num_ranks
        if stages > ranks * self.stages_per_rank:
            raise ValueError(
                f"PipelinePlan(stages_per_rank={self.stages_per_rank}): the schedule {schedule.name!r} runs "
                f"stages 0..{stages - 1} on its {ranks} ranks; set stages_per_rank={-(-stages // ranks)}"
            )
        schedule.build(ranks * self.stages_per_rank, self.num_microbatches, self.overlap_p2p)

    @property
    def schedule_name(self) -> str:
        """The schedule's name in summaries and reports ("1F1B", or the CustomSchedule's name)."""
        return self.schedule.name if isinstance(self.schedule, CustomSchedule) else self.schedule

    def rank_schedules(self, num_ranks: int) -> dict:
        """{pp rank: [MetaStep, ...]} the executor runs, checked (schedules.check_schedule)."""
        if isinstance(self.schedule, CustomSchedule):
            return self.schedule.build(num_ranks * self.stages_per_rank, self.num_microbatches, self.overlap_p2p)
        return build_schedule(self.schedule, num_ranks, self.num_microbatches, self.stages_per_rank, self.overlap_p2p)

    @classmethod
    def from_value(cls, value: Any) -> "PipelinePlan":
        """Accept a PipelinePlan or the same as a plain dict."""
        return option_from_value(cls, value, "ParallelPlan.pipeline")


@dataclasses.dataclass(frozen=True)
class ResolvedPipeline:
    """A pipeline plan checked against the model and mesh."""

    plan: PipelinePlan
    num_ranks: int  # size of the pp axis
    rank: int  # this rank's coordinate on the pp axis
    num_stages: int

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this rank runs (loop placement: stage s lives on pp rank s % num_ranks)."""
        return tuple(range(self.rank, self.num_stages, self.num_ranks))


def resolve_pipeline(value: Any, model: nn.Module, mesh) -> ResolvedPipeline:
    plan = PipelinePlan.from_value(value)
    names = tuple(mesh.mesh_dim_names or ())
    if plan.axis not in names:
        raise ValueError(
            f"PipelinePlan(axis={plan.axis!r}) is not an axis of the mesh {names}; build the mesh with "
            f"a '{plan.axis}' axis (hp.ParallelDims(pp=...).build_mesh())"
        )
    num_ranks = mesh.size(names.index(plan.axis))
    num_stages = num_ranks * plan.stages_per_rank
    if isinstance(plan.schedule, CustomSchedule) and plan.schedule.num_ranks != num_ranks:
        raise ValueError(
            f"PipelinePlan(schedule=CustomSchedule {plan.schedule.name!r}) has steps for {plan.schedule.num_ranks} "
            f"pp ranks, but the '{plan.axis}' axis has {num_ranks}; write one step list per pp rank"
        )
    if plan.split_points != AUTO:
        if len(plan.split_points) + 1 != num_stages:
            raise ValueError(
                f"PipelinePlan(split_points={list(plan.split_points)!r}) makes {len(plan.split_points) + 1} "
                f"stages, but the '{plan.axis}' axis has {num_ranks} ranks x stages_per_rank="
                f"{plan.stages_per_rank} = {num_stages} stages; give {num_stages - 1} split points"
            )
        modules = dict(model.named_modules())
        for point in plan.split_points:
            if point not in modules or point == "":
                near = sorted(m for m in modules if m and m.rsplit(".", 1)[0] == point.rsplit(".", 1)[0])[:5]
                raise ValueError(
                    f"PipelinePlan split point {point!r} is not a module boundary of "
                    f"{type(model).__name__}: a stage can only begin where a submodule begins. "
                    f"Modules nearby: {near or sorted(modules)[:5]}"
                )
    if plan.schedule == "Interleaved1F1B" and plan.num_microbatches % num_ranks:
        raise ValueError(
            f"PipelinePlan(schedule='Interleaved1F1B', num_microbatches={plan.num_microbatches}) needs a "
            f"multiple of the {num_ranks} pipeline ranks"
        )
    return ResolvedPipeline(plan, num_ranks, mesh.get_local_rank(plan.axis), num_stages)


def stage_mesh(mesh, axis: str):
    """The mesh without ``axis``: this rank's slice, where the rest of the plan applies. With no
    other axis, a one-rank axis named "stage" (no collectives run on it)."""
    names = tuple(mesh.mesh_dim_names)
    others = tuple(n for n in names if n != axis)
    if others:
        return mesh[others] if len(others) > 1 else mesh[others[0]]
    return compat.unflatten_mesh_axis(mesh, axis, (mesh.size(0), 1), (axis, "stage"))["stage"]
