"""The module ``parallelize`` returns, at run time: per-call agreement, the program cache, running.

The user's model object *is* the parallel module: its class is swapped for a subclass that also
derives from :class:`ParallelModule` (as FSDP2 extends modules), so attribute access,
``isinstance`` and ``state_dict()`` keys are unchanged. Each call: the ranks agree on the input
signature and flags (spmd.agree; input checks ride along), the program for that key is compiled on
a miss (compile/driver.py), then run inside one autograd Function (runtime/program.py); buffers the
forward updates are written back and FSDP gradient hooks keep pending gradients aside.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..ir.kinds import InputKind
from .. import compat
from ..compat import pytree
from ..ir.graph import flat_paths
from ..compile.options import CompileOptions
from ..compile.driver import CompiledEntry, compile_program, compile_within_budget
from ..compile.request import CompileRequest
from ..compile.signature import capture_device, current_rank, format_signature, signature
from ..analysis.debug import group_axis_names
from ..fsdp.flags import FsdpFlags, program_key
from ..fsdp.fully_shard import recorded_prefetch
from ..fsdp.grad_accumulation import GradientAccumulator
from ..fsdp.methods import FsdpMethods
from ..fsdp.unshard import GatheredParams, watch_optimizers
from ..analysis.memory import estimate_program
from ..pipeline.step_arguments import call_arguments, loss_of
from ..plan import ResolvedPlan
from ..plan.resolution import Resolution
from ..propagation.accumulation import GRAD_ACCUM, deferred_replicated
from ..propagation.unshard import PREGATHERED
from ..distributed.spmd import agree, digest_of
from . import agreement_gate
from .attribute_guards import AttributeGuards
from .autocast_state import autocast_state, describe as describe_autocast
from .collective_errors import reworded
from .grad_norm import clip_grad_norm_
from .selection import begin_agreement, cached_or_compiled
from .recompiles import ProgramKey, before_compile, describe_dtypes, describe_frozen
from .random_state import drawing_from, shared_generator_state
from .input_check import empty_problem, index_problem

log = logging.getLogger(__name__)


class ParallelState:
    """What a parallelized module carries (``module._hp``): the resolved plan, its options, the
    program cache, and the state that changes between calls (FSDP flags, pending gradients,
    gathered parameters, the pipeline's)."""

    def __init__(self, resolution: Resolution, original_cls, parameters, options: CompileOptions):
        # Every plan entry resolved (plan/resolution.py): the layouts and FSDP units, the activation
        # plan, the pipeline, the mesh the plan applies on, recompute="auto"'s candidates.
        self.resolution = resolution
        self.original_cls = original_cls
        self.options = options
        self.cache: dict[Any, CompiledEntry] = {}
        self.calls = 0  # calls so far, named in errors ("call 3")
        self.digests: dict = {}  # cache key -> digest exchanged by the per-call agreement
        self.attributes = AttributeGuards()  # module attribute values the programs read (a key part)
        # Program-changing flags (HSDPModule methods); each combination is compiled once.
        self.fsdp_flags = FsdpFlags()
        self.accumulator = GradientAccumulator()  # FSDP gradients pending between micro-steps
        # no_sync(): gradients of parameters no FSDP unit owns stay unreduced (replicated_sync
        # False), kept here between micro-steps (propagation/accumulation.py).
        self.replicated_sync = True
        self.replicated_accumulator = GradientAccumulator()
        self.gathered = GatheredParams(parameters)  # by unshard(), or kept by backward for the next forward
        watch_optimizers(self.gathered)
        self.last: CompiledEntry | None = None  # the program the last call ran
        self.last_key = None  # its cache key (what a recompile is compared with)
        # Pipeline parallelism: parameters of stages other ranks run, released from this rank after
        # the split (FQN -> (global shape, dtype, requires_grad, device), for later captures).
        self.released: dict[str, tuple] = {}
        self.pipeline = None  # pipeline.state.PipelineState when the plan has a pipeline

    @property
    def resolved(self) -> ResolvedPlan:
        return self.resolution.resolved

    @property
    def mesh(self):
        """The mesh the plan applies on (a pipeline's stage mesh)."""
        return self.resolution.mesh

    @property
    def activation(self):
        """The recompute and swap plan (recompute.ActivationPlan)."""
        return self.resolution.activation

    @property
    def auto_candidates(self) -> tuple:
        """recompute="auto": each candidate's entry and activation plan."""
        return self.resolution.auto_candidates

    def all_parameters(self, module: nn.Module) -> dict[str, tuple]:
        """FQN -> (global shape, dtype, requires_grad, capture device) of every parameter of the
        model, the ones released by the pipeline split included."""
        specs = {
            fqn: (tuple(t.shape), t.dtype, t.requires_grad, capture_device(t)) for fqn, t in module.named_parameters()
        }
        return {**specs, **self.released}

    def compile_request(self, module: nn.Module, resolved: ResolvedPlan | None = None,
                        explicit_prefetch=None) -> CompileRequest:
        """What a compile of ``module`` reads of this state, frozen (compile/request.py):
        ``resolved`` with this call's flags applied (default: the plan as resolved)."""
        return CompileRequest(
            mesh=self.mesh, resolved=self.resolved if resolved is None else resolved, activation=self.activation,
            options=self.options, original_cls=self.original_cls,
            parameters=types.MappingProxyType(self.all_parameters(module)),
            explicit_prefetch=types.MappingProxyType(dict(explicit_prefetch or {})),
            auto_candidates=self.auto_candidates)

    def resolved_for_flags(self) -> ResolvedPlan:
        resolved = self.resolved
        # Gradients pending from earlier micro-steps become inputs of this program, added to its
        # own gradients before they are reduced (propagation/accumulation.py).
        pending = self.replicated_accumulator.pending is not None
        if not self.replicated_sync or pending:
            resolved = dataclasses.replace(resolved, replicated_sync=self.replicated_sync, replicated_pending=pending)
        fsdp = resolved.fsdp
        if fsdp is None:
            return resolved
        fsdp = self.fsdp_flags.apply(fsdp, accumulated=self.accumulator.pending,
                                     pregathered=tuple(sorted(self.gathered.units)))
        return dataclasses.replace(resolved, fsdp=fsdp)


_NOT_TRACED = ("a parallelized module runs its own compiled programs, which torch.compile does not trace "
               "into (a graph break): compile it without fullgraph=True, or pass parallelize(..., "
               "codegen='inductor') for Inductor kernels inside the programs")


class ParallelModule(FsdpMethods, nn.Module):
    """Mixin added to the user's model class by :func:`parallelize`."""

    _hp: ParallelState

    # torch.compile of a parallelized module (or of a model holding one) must not trace the runtime:
    # Dynamo would step into the compiler on the first call and fail there, blaming the plan. The
    # call runs the compiled programs as they are (``codegen="inductor"`` compiles their compute
    # regions with Inductor). Where this forward is the frame Dynamo compiles (the backend's later
    # calls, backend.py) the program counts as its compiled frame under ``fullgraph=True``.
    @torch.compiler.disable(reason=_NOT_TRACED)
    def forward(self, *args, **kwargs):  # noqa: D401 - same signature as the user's model
        compat.count_as_compiled_frame()
        entry, flat = entry_for(self, args, kwargs)
        try:
            if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
                return _meta_outputs(entry)
            return _run(self, entry, flat)
        finally:
            # A forward without collectives, or one that raised before its first: the agreement
            # is settled before the call returns (a disagreement is the error then).
            agreement_gate.await_agreement()

    def step(self, inputs, targets=None) -> torch.Tensor:
        """Forward and backward of one training step; returns the (global, detached) loss and
        leaves the gradients in ``.grad`` (added to what is there, as ``backward`` does).
        ``inputs``: a tensor, a tuple of positional or a dict of keyword arguments of the model;
        ``targets``: the second argument of ``parallelize(loss_fn=...)`` (pipelines only; see
        pipeline/module.py: there the local batch is split into micro-batches run on the schedule)."""
        args, kwargs = call_arguments(inputs, targets, None)
        loss = loss_of(self(*args, **kwargs))
        loss.backward()
        return loss.detach()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the gradients kept by accumulation micro-steps
        (``no_sync()``, ``set_requires_gradient_sync(False)``) dropped too: under DDP those live in
        ``.grad`` and this call clears them, so a loop that abandons an accumulation (a skipped
        step) must not find them added to the next one. (``optimizer.zero_grad()`` reaches only
        ``.grad``, as with FSDP2's accumulated gradients.)"""
        super().zero_grad(set_to_none)
        self._hp.accumulator.buffers.clear()
        self._hp.replicated_accumulator.buffers.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` with the total norm over every
        parameter of the model, pipeline stages on other ranks included (torch's function sees only
        this rank's stages there: grad_norm.py). Returns the total norm, equal on every rank; call
        it on every rank."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    def pipeline_report(self) -> dict:
        """See ``PipelinedModule.pipeline_report`` (pipeline/module.py)."""
        raise RuntimeError("pipeline_report(): this model has no pipeline plan")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors, DTensors or local shards into the sharded parameters (in place)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded parameters; use assign=False")
        from ..checkpoints.state_dict import StateDictOptions, set_model_state_dict

        self._hp.gathered.clear()  # gathered from the old values
        return set_model_state_dict(self, state_dict, StateDictOptions(strict=strict))

    # --- what users and tests read -----------------------------------------------------------
    def compile_summary(self, memory: bool = True) -> dict:
        """The summary of the program the last call ran (collectives by kind/axis, fallbacks, ...).
        ``memory=False``: without its ``"memory"`` estimate unless already made (a replay of both
        programs, made on first request when the compile dumped nothing)."""
        entry = self._last_entry()
        return entry.full_summary() if memory else entry.summary

    def compiled_programs(self) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """(forward, backward) GraphModules of the program the last call ran, for inspection."""
        entry = self._last_entry()
        return entry.program.forward_gm, entry.program.backward_gm

    def generated_programs(self) -> tuple:
        """(forward, backward) as they run: with ``codegen="inductor"`` the programs whose compute
        regions are Inductor kernels (``.gm`` is the GraphModule around them; the collectives and
        their order are those of :meth:`compiled_programs`), else the same as
        :meth:`compiled_programs`."""
        program = self._last_entry().program
        return program.runnable("forward"), program.runnable("backward")

    def memory_report(self, optimizer=None, keep_outputs: bool = True) -> dict:
        """This rank's estimated memory for one training step of the program the last call ran
        (hyper_parallel.analysis.memory): parameters, gradients, optimizer state, saved activations, the
        forward / backward / optimizer-step peaks, the overall peak and the node (module, source
        line) where it is reached. ``optimizer``: the optimizer instance (its real state once it has
        stepped), or "sgd" / "sgd_momentum" / "adam" / "adamw"; None counts no optimizer state.
        ``keep_outputs``: whether the training loop holds the forward's outputs (the logits)
        through backward, as ``out = model(...); out.loss.backward()`` does; False for
        ``model(...)["loss"].backward()``, which frees them when forward returns."""
        entry = self._last_entry()
        return estimate_program(entry.program, entry.captured, optimizer, keep_outputs=keep_outputs).as_dict()

    def _last_entry(self) -> CompiledEntry:
        if self._hp.last is None:
            raise RuntimeError("the module has not been compiled yet: call it once with real inputs")
        return self._hp.last


def entry_for(module: "ParallelModule", args: tuple, kwargs: dict) -> tuple["CompiledEntry", list]:
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
    # A program captured under autocast holds its casts (autocast_state.py), gradients only for the
    # parameters that required them then, and computes in the parameters' dtypes then: all three
    # pick the program (a model cast with .to(torch.bfloat16) after training compiles its own).
    params = list(module.named_parameters())
    # What the programs read from module attributes (a dropout's p, config flags) picks one too.
    variant, values = state.attributes.variant()
    replicated = () if resolved.replicated_sync and not resolved.replicated_pending else (
        ("no_sync" if not resolved.replicated_sync else "sync", "pending" if resolved.replicated_pending else "none"),)
    key = ProgramKey(in_spec, tuple(signature(x) for x in flat), program_key(resolved.fsdp) + (mode,) + replicated,
                     repr(prefetch),
                     autocast_state(), tuple(fqn for fqn, p in params if not p.requires_grad),
                     tuple(p.dtype for _, p in params), variant, torch.is_grad_enabled())
    # A call without gradients (torch.no_grad, inference_mode) runs the training program's forward
    # when there is one, else compiles a forward-only program (no activations kept: an evaluation
    # or a frozen reference model). A training call never runs a forward-only program: a first
    # call under no_grad (an evaluation before training) used to leave training without backward.
    if not key.backward and key not in state.cache and key._replace(backward=True) in state.cache:
        key = key._replace(backward=True)
    entry = state.cache.get(key)
    # Every rank agrees on the program before running or compiling one (spmd.agree): a rank that
    # hits its cache while a peer compiles another signature would otherwise hang.
    if key not in state.digests:
        state.digests[key] = digest_of(_describe_call(key, flat, args, kwargs))
    paths = lambda: flat_paths((args, kwargs))  # noqa: E731 - only needed to word an error
    problem = empty_problem(flat, paths)
    if entry is not None and problem is None:
        problem = _index_problem(state, entry, flat)
    last_variant = state.last_key.attributes if state.last_key is not None else None
    changed = lambda: state.attributes.changes(last_variant, values)  # noqa: E731
    describe = lambda: _describe_call(key, flat, args, kwargs, changed())  # noqa: E731
    what = begin_agreement(state, "call", state.mesh, state.digests[key], describe, problem,
                           reusing=entry is not None)
    if entry is None:
        compile_fn = compile_within_budget if state.activation.auto_blocks else compile_program
        entry = cached_or_compiled(
            state, state.cache, key, values,
            lambda: compile_fn(module, state.compile_request(module, resolved, prefetch), args, kwargs, flat),
            before_compile=lambda: before_compile(state, key, paths, changed()))
        # Ids and labels could not be checked before the program existed: once more after compiling.
        if entry.index_inputs and state.options.check_inputs is not False:
            problem = _index_problem(state, entry, flat)
            agree(state.mesh, what, state.digests[key], describe, problem, timeout=state.options.timeout)
    state.last, state.last_key = entry, key
    return entry, flat


def _index_problem(state: ParallelState, entry: CompiledEntry, flat) -> str | None:
    if state.options.check_inputs is False:
        return None
    return index_problem(entry.index_inputs, flat, force=bool(state.options.check_inputs))


def _describe_call(key, flat, args, kwargs, attributes: str = "") -> str:
    """The call signature the ranks agree on, one line per input (what an error shows; the digest
    is of the text without ``attributes``, the changed attribute values: ranks agree on the
    variant number, whatever values of their own it stands for)."""
    lines = [f"input '{p}': {format_signature(s)}" for p, s in zip(flat_paths((args, kwargs)), key.signatures)]
    # A few frozen names and a digest of all of them (two sets of one size may share their first names).
    frozen = f"{describe_frozen(key.frozen)} [set {digest_of(repr(key.frozen)) % 16**8:08x}]"
    return "\n".join([*lines, f"input structure: {key.in_spec}", f"FSDP flags: {key.flags}", f"prefetch: {key.prefetch}",
                       f"autocast: {describe_autocast(key.autocast)}", f"parameters with requires_grad=False: {frozen}",
                       f"parameter dtypes: {describe_dtypes(key.dtypes)} [{digest_of(repr(key.dtypes)) % 16**8:08x}]",
                       f"module attribute values: variant {key.attributes}" + (f" ({attributes})" if attributes else ""),
                       f"program with backward: {key.backward}"])


def _run(module: ParallelModule, entry: CompiledEntry, flat) -> Any:
    captured = entry.captured
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    primals = []
    # A call without gradients (an evaluation between accumulation micro-steps) runs no backward:
    # the gradients kept for the next synchronising step stay where they are.
    grad_enabled = torch.is_grad_enabled()
    for info in captured.inputs:
        if info.kind == InputKind.PARAM:  # a DTensor: the program unwraps it (program._RunStep)
            primals.append(params[info.name])
        elif info.kind == InputKind.BUFFER:
            primals.append(buffers[info.name])
        elif info.kind == InputKind.INPUT:
            primals.append(flat[info.index])
        elif info.kind == GRAD_ACCUM:
            fsdp = entry.resolved.fsdp
            owner = module._hp.accumulator if fsdp is not None and info.name in fsdp.unit_of \
                else module._hp.replicated_accumulator
            primals.append(_pending_gradient(owner, info.name, entry, len(primals), take=grad_enabled))
        elif info.kind == PREGATHERED:
            primals.append(module._hp.gathered.take(entry.resolved.fsdp.unit_of[info.name], info.name))
    module._hp.gathered.clear()  # consumed by this forward
    if entry.program.kept_gathered:
        entry.program.kept_hook = _keep_gathered_hook(module, entry)
    entry.program.grad_hook = _gradient_hook(module, entry)
    entry.program.bind_buffers(module)  # buffers updated in forward (BatchNorm running statistics)
    entry.program.on_error = _error_context(module, entry)
    # Replicated dropout draws alike on the ranks of its axes (random_state.py).
    shared = None
    if entry.random_axes:  # a collective of the runtime's own: after the agreement
        agreement_gate.await_agreement()
        shared = shared_generator_state(module._hp.mesh, entry.random_axes)
    with drawing_from(module._hp.mesh.device_type, shared):
        outs = list(entry.program(*primals))
    for index, sub_mesh, placements in entry.returned:  # still sharded: a DTensor, not gathered
        outs[index] = _as_dtensor(outs[index], sub_mesh, placements)
    return pytree.tree_unflatten(outs, captured.out_spec)


def _as_dtensor(local: torch.Tensor, sub_mesh, placements) -> DTensor:
    """This rank's shard of a returned value as a DTensor over the sub-mesh it is sharded on
    (differentiable: a loss the caller computes from it sends its gradient back to the shard).
    Shards are even (propagation checked the dims divide), so DTensor infers the global shape."""
    return DTensor.from_local(local, sub_mesh, placements, run_check=False)


def _error_context(module: ParallelModule, entry: CompiledEntry):
    """Names the call, program and collective in an error a compiled program raises."""
    state = module._hp
    call = f"call {state.calls} of {state.original_cls.__name__} (rank {current_rank()})"

    def on_error(exc: Exception, gm: torch.fx.GraphModule, phase: str):
        return reworded(exc, gm, phase, call, group_axis_names(state.mesh, entry.resolved.fsdp, entry.resolved.context))

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


def _pending_gradient(accumulator: GradientAccumulator, fqn: str, entry: CompiledEntry, primal_index: int,
                      take: bool = True):
    """The gradient of ``fqn`` accumulated by earlier micro-steps (zeros if it got none there, or
    when the call will not run backward: ``take`` False leaves it for the next one that will)."""
    if take and fqn in accumulator.buffers:
        return accumulator.take(fqn)
    val = list(entry.program.forward_gm.graph.find_nodes(op="placeholder"))[primal_index].meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype, device=val.device)


def _gradient_hook(module: ParallelModule, entry: CompiledEntry):
    """What backward does with gradients that are not final yet (accumulation micro-steps): FSDP
    gradients under set_requires_gradient_sync(False) and the other parameters' under no_sync()
    are kept aside; a synchronising step checks that it reduced everything kept."""
    fsdp, resolved = entry.resolved.fsdp, entry.resolved
    state = module._hp
    primals = [info for info in entry.captured.inputs if info.kind != InputKind.TANGENT]
    hooks = []
    if fsdp is not None and fsdp.gradient_layout != "reduced":
        params = [info.name if info.kind == InputKind.PARAM and info.name in fsdp.unit_of else None for info in primals]
        hooks.append(state.accumulator.keep_hook(params, fsdp.gradient_layout))
    if not resolved.replicated_sync:
        deferred = deferred_replicated(resolved, [info.name for info in primals if info.kind == InputKind.PARAM])
        params = [info.name if info.kind == InputKind.PARAM and info.name in deferred else None for info in primals]
        hooks.append(state.replicated_accumulator.keep_hook(params, "unreduced"))
    checked = [acc for acc, synced in ((state.accumulator, fsdp is not None and fsdp.gradient_layout == "reduced"),
                                       (state.replicated_accumulator, resolved.replicated_sync)) if synced]

    def on_gradients(grads):
        for hook in hooks:
            grads = hook(grads)
        for accumulator in checked:
            if accumulator.buffers:
                raise RuntimeError(
                    "gradient accumulation: gradients of "
                    f"{sorted(accumulator.buffers)[:3]} were accumulated without sync but this "
                    "synchronising step did not reduce them (a micro-step's backward ran after this "
                    "step's forward, or the parameters got no gradient here); run each backward before "
                    "the next forward"
                )
        return grads

    return on_gradients
