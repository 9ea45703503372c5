"""Kernel code generation for the per-rank programs: ``parallelize(..., codegen=...)``.

``"eager"`` runs each program as its FX GraphModule, op by op (aten kernels). ``"inductor"`` keeps
that program and its schedule (every collective, wait, release, swap and profiler range where the
passes put it) and hands each compute region between them to Inductor (regions.py, inductor.py):
:func:`generate` returns the program with the regions outlined as ``InductorRegion`` modules,
compiled on their first call. The dumps and summaries keep describing our program (the graph the
passes wrote); ``<phase>.inductor.py`` shows the generated program around the regions and
``inductor/<phase>.region<i>.py`` each region's generated code.
"""

from __future__ import annotations

import time

import torch

from .. import compat
from ..progress import Progress
from .inductor import InductorRegion, cache_stats
from .regions import cut_regions, outline, region_graph_module

CODEGENS = ("eager", "inductor")
# A region with fewer ops that do work than this stays as eager ops: one mm or one view is already
# one kernel, and a compile would only cost time.
MIN_REGION_WORK = 2


def check_codegen(value) -> str:
    """``value`` as a codegen name, or a ValueError naming the choices."""
    if value not in CODEGENS:
        raise ValueError(f"parallelize(codegen={value!r}): choose one of {list(CODEGENS)}")
    return value


class GeneratedProgram:
    """A program with its compute regions as Inductor kernels; called as the program it replaces
    (the same arguments and calling convention; ``gm`` is its GraphModule). After its first call
    (when its regions compile) rank 0 logs one progress line: regions compiled, reused, seconds."""

    def __init__(self, gm: torch.fx.GraphModule, label: str, regions: int):
        self.gm = gm
        self.label = label
        self.regions = regions
        self._first = True

    def __call__(self, *args):
        if not self._first:
            return self.gm(*args)
        before, started = cache_stats(), time.perf_counter()
        result = self.gm(*args)
        self._first = False
        after = cache_stats()
        Progress(f"inductor {self.label}").record(
            "first call", time.perf_counter() - started,
            f"{self.regions} regions, {after.compiled - before.compiled} compiled, "
            f"{after.reused - before.reused} reused from the cache")
        return result


def generate(gm: torch.fx.GraphModule, label: str, dumper=None) -> GeneratedProgram:
    """``gm`` with its compute regions (of at least ``MIN_REGION_WORK`` ops) as Inductor kernels
    (module docstring). ``label``: the program's name in dumps and logs (``forward``,
    ``stage1.backward``); ``dumper``: a debug.Dumper, or None."""
    regions = cut_regions(gm.graph)

    def on_compile(region_label, region_gm, compiled, seconds, reused):
        if dumper is not None and dumper.dir:
            source = compat.inductor_source(compiled) or "# Inductor kept no source for this region\n"
            header = f"# {region_label}: {'reused from the cache' if reused else f'compiled in {seconds:.2f} s'}\n"
            dumper.text(f"inductor.{region_label}.py", header + "# region graph:\n# " +
                        region_gm.code.strip().replace("\n", "\n# ") + "\n\n" + source)

    def make(index, region):
        if region.work < MIN_REGION_WORK:
            return None
        return InductorRegion(region_graph_module(region, gm), f"{label}.region{index}", on_compile)

    generated = outline(gm, regions, make)
    if compat.is_boxed_call(gm):
        compat.use_boxed_calling_convention(generated)
    outlined = sum(1 for n in generated.graph.nodes if n.op == "call_module")
    if dumper is not None:
        dumper.text(f"{label}.inductor.py", generated.print_readable(print_output=False, include_stride=False,
                                                                     include_device=False))
    return GeneratedProgram(generated, label, outlined)
