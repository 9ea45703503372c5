"""``ParallelPlan.pipeline``: where the model is cut into stages and how micro-batches flow.

:class:`PipelinePlan` is pure data with validation; :func:`resolve_pipeline` checks it against the
model and the mesh (the pp axis exists, the stage count matches it, every split point is a module
the model has) and returns the :class:`ResolvedPipeline` the compiler and runtime read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from ..plan import option_from_value
from .schedules import SCHEDULES

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Pipeline parallelism over mesh axis ``axis``.

    ``split_points``: module FQNs where a new stage begins (``"model.layers.4"``: layers 0-3 in one
    stage, 4 onwards in the next), one fewer than the number of stages; or ``"auto"`` to place the
    cuts with the cost model. ``schedule``: "GPipe", "1F1B", "Interleaved1F1B" or "ZBH1" (zero
    bubble: each backward split into an input-gradient and a weight-gradient step, the weight
    gradients delayed into 1F1B's cooldown bubble at 1F1B's activation memory; one stage per rank);
    ``num_microbatches``: micro-batches each step's local batch is split into (dim 0);
    ``stages_per_rank``: stages each pp rank holds (2+ for Interleaved1F1B); ``overlap_p2p``:
    post the next compute step's receives before the current one runs.
    """

    axis: str = "pp"
    split_points: Any = AUTO
    schedule: str = "1F1B"
    num_microbatches: int = 2
    stages_per_rank: int = 1
    overlap_p2p: bool = False

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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelinePlan(schedule={self.schedule!r}) is not a schedule; choose one of {SCHEDULES}")
        for name in ("num_microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelinePlan({name}={value!r}) must be a positive integer")
        if self.schedule == "Interleaved1F1B" and self.stages_per_rank < 2:
            raise ValueError("PipelinePlan(schedule='Interleaved1F1B') needs stages_per_rank >= 2")
        if self.schedule != "Interleaved1F1B" and self.stages_per_rank != 1:
            raise ValueError(
                f"PipelinePlan(schedule={self.schedule!r}) runs one stage per rank; use "
                "schedule='Interleaved1F1B' for stages_per_rank > 1"
            )

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
