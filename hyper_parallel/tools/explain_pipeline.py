"""``explain`` of a plan with a pipeline (``--parallel ...,pp=N``): every stage compiled, the step
priced in its schedule's order, memory per pp rank.

One process plays a rank of the first pipeline stage and compiles the programs of every stage
(``pipeline.step.compile_step(..., every_stage=True)``): the capture, propagation and lowering a
real first step runs, the cut into stages, and each stage's passes, partition and variants. The
programs of a stage differ between its ranks only in rank-dependent offsets, so one rank's stand
for all. ``pipeline.step_cost.pipeline_cost`` then simulates each program with the cost model and
replays the schedule the executor runs with those times (sends priced over the pp axis), and
estimates each pp rank's peak with its in-flight micro-batches.

The report keeps ``explain``'s shape: ``memory`` and ``device`` are those of the pp rank with the
highest peak (the one that decides whether the plan fits), ``step`` is the whole pipelined step (its
forward/backward/compute/communication are the slowest pp rank's sums over its steps), and
``pipeline`` adds the schedule, the bubble, each stage's times and memory and each pp rank's peak.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..analysis.memory import format_bytes

__all__ = ["explain_pipelined", "format_pipeline"]


def explain_pipelined(net: torch.nn.Module, plan: Any, mesh, ids: torch.Tensor, profile, optimizer,
                      dtype: str, **parallelize_options) -> dict:
    """Compile ``net`` with ``plan`` (which has a ``pipeline`` entry) on the fake ``mesh`` for the
    local batch ``ids`` and price it: ``{"pmodel", "cost"`` (the ``PipelineCost``), ``"memory",
    "step", "collectives", "pipeline"}``. ``optimizer``: an
    ``OptimizerModel`` (or its name, "none" for no optimizer step)."""
    from ..analysis.debug import group_axis_names
    from ..api import parallelize
    from ..cost import axis_infos, mfu
    from ..pipeline.step import compile_step
    from ..pipeline.step_cost import pipeline_cost

    pmodel = parallelize(net, plan, mesh, materialize=False, **parallelize_options)
    state = pmodel._hp
    entry = compile_step(pmodel, {"input_ids": ids, "labels": ids}, every_stage=True)
    pipe = state.pipeline
    resolved = state.resolved
    stage_mesh = state.mesh
    axes = axis_infos(stage_mesh, groups=group_axis_names(stage_mesh, resolved.fsdp, resolved.context))
    pp_axis = axis_infos(mesh)[mesh.get_group(pipe.resolved.plan.axis).group_name]
    cost = pipeline_cost(entry, pipe.resolved.num_ranks, axes, pp_axis, profile, optimizer,
                         agreement_ranks=dist.get_world_size() if dist.is_initialized() else mesh.size())
    worst = max(cost.rank_peak_bytes, key=lambda r: (cost.rank_peak_bytes[r], -r))
    memory = _rank_memory(cost, worst)
    slowest = max(cost.rank_end_s, key=lambda r: (cost.rank_end_s[r], -r))
    totals = cost.rank_totals[slowest]
    ranks = len(cost.rank_totals)
    model_flops = sum(t["flops"] - t["recompute_flops"] for t in cost.rank_totals.values()) / ranks
    flops = sum(t["flops"] for t in cost.rank_totals.values()) / ranks
    positive = cost.step_s > 0
    step = {**totals, "step_s": cost.step_s, "available": True, "profile": profile.name,
            "model_flops": model_flops, "flops": flops,
            "recompute_flops": sum(t["recompute_flops"] for t in cost.rank_totals.values()) / ranks,
            "agreement_s": cost.agreement_s, "agreement_exposed_s": cost.agreement_exposed_s,
            "mfu": mfu(model_flops, cost.step_s, profile, dtype) if positive else 0.0,
            "hfu": mfu(flops, cost.step_s, profile, dtype) if positive else 0.0}
    plan_ = pipe.resolved.plan
    section = {"schedule": plan_.schedule_name, "num_stages": pipe.resolved.num_stages, "pp": pipe.resolved.num_ranks,
               "stages_per_rank": plan_.stages_per_rank, "num_microbatches": plan_.num_microbatches,
               "split_points": list(entry.split_points), "analytic_bubble": entry.summary["analytic_bubble"],
               "memory_rank": worst, "slowest_rank": slowest, **cost.as_dict()}
    summary = entry.summary
    return {"pmodel": pmodel, "cost": cost, "memory": memory, "step": step, "pipeline": section,
            "collectives": {"forward": _phase(summary, "forward"), "backward": _phase(summary, "backward"),
                            "per_step": summary["collectives_per_step"]}}


def _phase(summary: dict, phase: str) -> dict:
    """Per kind and axis, the collectives of this rank's ``phase`` programs times the runs a step
    makes of each (``explain``'s fwd / bwd columns: per step, as the bytes column)."""
    out: dict = {}
    runs = summary["runs_per_step"]
    for name, table in summary["collectives"].items():
        if name not in runs or (phase == "forward") != name.split(" ", 1)[1].startswith("forward"):
            continue
        for kind, per_axis in table.items():
            for axis, entry in per_axis.items():
                slot = out.setdefault(kind, {}).setdefault(axis, {"count": 0, "bytes": 0})
                slot["count"] += entry["count"] * runs[name]
                slot["bytes"] += entry["bytes"] * runs[name]
    return out


def _rank_memory(cost, rank: int) -> dict:
    """``explain``'s memory section for pp rank ``rank``: its stages' one-micro-batch estimates
    summed where they add (parameters, gradients, state) and its in-flight activations."""
    own = [s for s in cost.stages if s.rank == rank]
    biggest = max(own, key=lambda s: s.memory["peak"])
    peak = cost.rank_peak_bytes[rank]

    def total(key: str) -> int:
        return sum(s.memory[key] for s in own)

    # The allocator's cache over the allocated peak, as the stage with the largest one-micro-batch peak has it.
    over = {k: biggest.memory[k] - biggest.memory["peak"] for k in ("reserved_default", "reserved_expandable")}
    return {**biggest.memory, "params": total("params"), "buffers": total("buffers"), "grads": total("grads"),
            "optimizer_state": total("optimizer_state"),
            "saved_activations": peak - sum(s.persistent_bytes for s in own) - max(s.temporary_bytes for s in own),
            "peak": peak, "reserved_default": peak + max(0, over["reserved_default"]),
            "reserved_expandable": peak + max(0, over["reserved_expandable"]),
            "pp_rank": rank, "stages": [s.stage for s in own]}


def format_pipeline(section: dict) -> list[str]:
    """The pipeline's lines of ``explain``'s text report."""
    lines = ["", f"pipeline  {section['num_stages']} stages over pp={section['pp']}, schedule {section['schedule']}, "
                 f"{section['num_microbatches']} micro-batches; bubble {section['bubble_fraction'] * 100:.1f}% "
                 f"(equal stages: {section['analytic_bubble'] * 100:.1f}%), send {section['p2p_s'] * 1e3:.2f} ms",
             f"  {'stage':<7}{'rank':>5}{'fwd/mb':>10}{'bwd/mb':>10}{'in flight':>11}{'held/mb':>12}{'persistent':>12}"]
    for s in section["stages"]:
        lines.append(f"  {s['stage']:<7}{s['rank']:>5}{s['forward_s'] * 1e3:>8.1f}ms{s['backward_s'] * 1e3:>8.1f}ms"
                     f"{s['in_flight']:>11}{format_bytes(s['saved_bytes']):>12}{format_bytes(s['persistent_bytes']):>12}")
    lines.append(f"  {'pp rank':<9}{'stages':<10}{'ends at':>10}{'peak':>12}")
    for r in section["ranks"]:
        lines.append(f"  {r['rank']:<9}{','.join(map(str, r['stages'])):<10}{r['end_s'] * 1e3:>8.1f}ms"
                     f"{format_bytes(r['peak_bytes']):>12}")
    return lines

