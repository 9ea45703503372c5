"""The one plan-resolution entry point: :func:`resolve` turns the user's plan into a :class:`Resolution`.

``parallelize`` calls it once. In order, it merges the entries recorded on the model
(shard_module / parallelize_module) with the explicit plan; resolves the pipeline plan and the stage
mesh the rest of the plan applies on (pipeline/plan.py); the tensor-parallel and explicit layouts
(:func:`~hyper_parallel.plan.resolver.resolve_plan`); the activation plan of ``recompute`` / ``swap``
(recompute.py); the FSDP units with the process groups of ``reshard_after_forward=<k>``
(fsdp/resolve.py); the sub-groups of hybrid context parallelism (cp/resolve.py); and on gloo the
reduction lanes of the data-parallel axes (plan/lanes.py).

It sits above those stages, which themselves import this package, so ``hyper_parallel.plan`` does
not import this module: use ``from hyper_parallel.plan.resolution import resolve``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from ..cp.resolve import attach_context_groups
from ..fsdp.fully_shard import collect_recorded_fully_shard
from ..fsdp.resolve import attach_joint_shard_group, attach_post_forward_groups, resolve_fully_shard
from ..pipeline.plan import ResolvedPipeline, resolve_pipeline, stage_mesh
from ..recompute import ActivationPlan, auto_activation_candidates, resolve_activation_plan
from .lanes import attach_reduction_lanes
from .recorded import collect_recorded_plan, merge_plans
from .resolved import ResolvedPlan
from .resolver import check_mesh_axes_used, resolve_plan
from .values import ParallelPlan

__all__ = ["Resolution", "resolve"]


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A plan resolved against a model and a mesh: everything ``parallelize`` builds the module from.

    * ``plan``: the full plan, the explicit one merged with the entries recorded on the model.
    * ``resolved``: parameter and buffer layouts, module-boundary constraints, input overrides and
      the FSDP units (``resolved.fsdp``), on ``mesh``.
    * ``activation``: the recompute and swap regions (``recompute="auto"``: the blocks to choose for).
    * ``pipeline``: the resolved pipeline plan, or None without a pipeline plan.
    * ``mesh``: the mesh the rest of the plan applies on: a pipeline stage's mesh (without the pp
      axis) with a pipeline plan, else the mesh given.
    * ``full_mesh``: the mesh given, pp axis included (the ranks that must agree).
    * ``auto_candidates``: with ``recompute="auto"``, each candidate's recompute entry and its
      activation plan (recompute.auto_activation_candidates), which the compile chooses among.
    """

    plan: ParallelPlan
    resolved: ResolvedPlan
    activation: ActivationPlan
    pipeline: ResolvedPipeline | None
    mesh: Any
    full_mesh: Any
    auto_candidates: tuple = ()


def resolve(
    plan: Any,
    model: nn.Module,
    mesh: Any,
    *,
    loss_fn: Callable | None = None,
    memory_budget_bytes: int | None = None,
) -> Resolution:
    """Resolve ``plan`` (ParallelPlan, dict, or None for only the recorded entries) for ``model`` on
    ``mesh``; see the module docstring for the stages, run in that order.

    ``loss_fn`` is the pipeline's loss (only with a pipeline plan); ``memory_budget_bytes`` (already
    validated) is required by, and only allowed with, ``recompute="auto"``. Every rank calls it:
    ``reshard_after_forward=<k>``, hybrid context parallelism and gloo's reduction lanes create
    process groups. Raises the
    stages' ValueError / TypeError.
    """
    recorded = collect_recorded_plan(model)
    full_plan = merge_plans(plan or {}, recorded) if plan is not None else recorded
    pipeline = None
    full_mesh = mesh
    if full_plan.pipeline is not None:
        # The rest of the plan applies within a stage: on the mesh without the pp axis.
        pipeline = resolve_pipeline(full_plan.pipeline, model, mesh)
        mesh = stage_mesh(mesh, pipeline.plan.axis)
    elif loss_fn is not None:
        raise ValueError(
            "parallelize(loss_fn=...) is for pipeline plans (ParallelPlan.pipeline), whose stages need "
            "the loss inside the compiled program; without a pipeline, compute the loss on the output"
        )
    resolved = resolve_plan(full_plan, model, mesh)
    activation = resolve_activation_plan(full_plan.recompute, full_plan.swap, model)
    if pipeline is not None and activation.auto_blocks:
        raise ValueError(
            "recompute='auto' is not supported with a pipeline plan yet; give each stage's modules an "
            "explicit recompute entry ('full' / 'selective')"
        )
    if bool(activation.auto_blocks) != (memory_budget_bytes is not None):
        raise ValueError(
            "recompute='auto' needs parallelize(..., memory_budget_bytes=<per-rank bytes>)"
            if activation.auto_blocks else
            "memory_budget_bytes applies to recompute='auto'; set ParallelPlan(recompute='auto') or "
            "drop memory_budget_bytes"
        )
    recorded = collect_recorded_fully_shard(model)
    if full_plan.fully_shard is not None and recorded is not None:
        # Two sources of FSDP units: taking either would silently drop the other's.
        raise ValueError(
            f"the plan has a fully_shard entry and hp.fully_shard was also called on modules of "
            f"{type(model).__name__} (units {list(recorded.units)}): use one of the two, either the "
            "plan's FullyShard(units=...) or the hp.fully_shard calls")
    fully_shard_spec = full_plan.fully_shard or recorded
    if fully_shard_spec is not None:
        resolved = resolve_fully_shard(fully_shard_spec, model, resolved)
        # reshard_after_forward=<k>: the groups of k ranks backward gathers over (collective).
        resolved = dataclasses.replace(resolved, fsdp=attach_post_forward_groups(resolved.fsdp, mesh))
        # Dense parameters sharded over several axes: one collective over their flattened mesh.
        resolved = dataclasses.replace(resolved, fsdp=attach_joint_shard_group(resolved.fsdp, mesh))
    # Ring attention over groups of Ulysses ranks: the two sub-groups of the cp axis (collective).
    resolved = dataclasses.replace(resolved, context=attach_context_groups(resolved.context, mesh))
    # Gloo: a second group per data-parallel axis for the gradient reductions (collective).
    fsdp = resolved.fsdp
    axes = (*resolved.data_parallel_axes, *((fsdp.replicate_axis, fsdp.shard_axis) if fsdp is not None else ()))
    axes = tuple(a for a in axes if a is not None)
    resolved = dataclasses.replace(resolved, reduction_lanes=attach_reduction_lanes(mesh, axes))
    check_mesh_axes_used(resolved, full_plan)
    return Resolution(plan=full_plan, resolved=resolved, activation=activation, pipeline=pipeline, mesh=mesh,
                      full_mesh=full_mesh,
                      auto_candidates=auto_activation_candidates(activation, full_plan.swap, model))
