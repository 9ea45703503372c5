"""Dumps and summaries: what the compiler did, readable per rank.

``Dumper`` writes, under ``dump_dir/rank<r>/``: one ``NN_<stage>.py`` per pipeline stage (graph code),
``layouts.tsv`` (node, op, module FQN, input layouts, output layout, local shape, source line),
``forward.py``/``backward.py`` (the partitioned programs) and ``summary.json`` (collectives per step
by kind and mesh axis with count and bytes, fallbacks, plan-imposed redistributions). Everything is
written deterministically: the same model, plan, mesh and inputs give byte-identical files.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

import torch

from .capture import module_fqn_of, source_line

c10d = torch.ops._c10d_functional

COLLECTIVE_KINDS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast.default: "broadcast",
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: what a user counts and what the SPMD check compares."""

    kind: str
    axis: str  # mesh axis name (or group name if it is not a mesh axis)
    dtype: str
    shape: tuple[int, ...]  # local input shape
    nbytes: int  # bytes of the local input
    node: str
    source: str  # the joint-graph node it serves

    def signature(self) -> str:
        return f"{self.kind}[{self.axis}] {self.dtype}{list(self.shape)}"


def group_axis_names(mesh, fsdp=None) -> dict[str, str]:
    """Process-group name → mesh axis name for every axis of ``mesh``; with ``fsdp`` (an FsdpPlan),
    also "<shard axis>/k<k>" for the groups of k ranks that ``reshard_after_forward=<k>`` units
    gather over in backward. Group names differ between ranks; these labels do not."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    out = {mesh.get_group(i).group_name: names[i] for i in range(mesh.ndim)}
    for unit in fsdp.units if fsdp is not None else ():
        k = unit.reshard_after_forward
        if unit.post_forward_group is not None and isinstance(k, int) and not isinstance(k, bool):
            out[unit.post_forward_group] = f"{fsdp.shard_axis}/k{k}"
    return out


def collectives(gm: torch.fx.GraphModule, axis_of_group: dict[str, str]) -> list[Collective]:
    out = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        val = node.args[0].meta["val"]
        group = node.args[-1]
        out.append(
            Collective(
                kind=kind,
                axis=axis_of_group.get(group, group),
                dtype=str(val.dtype).replace("torch.", ""),
                shape=tuple(val.shape),
                nbytes=val.numel() * val.element_size(),
                node=node.name,
                source=node.meta.get("hp_source", ""),
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
    return "[" + ", ".join(str(p) for p in spec.placements) + "]"


def layout_table(gm: torch.fx.GraphModule) -> str:
    """One row per node of the lowered graph: what a user reads to see where data lives."""
    rows = ["node\top\tmodule\tinput_layouts\toutput_layout\tlocal_shape\tsource"]
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        layout = node.meta.get("hp_layout")
        val = node.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else "-"
        if node.meta.get("hp_role") == "redistribute":
            inputs, output = node.meta.get("hp_redistribute", ""), "-"
        else:
            inputs = _fmt_spec(layout.inputs) if layout and node.op != "placeholder" else "-"
            output = _fmt_spec(layout.output) if layout else "-"
        op = "placeholder" if node.op == "placeholder" else str(node.target)
        rows.append(
            f"{node.name}\t{op}\t{module_fqn_of(node)}\t{inputs}\t{output}\t{shape}\t{source_line(node)}"
        )
    return "\n".join(rows) + "\n"


class Dumper:
    """Writes the per-rank dump files; a no-op when ``dump_dir`` is None."""

    def __init__(self, dump_dir: str | None, rank: int):
        self.dir = os.path.join(dump_dir, f"rank{rank}") if dump_dir else None
        self.step = 0
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)

    def _write(self, name: str, text: str) -> None:
        if self.dir:
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)

    def graph(self, stage: str, gm: torch.fx.GraphModule) -> None:
        if self.dir:
            code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
            self._write(f"{self.step:02d}_{stage}.py", code)
            self.step += 1

    def text(self, name: str, text: str) -> None:
        self._write(name, text)

    def json(self, name: str, data) -> None:
        self._write(name, json.dumps(data, indent=2, sort_keys=True) + "\n")
