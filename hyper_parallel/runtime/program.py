"""The compiled training step: the local joint graph split into forward and backward programs.

``CompiledProgram`` partitions the lowered joint graph by phase (partition.py: the forward and
backward nodes as scheduled by the passes; the forward values backward reads are saved) and runs
the pair inside one ``torch.autograd.Function``, so the user's ``loss.backward()``
runs our backward graph and leaves each parameter's gradient in its (DTensor) ``.grad``.

Buffers the forward updates in place (BatchNorm's running statistics, step counters) are outputs
of the forward program, after the user outputs and already in the buffer's storage layout (lowering
brought them there); after the forward runs they are written into the module's buffers
(:func:`write_buffers`), so the module holds what one device would after the same step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from ..ir.kinds import InputKind
from .. import compat
from ..ir.graph import CapturedGraph
from ..errors import internal_error
from .autocast_state import programs_run_as_captured
from .profiled import ranges_wanted, with_ranges
from .zero_tangents import without_tangents
from ..passes.inplace_reuse import overwrites_inputs, without_saved_overwrites


def flatten_placeholders(gm: torch.fx.GraphModule, captured: CapturedGraph) -> None:
    """Rename the lowered graph's placeholders to ``primals_i``/``tangents_i`` (the partitioner tells
    forward inputs from tangents by name) and make it a flat positional callable."""
    primal_i = tangent_i = 0
    for node, info in zip(gm.graph.find_nodes(op="placeholder"), captured.inputs):
        if info.kind == InputKind.TANGENT:
            tangent_i += 1
            name = f"tangents_{tangent_i}"
        else:
            primal_i += 1
            name = f"primals_{primal_i}"
        node.target = name
        node.name = name
    gm.graph._codegen = torch.fx.graph.CodeGen()
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]),)
    gm.recompile()


@dataclasses.dataclass
class CompiledProgram:
    """Forward and backward GraphModules of one rank plus the bookkeeping to call them."""

    forward_gm: torch.fx.GraphModule
    backward_gm: torch.fx.GraphModule
    # The forward's outputs before its saved tensors: the model's outputs, then one new value per
    # entry of ``buffer_updates`` (analysis/memory.py reads this count too).
    num_user_outputs: int
    num_primals: int
    tangent_outputs: tuple[int, ...]  # which user outputs have a tangent input in backward
    differentiable: tuple[bool, ...]  # per output counted by num_user_outputs (buffer updates: False)
    # FQNs of the gathered parameters backward returns after the gradients (kept for the next
    # forward: set_reshard_after_backward(False)).
    kept_gathered: tuple[str, ...] = ()
    # FQNs of the buffers the forward updates, in the order of their outputs (after the model's).
    buffer_updates: tuple[str, ...] = ()
    # Set by the runtime per call: receives the backward's gradients and returns what autograd gets
    # (gradient accumulation keeps not-yet-reduced gradients aside for the next micro-step).
    grad_hook: object = None
    # Set by the runtime per call: receives {FQN: gathered parameter} when kept_gathered is not empty.
    kept_hook: object = None
    # Set by the runtime per call (bind_buffers): receives {FQN: new value} of ``buffer_updates``.
    buffer_hook: object = None
    # Set by the runtime per call: (exception, GraphModule, "forward" | "backward") -> a clearer
    # exception naming the call and collective, or None to re-raise as is (collective_errors.py).
    on_error: object = None
    # Set by the compile driver: what the profiler ranges inside the programs are named by
    # (runtime/profiled.py); their copies with the ranges, built on the first profiled call.
    ranges: object = None
    _with_ranges: dict = dataclasses.field(default_factory=dict, repr=False)
    # Set by the compile driver for codegen="inductor": (program, label) -> what runs in its place
    # (codegen.generate: the compute regions as Inductor kernels, the schedule unchanged).
    generator: object = None
    _generated: dict = dataclasses.field(default_factory=dict, repr=False)
    # Backward programs for steps where some outputs got no gradient (zero_tangents.py), by the
    # positions of the missing tangents; and the positions the last backward ran without.
    _without: dict = dataclasses.field(default_factory=dict, repr=False)
    # The same by missing tangents, leaving the saved activations unchanged (retain_graph=True).
    _keeping_saved: dict = dataclasses.field(default_factory=dict, repr=False)
    last_missing_tangents: tuple[int, ...] | None = None
    # Set by the compile driver: user output -> factor its incoming gradient is scaled by (1/N for
    # an output split over N data-parallel ranks: compile/driver.data_parallel_tangent_scales).
    tangent_scales: dict = dataclasses.field(default_factory=dict)

    def backward_without(self, missing: tuple[int, ...] = ()) -> torch.fx.GraphModule:
        """The backward program with the tangents at positions ``missing`` read as zeros."""
        if not missing:
            return self.backward_gm
        if missing not in self._without:
            self._without[missing] = without_tangents(self.backward_gm, missing)
        return self._without[missing]

    def missing_tangents(self) -> tuple[int, ...]:
        """The tangents the next backward most likely runs without: the last backward's; before
        any, those of the outputs that are not scalars when some output is one (a model returning
        its loss and its logits, trained with ``loss.backward()``)."""
        if self.last_missing_tangents is not None:
            return self.last_missing_tangents
        outputs = list(self.forward_gm.graph.output_node().args[0])
        scalar = [isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)
                  and o.meta["val"].dim() == 0 for o in (outputs[i] for i in self.tangent_outputs)]
        return tuple(j for j, s in enumerate(scalar) if not s) if any(scalar) else ()

    def backward_keeping_saved(self, missing: tuple[int, ...] = ()) -> torch.fx.GraphModule:
        """``backward_without(missing)`` that leaves the saved activations as they are (for
        ``retain_graph=True``): the copy without passes/inplace_reuse.py's writes into them, or the
        program itself if it makes none."""
        if missing not in self._keeping_saved:
            gm = self.backward_without(missing)
            self._keeping_saved[missing] = without_saved_overwrites(gm) if overwrites_inputs(gm) else gm
        return self._keeping_saved[missing]

    def runnable(self, phase: str, missing: tuple[int, ...] = (), keep_saved: bool = False):
        """The program of ``phase`` to run now: with named ranges while a profiler records, through
        the kernel generator when there is one. ``missing``: backward's tangents that are absent;
        ``keep_saved``: backward must leave its saved activations unchanged (``retain_graph=True``)."""
        if phase == "forward":
            gm = self.forward_gm
        else:
            gm = self.backward_keeping_saved(missing) if keep_saved else self.backward_without(missing)
        variant = phase + "".join(f".no_tangent{m}" for m in missing) + (".keep_saved" if keep_saved else "")
        profiled = self.ranges is not None and ranges_wanted()
        if profiled:
            if variant not in self._with_ranges:
                self._with_ranges[variant] = with_ranges(gm, phase, self.ranges)
            gm = self._with_ranges[variant]
        if self.generator is None:
            return gm
        key = (variant, profiled)
        if key not in self._generated:
            self._generated[key] = self.generator(gm, variant + (".profiled" if profiled else ""))
        return self._generated[key]

    @classmethod
    def from_programs(cls, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                      captured: CapturedGraph) -> "CompiledProgram":
        """The program of a joint graph partitioned into ``fw`` and ``bw`` (boxed) by the compile's
        back half (compile/programs.py), ``captured`` describing its inputs and outputs."""
        primals = [i for i in captured.inputs if i.kind != InputKind.TANGENT]
        tangents = tuple(i.index for i in captured.inputs if i.kind == InputKind.TANGENT)
        # The buffer updates are forward outputs without a tangent, like non-differentiable user outputs.
        num_outputs = captured.num_forward_outputs
        differentiable = tuple(i in tangents for i in range(captured.num_user_outputs))
        differentiable += (False,) * len(captured.buffer_updates)
        for n in fw.graph.find_nodes(op="placeholder"):
            if isinstance(n.meta.get("val"), torch.SymInt):
                # Capture traces fake tensors of static shapes (torch.export specialises them); only
                # values computed at run time (an expert region's split sizes) may be symbolic, and
                # those reach backward as saved integers, never as forward inputs.
                raise internal_error(
                    "the runtime", f"placeholder {n.name!r} of the forward program is a symbolic "
                    "size, but capture specialises every input shape (dynamic shapes are not supported yet)",
                )
        kept = tuple(o.name for o in captured.outputs if o.kind == "gathered")
        return cls(fw, bw, num_outputs, len(primals), tangents, differentiable, kept,
                   buffer_updates=captured.buffer_updates)

    @property
    def num_model_outputs(self) -> int:
        """How many of the forward's outputs are the model's own (the rest are buffer updates)."""
        return self.num_user_outputs - len(self.buffer_updates)

    def bind_buffers(self, module: torch.nn.Module) -> None:
        """Write the buffers this program updates into ``module``'s after each forward (the
        runtime calls this before running the program)."""
        self.buffer_hook = (lambda values: write_buffers(module, values)) if self.buffer_updates else None

    def saved_for_backward(self) -> list[torch.fx.Node]:
        """The forward graph's outputs that backward consumes (activations, views, inputs)."""
        return list(self.forward_gm.graph.output_node().args[0][self.num_user_outputs :])

    def __call__(self, *primals: torch.Tensor):
        """The model's outputs; the buffer updates go to ``buffer_hook``."""
        outs = _RunStep.apply(self, *primals)
        if not self.buffer_updates:
            return outs
        n = self.num_model_outputs
        if self.buffer_hook is None:
            raise RuntimeError(
                f"this program updates buffers {list(self.buffer_updates)} in forward but nothing writes "
                "them back: call program.bind_buffers(module) before running it"
            )
        self.buffer_hook(dict(zip(self.buffer_updates, outs[n:])))
        return outs[:n]


def write_buffers(module: torch.nn.Module, values: dict) -> None:
    """Copy each new value into ``module``'s buffer of that FQN, in place (its local shard when the
    buffer is a DTensor), so references to the buffer (``state_dict()``) see it, as with eager
    BatchNorm's in-place update."""
    buffers = dict(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for fqn, value in values.items():
            buffer = buffers.get(fqn)
            if buffer is None:
                raise ValueError(
                    f"{type(module).__name__}: the compiled forward updates buffer {fqn!r}, which is no "
                    "longer registered on the module; keep the buffers the model was compiled with "
                    "(re-register it) or parallelize the model again"
                )
            local = compat.plain_tensor(buffer)
            if local.shape != value.shape:
                raise ValueError(
                    f"{type(module).__name__}: buffer {fqn!r} holds shape {tuple(local.shape)} on this "
                    f"rank but the compiled forward computed {tuple(value.shape)} for it; the buffer was "
                    "replaced after compiling: load new values with load_state_dict (in place) instead"
                )
            local.copy_(value)


class _RunStep(torch.autograd.Function):
    """One forward program call and its backward. Parameters arrive as the module's DTensors and
    their gradients leave as DTensors with the parameter's own spec: unwrapping and rewrapping here
    costs one attribute read and one wrapper per parameter, where ``to_local()`` would add an
    autograd node per parameter and a ``DTensor.from_local`` (a new spec) per gradient, on every
    step."""

    @staticmethod
    def forward(ctx, program: CompiledProgram, *primals):
        ctx.dtensor_specs = [compat.spec_of(p) if isinstance(p, DTensor) else None for p in primals]
        primals = [compat.plain_tensor(p) for p in primals]
        outs = _call(program.on_error, program.runnable("forward"), "forward", primals)
        user, saved = outs[: program.num_user_outputs], outs[program.num_user_outputs :]
        ctx.program = program
        ctx.grad_hook = program.grad_hook
        ctx.kept_hook = program.kept_hook
        ctx.on_error = program.on_error
        ctx.primal_meta = [(p.dtype, p.device) if isinstance(p, torch.Tensor) else (None, None) for p in primals]
        # Integers computed in forward (an expert region's all-to-all split sizes) travel beside
        # the saved tensors.
        ctx.saved_is_tensor = [isinstance(s, torch.Tensor) for s in saved]
        ctx.saved_scalars = [s for s in saved if not isinstance(s, torch.Tensor)]
        ctx.save_for_backward(*(s for s in saved if isinstance(s, torch.Tensor)))
        # An output no gradient reaches arrives in backward as None, not as zeros of its size
        # (zero_tangents.py: the backward program then skips adding them).
        ctx.set_materialize_grads(False)
        non_diff = [o for o, d in zip(user, program.differentiable) if not d and isinstance(o, torch.Tensor)]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs):
        program: CompiledProgram = ctx.program
        args = list(ctx.saved_tensors)
        if ctx.saved_scalars:
            tensors, scalars = iter(args), iter(ctx.saved_scalars)
            args = [next(tensors) if is_tensor else next(scalars) for is_tensor in ctx.saved_is_tensor]
            del tensors  # it references the first list: only ``args`` may own the saved tensors
        tangents = [grad_outputs[i] for i in program.tangent_outputs]
        if program.tangent_scales:  # a per-rank loss on this rank's rows counts as DDP's would
            scales = program.tangent_scales
            tangents = [t * scales[i] if t is not None and i in scales else t
                        for i, t in zip(program.tangent_outputs, tangents)]
        missing = tuple(j for j, t in enumerate(tangents) if t is None)
        program.last_missing_tangents = missing
        args += [t.contiguous() if t is not None else None for t in tangents]
        # The list is now the only owner of the saved activations, so backward may write into them
        # (passes/inplace_reuse.py), unless autograd keeps them for another backward.
        keep_saved = compat.graph_task_keeps_graph()
        ctx.maybe_clear_saved_tensors()
        grads = _call(ctx.on_error, program.runnable("backward", missing, keep_saved), "backward", args, boxed=True)
        if len(grads) != program.num_primals + len(program.kept_gathered):
            # Gradients would be handed to the wrong parameters: never run on.
            raise internal_error(
                "the runtime (backward)", f"the backward program returned {len(grads)} values, not one "
                f"gradient per primal ({program.num_primals}) plus {len(program.kept_gathered)} kept "
                "gathered parameters",
            )
        grads, kept = grads[: program.num_primals], grads[program.num_primals :]
        if kept and ctx.kept_hook is not None:
            ctx.kept_hook(dict(zip(program.kept_gathered, kept)))
        if ctx.grad_hook is not None:
            grads = ctx.grad_hook(list(grads))
        # Gradients reduced in another dtype (mixed precision's reduce_dtype) or on another device
        # (CPU offload) arrive there; autograd needs each like its input: a DTensor parameter's as
        # a DTensor laid out as the parameter.
        return (None, *(
            _like_primal(g, dtype, device, spec)
            for g, (dtype, device), spec in zip(grads, ctx.primal_meta, ctx.dtensor_specs)
        ))


def _like_primal(grad, dtype, device, spec):
    if grad is None:
        return None
    if (grad.dtype, grad.device) != (dtype, device):
        grad = grad.to(device=device, dtype=dtype)
    return grad if spec is None else compat.dtensor_from_spec(grad, spec)


def _call(on_error, gm, phase: str, args, boxed: bool = False):
    """Run one program, as the range ``hyper_parallel::<phase>`` in a torch.profiler trace; an
    exception it raises goes through ``on_error`` to name where it was."""
    try:
        with torch.profiler.record_function(f"hyper_parallel::{phase}"), programs_run_as_captured():
            return gm(args) if boxed else gm(*args)
    except RuntimeError as exc:
        # A generated program (codegen="inductor") keeps the collectives in its GraphModule.
        better = on_error(exc, getattr(gm, "gm", gm), phase) if on_error is not None else None
        if better is None:
            raise
        raise better from exc
