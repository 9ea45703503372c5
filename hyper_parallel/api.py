"""``parallelize(model, plan, mesh)``: the user's entry point.

It validates the options, resolves the plan (``plan.resolution.resolve``: tensor-parallel layouts,
FSDP units, activation and pipeline plans), has every rank agree on the result before anything is
distributed, distributes the parameters and turns the model into a
:class:`~hyper_parallel.runtime.module.ParallelModule`, which compiles on its first call
(compile/driver.py) and runs the cached program afterwards.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import compat, options
from .codegen import check_codegen
from .compile.repeated import check_option as check_repeated_blocks
from .compile.signature import current_rank
from .compile.options import CompileOptions
from .fsdp.fully_shard import link_units_to_root
from .init import distribute_parameters
from .passes import check_disabled_passes
from .plan import ResolvedPlan
from .plan.resolution import resolve
from .progress import enable_default_logging
from .pipeline.module import PipelinedModule
from .pipeline.state import PipelineState
from .runtime.agreement_gate import await_agreement
from .runtime.module import ParallelModule, ParallelState, entry_for
from .runtime.replaced_parameters import remember_replacements
from .runtime.save_pretrained import SavePretrainedFull
from .distributed.spmd import agree, digest_of

__all__ = ["ParallelModule", "compile_for_inputs", "parallelize"]

log = logging.getLogger(__name__)


def compile_for_inputs(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> None:
    """Compile ``module`` (returned by :func:`parallelize`) for the signature of ``args`` /
    ``kwargs`` (per-rank local inputs; meta or fake tensors are fine) as its first call would,
    without running it: ``compile_summary()``, ``compiled_programs()`` and ``memory_report()``
    then describe that program (planning, ``hyper_parallel.tools.explain``)."""
    if not isinstance(module, ParallelModule):
        raise TypeError(f"compile_for_inputs needs a module returned by hp.parallelize, got {type(module).__name__}")
    try:
        entry_for(module, tuple(args), dict(kwargs or {}))
    finally:  # nothing runs: the agreement of a reused program is settled here
        await_agreement()


def parallelize(
    model: nn.Module,
    plan: Any = None,
    mesh=None,
    *,
    dump_dir: str | None = None,
    disable_passes: tuple[str, ...] = (),
    prefetch_depth: int | None = None,
    reductions_in_flight: int | None = None,
    bucket_cap_mb: float | None = None,
    memory_budget_bytes: int | None = None,
    materialize: bool = True,
    loss_fn=None,
    check_inputs: bool | None = None,
    timeout=None,
    recompile_limit: int = 8,
    fail_on_recompile_limit: bool = False,
    codegen: str = "eager",
    repeated_blocks: str | None = "auto",
) -> nn.Module:
    """Make ``model`` a distributed training program for ``plan`` on ``mesh`` (see docs/architecture.md §1).

    ``plan`` is a :class:`ParallelPlan`, the same as a nested dict, or None to use only the entries
    recorded by ``shard_module``/``parallelize_module``. The model's parameters are distributed now
    (from rank 0's values, so every rank starts identical); compilation happens on the first call.
    ``prefetch_depth``: FSDP units whose all-gather is issued ahead (default 1);
    ``reductions_in_flight``: gradient reductions (FSDP reduce-scatters, DDP buckets) that may run
    while backward goes on, each waited for just before the one N later is issued (default 1,
    FSDP2's, where units are prefetched, else 0: waited at once); on gloo process groups one
    collective of a group is in flight at a time whatever these say (passes/serialize_collectives.py);
    ``bucket_cap_mb``: size of the gradient all-reduce buckets of parameters FSDP does not
    own, DDP's option and rule: None (default), 25 MB buckets after a 1 MiB first one; a size,
    every bucket at most that, the first one too; ``memory_budget_bytes``: the per-rank peak that
    ``recompute="auto"`` must fit; ``disable_passes``: pass names to skip; ``dump_dir``: per-rank
    dumps of every stage. ``materialize=False``: a meta-device model keeps meta shards (planning
    only, see ``hyper_parallel.tools.explain``: the module can be compiled and inspected, not run).
    ``loss_fn``: with a pipeline plan, ``loss_fn(output, target)`` gives the loss the last stage
    computes (else the model must return its loss); train with ``pmodel.step(inputs, targets)``.
    ``check_inputs``: check token ids and labels against the embedding's vocabulary and the loss's
    classes before each call (None:
    for inputs on the CPU, where it is free; True: also on accelerators, which synchronises the
    device; False: never). ``timeout``: seconds (or a timedelta) a collective of this module may wait
    for its peers before the call fails naming the program, collective and call (default: the
    process groups' own, 30 minutes on gloo, 10 on NCCL). ``recompile_limit``: programs are
    compiled for fixed input shapes, one per new signature (each logged with what changed); past
    this many a warning says so, or a ValueError with ``fail_on_recompile_limit=True``.
    ``codegen``: how each rank's programs run: ``"eager"`` (default), op by op, or ``"inductor"``:
    the compute between collectives as Inductor-generated kernels (compiled on the first step),
    collectives and the passes' schedule unchanged (docs/codegen.md).
    ``repeated_blocks``: ``"auto"`` (default) or the FQN of a ModuleList of identical blocks
    (``"model.layers"``): two of its blocks are traced, propagated and lowered, and the others
    written as their copies (a 32-layer compile in 0.11x the time); the graphs are the ones every
    block going through every step gives. Blocks that differ, or code that computes with their
    number (``len(self.layers)``), go through every step, with the reason logged
    (docs/codegen.md#compile-time-repeated_blocks). None: every block is traced.

    Before distributing anything the ranks check that they resolved the same plan and options
    (a ValueError on every rank naming the difference, not a hang); every call likewise checks
    that all ranks run the same input signature.
    """
    bucket_cap_mb = options.check_bucket_cap_mb(bucket_cap_mb)
    bucket_bytes, first_bucket_bytes = options.gradient_bucket_sizes(bucket_cap_mb)
    prefetch_depth = options.check_int("prefetch_depth", prefetch_depth, minimum=0)
    reductions_in_flight = options.check_int("reductions_in_flight", reductions_in_flight, minimum=0)
    memory_budget_bytes = options.check_memory_budget(memory_budget_bytes)
    check_inputs = options.check_check_inputs(check_inputs)
    timeout = options.check_timeout(timeout)
    recompile_limit = options.check_int("recompile_limit", recompile_limit, minimum=1, allow_none=False)
    if not isinstance(fail_on_recompile_limit, bool):
        raise TypeError(f"fail_on_recompile_limit is True or False, got {fail_on_recompile_limit!r}")
    check_disabled_passes(disable_passes)
    codegen = check_codegen(codegen)
    repeated_blocks = check_repeated_blocks(repeated_blocks, model)
    enable_default_logging()
    if mesh is None:
        raise ValueError("parallelize needs a mesh: hp.init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))")
    if isinstance(model, ParallelModule):
        raise ValueError("this model is already parallelized; call parallelize on the original model once")
    resolution = resolve(plan, model, mesh, loss_fn=loss_fn, memory_budget_bytes=memory_budget_bytes)
    resolved, activation = resolution.resolved, resolution.activation
    mesh = resolution.mesh  # with a pipeline plan, the stage mesh: the rest of the plan applies there
    prefetch_depth = _default_prefetch_depth() if prefetch_depth is None else prefetch_depth
    if reductions_in_flight is None:  # overlap follows prefetch unless asked for on its own
        reductions_in_flight = 1 if prefetch_depth > 0 else 0
    if timeout is not None:
        set_collective_timeout(resolution.full_mesh, timeout, lanes=resolution.resolved.reduction_lanes.values())
    # Agree on the plan before parameters are distributed: differing plans would hang in there.
    settings = _describe_plan(resolved, activation, resolution.plan, prefetch_depth=prefetch_depth,
                              reductions_in_flight=reductions_in_flight,
                              bucket_cap_mb=bucket_cap_mb, disable_passes=sorted(disable_passes),
                              check_inputs=check_inputs, timeout=timeout, loss_fn=loss_fn is not None,
                              codegen=codegen, repeated_blocks=repeated_blocks)
    agree(resolution.full_mesh, f"parallelize({type(model).__name__})",
          digest_of(settings), lambda: settings, timeout=timeout)
    dump_source = "dump_dir" if dump_dir else "HYPER_PARALLEL_DUMP_DIR"
    dump_dir = options.prepare_dump_dir(dump_dir or os.environ.get("HYPER_PARALLEL_DUMP_DIR"), current_rank(), dump_source)
    before = dict(model.named_parameters())
    distribute_parameters(model, resolved.param_placements, mesh, materialize=materialize)
    _offload_shards(model, resolved)
    # An optimizer built before this call gets the DTensor parameters at its first step.
    remember_replacements(before, dict(model.named_parameters()), "parallelize", "parallelize(model, ...)")
    original_cls = type(model)
    module_cls = PipelinedModule if resolution.pipeline is not None else ParallelModule
    # transformers' save_pretrained writes the gathered weights (runtime/save_pretrained.py).
    saving = (SavePretrainedFull,) if callable(getattr(original_cls, "save_pretrained", None)) else ()
    model.__class__ = type(f"Parallel{original_cls.__name__}", (module_cls, *saving, original_cls), {})
    compile_options = CompileOptions(
        dump_dir=dump_dir, disable_passes=frozenset(disable_passes), prefetch_depth=prefetch_depth,
        reductions_in_flight=reductions_in_flight,
        gradient_bucket_bytes=bucket_bytes, first_gradient_bucket_bytes=first_bucket_bytes,
        memory_budget_bytes=memory_budget_bytes,
        check_inputs=check_inputs, timeout=timeout, recompile_limit=recompile_limit,
        fail_on_recompile_limit=fail_on_recompile_limit, codegen=codegen, repeated_blocks=repeated_blocks,
    )
    model._hp = ParallelState(resolution, original_cls, list(model.parameters()), compile_options)
    if resolution.pipeline is not None:
        model._hp.pipeline = PipelineState(resolution.pipeline, resolution.full_mesh, loss_fn)
    link_units_to_root(model)
    return model


def set_collective_timeout(mesh, timeout, lanes=()) -> None:
    """Collectives over ``mesh``'s axes, and over the reduction lanes named ``lanes``
    (plan/lanes.py), wait at most ``timeout`` for their peers."""
    for axis in range(mesh.ndim):
        compat.set_group_timeout(mesh.get_group(axis), timeout)
    for lane in lanes:
        compat.set_group_timeout(compat.resolve_process_group(lane), timeout)


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


def _default_prefetch_depth() -> int:
    """FSDP units gathered ahead by default: 1 on every backend (so, by default, one gradient
    reduction of a kind also stays in flight: ``reductions_in_flight``).

    It was 0 on gloo while several collectives in flight crashed gloo workers natively now and
    then. The cause: two collectives of one gloo process group executing at once on its two worker
    threads; passes/serialize_collectives.py now waits for each before the next one of its group is
    issued, and ``bench/stress_gloo_prefetch.py`` reproduces the old failure with
    ``--disable-serialize``. The environment variable ``HYPER_PARALLEL_PREFETCH_DEPTH`` overrides
    the default for runs that cannot change the call."""
    from_env = os.environ.get("HYPER_PARALLEL_PREFETCH_DEPTH")
    if from_env:
        if not from_env.isdigit():
            raise ValueError(f"HYPER_PARALLEL_PREFETCH_DEPTH must be a non-negative integer, got {from_env!r}")
        return int(from_env)
    return 1


def _offload_shards(model: nn.Module, resolved: ResolvedPlan) -> None:
    """CPU offload: FSDP shards (hence their gradients and optimizer state) live on the host, for
    the units whose offload policy is a CPUOffloadPolicy."""
    fsdp = resolved.fsdp
    if fsdp is None:
        return
    for fqn, param in list(model.named_parameters()):
        local = param.to_local()
        if fqn in fsdp.unit_of and fsdp.offloaded(fqn) and local.device.type != "cpu":
            host = local.detach().to("cpu")
            if fsdp.offload_of(fqn).pin_memory and torch.cuda.is_available():
                host = host.pin_memory()
            owner_name, _, name = fqn.rpartition(".")
            dt = DTensor.from_local(host, param.device_mesh, param.placements, run_check=False)
            model.get_submodule(owner_name).register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))

