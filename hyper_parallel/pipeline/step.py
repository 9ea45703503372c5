"""``pmodel.step(inputs, targets)`` of a pipelined module: the ranks agree on the step's inputs,
the inputs are cut into micro-batches, the micro-batch signature's stage programs are compiled on a
cache miss (``compile_stages.py``), and the executor runs the schedule over them (``runtime.py``);
then the loss is broadcast from the last stage and the step's gradients are added into each
parameter's ``.grad``, as ``backward`` would."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..compat import pytree
from .. import compat
from ..ir.graph import flat_paths
from ..compile.driver import training_grad_mode
from ..compile.signature import current_rank, format_signature, signature
from ..analysis.debug import Dumper
from ..runtime import agreement_gate
from ..runtime.autocast_state import autocast_state, describe as describe_autocast, programs_run_as_captured
from ..runtime.random_state import drawing_from, shared_generator_state
from ..runtime.recompiles import describe_frozen
from ..runtime.input_check import empty_problem
from ..distributed.spmd import digest_of
from ..runtime.selection import begin_agreement, cached_or_compiled
from .step_arguments import call_arguments
from .state import PipelineEntry, PipelineState
from .micro_batches import input_names, leaf_specs, micro_batches
from .compile_stages import compile_pipeline

log = logging.getLogger(__name__)


def pipeline_step(module, inputs: Any, targets: Any = None) -> torch.Tensor:
    """``ParallelModule.step`` for a pipelined module (see :meth:`ParallelModule.step`)."""
    state = module._hp
    pipe: PipelineState = state.pipeline
    _check_no_fsdp_flags(state)
    args, kwargs = call_arguments(inputs, targets, pipe.loss_fn)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    paths = flat_paths((args, kwargs))
    # Every rank of the whole mesh agrees on the step's inputs first (spmd.agree): a rank with
    # another batch shape would otherwise wait forever for its stage peers.
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
    begin_agreement(state, "step", pipe.mesh, digest_of(text), lambda: text + (f" ({changed})" if changed else ""),
                    problem, reusing=seen in pipe.reused)
    try:
        mbs = _cut(module, args, kwargs, flat)
        key = (in_spec, tuple(signature(x) for x in mbs[0]), autocast, variant)

        def compile() -> PipelineEntry:
            mb_args, mb_kwargs = pytree.tree_unflatten(mbs[0], in_spec)
            with training_grad_mode():
                return compile_pipeline(module, mb_args, mb_kwargs, mbs[0])

        def before_compile() -> None:
            if changed and current_rank() == 0:
                log.info("recompiling the %s pipeline: module attributes the stage programs read changed: %s",
                         state.original_cls.__name__, changed)

        entry = cached_or_compiled(state, pipe.cache, key, values, compile, before_compile)
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


def compile_step(module, inputs: Any, targets: Any = None, *, every_stage: bool = False) -> PipelineEntry:
    """Compile the stage programs ``step(inputs, targets)`` would run, without running them and
    without the ranks' agreement (planning on a fake mesh, ``api.compile_for_inputs``): the entry
    becomes the module's last. ``every_stage``: every stage's programs, not only this rank's (for
    ``step_cost.pipeline_cost``; the module can then not run that entry)."""
    state = module._hp
    pipe: PipelineState = state.pipeline
    args, kwargs = call_arguments(inputs, targets, pipe.loss_fn)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    mbs = _cut(module, args, kwargs, flat)
    mb_args, mb_kwargs = pytree.tree_unflatten(mbs[0], in_spec)
    with training_grad_mode():
        entry = compile_pipeline(module, mb_args, mb_kwargs, mbs[0], every_stage=every_stage)
    pipe.last = entry
    return entry


def _cut(module, args: tuple, kwargs: dict, flat: list) -> list:
    """The step's micro-batches (flat inputs each): every tensor input cut along its batch dim
    (PipelinePlan.batch_dims, else dim 0)."""
    state = module._hp
    pipe: PipelineState = state.pipeline
    plan = pipe.resolved.plan
    forward = state.original_cls.forward.__get__(module)
    names = input_names(forward, len(args), kwargs, pipe.loss_fn is not None)
    labels, specs = leaf_specs(args, kwargs, names, plan.batch_dims, forward)
    return micro_batches(flat, plan.num_microbatches, labels, specs)


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
