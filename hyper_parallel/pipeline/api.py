"""Pipeline parallelism in ``parallelize``: the stage mesh, the compile into stage programs, ``step``.

With ``ParallelPlan.pipeline`` every other part of the plan (tensor parallelism, FSDP, recompute,
swap) applies on the *stage mesh*: the mesh without the pp axis, i.e. the ranks that run the same
stages. The first ``pmodel.step(inputs, targets)`` for an input signature compiles:

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..ir.kinds import InputKind, OutputKind
from ..compat import pytree
from .. import compat
from ..codegen import generate
from ..ir.graph import flat_paths
from ..compile.gc_freeze import older_objects_frozen
from ..compile.driver import capture_and_lower, run_pass_pipeline, training_grad_mode
from ..compile.signature import current_rank, format_signature, signature
from ..debug import Dumper, collective_summary, collectives, group_axis_names
from ..ir import meta
from ..progress import Progress
from ..passes.pipeline_split import StageGraph, deferred_parameters, gradient_variant, split_stages
from ..runtime import agreement_gate
from ..runtime.agreement_gate import insert_gate
from ..runtime.autocast_state import autocast_state, describe as describe_autocast, programs_run_as_captured
from ..runtime.partition import partition_by_phase
from ..runtime.random_state import drawing_from, replicated_random_axes, shared_generator_state
from ..runtime.recompiles import describe_frozen
from ..runtime.input_check import empty_problem
from ..spmd import agree, check_spmd_on_mesh, digest_of
from .loss import expose_loss_count, loss_combination, loss_source
from .step_arguments import call_arguments, loss_of
from .plan import AUTO, DEFAULT_INPUT, TARGETS, BatchDimSpec, ResolvedPipeline
from .runtime import (
    PipelineExecutor, StageProgram, first_microbatches, flat_steps, program_for, split_stage_backward, sync_microbatches,
    variants_of,
)
from .schedules import (
    CustomSchedule, MetaStepType, analytic_bubble, equal_stage_bubble, format_schedule, simulate,
    split_backward_stages,
)

log = logging.getLogger(__name__)

# Name suffixes of a stage's variants (summary keys), and their dump folders / Inductor labels.
NO_SYNC = " (no sync)"
FIRST = " (first micro-batch)"
_VARIANT_FOLDERS = {NO_SYNC: "no_sync", FIRST: "first_microbatch"}


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


def stage_mesh(mesh, axis: str):
    """The mesh without ``axis``: this rank's slice, where the rest of the plan applies. With no
    other axis, a one-rank axis named "stage" (no collectives run on it)."""
    names = tuple(mesh.mesh_dim_names)
    others = tuple(n for n in names if n != axis)
    if others:
        return mesh[others] if len(others) > 1 else mesh[others[0]]
    return compat.unflatten_mesh_axis(mesh, axis, (mesh.size(0), 1), (axis, "stage"))["stage"]


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


def input_names(forward: Callable, num_args: int, kwargs: Mapping, with_targets: bool) -> list[str]:
    """The batch_dims name of each top-level input of a step: ``forward``'s parameter names for the
    positional ones (``[i]`` past them), the keys for the keyword ones, ``"targets"`` last when
    ``step`` appended the targets."""
    try:
        params = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"[{i}]" for i in range(num_args)]
    if with_targets and names:
        names[-1] = TARGETS
    return names + list(kwargs)


def forward_parameters(forward: Callable) -> set[str]:
    try:
        return set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return set()


def leaf_specs(args: tuple, kwargs: dict, names: list[str], batch_dims: Mapping[str, BatchDimSpec],
               forward: Callable) -> tuple[list[str], list[BatchDimSpec]]:
    """(label, BatchDimSpec) of every leaf of ``pytree.tree_flatten((args, kwargs))``, in order."""
    known = set(names) | forward_parameters(forward) | {DEFAULT_INPUT}
    unknown = sorted(set(batch_dims) - known)
    if unknown:
        raise ValueError(
            f"PipelinePlan(batch_dims=...) names {unknown}, which are neither inputs of this step nor "
            f"arguments of forward; this step's inputs are {names} ('*': every input not named)"
        )
    default = batch_dims.get(DEFAULT_INPUT, BatchDimSpec(0))
    labels, specs = [], []
    for name, value in zip(names, (*args, *kwargs.values())):
        spec = batch_dims.get(name, default)
        for path, _ in pytree.tree_flatten_with_path(value)[0]:
            labels.append(name + pytree.keystr(path))
            specs.append(spec)
    return labels, specs


def micro_batches(flat: list, num_microbatches: int, labels: list[str],
                  specs: list[BatchDimSpec] | None = None) -> list[list]:
    """Every tensor input cut into ``num_microbatches`` equal chunks along its batch dim (dim 0
    unless ``specs`` names another; contiguous); ``micro_batches[mb]``: the flat inputs of ``mb``."""
    specs = specs or [BatchDimSpec(0)] * len(flat)
    per_input = []
    for label, x, spec in zip(labels, flat, specs, strict=True):
        dim = spec.batch_dim
        if not isinstance(x, torch.Tensor) or dim is None:
            per_input.append([x] * num_microbatches)
            continue
        if dim >= x.dim():
            raise ValueError(
                f"pipeline: input {label!r} has shape {list(x.shape)}, with no batch dim {dim} to split into "
                f"micro-batches; set its PipelinePlan(batch_dims=...) entry ({spec!r} now), or "
                "BatchDimSpec(None) to give every micro-batch the whole tensor"
            )
        if x.shape[dim] % num_microbatches:
            raise ValueError(
                f"pipeline: input {label!r} has batch size {x.shape[dim]} on dim {dim} ({spec!r}, shape "
                f"{list(x.shape)}), which num_microbatches={num_microbatches} does not divide; use a local "
                "batch that is a multiple of num_microbatches"
            )
        chunks = x.chunk(num_microbatches, dim=dim)
        per_input.append(list(chunks) if dim == 0 else [c.contiguous() for c in chunks])
    return [[chunks[mb] for chunks in per_input] for mb in range(num_microbatches)]


def pipeline_step(module, inputs: Any, targets: Any = None) -> torch.Tensor:
    """``ParallelModule.step`` for a pipelined module (see :meth:`ParallelModule.step`)."""
    state = module._hp
    pipe: PipelineState = state.pipeline
    plan = pipe.resolved.plan
    _check_no_fsdp_flags(state)
    args, kwargs = call_arguments(inputs, targets, pipe.loss_fn)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    paths = flat_paths((args, kwargs))
    # Every rank of the whole mesh agrees on the step's inputs first (spmd.agree): a rank with
    # another batch shape would otherwise wait forever for its stage peers.
    state.calls += 1
    autocast = autocast_state()  # the stage programs hold the casts of the state they were captured in
    # Module attribute values the stage programs read (runtime/attribute_guards.py) pick them too.
    variant, values = state.attributes.variant()
    text = "\n".join([*(f"input '{p}': {format_signature(signature(x))}" for p, x in zip(paths, flat)),
                      f"autocast: {describe_autocast(autocast)}", f"module attribute values: variant {variant}"])
    changed = state.attributes.changes(pipe.last_variant, values) if variant != pipe.last_variant else ""
    problem = empty_problem(flat, lambda: paths) or _parameter_change_problem(module, pipe)
    # A step whose inputs found a compiled entry before waits for the exchange only before its first
    # transfer or collective (runtime/agreement_gate.py): the first stage starts computing at once.
    # Otherwise now: cutting micro-batches or compiling could raise or communicate on one rank.
    seen = (in_spec, tuple(signature(x) for x in flat), autocast, variant)
    agreement_gate.begin(agree(pipe.mesh, f"step {state.calls} of {state.original_cls.__name__}", digest_of(text),
                               lambda: text + (f" ({changed})" if changed else ""), problem,
                               timeout=state.options.timeout, wait=seen not in pipe.reused or problem is not None))
    try:
        # Each tensor input is cut along its batch dim (PipelinePlan.batch_dims, else dim 0).
        forward = state.original_cls.forward.__get__(module)
        names = input_names(forward, len(args), kwargs, pipe.loss_fn is not None)
        labels, specs = leaf_specs(args, kwargs, names, plan.batch_dims, forward)
        mbs = micro_batches(flat, plan.num_microbatches, labels, specs)

        key = (in_spec, tuple(signature(x) for x in mbs[0]), autocast, variant)
        entry = pipe.cache.get(key)
        if entry is None:
            state.attributes.remember(values)
            if changed and current_rank() == 0:
                log.info("recompiling the %s pipeline: module attributes the stage programs read changed: %s",
                         state.original_cls.__name__, changed)
            mb_args, mb_kwargs = pytree.tree_unflatten(mbs[0], in_spec)
            with training_grad_mode():
                entry = pipe.cache[key] = compile_pipeline(module, mb_args, mb_kwargs, mbs[0])
        pipe.last, pipe.last_variant = entry, variant
        pipe.reused.add(seen)
        # Replicated dropout draws alike on its stage peers, once for the whole step (random_state.py).
        shared = None
        if entry.random_axes:  # a collective: after the agreement
            agreement_gate.await_agreement()
            shared = shared_generator_state(state.mesh, entry.random_axes)
        # Under torch.no_grad() / inference_mode a step is an evaluation: the forward of every
        # micro-batch and the loss, no backward (it used to run backward and add gradients anyway,
        # which the next training step's optimizer then applied).
        forward_only = not torch.is_grad_enabled()
        with programs_run_as_captured(), drawing_from(state.mesh.device_type, shared):
            loss, count, grads = entry.executor.run(module, mbs, forward_only=forward_only)
        agreement_gate.await_agreement()  # a stage that ran no transfer or collective waits here
        loss, count = _broadcast_loss(pipe, loss, count, entry)
        if count is not None:  # the gradients are of the summed loss (pipeline/loss.py)
            for g in grads.values():
                g.div_(count)
        _accumulate_gradients(module, grads)
        if state.options.dump_dir:
            _dump_timeline(state, entry)
        return loss
    finally:
        agreement_gate.await_agreement()


def _parameter_change_problem(module, pipe: PipelineState) -> str | None:
    """Every rank captures the whole model, the parameters other stages hold with the flags and
    dtypes they had when split off, so a change of requires_grad or dtype after the first step
    cannot be compiled consistently: refused (on every rank, through the agreement) rather than
    ignored (a parameter unfrozen then would silently get no gradient)."""
    params = {fqn: (p.requires_grad, p.dtype) for fqn, p in module.named_parameters()}
    if pipe.param_state is None:
        pipe.param_state = params
    changed = sorted(fqn for fqn in params if params[fqn] != pipe.param_state.get(fqn))
    if not changed:
        return None
    return (f"requires_grad or dtype changed on {describe_frozen(changed)} after the first step, which a "
            "pipeline plan does not support yet: its stage programs were captured with the values of "
            "then. Set them before the first step, or parallelize a fresh model")


def _check_no_fsdp_flags(state) -> None:
    """The FSDP methods that change the compiled program are not wired into stage programs yet:
    refuse them rather than ignore them."""
    changed = state.fsdp_flags.changed()
    if state.gathered.units:
        changed.append("unshard")
    if changed:
        raise ValueError(
            f"{', '.join(changed)} is not supported with a pipeline plan yet: pmodel.step() already "
            "accumulates the micro-batches' gradients; leave these at their defaults"
        )


def _dump_timeline(state, entry: PipelineEntry) -> None:
    """``pipeline_trace.json``: this rank's measured compute steps of the last step as a Chrome
    trace (one row per stage; the gaps are the bubble), for Perfetto / chrome://tracing."""
    timing = entry.executor.last_timing
    rank = current_rank()
    events = [
        {"name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": rank, "tid": f"stage {stage}",
         "cat": "forward" if name.startswith("F") else "backward"}
        for name, stage, start, end in timing.events
    ]
    events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    Dumper(state.options.dump_dir, rank).json("pipeline_trace.json", {
        "traceEvents": events,
        "otherData": {"schedule": entry.summary["schedule"], "measured_bubble": timing.bubble_fraction(),
                      "analytic_bubble": entry.summary["analytic_bubble"], "step_s": timing.step_s},
    }, indent=None)


def _accumulate_gradients(module: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Add the step's local gradients into each parameter's DTensor ``.grad`` (like ``backward``)."""
    for fqn, p in module.named_parameters():
        g = grads.get(fqn)
        if g is None:
            continue
        local = compat.plain_tensor(p)
        if (g.dtype, g.device) != (local.dtype, local.device):
            g = g.to(dtype=local.dtype, device=local.device)
        if isinstance(p, DTensor):  # laid out as its parameter (no from_local: a new spec each step)
            g = compat.dtensor_from_spec(g, compat.spec_of(p))
        p.grad = g if p.grad is None else p.grad + g


def _broadcast_loss(pipe: PipelineState, loss: torch.Tensor | None, count: torch.Tensor | None,
                    entry: PipelineEntry) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every pp rank gets the loss and, for a token-mean loss, the step's token count, both
    computed on the last stage's rank (one broadcast of the pair)."""
    last_rank = (pipe.resolved.num_stages - 1) % pipe.resolved.num_ranks
    executor = entry.executor
    pair = torch.empty(2, dtype=executor.loss_dtype, device=executor.device)
    if loss is not None:
        pair[0] = loss
        pair[1] = count if count is not None else 0
    if pipe.resolved.num_ranks > 1:
        dist.broadcast(pair, src=dist.get_global_rank(pipe.pp_group, last_rank), group=pipe.pp_group)
    return pair[0], (pair[1] if executor.token_mean else None)


@older_objects_frozen()
def compile_pipeline(module, args: tuple, kwargs: dict, flat: list) -> PipelineEntry:
    """Compile one micro-batch signature into this rank's stage programs (module docstring)."""
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
    state.attributes.add(list(lowered.reads))
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
    axis_of_group = group_axis_names(state.mesh, state.resolved.fsdp, state.resolved.context)
    reductions = {}
    for s in resolved.local_stages:
        graph = stages[s]
        # Gradients summed by the programs and reduced once per step (passes/pipeline_split.py): the
        # variant of the stage's last micro-batch keeps the plain names and dump folders, the others
        # are beside it. One micro-batch: the plain graph.
        deferred = deferred_parameters(graph) if plan.num_microbatches > 1 else ()
        variants = gradient_variants(graph, plan.num_microbatches, deferred)
        built = {}
        for suffix, variant in variants.items():
            folder = os.path.join(f"stage{s}", _VARIANT_FOLDERS[suffix]) if suffix else f"stage{s}"
            dump_dir = state.options.dump_dir
            stage_dumper = Dumper(os.path.join(dump_dir, folder) if dump_dir else None, rank)
            stage_dumper.graph("split", variant.gm)
            seconds = pass_seconds[f"stage{s}{suffix}"] = {}
            gm = run_pass_pipeline(request, variant.gm, lowered.annotated, stage_dumper.graph, seconds,
                                   backward_reordered=s in split_backward)
            forward_gm, backward_gm, _ = partition_by_phase(gm, variant.num_forward_outputs)
            insert_gate(forward_gm)  # a reused step's agreement is waited for before the first collective
            stage_dumper.graph("forward", forward_gm)
            stage_dumper.graph("backward", backward_gm)
            program = StageProgram(s, forward_gm, backward_gm, variant, name_suffix=suffix)
            colls[f"stage{s} forward{suffix}"] = collectives(forward_gm, axis_of_group)
            backwards = {"backward": backward_gm}
            if s in split_backward:
                program.split = split_stage_backward(program)
                backwards = {"backward input": program.split.input_gm, "backward weight": program.split.weight_gm}
                stage_dumper.graph("backward_input", program.split.input_gm)
                stage_dumper.graph("backward_weight", program.split.weight_gm)
            compat.use_boxed_calling_convention(backward_gm)
            for name, bwd in backwards.items():  # the programs the schedule runs
                colls[f"stage{s} {name}{suffix}"] = collectives(bwd, axis_of_group)
                reductions[f"stage{s} {name}{suffix}"] = gradient_reductions(bwd, axis_of_group)
            if state.options.codegen == "inductor":
                programs_run = {"forward": forward_gm, **{k.replace(" ", "_"): v for k, v in backwards.items()}}
                label = f"stage{s}.{_VARIANT_FOLDERS[suffix]}" if suffix else f"stage{s}"  # a file name in dumps
                program.runners = {name: generate(gm, f"{label}.{name}", stage_dumper)
                                   for name, gm in programs_run.items()}
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
    return PipelineEntry(tuple(split_points), stages, programs, executor, schedule, summary, random_axes)


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


def gradient_reductions(gm: torch.fx.GraphModule, axis_of_group: dict) -> list:
    """The collectives of a program that reduce parameter gradients (``debug.Collective``): the
    all-reduces and reduce-scatters lowering made for a gradient slot (``hp_grad_of``) and the
    bucketing pass's fusions of them (``hp_bucket``)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return [c for c in collectives(gm, axis_of_group) if c.kind in _REDUCTIONS
            and (meta.GRAD_OF in nodes[c.node].meta or meta.BUCKET in nodes[c.node].meta)]


def per_step(per_program: dict[str, list], runs: dict[str, int]) -> dict:
    """``collective_summary`` of a step: each program's collectives times the runs it makes."""
    return collective_summary([c for name, colls in per_program.items() for c in colls * runs.get(name, 0)])


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
