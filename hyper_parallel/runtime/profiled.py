"""Named profiler ranges inside the compiled programs: per FSDP unit and per collective.

While a ``torch.profiler`` is recording, the runtime runs a copy of each program with ranges
inserted as graph nodes (``record_function``'s own enter/exit ops), so a trace shows, inside
``hyper_parallel::forward`` / ``backward``:

* ``hyper_parallel::unit <fqn> <phase>``: each stretch of the program computing one FSDP unit's
  modules (the innermost unit holding the node's module; the loss and anything outside every unit
  belong to the root unit);
* ``hyper_parallel::<kind>[<axis>] <why>``: each collective's issue, named by kind, mesh axis and
  reason (analysis/why.py), and ``hyper_parallel::wait <kind>[<axis>]`` for its wait.

The copy is built on the first profiled call and kept; without a profiler the programs run
unchanged (a range costs a little even when nothing records, so it is never paid outside profiling).
Under :func:`ranges_suspended` they run unchanged even while a profiler records: a measurement that
uses the profiler only for its memory events (``testing.AllocatorPeak``) measures the programs as
they run in training, not a copy (with ``codegen="inductor"`` the ranges also cut other regions).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from .. import compat
from ..ir.graph import module_fqn_of
from ..ir import meta
from ..ir.collectives import collective_kind
from ..analysis.why import reason

_WAIT = torch.ops._c10d_functional.wait_tensor.default


_SUSPENDED = [0]  # depth of nested ranges_suspended() blocks


@contextlib.contextmanager
def ranges_suspended():
    """Run the programs without ranges inside this block, profiler or not (module docstring)."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1


def ranges_wanted() -> bool:
    """Whether a program run now gets its ranges: a profiler records and no block suspends them."""
    return compat.profiler_enabled() and not _SUSPENDED[0]


@dataclasses.dataclass(frozen=True)
class Ranges:
    """What the range names need: mesh axis label of each process group, and the FSDP units."""

    axis_of_group: dict
    units: tuple[str, ...] = ()

    def unit_of(self, node: torch.fx.Node) -> str | None:
        """The innermost FSDP unit holding ``node``'s module, "" for the root, None without units."""
        if not self.units:
            return None
        fqn = module_fqn_of(node)
        inside = [u for u in self.units if u == "" or fqn == u or fqn.startswith(u + ".")]
        return max(inside, key=len) if inside else ""


def with_ranges(gm: torch.fx.GraphModule, phase: str, ranges: Ranges) -> torch.fx.GraphModule:
    """A copy of ``gm`` (same calling convention) with the module docstring's ranges as nodes."""
    graph = copy.deepcopy(gm.graph)  # keeps the node metadata and the calling convention (boxed)
    unit_open: tuple[str, torch.fx.Node] | None = None
    for node in list(graph.nodes):
        if node.op == "output":
            if unit_open is not None:
                _exit(graph, node, unit_open[1], before=True)
            break
        if node.op != "call_function":
            continue
        if node.meta.get(meta.ROLE) == meta.ROLE_COMPUTE:
            unit = ranges.unit_of(node)
            if unit is not None and (unit_open is None or unit_open[0] != unit):
                if unit_open is not None:
                    _exit(graph, node, unit_open[1], before=True)
                unit_open = (unit, _enter(graph, node, f"hyper_parallel::unit {unit or '<root>'} {phase}"))
        kind = collective_kind(node)
        if kind is not None:
            axis = ranges.axis_of_group.get(node.args[-1], str(node.args[-1]))
            why = reason(node)
            handle = _enter(graph, node, f"hyper_parallel::{kind}[{axis}]" + (f" {why}" if why else ""))
            _exit(graph, node, handle, before=False)
        elif node.target is _WAIT and isinstance(node.args[0], torch.fx.Node):
            issued = node.args[0]
            kind = collective_kind(issued)
            if kind is not None:
                axis = ranges.axis_of_group.get(issued.args[-1], str(issued.args[-1]))
                handle = _enter(graph, node, f"hyper_parallel::wait {kind}[{axis}]")
                _exit(graph, node, handle, before=False)
    return torch.fx.GraphModule(gm, graph)


def _enter(graph: torch.fx.Graph, at: torch.fx.Node, name: str) -> torch.fx.Node:
    with graph.inserting_before(at):
        return graph.call_function(compat.RECORD_FUNCTION_ENTER, (name, None))


def _exit(graph: torch.fx.Graph, at: torch.fx.Node, handle: torch.fx.Node, before: bool) -> None:
    with graph.inserting_before(at) if before else graph.inserting_after(at):
        graph.call_function(compat.RECORD_FUNCTION_EXIT, (handle,))
