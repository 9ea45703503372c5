"""The back half every compile shares: one lowered joint graph → the programs a rank runs.

    passes → forward/backward partition → agreement gate → dumps → (zero-bubble split of backward)
    → the collectives of each program → kernels (``codegen="inductor"``)

A plain module has one joint graph (``driver.finish`` wraps the result in a
``runtime.program.CompiledProgram``); a pipelined one has a joint graph per stage and variant
(``pipeline/compile.py`` wraps each in a ``StageProgram``). Both come here, so a pass, the
partition, the gate or codegen behaves the same on either path. Nothing here keeps state or
touches the module: it reads the frozen request and the graph it is given (which the passes
rewrite in place) and returns what it built. The SPMD check stays with the caller, which checks
all its programs at once."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch

from .. import compat
from ..codegen import generate
from ..analysis.debug import Dumper, collectives, group_axis_names
from ..ir.collectives import Collective
from ..passes import PassContext, run_passes
from ..runtime.agreement_gate import insert_gate
from ..runtime.partition import BackwardSplit, partition_by_phase, split_backward
from .request import CompileRequest


@dataclasses.dataclass
class Programs:
    """What one joint graph compiled into."""

    forward_gm: torch.fx.GraphModule
    backward_gm: torch.fx.GraphModule  # boxed: it takes its arguments as one list it clears
    # backward_gm cut into input- and weight-gradient programs (``weight_outputs`` given), or None
    split: BackwardSplit | None
    # Program name -> its collectives: "forward" and "backward", or "forward", "backward input" and
    # "backward weight" when split (the programs a schedule runs).
    collectives: dict[str, list[Collective]]
    # codegen="inductor": ``generator(gm, label)`` makes a program's kernels (codegen.generate,
    # dumping with this compile's dumper); None otherwise.
    generator: Callable | None = None

    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """Program name (as in ``collectives``) -> its graph: the programs a schedule runs."""
        if self.split is None:
            return {"forward": self.forward_gm, "backward": self.backward_gm}
        return {"forward": self.forward_gm, "backward input": self.split.input_gm,
                "backward weight": self.split.weight_gm}

    def runners(self, label: str) -> dict[str, Callable]:
        """With a generator: the kernels of every program of :meth:`graphs` (keys with ``_`` for
        spaces, ``label`` their prefix in dumps), made now; else an empty dict (run the graphs)."""
        if self.generator is None:
            return {}
        return {name.replace(" ", "_"): self.generator(gm, f"{label}.{name.replace(' ', '_')}")
                for name, gm in self.graphs().items()}


def run_pass_pipeline(request: CompileRequest, local, annotated: dict, on_pass, timings: dict | None = None,
                      backward_reordered: bool = False, activation=None) -> torch.fx.GraphModule:
    """The ordered passes over one lowered (or stage) joint graph with the request's options;
    ``timings`` (if given) receives each pass's seconds; ``backward_reordered``: a pipeline stage
    whose backward runs split into input- and weight-gradient programs (PassContext);
    ``activation``: the recompute/swap plan to run with (default: the request's)."""
    options = request.options
    return run_passes(
        local, PassContext(
            mesh=request.mesh, fsdp=request.resolved.fsdp, explicit_prefetch=dict(request.explicit_prefetch),
            prefetch_depth=options.prefetch_depth, reductions_in_flight=options.reductions_in_flight,
            activation=dataclasses.replace(activation or request.activation, annotated=annotated),
            gradient_bucket_bytes=options.gradient_bucket_bytes,
            first_gradient_bucket_bytes=options.first_gradient_bucket_bytes,
            disable_passes=options.disable_passes, reduction_lanes=request.resolved.reduction_lanes,
            codegen=options.codegen, on_pass=on_pass, timings={} if timings is None else timings,
            backward_reordered=backward_reordered,
        )
    )


def build_programs(
    request: CompileRequest, joint: torch.fx.GraphModule, annotated: dict, dumper: Dumper, num_forward_outputs: int,
    *, timings: dict | None = None, activation=None, backward_reordered: bool = False,
    weight_outputs: Sequence[int] | None = None, before_partition: Callable | None = None,
) -> Programs:
    """``joint`` through the back half (module docstring). ``num_forward_outputs``: the joint
    graph's output slots that are the forward's; ``timings``: receives each pass's seconds;
    ``activation``: the recompute/swap plan (default: the request's); ``backward_reordered``: the
    stage's backward runs split (PassContext); ``weight_outputs``: cut backward into input- and
    weight-gradient programs, these output slots (parameter gradients) going to the weight one;
    ``before_partition(gm)``: runs on the graph after the passes (the plain path dumps layouts and
    flattens its placeholders there)."""
    gm = run_pass_pipeline(request, joint, annotated, dumper.graph, timings,
                           backward_reordered=backward_reordered, activation=activation)
    if before_partition is not None:
        before_partition(gm)
    forward_gm, backward_gm, _ = partition_by_phase(gm, num_forward_outputs)
    # A call reusing a program waits for the ranks' agreement right before its first collective.
    insert_gate(forward_gm)
    split = None
    if weight_outputs is not None:  # cut before boxing: the parts are boxed on their own
        split = split_backward(backward_gm, list(weight_outputs))
    # Backward frees each saved activation after its last use (as eager autograd does), not when
    # it returns: it takes its arguments as one list that it clears.
    compat.use_boxed_calling_convention(backward_gm)
    if split is not None:
        compat.use_boxed_calling_convention(split.input_gm)
        compat.use_boxed_calling_convention(split.weight_gm)
    # The dumps show the programs as they run (backward boxed).
    dumper.graph("forward", forward_gm)
    dumper.graph("backward", backward_gm)
    if split is not None:
        dumper.graph("backward_input", split.input_gm)
        dumper.graph("backward_weight", split.weight_gm)
    resolved = request.resolved
    axis_of_group = group_axis_names(request.mesh, resolved.fsdp, resolved.context)
    built = Programs(forward_gm, backward_gm, split, {})
    built.collectives = {name: collectives(program, axis_of_group) for name, program in built.graphs().items()}
    if request.options.codegen == "inductor":
        built.generator = functools.partial(generate, dumper=dumper)
    return built
