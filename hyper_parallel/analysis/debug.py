"""Dumps and summaries: what the compiler did, readable per rank.

``Dumper`` writes, under ``dump_dir/rank<r>/``: one ``NN_<stage>.py`` per pipeline stage (graph code),
``layouts.tsv`` (node, op, module FQN, input layouts, output layout, local shape, source line, and
for collectives and layout changes why the program has them: analysis/why.py),
``forward.py``/``backward.py`` (the partitioned programs) and ``summary.json`` (collectives per step
by kind and mesh axis with count and bytes, fallbacks, plan-imposed redistributions); for
``hyper-parallel report``: ``passes.json`` (per stage, the nodes it added, removed and moved),
``memory.json`` (live bytes over the step) and ``trace.json`` (the cost model's simulated step, a
Chrome trace). Everything is written deterministically: the same model, plan, mesh and inputs give
byte-identical files.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import types

import torch
import torch.distributed as dist

from .. import compat
from ..ir.graph import module_fqn_of, source_line
from ..ir import meta
from ..ir.collectives import Collective, collective_kind
from ..layout import format_placements
from .why import reason

log = logging.getLogger(__name__)


def group_axis_names(mesh, fsdp=None, context=None) -> dict[str, str]:
    """Process-group name → mesh axis name for every axis of ``mesh``; with ``fsdp`` (an FsdpPlan),
    also "<shard axis>/k<k>" for the groups of k ranks that ``reshard_after_forward=<k>`` units
    gather over in backward, and "<axis>+<axis>" for the mesh flattened over the axes dense
    parameters are sharded over (FsdpPlan.joint_group); with ``context`` (a ContextPlan),
    "<cp axis>/ulysses" and "<cp axis>/ring" for the hybrid's sub-groups; a gloo axis's reduction
    lane (plan/lanes.py) gets its axis's name. Group names differ between ranks; these labels do
    not."""
    from ..plan.lanes import known_lanes

    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    out = {mesh.get_group(i).group_name: names[i] for i in range(mesh.ndim)}
    out.update({lane: out[group] for group, lane in known_lanes(mesh).items() if group in out})
    for group, part in ((getattr(context, "ulysses_group", None), "ulysses"),
                        (getattr(context, "ring_group", None), "ring")):
        if group is not None:
            out[group] = f"{context.axis}/{part}"
    if getattr(fsdp, "joint_group", None) is not None:  # FSDP over several axes, one group
        out[fsdp.joint_group] = "+".join(fsdp.joint_axes)
    for unit in fsdp.units if fsdp is not None else ():
        k = unit.reshard_after_forward
        if unit.post_forward_group is not None and isinstance(k, int) and not isinstance(k, bool):
            out[unit.post_forward_group] = f"{fsdp.shard_axis}/k{k}"
    return out


def collectives(gm: torch.fx.GraphModule, axis_of_group: dict[str, str]) -> list[Collective]:
    out = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        val = node.args[0].meta["val"]
        group = node.args[-1]
        out.append(
            Collective(
                kind=kind,
                axis=axis_of_group.get(group, group),
                dtype=str(val.dtype).replace("torch.", ""),
                shape=tuple(s if isinstance(s, int) else str(s) for s in val.shape),
                nbytes=compat.size_hint(val.numel()) * val.element_size(),
                node=node.name,
                source=node.meta.get(meta.SOURCE, ""),
                group=group,
                why=reason(node),
            )
        )
    return out


def collective_summary(colls: list[Collective]) -> dict:
    """{kind: {axis: {"count": n, "bytes": b}}}, sorted for deterministic output."""
    table: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: {"count": 0, "bytes": 0}))
    for c in colls:
        entry = table[c.kind][c.axis]
        entry["count"] += 1
        entry["bytes"] += c.nbytes
    return {k: {a: dict(v) for a, v in sorted(axes.items())} for k, axes in sorted(table.items())}


def _fmt_spec(spec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, (tuple, list)):
        return "(" + ", ".join(_fmt_spec(s) for s in spec) + ")"
    return format_placements(spec.placements)


def layout_table(gm: torch.fx.GraphModule) -> str:
    """One row per node of the lowered graph: what a user reads to see where data lives."""
    rows = ["node\top\tmodule\tinput_layouts\toutput_layout\tlocal_shape\tsource\twhy"]
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        layout = node.meta.get(meta.LAYOUT)
        val = node.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else "-"
        if meta.is_redistribute(node):
            inputs, output = node.meta.get(meta.REDISTRIBUTE, ""), "-"
        else:
            inputs = _fmt_spec(layout.inputs) if layout and node.op != "placeholder" else "-"
            output = _fmt_spec(layout.output) if layout else "-"
        op = "placeholder" if node.op == "placeholder" else str(node.target)
        rows.append("\t".join(
            (node.name, op, module_fqn_of(node), inputs, output, str(shape), source_line(node), reason(node))
        ))
    return "\n".join(rows) + "\n"


class Dumper:
    """Writes the per-rank dump files; a no-op when ``dump_dir`` is None."""

    def __init__(self, dump_dir: str | None, rank: int):
        self.dir = os.path.join(dump_dir, f"rank{rank}") if dump_dir else None
        self.rank = rank
        self.step = 0
        self._rewrites = 0  # rewrites dumped after the current step's graph
        self.stages: list[tuple[str, str, list]] = []  # (stage, file, graph_nodes) for passes.json
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)

    def _write(self, name: str, text: str) -> None:
        if self.dir:
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)

    def graph(self, stage: str, gm: torch.fx.GraphModule) -> None:
        if self.dir:
            code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
            file = f"{self.step:02d}_{stage}.py"
            self._write(file, code)
            self.stages.append((stage, file, graph_nodes(gm)))
            self.step += 1
            self._rewrites = 0

    def rewrite(self, stage: str, gm: torch.fx.GraphModule) -> None:
        """A rewrite of the graph last dumped, as ``NNa_<stage>.py``, ``NNb_…`` after ``NN_<stage>.py``
        (rewrites before propagation, after ``00_captured.py``); not a stage of ``passes.json``."""
        if self.dir:
            code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
            self._write(f"{self.step - 1:02d}{chr(ord('a') + self._rewrites)}_{stage}.py", code)
            self._rewrites += 1

    def _remove(self, name: str) -> None:
        if self.dir and os.path.exists(os.path.join(self.dir, name)):
            os.remove(os.path.join(self.dir, name))

    def text(self, name: str, text: str) -> None:
        self._write(name, text)

    def json(self, name: str, data, indent: int | None = 2) -> None:
        separators = None if indent else (",", ":")
        self._write(name, json.dumps(data, indent=indent, sort_keys=True, separators=separators) + "\n")

    def report_data(self, program, mesh, fsdp, memory, memory_series: list, context=None) -> None:
        """The files ``hyper-parallel report`` reads besides the graphs, layouts.tsv and
        summary.json: ``passes.json`` (per stage, nodes added / removed / moved), ``memory.json``
        (``memory``, the compile's estimate, and ``memory_series``, live bytes at each moment of
        its replay) and ``trace.json`` (the cost model's simulated step as a Chrome trace, for
        Perfetto). The trace is a diagnostic: if the cost model fails, a warning is logged and the
        file is skipped, the compile goes on."""
        if not self.dir:
            return
        from .memory import CATEGORIES

        self.json("passes.json", {"rank": self.rank, "stages": pass_report(self.stages)})
        self.json("memory.json", {"categories": list(CATEGORIES), "estimate": memory.as_dict(),
                                  "points": memory_series}, indent=None)
        try:
            trace, _ = step_trace(program, mesh, fsdp, self.rank, context=context)
            self.json("trace.json", trace, indent=None)
        except Exception as e:  # noqa: BLE001 - a dump must never break compilation
            log.warning("dump: cost-model step trace skipped (%s: %s)", type(e).__name__, e, exc_info=True)
            self._remove("trace.json")  # not a stale one from an earlier compile


# --- report data: what ``hyper-parallel report`` needs beyond the graph code --------------------
#
# The report (hyper_parallel/tools/report/) must work from a dump directory alone, copied off a cluster,
# so the dump carries what the .py files cannot give back: node identities per stage (passes.json),
# the simulated step (trace.json) and live memory over the step (memory.json).

# Mesh device type -> the cost model's hardware profile for the dumped step trace.
DEVICE_PROFILES = {"cpu": "cpu", "cuda": "h100", "npu": "ascend-910b"}
PROFILE_ENV = "HYPER_PARALLEL_DUMP_HARDWARE"  # overrides the profile (a name in cost.PROFILES)


def graph_nodes(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """(name, op, module FQN) of every node but the output, in graph order."""
    return [
        (node.name, node.op if node.op != "call_function" else _target_name(node.target), module_fqn_of(node))
        for node in gm.graph.nodes
        if node.op != "output"
    ]


def _target_name(target) -> str:
    """An op's name as dumps show it: ``str(target)`` (``aten.mm.default``, ``<built-in function
    getitem>``), but a Python function's module and qualified name, since its repr holds its
    address, which differs between runs (dumps are deterministic, docs/architecture.md §4.5)."""
    if isinstance(target, types.FunctionType):
        return f"{target.__module__}.{target.__qualname__}"
    return str(target)


def _longest_increasing(values: list[int]) -> set[int]:
    """Indices of one longest strictly increasing subsequence of ``values`` (patience sorting)."""
    import bisect

    tails: list[int] = []  # tails[k]: index of the smallest tail of an increasing run of length k+1
    tail_values: list[int] = []
    prev = [-1] * len(values)
    for i, v in enumerate(values):
        k = bisect.bisect_left(tail_values, v)
        if k > 0:
            prev[i] = tails[k - 1]
        if k == len(tails):
            tails.append(i)
            tail_values.append(v)
        else:
            tails[k], tail_values[k] = i, v
    keep, i = set(), tails[-1] if tails else -1
    while i >= 0:
        keep.add(i)
        i = prev[i]
    return keep


def node_diff(before: list[tuple[str, str, str]], after: list[tuple[str, str, str]]) -> dict:
    """What a stage did to a graph, by node name: nodes added, removed, and moved (the fewest
    nodes whose moving explains the new order of the nodes both graphs have)."""
    entry = lambda n: {"node": n[0], "op": n[1], "module": n[2]}  # noqa: E731
    names_before = {n[0] for n in before}
    names_after = {n[0] for n in after}
    position = {n[0]: i for i, n in enumerate(after)}
    common = [n for n in before if n[0] in names_after]
    keep = _longest_increasing([position[n[0]] for n in common])
    return {
        "nodes_before": len(before),
        "nodes_after": len(after),
        "added": [entry(n) for n in after if n[0] not in names_before],
        "removed": [entry(n) for n in before if n[0] not in names_after],
        "moved": [entry(n) for i, n in enumerate(common) if i not in keep],
    }


def pass_report(stages: list[tuple[str, str, list[tuple[str, str, str]]]]) -> list[dict]:
    """Per dumped stage, in order (``(stage, file, nodes)`` as :class:`Dumper` records them), what
    it changed relative to the stage before. The partition's two programs (``forward``,
    ``backward``) are compared together with the last joint graph: their union is what the
    partition kept, added (e.g. recomputed nodes) or dropped."""
    out: list[dict] = []
    joint: list[tuple[str, str, str]] = []
    program: dict[str, list] = {}
    for stage, file, nodes in stages:
        if stage in ("forward", "backward"):
            program[stage] = nodes
            continue
        out.append({"stage": stage, "file": file, **node_diff(joint, nodes)})
        joint = nodes
    if program:
        union = list({n[0]: n for part in program.values() for n in part}.values())
        diff = node_diff(joint, union)
        diff["moved"] = []  # two programs have no single order to compare
        files = [f for s, f, _ in stages if s in program]
        out.append({"stage": "partition", "file": ", ".join(files), **diff,
                    "programs": {name: len(nodes) for name, nodes in sorted(program.items())}})
    return out


def simulate_step(program, mesh, fsdp, profile, optimizer_state_per_param: int | None = 0, context=None):
    """The cost model's estimate (``cost.StepEstimate``) of one training step of ``program`` (a
    CompiledProgram) on ``profile``: its collectives priced on the groups of ``mesh`` (and the
    FSDP groups of ``fsdp`` and the context-parallel sub-groups of ``context``), then an optimizer
    step keeping ``optimizer_state_per_param`` parameter-sized state tensors (SGD 0, momentum 1,
    Adam/AdamW 2; None: no optimizer step). The per-call agreement spans the whole world."""
    from ..cost import axis_infos, optimizer_traffic, simulate

    axes = axis_infos(mesh, groups=group_axis_names(mesh, fsdp, context))
    opt_bytes = opt_tensors = 0
    if optimizer_state_per_param is not None:
        opt_bytes, opt_tensors = optimizer_traffic(program.backward_gm, optimizer_state_per_param)
    world = dist.get_world_size() if dist.is_initialized() else mesh.size()
    return simulate((program.forward_gm, program.backward_gm), axes, profile, opt_bytes, opt_tensors,
                    agreement_ranks=world)


def step_trace(program, mesh, fsdp=None, rank: int = 0, hardware: str | None = None,
               context=None) -> tuple[dict, dict]:
    """The cost model's simulated step of ``program`` (a CompiledProgram) as (Chrome trace dict,
    totals). Hardware: ``hardware``, else env ``HYPER_PARALLEL_DUMP_HARDWARE``, else by the mesh's
    device type (:data:`DEVICE_PROFILES`). The optimizer step is modelled as plain SGD (no
    optimizer state), matching the summary's memory estimate, which counts none either."""
    from ..cost import get_profile, to_chrome_trace

    name = hardware or os.environ.get(PROFILE_ENV) or DEVICE_PROFILES.get(mesh.device_type, "h100")
    est = simulate_step(program, mesh, fsdp, get_profile(name), context=context)
    trace = to_chrome_trace(est.timeline, rank=rank)
    totals = {**est.as_dict(), "optimizer_model": "sgd (no state)", "device_type": mesh.device_type}
    trace["otherData"] = {k: totals[k] for k in sorted(totals)}
    return trace, totals
