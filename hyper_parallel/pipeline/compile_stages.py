"""One micro-batch signature of a pipelined module compiled into this rank's stage programs.

The first ``pmodel.step(inputs, targets)`` for an input signature compiles:

    capture (one micro-batch, forward returning the loss) → propagate → lower
    → split into stages (passes/pipeline_split.py; cut points from the plan or chosen by auto.py)
    → for each stage this rank runs: passes → forward/backward partition, for each variant of the
      stage with several micro-batches (passes/pipeline_split.py): first (its first micro-batch:
      no gradient sums yet), no sync (adds its gradients to the step's local sums) and sync (the
      stage's last micro-batch: adds them and reduces the sums once; no sync and sync are one
      program when the stage has no reduction to defer)
    → for a split-backward schedule (ZB-H1; the stages a CustomSchedule runs with BACKWARD_INPUT /
      BACKWARD_WEIGHT steps), each variant's backward cut into an input-gradient and a
      weight-gradient program (runtime/partition.py:split_backward; the reductions go with the
      weight gradients, so the sync variant is the stage's last weight-gradient step)

then releases the parameters of the stages this rank does not run, and every later step runs the
schedule (runtime.py) over the micro-batches. The compile summary counts each program's collectives
(``collectives``, one run), how often a step runs it (``runs_per_step``) and their product
(``collectives_per_step``, ``gradient_reductions_per_step``: this rank's bytes per training step).
Programs are named ``stage<s> forward``, ``stage<s> backward`` (or, split, ``stage<s> backward
input`` and ``stage<s> backward weight``), with `` (no sync)`` for the no-sync variant and `` (first
micro-batch)`` for the first one.

Each stage variant goes through the back half every compile shares (``compile/programs.py``:
passes, partition, agreement gate, dumps, the zero-bubble split, codegen); this module chooses
the variants, wraps the programs for the executor and checks SPMD agreement over all of them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..ir.kinds import InputKind, OutputKind
from .. import compat
from ..compile.gc_freeze import older_objects_frozen
from ..compile.driver import capture_and_lower
from ..compile.programs import build_programs
from ..compile.signature import current_rank
from ..analysis.debug import Dumper, collective_summary
from ..progress import Progress
from ..passes.pipeline_split import StageGraph, deferred_parameters, gradient_variant, split_stages
from ..runtime.random_state import replicated_random_axes
from ..distributed.spmd import check_spmd_on_mesh
from .loss import expose_loss_count, loss_combination, loss_source
from .step_arguments import loss_of
from .plan import AUTO
from .runtime import PipelineExecutor, StageProgram, check_split, variants_of, weight_outputs
from .schedules import (
    CustomSchedule, analytic_bubble, equal_stage_bubble, format_schedule, split_backward_stages,
)
from .state import FIRST, NO_SYNC, VARIANT_FOLDERS, PipelineEntry, PipelineState
from .report import gradient_reductions, per_step, runs_per_step

log = logging.getLogger(__name__)


@contextlib.contextmanager
def loss_forward(module: nn.Module, loss_fn: Callable | None, original_forward: Callable):
    """While capturing, the module's forward returns only the loss: ``loss_fn(output, target)`` with
    the target as the last positional argument, or the model's own loss (a tensor, or the ``loss``
    entry of what it returns)."""

    def forward(*args, **kwargs):
        if loss_fn is not None:
            *args, target = args
            return loss_fn(original_forward(*args, **kwargs), target)
        return loss_of(original_forward(*args, **kwargs))

    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@older_objects_frozen()
def compile_pipeline(module, args: tuple, kwargs: dict, flat: list, every_stage: bool = False) -> PipelineEntry:
    """Compile one micro-batch signature into this rank's stage programs (module docstring).
    ``every_stage``: the programs of every stage, not only this rank's (planning on a fake mesh:
    ``step_cost.pipeline_cost`` prices them all; such an entry is not run)."""
    state = module._hp
    pipe: PipelineState = state.pipeline
    resolved = pipe.resolved
    plan = resolved.plan
    rank = current_rank()
    dumper = Dumper(state.options.dump_dir, rank)
    original_forward = state.original_cls.forward.__get__(module)
    progress = Progress(f"compile {state.original_cls.__name__} (pipeline)")
    request = state.compile_request(module)
    lowered = capture_and_lower(
        module, request, args, kwargs, flat, dumper,
        wrap_forward=lambda: loss_forward(module, pipe.loss_fn, original_forward), progress=progress,
    )
    if plan.split_points == AUTO:
        from .auto import choose_split_points

        split_points, auto_report = choose_split_points(lowered.local, lowered.captured, module, resolved, state)
    else:
        split_points, auto_report = plan.split_points, None
    if lowered.captured.buffer_updates:
        # The stage programs have no slot for them yet: refused rather than silently not updated.
        raise ValueError(
            f"pipeline: the model updates buffers in forward ({', '.join(lowered.captured.buffer_updates[:3])}; "
            "BatchNorm running statistics?), which pipeline stages do not write back yet. Use a plan "
            "without a pipeline, or norms without running statistics (track_running_stats=False)"
        )
    token_mean = expose_loss_count(lowered.local, lowered.captured)
    if not token_mean and plan.num_microbatches > 1:
        log.warning(
            "pipeline: the loss, %s, is not a plain token mean (e.g. cross-entropy plus a router's "
            "load-balancing loss), so each step averages its %d micro-batch losses: the numbers of "
            "one device accumulating gradients over the same micro-batches (loss / %d each), not of "
            "one device on the whole batch when micro-batches count different tokens or the loss "
            "uses batch statistics. Return the cross-entropy alone for the exact global token mean.",
            loss_source(lowered.local, lowered.captured), plan.num_microbatches, plan.num_microbatches,
        )
    stages = split_stages(lowered.local, lowered.captured, split_points, resolved.num_stages)
    schedule = plan.rank_schedules(resolved.num_ranks)
    split_backward = split_backward_stages(schedule)  # stages whose backward runs as I and W steps

    programs: dict[int, StageProgram] = {}
    colls = {}
    pass_seconds: dict = {"rewrites": lowered.rewrite_seconds}
    reductions = {}
    for s in range(resolved.num_stages) if every_stage else resolved.local_stages:
        graph = stages[s]
        # Gradients summed by the programs and reduced once per step (passes/pipeline_split.py): the
        # variant of the stage's last micro-batch keeps the plain names and dump folders, the others
        # are beside it. One micro-batch: the plain graph.
        deferred = deferred_parameters(graph) if plan.num_microbatches > 1 else ()
        variants = gradient_variants(graph, plan.num_microbatches, deferred)
        built = {}
        for suffix, variant in variants.items():
            folder = os.path.join(f"stage{s}", VARIANT_FOLDERS[suffix]) if suffix else f"stage{s}"
            dump_dir = state.options.dump_dir
            stage_dumper = Dumper(os.path.join(dump_dir, folder) if dump_dir else None, rank)
            stage_dumper.graph("split", variant.gm)
            seconds = pass_seconds[f"stage{s}{suffix}"] = {}
            split = s in split_backward  # its backward runs as input- and weight-gradient steps
            programs_of = build_programs(request, variant.gm, lowered.annotated, stage_dumper,
                                         variant.num_forward_outputs, timings=seconds, backward_reordered=split,
                                         weight_outputs=weight_outputs(variant) if split else None)
            program = StageProgram(s, programs_of.forward_gm, programs_of.backward_gm, variant, name_suffix=suffix,
                                   split=programs_of.split)
            if split:
                check_split(program)
            graphs = programs_of.graphs()
            for name, found in programs_of.collectives.items():  # the programs the schedule runs
                colls[f"stage{s} {name}{suffix}"] = found
                if name != "forward":
                    reductions[f"stage{s} {name}{suffix}"] = gradient_reductions(graphs[name], found)
            label = f"stage{s}.{VARIANT_FOLDERS[suffix]}" if suffix else f"stage{s}"  # a file name in dumps
            program.runners = programs_of.runners(label)
            built[suffix] = program
        programs[s] = stage_program(built, deferred)
    # The ranks of this stage mesh run the same stages: the plain path's check among them.
    check_spmd_on_mesh(colls, state.mesh)

    transfers = [t for g in stages for t in g.sends]
    device = _device_of(module, flat)
    loss_dtype = next(
        v.meta["val"].dtype for v, i in zip(lowered.local.graph.output_node().args[0], lowered.captured.outputs)
        if i.kind == OutputKind.OUTPUT
    )
    runs = runs_per_step(schedule[resolved.rank], programs)
    executor = PipelineExecutor(programs, schedule[resolved.rank], transfers, resolved.num_ranks,
                                plan.num_microbatches, pipe.pp_group, device, loss_dtype, token_mean)
    summary = {
        "split_points": list(split_points),
        "num_stages": resolved.num_stages,
        "local_stages": list(resolved.local_stages),
        "schedule": plan.schedule_name,
        "num_microbatches": plan.num_microbatches,
        "loss": loss_combination(token_mean),  # pipeline/loss.py
        "transfers": [dataclasses.asdict(t) | {"dtype": str(t.dtype)} for t in transfers],
        "collectives": {name: collective_summary(c) for name, c in colls.items()},
        # Per training step of this rank: each program's collectives times its runs in the schedule.
        "runs_per_step": runs,
        "collectives_per_step": per_step(colls, runs),
        "gradient_reductions_per_step": per_step(reductions, runs),
        # A custom schedule's own idle fraction with equal stages (the built-in ones' formula).
        "analytic_bubble": equal_stage_bubble(schedule) if isinstance(plan.schedule, CustomSchedule) else
        analytic_bubble(resolved.num_ranks, plan.num_microbatches, plan.stages_per_rank, plan.schedule),
    }
    if auto_report is not None:
        summary["auto_split"] = auto_report
    dumper.text("schedule.txt", format_schedule(schedule) + "\n")
    dumper.json("pipeline.json", summary)
    summary["pass_seconds"] = pass_seconds  # after the dump: seconds differ between runs
    summary["repeated_blocks"] = lowered.repeated_blocks  # capture's choice: the graph is the same either way
    _release_other_stages(module, state, programs)
    if rank == 0:
        log.info("[pipeline] %d stages at %s, schedule %s", resolved.num_stages, list(split_points), plan.schedule_name)
        if not pipe.warned_clipping:
            pipe.warned_clipping = True
            log.warning("pipeline: clip gradients with model.clip_grad_norm_(max_norm); "
                        "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) sees only this rank's stages, "
                        "so each pp rank would clip by its own norm instead of the model's")
    progress.done(f"{len(programs)} stage program{'s' if len(programs) != 1 else ''} on this rank")
    stage_programs = [p for program in programs.values() for p in variants_of(program)]
    drawn = {axis for p in stage_programs for axis in replicated_random_axes(p.forward_gm, state.mesh)}
    random_axes = tuple(a for a in state.mesh.mesh_dim_names if a in drawn)
    return PipelineEntry(tuple(split_points), stages, programs, executor, schedule, summary, random_axes,
                         lowered.reads)


def gradient_variants(graph: StageGraph, num_microbatches: int, deferred: tuple[str, ...]) -> dict[str, StageGraph]:
    """The variants of a stage's graph that its micro-batches run, by name suffix
    (passes/pipeline_split.py); ``deferred``: the parameters whose reduction it defers. One program
    with one micro-batch, or when the stage makes no parameter gradient (nothing to sum)."""
    if num_microbatches == 1 or not any(i.kind == OutputKind.GRAD for i in graph.outputs):
        return {"": graph}

    def variant(**how) -> StageGraph:
        return gradient_variant(graph, compat.copy_graph_module(graph.gm), **how)

    variants = {FIRST: variant(reduce=False, running_sums=False), "": variant(reduce=True, running_sums=True)}
    if deferred and num_microbatches > 2:
        variants[NO_SYNC] = variant(reduce=False, running_sums=True)
    return variants


def stage_program(built: dict[str, StageProgram], deferred: tuple[str, ...]) -> StageProgram:
    """What the executor holds for a stage, from its compiled variants (``gradient_variants``): the
    program its middle micro-batches run, with ``first`` and ``sync`` for the first and last one
    where they differ (runtime.program_for)."""
    if len(built) == 1:
        return built[""]
    if not deferred:  # the last micro-batch runs the middle ones' program
        return dataclasses.replace(built[""], first=built[FIRST])
    first = dataclasses.replace(built[FIRST], deferred=frozenset(deferred))
    if NO_SYNC not in built:  # two micro-batches: first and sync
        return dataclasses.replace(first, sync=built[""])
    return dataclasses.replace(built[NO_SYNC], deferred=frozenset(deferred), first=first, sync=built[""])


def _device_of(module: nn.Module, flat: list) -> torch.device:
    for x in [*flat, *module.parameters()]:
        if isinstance(x, torch.Tensor):
            return (x.to_local() if isinstance(x, DTensor) else x).device
    return torch.device("cpu")


def _release_other_stages(module: nn.Module, state, programs: dict[int, StageProgram]) -> None:
    """Drop the parameters no local stage reads: their memory is freed (state_dict and optimizers
    see only this rank's stages), their shapes are kept for later captures."""
    owned = {info.name for p in programs.values() for info in p.graph.inputs if info.kind == InputKind.PARAM}
    released = []
    for fqn, param in list(module.named_parameters()):
        if fqn in owned:
            continue
        owner_name, _, name = fqn.rpartition(".")
        state.released[fqn] = (tuple(param.shape), param.dtype, param.requires_grad,
                               (param.to_local() if isinstance(param, DTensor) else param).device)
        module.get_submodule(owner_name)._parameters[name] = None
        released.append(param)
    if released:
        forget_in_optimizers(released)


_RELEASED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_HOOK: list = []


def forget_in_optimizers(params: list[torch.Tensor]) -> None:
    """Optimizers built before the first step hold every parameter; before their next step they
    drop the released ones (and their state), so the memory is really freed."""
    for p in params:
        _RELEASED[id(p)] = p
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_drop_released))


def _drop_released(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if _RELEASED.get(id(p)) is not p]
        if len(kept) != len(group["params"]):
            for p in group["params"]:
                if _RELEASED.get(id(p)) is p:
                    optimizer.state.pop(p, None)
            group["params"] = kept
