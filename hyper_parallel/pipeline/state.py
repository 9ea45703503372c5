"""What a pipelined module keeps between steps: its resolved pipeline, the compiled entries by
micro-batch signature (``PipelineEntry``), and the stage mesh the rest of the plan applies on.

With ``ParallelPlan.pipeline`` every other part of the plan (tensor parallelism, FSDP, recompute,
swap) applies on the *stage mesh*: the mesh without the pp axis, i.e. the ranks that run the same
stages (``pipeline/plan.py:stage_mesh``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..passes.pipeline_split import StageGraph
from .plan import ResolvedPipeline
from .runtime import PipelineExecutor, StageProgram


# Name suffixes of a stage's variants (summary keys), and their dump folders / Inductor labels.
NO_SYNC = " (no sync)"
FIRST = " (first micro-batch)"
VARIANT_FOLDERS = {NO_SYNC: "no_sync", FIRST: "first_microbatch"}


@dataclasses.dataclass
class PipelineEntry:
    """One compiled input signature of a pipelined module."""

    split_points: tuple[str, ...]
    stages: list[StageGraph]  # every stage's graph before passes (the same on every rank)
    programs: dict[int, StageProgram]  # this rank's stages
    executor: PipelineExecutor
    schedule: dict  # pp rank -> [MetaStep]
    summary: dict
    # Stage-mesh axes over which a random op of this rank's stages has a replicated output: the
    # ranks of each draw from one generator state (runtime/random_state.py).
    random_axes: tuple[str, ...] = ()
    # Module attributes the captured forward read (runtime/attribute_guards.py): the step guards
    # later steps on their values (runtime/selection.py).
    reads: tuple = ()


@dataclasses.dataclass
class PipelineState:
    resolved: ResolvedPipeline
    mesh: Any  # the full mesh, pp axis included
    loss_fn: Callable | None
    cache: dict = dataclasses.field(default_factory=dict)
    last: PipelineEntry | None = None
    last_variant: int | None = None  # the module attribute variant of the last step (attribute_guards.py)
    # This rank's parameters' (requires_grad, dtype) when the first step compiled (every stage
    # program was captured with those, on every rank).
    param_state: dict | None = None
    warned_clipping: bool = False  # the note on clipping under a pipeline, logged at the first compile
    # Steps' (input structure, whole-input signatures, autocast, attribute variant) that found a
    # compiled entry: a step with one of these waits for the agreement where it first needs it.
    reused: set = dataclasses.field(default_factory=set)

    @property
    def pp_group(self):
        return self.mesh.get_group(self.resolved.plan.axis)
