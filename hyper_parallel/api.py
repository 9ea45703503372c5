"""``parallelize(model, plan, mesh)``: the user's entry point, and the module it returns.

The returned object *is* the user's model (its class is swapped for a subclass that also derives
from :class:`ParallelModule`, the way FSDP2 extends modules), so attribute access, ``isinstance``
and ``state_dict()`` keys are unchanged; its parameters become DTensors holding this rank's shards.
The first call with a given input signature (shapes, dtypes, non-tensor values) compiles:

    capture (fake global-shape tensors) → plan constraints → propagate → lower → passes →
    partition → SPMD check → dumps

and later calls with the same signature run the cached program.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Shard

from . import compat, options
from .capture import CapturedGraph, capture, flat_paths, module_fqn_of
from .debug import Dumper, collective_summary, collectives, group_axis_names, layout_table
from .fully_shard import (
    collect_recorded_fully_shard, link_units_to_root, recorded_prefetch, resolve_fully_shard,
)
from .init import distribute_parameters
from .lower import lower
from .memory import estimate_program
from .passes import PassContext, run_passes
from .plan import ResolvedPlan, collect_recorded_plan, merge_plans, resolve_plan
from .propagation.engine import PropagationReport, propagate
from .propagation.accumulation import GRAD_ACCUM
from .propagation.unshard import PREGATHERED
from .recompute import annotated_regions, auto_candidates, capturing, resolve_activation_plan
from .runtime.grad_accumulation import GradientAccumulator
from .runtime.program import CompiledProgram, flatten_placeholders
from .runtime.fsdp_methods import FsdpMethods
from .runtime.unshard import GatheredParams, watch_optimizers
from .runtime.collective_errors import reworded
from .runtime.input_check import empty_problem, index_inputs, index_problem
from .spmd import agree, check_spmd_on_mesh, digest_of

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


class _ParallelState:
    def __init__(
        self, resolved: ResolvedPlan, mesh, original_cls, parameters, *, dump_dir, disable_passes,
        prefetch_depth: int, gradient_bucket_bytes: int, activation, plan_swap, memory_budget_bytes,
        check_inputs: bool | None = None, timeout=None,
    ):
        self.resolved = resolved
        self.mesh = mesh
        self.original_cls = original_cls
        self.dump_dir = dump_dir
        self.disable_passes = frozenset(disable_passes)
        self.cache: dict[Any, CompiledEntry] = {}
        # Compile options.
        self.prefetch_depth = prefetch_depth
        self.gradient_bucket_bytes = gradient_bucket_bytes
        self.activation = activation  # recompute.ActivationPlan
        self.plan_swap = plan_swap  # the plan's swap entry (recompute="auto" re-resolves with it)
        self.memory_budget_bytes = memory_budget_bytes
        self.check_inputs = check_inputs  # None: ids and labels checked on the CPU only (input_check.py)
        self.timeout = timeout  # datetime.timedelta for this module's collectives, or None
        self.calls = 0  # calls so far, named in errors ("call 3")
        self.digests: dict = {}  # cache key -> digest exchanged by the per-call agreement
        # Program-changing flags (HSDPModule methods); each combination is compiled once.
        self.gradient_sync = True
        self.all_reduce = True
        self.reshard_after_forward: bool | None = None  # None: as the plan says
        self.reduce_op = "avg"
        self.accumulator = GradientAccumulator()  # FSDP gradients pending between micro-steps
        self.reshard_after_backward = True
        self.gathered = GatheredParams(parameters)  # by unshard(), or kept by backward for the next forward
        watch_optimizers(self.gathered)
        self.last: CompiledEntry | None = None  # the program the last call ran
        # Pipeline parallelism: parameters of stages other ranks run, released from this rank after
        # the split (FQN -> (global shape, dtype, requires_grad, device), for later captures).
        self.released: dict[str, tuple] = {}
        self.pipeline = None  # pipeline.api.PipelineState when the plan has a pipeline

    def all_parameters(self, module: nn.Module) -> dict[str, tuple]:
        """FQN -> (global shape, dtype, requires_grad, capture device) of every parameter of the
        model, the ones released by the pipeline split included."""
        specs = {
            fqn: (tuple(t.shape), t.dtype, t.requires_grad, _capture_device(t)) for fqn, t in module.named_parameters()
        }
        return {**specs, **self.released}

    def resolved_for_flags(self) -> ResolvedPlan:
        fsdp = self.resolved.fsdp
        if fsdp is None:
            return self.resolved
        units = fsdp.units
        if self.reshard_after_forward is not None:
            units = tuple(dataclasses.replace(u, reshard_after_forward=self.reshard_after_forward) for u in units)
        # Gradients pending from earlier micro-steps become inputs of this program, added to its
        # own gradients before they are reduced (propagation/accumulation.py).
        fsdp = dataclasses.replace(
            fsdp, units=units, gradient_sync=self.gradient_sync, all_reduce=self.all_reduce,
            accumulated=self.accumulator.pending, reduce_op=self.reduce_op,
            pregathered=tuple(sorted(self.gathered.units)),
            reshard_after_backward=self.reshard_after_backward,
        )
        return dataclasses.replace(self.resolved, fsdp=fsdp)


class ParallelModule(FsdpMethods, nn.Module):
    """Mixin added to the user's model class by :func:`parallelize`."""

    _hp: _ParallelState

    def forward(self, *args, **kwargs):  # noqa: D401 - same signature as the user's model
        if self._hp.pipeline is not None:
            raise RuntimeError(
                "a pipelined model trains through pmodel.step(inputs, targets) (forward and backward "
                "over all micro-batches); calling it directly is not supported"
            )
        entry, flat = _entry_for(self, args, kwargs)
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
            return _meta_outputs(entry)
        return _run(self, entry, flat)

    def step(self, inputs, targets=None) -> torch.Tensor:
        """Forward and backward of one training step; returns the (global, detached) loss and
        leaves the gradients in ``.grad`` (added to what is there, as ``backward`` does).
        ``inputs``: a tensor, a tuple of positional or a dict of keyword arguments of the model;
        ``targets``: the second argument of ``parallelize(loss_fn=...)`` (pipelines only). With a
        pipeline plan the local batch is split into its micro-batches and run on the schedule."""
        if self._hp.pipeline is not None:
            from .pipeline.api import pipeline_step

            return pipeline_step(self, inputs, targets)
        from .pipeline.api import loss_of, call_arguments

        args, kwargs = call_arguments(inputs, targets, None)
        loss = loss_of(self(*args, **kwargs))
        loss.backward()
        return loss.detach()

    def pipeline_report(self) -> dict:
        """The last pipeline step: schedule, split points, and the bubble fraction measured on
        every pp rank next to the schedule's analytic one. Collective over the pp axis."""
        from .pipeline.api import pipeline_report

        return pipeline_report(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors, DTensors or local shards into the sharded parameters (in place)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded parameters; use assign=False")
        from .state_dict import StateDictOptions, set_model_state_dict

        self._hp.gathered.clear()  # gathered from the old values
        return set_model_state_dict(self, state_dict, StateDictOptions(strict=strict))

    # --- what users and tests read -----------------------------------------------------------
    def compile_summary(self) -> dict:
        """The summary of the program the last call ran (collectives by kind/axis, fallbacks, ...);
        for a pipelined model, of the last step's stages (split points, transfers, collectives)."""
        pipe = self._hp.pipeline
        if pipe is not None:
            if pipe.last is None:
                raise RuntimeError("the module has not been compiled yet: run pmodel.step(...) once")
            return pipe.last.summary
        return self._last_entry().summary

    def compiled_programs(self) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """(forward, backward) GraphModules of the program the last call ran, for inspection."""
        entry = self._last_entry()
        return entry.program.forward_gm, entry.program.backward_gm

    def memory_report(self, optimizer=None) -> dict:
        """This rank's estimated memory for one training step of the program the last call ran
        (hyper_parallel.memory): parameters, gradients, optimizer state, saved activations, the
        forward / backward / optimizer-step peaks, the overall peak and the node (module, source
        line) where it is reached. ``optimizer``: the optimizer instance (its real state once it has
        stepped), or "sgd" / "sgd_momentum" / "adam" / "adamw"; None counts no optimizer state."""
        entry = self._last_entry()
        return estimate_program(entry.program, entry.captured, optimizer).as_dict()

    def _last_entry(self) -> CompiledEntry:
        if self._hp.pipeline is not None:
            raise RuntimeError("a pipelined model has one program per stage: see pipeline_report() and its dumps")
        if self._hp.last is None:
            raise RuntimeError("the module has not been compiled yet: call it once with real inputs")
        return self._hp.last


def _entry_for(module: "ParallelModule", args: tuple, kwargs: dict) -> tuple["CompiledEntry", list]:
    """The compiled entry for this call's input signature and the module's flags (compiled on a
    cache miss), made the module's last; and the flat inputs."""
    state = module._hp
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    resolved = state.resolved_for_flags()
    prefetch = recorded_prefetch(module) if resolved.fsdp is not None else {}
    # Train/eval mode changes the program (BatchNorm in eval normalises with its running statistics
    # and updates nothing; dropout is off): the root's mode and the modules set otherwise are flags.
    mode = ("train" if module.training else "eval",
            tuple(fqn for fqn, m in module.named_modules() if m.training != module.training))
    key = (in_spec, tuple(_signature(x) for x in flat), _flags_key(resolved) + (mode,), repr(prefetch))
    entry = state.cache.get(key)
    state.calls += 1
    # Every rank agrees on the program before running or compiling one (spmd.agree): a rank that
    # hits its cache while a peer compiles another signature would otherwise hang.
    if key not in state.digests:
        state.digests[key] = digest_of(_describe_call(key, flat, args, kwargs))
    paths = lambda: flat_paths((args, kwargs))  # noqa: E731 - only needed to word an error
    problem = empty_problem(flat, paths)
    if entry is not None and problem is None:
        problem = _index_problem(state, entry, flat)
    what = f"call {state.calls} of {state.original_cls.__name__}"
    describe = lambda: _describe_call(key, flat, args, kwargs)  # noqa: E731
    agree(state.mesh, what, state.digests[key], describe, problem, timeout=state.timeout)
    if entry is None:
        compile_fn = _compile_within_budget if state.activation.auto_blocks else _compile
        entry = compile_fn(module, state, resolved, args, kwargs, flat, prefetch)
        state.cache[key] = entry
        # Ids and labels could not be checked before the program existed: once more after compiling.
        if entry.index_inputs and state.check_inputs is not False:
            problem = _index_problem(state, entry, flat)
            agree(state.mesh, what, state.digests[key], describe, problem, timeout=state.timeout)
    state.last = entry
    return entry, flat


def _index_problem(state: _ParallelState, entry: CompiledEntry, flat) -> str | None:
    if state.check_inputs is False:
        return None
    return index_problem(entry.index_inputs, flat, force=bool(state.check_inputs))


def _describe_call(key, flat, args, kwargs) -> str:
    """The call signature the ranks agree on, one line per input (what an error shows)."""
    in_spec, signatures, flags, prefetch = key
    lines = [f"input '{p}': {format_signature(s)}" for p, s in zip(flat_paths((args, kwargs)), signatures)]
    return "\n".join([*lines, f"input structure: {in_spec}", f"FSDP flags: {flags}", f"prefetch: {prefetch}"])


def compile_for_inputs(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> None:
    """Compile ``module`` (returned by :func:`parallelize`) for the signature of ``args`` /
    ``kwargs`` (per-rank local inputs; meta or fake tensors are fine) as its first call would,
    without running it: ``compile_summary()``, ``compiled_programs()`` and ``memory_report()``
    then describe that program (planning, ``hyper_parallel.explain``)."""
    if not isinstance(module, ParallelModule):
        raise TypeError(f"compile_for_inputs needs a module returned by hp.parallelize, got {type(module).__name__}")
    _entry_for(module, tuple(args), dict(kwargs or {}))


def _flags_key(resolved: ResolvedPlan) -> tuple:
    fsdp = resolved.fsdp
    if fsdp is None:
        return ()
    return (
        fsdp.gradient_layout, fsdp.accumulated, fsdp.reduce_op, fsdp.pregathered, fsdp.reshard_after_backward,
        tuple(u.reshard_after_forward for u in fsdp.units),
    )


def _signature(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
    return ("const", type(x).__name__, repr(x))


def format_signature(signature: tuple) -> str:
    """``int64[4, 16] on cpu`` for a tensor's :func:`_signature`, ``int 3`` for a constant."""
    if signature[0] == "tensor":
        _, shape, dtype, requires_grad, device = signature
        text = f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"
        return text + (" requiring grad" if requires_grad else "")
    return f"{signature[1]} {signature[2]}"


def parallelize(
    model: nn.Module,
    plan: Any = None,
    mesh=None,
    *,
    dump_dir: str | None = None,
    disable_passes: tuple[str, ...] = (),
    prefetch_depth: int | None = None,
    bucket_cap_mb: float = 25,
    memory_budget_bytes: int | None = None,
    materialize: bool = True,
    loss_fn=None,
    check_inputs: bool | None = None,
    timeout=None,
) -> nn.Module:
    """Make ``model`` a distributed training program for ``plan`` on ``mesh`` (see docs/architecture.md §1).

    ``plan`` is a :class:`ParallelPlan`, the same as a nested dict, or None to use only the entries
    recorded by ``shard_module``/``parallelize_module``. The model's parameters are distributed now
    (from rank 0's values, so every rank starts identical); compilation happens on the first call.
    ``prefetch_depth``: FSDP units whose all-gather is issued ahead (default 1 on NCCL/HCCL, 0 on
    gloo); ``bucket_cap_mb``: size of the gradient all-reduce buckets of parameters FSDP does not
    own (DDP's option and default); ``memory_budget_bytes``: the per-rank peak that
    ``recompute="auto"`` must fit; ``disable_passes``: pass names to skip; ``dump_dir``: per-rank
    dumps of every stage. ``materialize=False``: a meta-device model keeps meta shards (planning
    only, see ``hyper_parallel.explain``: the module can be compiled and inspected, not run).
    ``loss_fn``: with a pipeline plan, ``loss_fn(output, target)`` gives the loss the last stage
    computes (else the model must return its loss); train with ``pmodel.step(inputs, targets)``.
    ``check_inputs``: check token ids and labels against the embedding's vocabulary and the loss's
    classes before each call (None:
    for inputs on the CPU, where it is free; True: also on accelerators, which synchronises the
    device; False: never). ``timeout``: seconds (or a timedelta) a collective of this module may wait
    for its peers before the call fails naming the program, collective and call (default: the
    process groups' own, 30 minutes on gloo, 10 on NCCL).

    Before distributing anything the ranks check that they resolved the same plan and options
    (a ValueError on every rank naming the difference, not a hang); every call likewise checks
    that all ranks run the same input signature.
    """
    bucket_cap_mb = options.check_bucket_cap_mb(bucket_cap_mb)
    prefetch_depth = options.check_int("prefetch_depth", prefetch_depth, minimum=0)
    memory_budget_bytes = options.check_memory_budget(memory_budget_bytes)
    check_inputs = options.check_check_inputs(check_inputs)
    timeout = options.check_timeout(timeout)
    if mesh is None:
        raise ValueError("parallelize needs a mesh: hp.init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))")
    if isinstance(model, ParallelModule):
        raise ValueError("this model is already parallelized; call parallelize on the original model once")
    recorded = collect_recorded_plan(model)
    full_plan = merge_plans(plan or {}, recorded) if plan is not None else recorded
    pipeline = None
    if full_plan.pipeline is not None:
        from .pipeline.api import PipelineState, stage_mesh
        from .pipeline.plan import resolve_pipeline

        # The rest of the plan applies within a stage: on the mesh without the pp axis.
        pipeline = PipelineState(resolve_pipeline(full_plan.pipeline, model, mesh), mesh, loss_fn)
        mesh = stage_mesh(mesh, pipeline.resolved.plan.axis)
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
    fully_shard_spec = full_plan.fully_shard or collect_recorded_fully_shard(model)
    if fully_shard_spec is not None:
        resolved = resolve_fully_shard(fully_shard_spec, model, resolved)
        # reshard_after_forward=<k>: the groups of k ranks backward gathers over (collective).
        from .passes.reshard_after_forward import attach_post_forward_groups

        resolved = dataclasses.replace(resolved, fsdp=attach_post_forward_groups(resolved.fsdp, mesh))
    prefetch_depth = _default_prefetch_depth(mesh) if prefetch_depth is None else prefetch_depth
    if timeout is not None:
        set_collective_timeout(pipeline.mesh if pipeline is not None else mesh, timeout)
    # Agree on the plan before parameters are distributed: differing plans would hang in there.
    settings = _describe_plan(resolved, activation, full_plan, prefetch_depth=prefetch_depth,
                              bucket_cap_mb=bucket_cap_mb, disable_passes=sorted(disable_passes),
                              check_inputs=check_inputs, timeout=timeout, loss_fn=loss_fn is not None)
    agree(pipeline.mesh if pipeline is not None else mesh, f"parallelize({type(model).__name__})",
          digest_of(settings), lambda: settings, timeout=timeout)
    dump_source = "dump_dir" if dump_dir else "HYPER_PARALLEL_DUMP_DIR"
    dump_dir = options.prepare_dump_dir(dump_dir or os.environ.get("HYPER_PARALLEL_DUMP_DIR"), _rank(), dump_source)
    distribute_parameters(model, resolved.param_placements, mesh, materialize=materialize)
    _offload_shards(model, resolved)
    original_cls = type(model)
    model.__class__ = type(f"Parallel{original_cls.__name__}", (ParallelModule, original_cls), {})
    model._hp = _ParallelState(
        resolved, mesh, original_cls, list(model.parameters()), dump_dir=dump_dir,
        disable_passes=disable_passes,
        prefetch_depth=prefetch_depth,
        gradient_bucket_bytes=int(bucket_cap_mb * 1024 * 1024), activation=activation,
        plan_swap=full_plan.swap, memory_budget_bytes=memory_budget_bytes,
        check_inputs=check_inputs, timeout=timeout,
    )
    model._hp.pipeline = pipeline
    link_units_to_root(model)
    return model


def set_collective_timeout(mesh, timeout) -> None:
    """Collectives over ``mesh``'s axes wait at most ``timeout`` for their peers."""
    for axis in range(mesh.ndim):
        compat.set_group_timeout(mesh.get_group(axis), timeout)


def _describe_plan(resolved: ResolvedPlan, activation, full_plan, **settings) -> str:
    """What every rank must agree on before parameters are distributed, one fact per line: each
    parameter's layout, the FSDP units, activation and pipeline plans, and the options."""
    unit_of = resolved.fsdp.unit_of if resolved.fsdp is not None else {}
    lines = [
        f"parameter {fqn}: {placements}" + (f", FSDP unit {unit_of[fqn]!r}" if fqn in unit_of else "")
        for fqn, placements in sorted(resolved.param_placements.items())
    ]
    if resolved.fsdp is not None:
        lines += [f"FSDP unit {u.module_fqn!r}: reshard_after_forward={u.reshard_after_forward}"
                  for u in resolved.fsdp.units]
    lines.append(f"activation: {activation!r}")
    lines.append(f"pipeline: {full_plan.pipeline!r}")
    lines += [f"option {k}: {v!r}" for k, v in sorted(settings.items())]
    # Reprs of callables (recompute policies) carry addresses that differ between processes.
    return re.sub(r" at 0x[0-9a-f]+", "", "\n".join(lines))


def _default_prefetch_depth(mesh) -> int:
    """FSDP units gathered ahead by default: 1, except 0 on gloo. With several gloo collectives in
    flight, workers crashed natively (heap corruption, SIGSEGV/SIGABRT) in about one full CI run out of
    four under load; the cause is not found yet (see the issue note). Prefetch is worth having on gloo
    too (FSDP step hp/FSDP2 0.84 with depth 1 vs 0.97 with 0, measured back to back), so
    ``parallelize(..., prefetch_depth=1)`` turns it on explicitly, as does the environment
    variable ``HYPER_PARALLEL_PREFETCH_DEPTH`` (for runs that cannot change the call)."""
    from_env = os.environ.get("HYPER_PARALLEL_PREFETCH_DEPTH")
    if from_env:
        if not from_env.isdigit():
            raise ValueError(f"HYPER_PARALLEL_PREFETCH_DEPTH must be a non-negative integer, got {from_env!r}")
        return int(from_env)
    if not dist.is_initialized():
        return 1
    return 0 if dist.get_backend(mesh.get_group(0)) == "gloo" else 1


def _offload_shards(model: nn.Module, resolved: ResolvedPlan) -> None:
    """CPU offload: FSDP shards (hence their gradients and optimizer state) live on the host."""
    from .fully_shard import CPUOffloadPolicy

    fsdp = resolved.fsdp
    if fsdp is None or not isinstance(fsdp.offload_policy, CPUOffloadPolicy):
        return
    for fqn, param in list(model.named_parameters()):
        local = param.to_local()
        if fqn in fsdp.unit_of and local.device.type != "cpu":
            host = local.detach().to("cpu")
            if fsdp.offload_policy.pin_memory and torch.cuda.is_available():
                host = host.pin_memory()
            owner_name, _, name = fqn.rpartition(".")
            dt = DTensor.from_local(host, param.device_mesh, param.placements, run_check=False)
            model.get_submodule(owner_name).register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _input_placements(resolved: ResolvedPlan, paths, flat) -> dict[str, tuple]:
    """Layouts of the user's tensor inputs: plan.inputs, else Shard(0) over the data-parallel axes."""
    return {
        path: resolved.input_placements(path, x.dim())
        for path, x in zip(paths, flat)
        if isinstance(x, torch.Tensor)
    }


def _compute_dtypes(module: nn.Module, resolved: ResolvedPlan) -> dict:
    """Parameter FQN -> the dtype it computes in (FSDP mixed precision's param_dtype)."""
    fsdp = resolved.fsdp
    policy = fsdp.mixed_precision if fsdp is not None else None
    if policy is None or policy.param_dtype is None:
        return {}
    return {
        fqn: policy.param_dtype
        for fqn, p in module.named_parameters()
        if fqn in fsdp.unit_of and p.is_floating_point()
    }


def _global_shape(local_shape, placements, mesh) -> tuple[int, ...]:
    shape = list(local_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.size(axis)
    return tuple(shape)


def _capture_device(t: torch.Tensor) -> torch.device:
    """The device a value is captured on: where it lives, so factory ops in the graph (positions,
    masks) and the swap pass's copies back name the device the program runs on. Meta tensors
    (planning) are captured on the CPU."""
    return torch.device("cpu") if t.device.type == "meta" else t.device


@dataclasses.dataclass
class _Lowered:
    """The front half of a compile (capture, propagate, lower) for one input signature: what the
    passes start from. ``recompute="auto"`` runs the passes on copies of it, once per candidate."""

    captured: CapturedGraph
    resolved: ResolvedPlan  # with this signature's input layouts
    report: PropagationReport
    local: torch.fx.GraphModule
    input_placements: dict
    annotated: dict  # hp.checkpoint / hp.swap calls seen while capturing


def _capture_and_lower(
    module: ParallelModule, state: _ParallelState, resolved_plan: ResolvedPlan, args, kwargs, flat,
    dumper: Dumper, wrap_forward=None,
) -> _Lowered:
    """``wrap_forward``: a context manager factory that changes what the module's forward returns
    while it is captured (the pipeline's loss)."""
    mesh = state.mesh
    paths = flat_paths((args, kwargs))
    input_placements = _input_placements(resolved_plan, paths, flat)
    resolved = dataclasses.replace(resolved_plan, inputs={**resolved_plan.inputs, **input_placements})

    # Capture on fake tensors of the *global* shapes: single-device semantics, no real memory.
    fake_mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        # An input that requires grad gets its gradient (a pipeline stage's activations).
        fake_flat = [
            torch.empty(_global_shape(x.shape, input_placements[p], mesh), dtype=x.dtype, device=_capture_device(x),
                        requires_grad=x.requires_grad)
            if isinstance(x, torch.Tensor) else x
            for p, x in zip(paths, flat)
        ]
        compute_dtypes = _compute_dtypes(module, resolved_plan)
        fake_state = {
            fqn: nn.Parameter(
                torch.empty(shape, dtype=compute_dtypes.get(fqn, dtype), device=device), requires_grad=requires_grad,
            )
            for fqn, (shape, dtype, requires_grad, device) in state.all_parameters(module).items()
        }
        fake_state.update({
            fqn: torch.empty(t.shape, dtype=t.dtype, device=_capture_device(t)) for fqn, t in module.named_buffers()
        })
    fake_args, fake_kwargs = pytree.tree_unflatten(fake_flat, pytree.tree_flatten((args, kwargs))[1])
    module.__class__, parallel_cls = state.original_cls, module.__class__
    try:
        with compat.reparametrize_module(module, fake_state, tie_weights=True), capturing(), \
                (wrap_forward() if wrap_forward else contextlib.nullcontext()):
            captured = capture(module, fake_args, fake_kwargs, resolved_plan.modules)
            annotated = annotated_regions()
    finally:
        module.__class__ = parallel_cls
    _name_tied_parameters(captured, module)
    dumper.graph("captured", captured.gm)

    storage_dtypes = {fqn: spec[1] for fqn, spec in state.all_parameters(module).items()}
    report = propagate(captured, resolved, mesh, storage_dtypes)
    local = lower(captured, mesh)
    dumper.graph("lowered", local)
    return _Lowered(captured, resolved, report, local, input_placements, annotated)


def _name_tied_parameters(captured: CapturedGraph, module: nn.Module) -> None:
    """A parameter shared by several modules (tied embedding and output head) may be captured under
    any of its names; use the one ``named_parameters()`` gives, which is the one that holds it."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        aliases[fqn] = canonical.setdefault(id(p), fqn)
    captured.inputs[:] = [
        dataclasses.replace(i, name=aliases.get(i.name, i.name)) if i.kind == "param" else i for i in captured.inputs
    ]
    captured.outputs[:] = [
        dataclasses.replace(o, name=aliases.get(o.name, o.name)) if o.kind == "grad" else o for o in captured.outputs
    ]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph passes may rewrite without touching ``gm`` (node meta copied shallowly)."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def run_pass_pipeline(state: _ParallelState, resolved_plan: ResolvedPlan, local, explicit_prefetch: dict,
                      activation, annotated: dict, on_pass) -> torch.fx.GraphModule:
    """The ordered passes over one lowered (or stage) joint graph with this module's options."""
    return run_passes(
        local, PassContext(
            mesh=state.mesh, fsdp=resolved_plan.fsdp, explicit_prefetch=explicit_prefetch,
            prefetch_depth=state.prefetch_depth,
            activation=dataclasses.replace(activation or state.activation, annotated=annotated),
            gradient_bucket_bytes=state.gradient_bucket_bytes,
            disable_passes=state.disable_passes,
            on_pass=on_pass,
        )
    )


def _compile(
    module: ParallelModule, state: _ParallelState, resolved_plan: ResolvedPlan, args, kwargs, flat,
    explicit_prefetch: dict, activation=None,
) -> CompiledEntry:
    """``activation``: the recompute/swap plan to compile with (default: the module's)."""
    dumper = Dumper(state.dump_dir, _rank())
    lowered = _capture_and_lower(module, state, resolved_plan, args, kwargs, flat, dumper)
    return _finish(state, resolved_plan, lowered, explicit_prefetch, activation, dumper)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _finish(
    state: _ParallelState, resolved_plan: ResolvedPlan, lowered: _Lowered, explicit_prefetch: dict, activation,
    dumper: Dumper, local: torch.fx.GraphModule | None = None,
) -> CompiledEntry:
    """The back half of a compile: passes, partition, SPMD check, summary and dumps. ``local``: the
    lowered graph to run the passes on (default: ``lowered.local`` itself)."""
    mesh = state.mesh
    captured = lowered.captured
    local = run_pass_pipeline(state, resolved_plan, lowered.local if local is None else local, explicit_prefetch,
                              activation, lowered.annotated, dumper.graph)
    dumper.text("layouts.tsv", layout_table(local))
    flatten_placeholders(local, captured)
    program = CompiledProgram.from_joint(local, captured)
    dumper.graph("forward", program.forward_gm)
    dumper.graph("backward", program.backward_gm)

    axis_of_group = group_axis_names(mesh, resolved_plan.fsdp)
    colls = {
        "forward": collectives(program.forward_gm, axis_of_group),
        "backward": collectives(program.backward_gm, axis_of_group),
    }
    digest = check_spmd_on_mesh(colls, mesh)
    memory_series = [] if dumper.dir else None  # live bytes per moment, for the report's plot
    memory = estimate_program(program, captured, series=memory_series)  # no optimizer state: memory_report(opt) adds it
    summary = {
        "collectives": {name: collective_summary(c) for name, c in colls.items()},
        "collectives_per_step": collective_summary(colls["forward"] + colls["backward"]),
        "saved_for_backward": _saved_summary(program),
        "fallbacks": lowered.report.fallbacks,
        "plan_redistributions": lowered.report.boundaries,
        "mesh": {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names)},
        "spmd_hash": digest,
        "inputs": {p: [str(pl) for pl in v] for p, v in lowered.input_placements.items()},
        "memory": memory.as_dict(),
    }
    dumper.json("summary.json", summary)
    dumper.report_data(program, mesh, resolved_plan.fsdp, memory, memory_series)  # for `hyper-parallel report`
    if _rank() == 0:
        log.info("[compile] %s", summary["collectives_per_step"])
    return CompiledEntry(captured, lowered.resolved, program, lowered.report, summary, index_inputs(captured))


def _compile_within_budget(
    module: ParallelModule, state: _ParallelState, resolved_plan: ResolvedPlan, args, kwargs, flat,
    explicit_prefetch: dict,
) -> CompiledEntry:
    """``recompute="auto"``: among :func:`recompute.auto_candidates` (each recomputing at least as
    much as the one before, none more than full recompute of every block), compile the first
    whose estimated peak (``summary["memory"]["peak"]``, the largest over ranks so every rank
    picks the same program) fits ``memory_budget_bytes``, found by bisection.

    Capture, propagation and lowering run once; each tried candidate runs only the passes (on a
    copy of the lowered graph) and the estimate. The dumps show the chosen candidate: its passes
    are re-run with the dumper at the end."""
    dumper = Dumper(state.dump_dir, _rank())
    lowered = _capture_and_lower(module, state, resolved_plan, args, kwargs, flat, dumper)
    silent = Dumper(None, _rank())
    candidates = auto_candidates(state.activation.auto_blocks)
    tried: dict[int, int] = {}

    def activation_of(i: int):
        return resolve_activation_plan(candidates[i], state.plan_swap, module)

    def peak(i: int) -> int:
        if i not in tried:
            entry = _finish(state, resolved_plan, lowered, explicit_prefetch, activation_of(i), silent,
                            local=copy_graph_module(lowered.local))
            value = torch.tensor([entry.summary["memory"]["peak"]], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
            tried[i] = int(value.item())
        return tried[i]

    budget = state.memory_budget_bytes
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
    entry = _finish(state, resolved_plan, lowered, explicit_prefetch, activation_of(lo), dumper)
    entry.summary["recompute_auto"] = {
        "memory_budget_bytes": budget, "estimated_peak": tried[lo], "chosen": candidates[lo],
        "candidates_compiled": len(tried),
    }
    dumper.json("summary.json", entry.summary)
    log.info("[recompute auto] %s", entry.summary["recompute_auto"])
    return entry


def _saved_summary(program: CompiledProgram) -> dict:
    """Bytes kept from forward to backward, and how many of them are gathered FSDP parameters."""
    from .passes.recompute import is_view_of_input
    from .passes.reshard_after_forward import gathered_param_region

    region = gathered_param_region(program.forward_gm.graph)
    total = gathered = 0
    by_module: dict[str, dict[str, int]] = {}
    swapped = {"count": 0, "bytes": 0}  # kept in host memory by the swap pass
    for node in program.saved_for_backward():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or is_view_of_input(node):
            continue  # inputs (and views of them, such as t(weight)) are held anyway
        nbytes = val.numel() * val.element_size()
        total += nbytes
        if node in region:
            gathered += nbytes
            continue
        if node.meta.get("hp_swap_copy") == "to_host":
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


def _run(module: ParallelModule, entry: CompiledEntry, flat) -> Any:
    captured = entry.captured
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    primals = []
    for info in captured.inputs:
        if info.kind == "param":
            p = params[info.name]
            primals.append(p.to_local() if isinstance(p, DTensor) else p)
        elif info.kind == "buffer":
            b = buffers[info.name]
            primals.append(b.to_local() if isinstance(b, DTensor) else b)
        elif info.kind == "input":
            primals.append(flat[info.index])
        elif info.kind == GRAD_ACCUM:
            primals.append(_pending_gradient(module._hp.accumulator, info.name, entry, len(primals)))
        elif info.kind == PREGATHERED:
            primals.append(module._hp.gathered.take(entry.resolved.fsdp.unit_of[info.name], info.name))
    module._hp.gathered.clear()  # consumed by this forward
    if entry.program.kept_gathered:
        entry.program.kept_hook = _keep_gathered_hook(module, entry)
    entry.program.grad_hook = _gradient_hook(module, entry)
    entry.program.bind_buffers(module)  # buffers updated in forward (BatchNorm running statistics)
    entry.program.on_error = _error_context(module, entry)
    outs = entry.program(*primals)
    return pytree.tree_unflatten(list(outs), captured.out_spec)


def _error_context(module: ParallelModule, entry: CompiledEntry):
    """Names the call, program and collective in an error a compiled program raises."""
    state = module._hp
    call = f"call {state.calls} of {state.original_cls.__name__} (rank {_rank()})"

    def on_error(exc: Exception, gm: torch.fx.GraphModule, phase: str):
        return reworded(exc, gm, phase, call, group_axis_names(state.mesh, entry.resolved.fsdp))

    return on_error


def _meta_outputs(entry: CompiledEntry) -> Any:
    """Called with meta inputs (shape inference, e.g. torch.distributed.pipelining's stages): the
    outputs as meta tensors of this rank's local shapes, from the compiled program; nothing runs."""
    program = entry.program
    outs = program.forward_gm.graph.output_node().args[0][: program.num_model_outputs]
    metas = [
        torch.empty(o.meta["val"].shape, dtype=o.meta["val"].dtype, device="meta") if isinstance(o, torch.fx.Node) else o
        for o in outs
    ]
    return pytree.tree_unflatten(metas, entry.captured.out_spec)


def _keep_gathered_hook(module: ParallelModule, entry: CompiledEntry):
    """Store the gathered parameters backward returns, for the next forward."""
    unit_of = entry.resolved.fsdp.unit_of

    def keep(values: dict[str, torch.Tensor]) -> None:
        for fqn, value in values.items():
            module._hp.gathered.put(unit_of[fqn], {fqn: value})

    return keep


def _pending_gradient(accumulator: GradientAccumulator, fqn: str, entry: CompiledEntry, primal_index: int):
    """The gradient of ``fqn`` accumulated by earlier micro-steps (zeros if it got none there)."""
    if fqn in accumulator.buffers:
        return accumulator.take(fqn)
    val = list(entry.program.forward_gm.graph.find_nodes(op="placeholder"))[primal_index].meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype, device=val.device)


def _gradient_hook(module: ParallelModule, entry: CompiledEntry):
    """What backward does with FSDP gradients that are not final yet (accumulation micro-steps)."""
    fsdp = entry.resolved.fsdp
    if fsdp is None:
        return None
    accumulator = module._hp.accumulator
    layout = fsdp.gradient_layout
    if layout != "reduced":
        primal_params = [
            info.name if info.kind == "param" and info.name in fsdp.unit_of else None
            for info in entry.captured.inputs if info.kind != "tangent"
        ]
        return accumulator.keep_hook(primal_params, layout)

    def check_nothing_left(grads):
        if accumulator.buffers:
            raise RuntimeError(
                "gradient accumulation: gradients of "
                f"{sorted(accumulator.buffers)[:3]} were accumulated without sync but this "
                "synchronising step did not reduce them (a micro-step's backward ran after this "
                "step's forward, or the parameters got no gradient here); run each backward before "
                "the next forward"
            )
        return grads

    return check_nothing_left
