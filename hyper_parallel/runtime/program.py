"""The compiled training step: the local joint graph split into forward and backward programs.

``CompiledProgram`` partitions the lowered joint graph by phase (partition.py: the forward and
backward nodes as scheduled by the passes; the forward values backward reads are saved) and runs
the pair inside one ``torch.autograd.Function``, so the user's ``loss.backward()``
runs our backward graph and leaves each parameter's gradient in its (DTensor) ``.grad``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import compat
from ..capture import CapturedGraph
from .partition import partition_by_phase


def flatten_placeholders(gm: torch.fx.GraphModule, captured: CapturedGraph) -> None:
    """Rename the lowered graph's placeholders to ``primals_i``/``tangents_i`` (the partitioner tells
    forward inputs from tangents by name) and make it a flat positional callable."""
    primal_i = tangent_i = 0
    for node, info in zip(gm.graph.find_nodes(op="placeholder"), captured.inputs):
        if info.kind == "tangent":
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
    num_user_outputs: int
    num_primals: int
    tangent_outputs: tuple[int, ...]  # which user outputs have a tangent input in backward
    differentiable: tuple[bool, ...]  # per user output
    # FQNs of the gathered parameters backward returns after the gradients (kept for the next
    # forward: set_reshard_after_backward(False)).
    kept_gathered: tuple[str, ...] = ()
    # Set by the runtime per call: receives the backward's gradients and returns what autograd gets
    # (gradient accumulation keeps not-yet-reduced gradients aside for the next micro-step).
    grad_hook: object = None
    # Set by the runtime per call: receives {FQN: gathered parameter} when kept_gathered is not empty.
    kept_hook: object = None

    @classmethod
    def from_joint(cls, joint_gm: torch.fx.GraphModule, captured: CapturedGraph) -> "CompiledProgram":
        primals = [i for i in captured.inputs if i.kind != "tangent"]
        tangents = tuple(i.index for i in captured.inputs if i.kind == "tangent")
        num_outputs = captured.num_user_outputs
        fw, bw, _ = partition_by_phase(joint_gm, num_outputs)
        differentiable = tuple(i in tangents for i in range(num_outputs))
        for gm in (fw, bw):
            if any(
                isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder")
            ):
                raise NotImplementedError("dynamic shapes are not supported yet")
        kept = tuple(o.name for o in captured.outputs if o.kind == "gathered")
        # Backward frees each saved activation after its last use (as eager autograd does), not
        # when it returns: it takes its arguments as one list that it clears.
        compat.use_boxed_calling_convention(bw)
        return cls(fw, bw, num_outputs, len(primals), tangents, differentiable, kept)

    def saved_for_backward(self) -> list[torch.fx.Node]:
        """The forward graph's outputs that backward consumes (activations, views, inputs)."""
        return list(self.forward_gm.graph.output_node().args[0][self.num_user_outputs :])

    def __call__(self, *primals: torch.Tensor):
        return _RunStep.apply(self, *primals)


class _RunStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program: CompiledProgram, *primals):
        outs = program.forward_gm(*primals)
        user, saved = outs[: program.num_user_outputs], outs[program.num_user_outputs :]
        ctx.program = program
        ctx.grad_hook = program.grad_hook
        ctx.kept_hook = program.kept_hook
        ctx.primal_meta = [(p.dtype, p.device) if isinstance(p, torch.Tensor) else (None, None) for p in primals]
        ctx.save_for_backward(*saved)
        non_diff = [o for o, d in zip(user, program.differentiable) if not d and isinstance(o, torch.Tensor)]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user)

    @staticmethod
    def backward(ctx, *grad_outputs):
        program: CompiledProgram = ctx.program
        args = [*ctx.saved_tensors, *[grad_outputs[i].contiguous() for i in program.tangent_outputs]]
        ctx.maybe_clear_saved_tensors()  # the list is now the only owner of the saved activations
        grads = program.backward_gm(args)
        assert len(grads) == program.num_primals + len(program.kept_gathered), len(grads)
        grads, kept = grads[: program.num_primals], grads[program.num_primals :]
        if kept and ctx.kept_hook is not None:
            ctx.kept_hook(dict(zip(program.kept_gathered, kept)))
        if ctx.grad_hook is not None:
            grads = ctx.grad_hook(list(grads))
        # Gradients reduced in another dtype (mixed precision's reduce_dtype) or on another device
        # (CPU offload) arrive there; autograd needs each like its input.
        return (None, *(
            g.to(device=device, dtype=dtype) if g is not None and (g.dtype, g.device) != (dtype, device) else g
            for g, (dtype, device) in zip(grads, ctx.primal_meta)
        ))
