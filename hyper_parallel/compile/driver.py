"""The compile driver: one input signature of a module → its compiled program.

    capture (fake global-shape tensors) → propagate (pre-propagation rewrites, layouts) → lower →
    passes → partition → SPMD check → summary and dumps

``capture_and_lower`` is the front half (what ``recompute="auto"`` and the pipeline path share);
``finish`` wraps the back half (``compile/programs.build_programs``: passes → partition → gate →
dumps → codegen, which the pipeline path runs once per stage and variant) with the SPMD check and
the summary. Every function takes a frozen ``compile.request.CompileRequest`` (what
the module's run-time state or a planner asks for) and returns what it built: nothing here changes
the module's run-time state or keeps state between calls (a caller's ``reusing_lowerings`` scope
keeps lowerings for the compiles inside it: compile/lowering_reuse.py). What the capture read of
the module (its attribute reads, which guard later calls) comes back in ``Lowered.reads`` /
``CompiledEntry.reads`` for the caller to record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from ..ir.kinds import InputKind, OutputKind
from ..compat import pytree
from ..cp.check import check_attention_stays_sharded
from .. import compat
from ..ir.graph import CapturedGraph, flat_paths, module_fqn_of
from .gc_freeze import older_objects_frozen
from . import lowering_reuse
from .repeated import capture_blocks_once, lower_blocks_once
from ..analysis.debug import Dumper, collective_summary, group_axis_names, layout_table
from .lower import lower
from .unplanned import find_unplanned, warn_unplanned
from ..analysis.memory import estimate_program
from ..passes import PassContext, run_rewrites
from ..plan import ResolvedPlan
from ..progress import Progress
from ..propagation import decision_cache
from ..propagation.engine import PropagationReport, propagate
from ..recompute import annotated_regions, capturing, forget_annotated_regions
from ..runtime.attribute_guards import recording_reads
from ..runtime.input_check import index_inputs
from ..runtime.profiled import Ranges
from ..runtime.program import CompiledProgram, flatten_placeholders
from ..runtime.random_state import replicated_random_axes
from ..distributed.spmd import check_spmd_on_mesh
from ..ir import meta
from .programs import build_programs
from .request import CompileRequest
from .signature import capture_device, current_rank


log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompiledEntry:
    """One compiled input signature: the program plus what the dumps and reports show."""

    captured: CapturedGraph
    resolved: ResolvedPlan
    program: CompiledProgram
    report: PropagationReport
    summary: dict
    index_inputs: tuple = ()  # runtime.input_check.IndexInput: ids and labels checked before each call
    # (flat output index, sub-mesh, placements): outputs returned as DTensors over the
    # non-data-parallel axes they stay sharded on (see returned_shardings).
    returned: tuple = ()
    # summary["memory"] when a compile that dumps nothing left it out: estimated on first request
    # (a replay of both programs; explain prices memory with the optimizer itself).
    estimate_memory: Callable[[], dict] | None = None
    # Mesh axes over which a random op of the forward has a replicated output: the ranks of each
    # draw from one generator state (runtime/random_state.py).
    random_axes: tuple[str, ...] = ()
    # Module attributes the captured forward read (runtime/attribute_guards.py): the caller guards
    # later calls on their values.
    reads: tuple = ()

    def full_summary(self) -> dict:
        """``summary`` with its ``"memory"`` estimate."""
        if "memory" not in self.summary and self.estimate_memory is not None:
            self.summary["memory"] = self.estimate_memory()
        return self.summary


def returned_shardings(mesh, resolved: ResolvedPlan, report: PropagationReport) -> tuple:
    """The user outputs propagation left sharded on a non-data-parallel axis (vocab-parallel
    logits): each with the sub-mesh of those axes and its placements there, so the runtime returns
    it as a DTensor over them. On the data-parallel axes every output is this rank's part of the
    batch, as a plain tensor is without them."""
    names = tuple(mesh.mesh_dim_names or ())
    free = tuple(a for a in names if a not in resolved.data_parallel_axes)
    if not free:
        return ()
    result = []
    for index, placements in sorted(report.output_placements.items()):
        on_free = tuple(placements[names.index(a)] for a in free)
        if any(isinstance(p, Shard) for p in on_free):
            sub_mesh = mesh[free] if len(free) > 1 else mesh[free[0]]
            result.append((index, sub_mesh, on_free))
    return tuple(result)


def data_parallel_tangent_scales(mesh, resolved: ResolvedPlan, report: PropagationReport) -> dict[int, float]:
    """Flat user-output index -> 1/N for each output returned as this rank's part of the batch,
    N the number of data-parallel ranks it is split over (Shard on those axes).

    A caller that computes its loss from such an output (logits -> cross-entropy, outside the
    model) computes it on its own rows, a per-rank loss, as it would under DDP or FSDP2. Those
    average the ranks' gradients, so a per-rank mean gives the gradient of the global mean, one
    device's. The program sums the ranks' contributions (right for the global loss it returns), so
    the gradient arriving for such an output is scaled by 1/N: the same training loop trains the
    same under hyper_parallel as under DDP, instead of with N times the gradient."""
    names = tuple(mesh.mesh_dim_names or ())
    scales = {}
    for index, placements in report.output_placements.items():
        ranks = math.prod(mesh.size(i) for i, (axis, p) in enumerate(zip(names, placements))
                          if axis in resolved.data_parallel_axes and isinstance(p, Shard))
        if ranks > 1:
            scales[index] = 1.0 / ranks
    return scales


def _input_placements(resolved: ResolvedPlan, paths, flat) -> dict[str, tuple]:
    """Layouts of the user's tensor inputs: plan.inputs, else Shard(0) over the data-parallel axes."""
    return {
        path: resolved.input_placements(path, x.dim())
        for path, x in zip(paths, flat)
        if isinstance(x, torch.Tensor)
    }


def _global_shape(local_shape, placements, mesh) -> tuple[int, ...]:
    shape = list(local_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.size(axis)
    return tuple(shape)


@dataclasses.dataclass
class Lowered:
    """The front half of a compile (capture, propagate, lower) for one input signature: what the
    passes start from. ``recompute="auto"`` runs the passes on copies of it, once per candidate."""

    captured: CapturedGraph
    resolved: ResolvedPlan  # with this signature's input layouts
    report: PropagationReport
    local: torch.fx.GraphModule
    input_placements: dict
    annotated: dict  # hp.checkpoint / hp.swap calls seen while capturing
    rewrite_seconds: dict  # seconds per pre-propagation rewrite
    # "2 of 32 blocks of model.layers traced" when capture copied blocks, "..., propagated and
    # lowered" when their layouts and lowering were copied too (compile/repeated/lowering.py)
    repeated_blocks: str = ""
    # (object, attribute, label) of each module attribute the forward read while captured
    # (runtime/attribute_guards.recording_reads), for the caller to guard
    reads: tuple = ()


@contextlib.contextmanager
def training_grad_mode():
    """Compile a pipeline's stage programs as for training, whatever grad mode the step that
    compiles comes in: a first step under ``torch.no_grad()`` (an evaluation before training)
    captured stages without a backward, which training then reused. A step without gradients runs
    the forward steps of the same programs (pipeline/runtime.py, ``forward_only``)."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def capture_and_lower(
    module: nn.Module, request: CompileRequest, args, kwargs, flat, dumper: Dumper, wrap_forward=None,
    progress: Progress | None = None,
) -> Lowered:
    """``wrap_forward``: a context manager factory that changes what the module's forward returns
    while it is captured (the pipeline's loss). Inside a ``lowering_reuse.reusing_lowerings``
    scope a lowering whose inputs match an earlier one's is a copy of it (compile/lowering_reuse.py).
    ``progress``: where each phase's seconds go (the rank-0 progress lines), or None. The module runs as ``request.original_cls`` while captured,
    on fake parameters; on return it is as it was."""
    progress = progress or Progress(f"compile {request.model_name}", enabled=False)
    # Inside the planner's reuse scope a compile whose capture, propagation and lowering would be
    # another's (a recompute mode of the same configuration) takes a copy of that one's.
    reuse = lowering_reuse.active_reuse() if wrap_forward is None and not dumper.dir else None
    reuse_key = reuse.key_for(module, request, flat, pytree.tree_flatten((args, kwargs))[1]) if reuse else None
    if reuse is not None:
        kept = reuse.get(reuse_key)
        if kept is not None:
            progress.record("capture", 0.0, "lowering reused")
            return kept
    lowered = _capture_and_lower(module, request, args, kwargs, flat, dumper, wrap_forward, progress)
    if reuse is not None:
        reuse.put(reuse_key, lowered)
    return lowered


def _capture_and_lower(module, request, args, kwargs, flat, dumper, wrap_forward, progress) -> Lowered:
    mesh = request.mesh
    resolved_plan = request.resolved
    # DTensor's cached decisions hold the mesh they were made for and match any equal mesh.
    decision_cache.sharding_caches_for(mesh)
    paths = flat_paths((args, kwargs))
    input_placements = _input_placements(resolved_plan, paths, flat)
    resolved = dataclasses.replace(resolved_plan, inputs={**resolved_plan.inputs, **input_placements})

    # Capture on fake tensors of the *global* shapes: single-device semantics, no real memory.
    fake_mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        # An input that requires grad gets its gradient (a pipeline stage's activations).
        fake_flat = [
            torch.empty(_global_shape(x.shape, input_placements[p], mesh), dtype=x.dtype, device=capture_device(x),
                        requires_grad=x.requires_grad)
            if isinstance(x, torch.Tensor) else x
            for p, x in zip(paths, flat)
        ]
        # FSDP mixed precision: a parameter computes in its unit's param_dtype.
        compute_dtypes = resolved_plan.fsdp.compute_dtypes(
            {fqn: spec[1] for fqn, spec in request.parameters.items()}) if resolved_plan.fsdp else {}
        fake_state = {
            fqn: nn.Parameter(
                torch.empty(shape, dtype=compute_dtypes.get(fqn, dtype), device=device), requires_grad=requires_grad,
            )
            for fqn, (shape, dtype, requires_grad, device) in request.parameters.items()
        }
        fake_state.update({
            fqn: torch.empty(t.shape, dtype=t.dtype, device=capture_device(t)) for fqn, t in module.named_buffers()
        })
    fake_args, fake_kwargs = pytree.tree_unflatten(fake_flat, pytree.tree_flatten((args, kwargs))[1])
    module.__class__, parallel_cls = request.original_cls, module.__class__
    reads: list = []  # module attributes the forward reads: guarded per call (runtime/attribute_guards.py)
    try:
        started = time.perf_counter()
        with recording_reads(module, reads):
            with compat.reparametrize_module(module, fake_state, tie_weights=True), capturing(), \
                    (wrap_forward() if wrap_forward else contextlib.nullcontext()):
                blocks = capture_blocks_once(
                    module, fake_args, fake_kwargs, resolved_plan.modules, resolved_plan.experts,
                    request.options.repeated_blocks, forget_annotated_regions)
                annotated = annotated_regions()
        progress.record("capture", time.perf_counter() - started, blocks.traced)
    finally:
        module.__class__ = parallel_cls
    for graph in (blocks.captured, blocks.two, blocks.pristine):
        if graph is not None:
            _name_tied_parameters(graph, module)
    if dumper.dir:
        dumper.graph("captured", blocks.full().gm)

    storage_dtypes = {fqn: spec[1] for fqn, spec in request.parameters.items()}
    timings: dict = {}

    def front_end(graph: CapturedGraph, on_rewrite, check_rewritten=None) -> tuple:
        """Rewrites, propagation and lowering of ``graph``: (propagation report, lowered graph).
        ``check_rewritten(graph)`` runs between the rewrites and propagation (it may raise)."""
        with progress.phase("propagation"):
            run_rewrites(graph, PassContext(mesh=mesh, resolved=resolved, storage_dtypes=storage_dtypes,
                                            fsdp=resolved.fsdp, disable_passes=request.options.disable_passes,
                                            on_pass=on_rewrite, timings=timings))
            if check_rewritten is not None:
                check_rewritten(graph)
            report = propagate(graph, resolved, mesh)
            check_attention_stays_sharded(graph.gm, resolved.context, mesh)
        with progress.phase("lowering"):
            # A pipeline's stages read different inputs: each input enters on its own there.
            return report, lower(graph, mesh, resolved.context, stack_inputs=wrap_forward is None)

    copied = None
    if blocks.two is not None:
        copied = lower_blocks_once(blocks.two, blocks.blocks, front_end,
                                   dumper.rewrite if dumper.dir else None, resolved.context, progress)
    traced = blocks.traced
    if copied is not None:
        captured, report, local = copied.captured, copied.report, copied.local
        traced += ", propagated and lowered"
    else:
        timings.clear()
        captured = blocks.full()
        report, local = front_end(captured, dumper.rewrite)
    dumper.graph("lowered", local)
    return Lowered(captured, resolved, report, local, input_placements, annotated, timings, traced, tuple(reads))


def _name_tied_parameters(captured: CapturedGraph, module: nn.Module) -> None:
    """A parameter shared by several modules (tied embedding and output head) may be captured under
    any of its names; use the one ``named_parameters()`` gives, which is the one that holds it."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        aliases[fqn] = canonical.setdefault(id(p), fqn)
    captured.inputs[:] = [
        dataclasses.replace(i, name=aliases.get(i.name, i.name)) if i.kind == InputKind.PARAM else i for i in captured.inputs
    ]
    captured.outputs[:] = [
        dataclasses.replace(o, name=aliases.get(o.name, o.name)) if o.kind == OutputKind.GRAD else o for o in captured.outputs
    ]


@older_objects_frozen()
def compile_program(module: nn.Module, request: CompileRequest, args, kwargs, flat) -> CompiledEntry:
    """One input signature of ``module`` compiled as ``request`` asks (the module docstring)."""
    dumper = Dumper(request.options.dump_dir, current_rank())
    progress = Progress(f"compile {request.model_name}")
    lowered = capture_and_lower(module, request, args, kwargs, flat, dumper, progress=progress)
    entry = finish(request, lowered, dumper, progress=progress)
    progress.done(_collective_count(entry.summary))
    return entry


def _collective_count(summary: dict) -> str:
    per_step = summary["collectives_per_step"]
    count = sum(entry["count"] for by_axis in per_step.values() for entry in by_axis.values())
    return f"{count} collective{'s' if count != 1 else ''} per step"


def finish(
    request: CompileRequest, lowered: Lowered, dumper: Dumper, local: torch.fx.GraphModule | None = None,
    progress: Progress | None = None, activation=None,
) -> CompiledEntry:
    """The back half of a compile: passes, partition, SPMD check, summary and dumps. ``local``: the
    lowered graph to run the passes on (default: ``lowered.local`` itself); ``progress``: where
    each phase's seconds go, or None; ``activation``: the recompute/swap plan to run the passes
    with (default: the request's)."""
    progress = progress or Progress(f"compile {request.model_name}", enabled=False)
    mesh = request.mesh
    resolved_plan = request.resolved
    captured = lowered.captured
    pass_seconds = dict(lowered.rewrite_seconds)
    started = time.perf_counter()
    run_seconds: dict = {}
    partition_started: list[float] = []

    def before_partition(gm: torch.fx.GraphModule) -> None:
        progress.record("passes", time.perf_counter() - started,
                        ", ".join(f"{name} {s:.2f}" for name, s in run_seconds.items()))
        if dumper.dir:
            dumper.text("layouts.tsv", layout_table(gm))
        flatten_placeholders(gm, captured)
        partition_started.append(time.perf_counter())

    built = build_programs(request, lowered.local if local is None else local, lowered.annotated, dumper,
                           captured.num_forward_outputs, timings=run_seconds, activation=activation,
                           before_partition=before_partition)
    pass_seconds.update(run_seconds)
    program = CompiledProgram.from_programs(built.forward_gm, built.backward_gm, captured)
    progress.record("partition", time.perf_counter() - partition_started[0])
    program.tangent_scales = data_parallel_tangent_scales(mesh, resolved_plan, lowered.report)
    if built.generator is not None:
        program.generator = built.generator
        for phase in ("forward", "backward"):
            program.runnable(phase)  # outlined now, so its dump sits with the others; compiled on first call

    axis_of_group = group_axis_names(mesh, resolved_plan.fsdp, resolved_plan.context)
    fsdp_units = tuple(sorted(set(resolved_plan.fsdp.unit_of.values()))) if resolved_plan.fsdp else ()
    program.ranges = Ranges(axis_of_group, fsdp_units)  # named profiler ranges (runtime/profiled.py)
    colls = built.collectives
    with progress.phase("SPMD check"):
        digest = check_spmd_on_mesh(colls, mesh)
    memory_series = [] if dumper.dir else None  # live bytes per moment, for the report's plot
    # No optimizer state (memory_report(opt) adds it); estimated now only for the dumps.
    memory = estimate_program(program, captured, series=memory_series) if dumper.dir else None
    summary = {
        "collectives": {name: collective_summary(c) for name, c in colls.items()},
        "collectives_per_step": collective_summary(colls["forward"] + colls["backward"]),
        "saved_for_backward": _saved_summary(program),
        "fallbacks": lowered.report.fallbacks,
        "plan_redistributions": lowered.report.boundaries,
        "unplanned_collectives": find_unplanned((program.forward_gm, program.backward_gm), axis_of_group,
                                                resolved_plan),
        "mesh": {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names)},
        "spmd_hash": digest,
        "inputs": {p: [str(pl) for pl in v] for p, v in lowered.input_placements.items()},
    }
    if memory is not None:
        summary["memory"] = memory.as_dict()
        dumper.json("summary.json", summary)
        # For `hyper-parallel report`.
        dumper.report_data(program, mesh, resolved_plan.fsdp, memory, memory_series, context=resolved_plan.context)
    if current_rank() == 0:
        warn_unplanned(summary["unplanned_collectives"])
    # Seconds differ between runs: only in the in-memory summary (and the log), never in a dump.
    summary["pass_seconds"] = pass_seconds
    summary["repeated_blocks"] = lowered.repeated_blocks  # capture's choice: the graph is the same either way
    if current_rank() == 0:
        log.debug("[compile] %s", summary["collectives_per_step"])
        log.debug("[compile] seconds per rewrite and pass: %s", {k: round(v, 4) for k, v in pass_seconds.items()})
    return CompiledEntry(captured, lowered.resolved, program, lowered.report, summary, index_inputs(captured),
                         returned_shardings(mesh, resolved_plan, lowered.report),
                         lambda: estimate_program(program, captured).as_dict(),
                         replicated_random_axes(program.forward_gm, mesh), lowered.reads)


@older_objects_frozen()
def compile_within_budget(module: nn.Module, request: CompileRequest, args, kwargs, flat) -> CompiledEntry:
    """``recompute="auto"``: among ``request.auto_candidates`` (recompute.auto_candidates, each
    recomputing at least as much as the one before, none more than full recompute of every
    block), compile the first whose estimated peak (``summary["memory"]["peak"]``, the largest over
    ranks so every rank picks the same program) fits ``memory_budget_bytes``, found by bisection.

    Capture, propagation and lowering run once; each tried candidate runs only the passes (on a
    copy of the lowered graph) and the estimate. The dumps show the chosen candidate: its passes
    are re-run with the dumper at the end."""
    dumper = Dumper(request.options.dump_dir, current_rank())
    progress = Progress(f"compile {request.model_name}")
    lowered = capture_and_lower(module, request, args, kwargs, flat, dumper, progress=progress)
    silent = Dumper(None, current_rank())
    candidates = [entry for entry, _ in request.auto_candidates]
    tried: dict[int, int] = {}

    def activation_of(i: int):
        return request.auto_candidates[i][1]

    def peak(i: int) -> int:
        if i not in tried:
            entry = finish(request, lowered, silent, local=compat.copy_graph_module(lowered.local),
                           activation=activation_of(i))
            value = torch.tensor([entry.full_summary()["memory"]["peak"]], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
            tried[i] = int(value.item())
        return tried[i]

    budget = request.options.memory_budget_bytes
    last = len(candidates) - 1
    if peak(last) > budget:
        raise ValueError(
            f"recompute='auto': memory_budget_bytes={budget:,} cannot be met; recomputing every "
            f"block fully still peaks at {peak(last):,} bytes per rank (the smallest achievable "
            "with recompute). Raise the budget, shard more (fully_shard, tensor parallelism) or "
            "use a smaller batch"
        )
    lo, hi = 0, last
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    entry = finish(request, lowered, dumper, progress=progress, activation=activation_of(lo))
    progress.done(f"recompute='auto' chose candidate {lo} of {last + 1} after {len(tried)} trial compiles")
    entry.summary["recompute_auto"] = {
        "memory_budget_bytes": budget, "estimated_peak": tried[lo], "chosen": candidates[lo],
        "candidates_compiled": len(tried),
    }
    dumper.json("summary.json", {k: v for k, v in entry.summary.items() if k != "pass_seconds"})
    log.info("[recompute auto] %s", entry.summary["recompute_auto"])
    return entry


def _saved_summary(program: CompiledProgram) -> dict:
    """Bytes kept from forward to backward, and how many of them are gathered FSDP parameters."""
    from ..ir.ops import is_view_of_input
    from ..passes.reshard_after_forward import gathered_param_region

    region = gathered_param_region(program.forward_gm.graph)
    total = gathered = 0
    by_module: dict[str, dict[str, int]] = {}
    swapped = {"count": 0, "bytes": 0}  # kept in host memory by the swap pass
    for node in program.saved_for_backward():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or is_view_of_input(node):
            continue  # inputs (and views of them, such as t(weight)) are held anyway
        nbytes = compat.size_hint(val.numel()) * val.element_size()
        total += nbytes
        if node in region:
            gathered += nbytes
            continue
        if node.meta.get(meta.SWAP_COPY) == meta.SWAP_TO_HOST:
            swapped["count"] += 1
            swapped["bytes"] += nbytes
        entry = by_module.setdefault(module_fqn_of(node), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    # Activations by the module that computed them (gathered FSDP parameters counted apart).
    return {
        "bytes": total, "gathered_param_bytes": gathered, "swapped": swapped,
        "activations_by_module": dict(sorted(by_module.items())),
    }

