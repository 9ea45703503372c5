"""What a pipelined step costs and how long it idled: the collectives of each stage program times
its runs per step, the gradient reductions among them, and ``pipeline_report()`` (the measured,
simulated and analytic bubble, gathered from every pp rank)."""

from __future__ import annotations


import torch
import torch.distributed as dist

from ..analysis.debug import collective_summary
from ..ir import meta
from .runtime import StageProgram, first_microbatches, flat_steps, program_for, sync_microbatches
from .schedules import MetaStepType, simulate
from .state import PipelineState


_PROGRAM_OF_STEP = {MetaStepType.FORWARD: "forward", MetaStepType.BACKWARD: "backward",
                    MetaStepType.BACKWARD_INPUT: "backward input", MetaStepType.BACKWARD_WEIGHT: "backward weight"}


def runs_per_step(schedule: list, programs: dict[int, StageProgram]) -> dict[str, int]:
    """Program name (as in the summary's ``collectives``) -> how often one step runs it."""
    first_mb, sync_mb = first_microbatches(schedule), sync_microbatches(schedule)
    runs: dict[str, int] = {}
    for step in flat_steps(schedule):
        phase = _PROGRAM_OF_STEP.get(step.step_type)
        if phase is None:
            continue
        program = programs[step.stage]
        variant = program_for(program, step.micro_batch, first_mb, sync_mb)
        name = f"stage{step.stage} {phase}{variant.name_suffix}"
        runs[name] = runs.get(name, 0) + 1
    return dict(sorted(runs.items()))


_REDUCTIONS = ("all_reduce", "reduce_scatter")


def gradient_reductions(gm: torch.fx.GraphModule, found: list) -> list:
    """Of ``found``, the collectives of program ``gm`` (``ir.collectives.Collective``), those that
    reduce parameter gradients: the all-reduces and reduce-scatters lowering made for a gradient
    slot (``hp_grad_of``) and the bucketing pass's fusions of them (``hp_bucket``)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return [c for c in found if c.kind in _REDUCTIONS
            and (meta.GRAD_OF in nodes[c.node].meta or meta.BUCKET in nodes[c.node].meta)]


def per_step(per_program: dict[str, list], runs: dict[str, int]) -> dict:
    """``collective_summary`` of a step: each program's collectives times the runs it makes."""
    return collective_summary([c for name, colls in per_program.items() for c in colls * runs.get(name, 0)])


def pipeline_report(module) -> dict:
    """See ``ParallelModule.pipeline_report``."""
    pipe: PipelineState = module._hp.pipeline
    if pipe is None:
        raise RuntimeError("pipeline_report(): this model has no pipeline plan")
    entry = pipe.last
    if entry is None or entry.executor.last_timing is None:
        raise RuntimeError("pipeline_report(): run pmodel.step(...) first")
    timing = entry.executor.last_timing
    mine = {"rank": pipe.resolved.rank, "bubble": timing.bubble_fraction(), "step_s": timing.step_s,
            "events": timing.events, "collectives": entry.summary["collectives_per_step"],
            "gradient_reductions": entry.summary["gradient_reductions_per_step"]}
    everyone = [mine]
    if pipe.resolved.num_ranks > 1:
        everyone = [None] * pipe.resolved.num_ranks
        dist.all_gather_object(everyone, mine, group=pipe.pp_group)
    plan = pipe.resolved.plan
    # The schedule's own bubble with the measured mean forward / backward time of each stage. A
    # split backward's input- and weight-gradient steps are each measured, so nothing is estimated
    # here (the analytic bubble assumes them equal, schedules.analytic_bubble).
    durations: dict = {}
    for r in everyone:
        for name, stage, start, end in r["events"]:
            durations.setdefault(name[0], {}).setdefault(stage, []).append(end - start)
    mean = {k: {s: sum(v) / len(v) for s, v in d.items()} for k, d in durations.items()}
    # (A custom schedule may run some stages' backward whole and others' split.)
    backward = {**mean.get("B", {}), **mean.get("I", {})}
    weight = {s: mean.get("W", {}).get(s, 0.0) for s in mean["F"]} if "W" in mean else None
    simulated = simulate(entry.schedule, mean["F"], backward, weight_time=weight).bubble_fraction()
    return {
        "schedule": plan.schedule_name,
        "num_microbatches": plan.num_microbatches,
        "split_points": list(entry.split_points),
        "analytic_bubble": entry.summary["analytic_bubble"],
        "simulated_bubble": simulated,
        "measured_bubble": {r["rank"]: r["bubble"] for r in everyone},
        "measured_bubble_mean": sum(r["bubble"] for r in everyone) / len(everyone),
        "step_s": max(r["step_s"] for r in everyone),
        "timeline": {r["rank"]: r["events"] for r in everyone},
        # Per pp rank (this stage-mesh coordinate), per training step: every collective of its
        # programs, and the gradient reductions among them (once per step, not per micro-batch).
        "collectives_per_step": {r["rank"]: r["collectives"] for r in everyone},
        "gradient_reductions_per_step": {r["rank"]: r["gradient_reductions"] for r in everyone},
    }
