"""Repeated blocks, instantiation: the graph of all blocks written from the two-block one.

Block 1 is the template: its parameter placeholders, nodes and gradient slots are written once per
block j >= 1 with block j's names, each copy reading the one before it (forward) or after it
(backward), and autograd's sequence numbers shifted as a trace of all blocks numbers them
(:func:`instantiate`); code outside the blocks is written once, and may read block 1 only where it
reads the last block (forward) or the first (backward) (:func:`_check_outside_readers`). The same
function writes out a joint graph before or after propagation and a lowered one
(``lowering.py``).

Reads: the two-block :class:`~...ir.graph.CapturedGraph`. Writes: a new CapturedGraph of all blocks
(the two-block one is not changed).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch.fx as fx

from ... import compat
from ...compat import pytree
from ...ir.graph import CapturedGraph
from ...ir.kinds import InputKind, OutputKind
from ...ir.names import base_name, unnumbered
from .correspondence import (
    _Blocks, _check_chained_layouts, _check_layout, _correspondence, block_index, locate_blocks,
)
from .eligibility import BlocksDiffer, RepeatedBlocks
from .renaming import _rename_desc, _rename_meta, renamer


def _contiguous_runs(indices: list[int]) -> dict[int, list[int]]:
    """First index of each run of consecutive ``indices`` -> the run."""
    runs: dict[int, list[int]] = {}
    first = None
    for i in sorted(indices):
        if first is None or i != runs[first][-1] + 1:
            first = i
            runs[first] = []
        runs[first].append(i)
    return runs


class _SequenceNumbers:
    """autograd's ``seq_nr`` as a trace of all blocks numbers it (the pipeline split pairs backward
    nodes with their forward op by it): block 1's numbers shifted by a block's span per copy, later
    ones by the span of all added blocks."""

    def __init__(self, forward1: list[fx.Node], count: int):
        numbers = [n.meta["seq_nr"] for n in forward1 if "seq_nr" in n.meta]
        self.lo, self.hi = (min(numbers), max(numbers)) if numbers else (0, -1)
        self.span = self.hi - self.lo + 1
        self.count = count

    def renumber(self, number: int, copy: int | None) -> int:
        if copy is not None and self.lo <= number <= self.hi:
            return number + (copy - 1) * self.span
        if number > self.hi:
            return number + (self.count - 2) * self.span
        return number


def _check_outside_readers(captured: CapturedGraph, template: set, located: _Blocks,
                           runs: list[tuple[list[fx.Node], bool]]) -> None:
    """Outside code may read block 1 only between its first run and its second (forward and
    backward: the last block's values after the copies) or from block 0 (the first copy's)."""
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    start = order[runs[0][0][-1]]
    end = order[runs[1][0][0]] if len(runs) > 1 else len(order)
    for node in template:
        for user in node.users:
            if user in template or user.op == "output":
                continue
            if located.of.get(user) == 0 or start < order[user] < end:
                continue
            raise BlocksDiffer(f"{user.name!r} outside the blocks reads block 1's {node.name!r} after its "
                               "backward ran")


@dataclasses.dataclass
class Instantiated:
    """All blocks written out, and where each node of the two-block graph went."""

    captured: CapturedGraph
    outside: dict[fx.Node, fx.Node]  # a node outside block 1 (block 0's too) -> its one new node
    copies: dict[int, dict[fx.Node, fx.Node]]  # block j >= 1 -> block 1's node -> block j's
    located: _Blocks  # the two-block graph's blocks
    counterpart: dict[fx.Node, fx.Node]  # block 0's node -> block 1's

    def new_node(self, old: fx.Node, j: int | None) -> fx.Node:
        """Where ``old`` went in block ``j`` (None, or ``old`` outside block 1: its one place)."""
        return self.copies[j][old] if j is not None and old in self.copies[j] else self.outside[old]


def instantiate_blocks(captured: CapturedGraph, blocks: RepeatedBlocks) -> CapturedGraph:
    """The joint graph of all ``blocks.count`` blocks from the two-block ``captured`` (traced with
    the list cut to blocks 0 and 1). Raises :class:`BlocksDiffer` when the copies would not be
    exact."""
    return instantiate(captured, blocks).captured


def check_rewrites_copyable(captured: CapturedGraph) -> None:
    """Raise :class:`BlocksDiffer` for what copies never write: expert-parallel regions and the
    gradients accumulated over micro-steps (``pending_inputs``, added by a rewrite)."""
    if captured.pending_inputs or captured.expert_regions:
        raise BlocksDiffer("expert-parallel regions and pending gradients are traced block by block")


def check_copyable(captured: CapturedGraph, blocks: RepeatedBlocks, located: _Blocks | None = None,
                   same_source: Callable[[fx.Node, fx.Node], bool] | None = None) -> tuple:
    """Raise :class:`BlocksDiffer` unless copies of block 1 write all blocks exactly (the checks of
    :func:`instantiate`, which takes the same arguments); returns (located, block 1's runs, the
    correspondence)."""
    check_rewrites_copyable(captured)
    located = located or locate_blocks(captured, blocks.prefix)
    runs = _check_layout(captured, located)
    corr = _correspondence(captured, located, blocks.prefix, same_source)
    _check_chained_layouts(corr)
    _check_outside_readers(captured, set(located.nodes[1]), located, runs)
    return located, runs, corr


def instantiate(captured: CapturedGraph, blocks: RepeatedBlocks, located: _Blocks | None = None,
                same_source: Callable[[fx.Node, fx.Node], bool] | None = None,
                retag: Callable[[fx.Node, int | None, dict], dict] | None = None) -> Instantiated:
    """:func:`instantiate_blocks` for a joint graph before or after propagation, or a lowered one.
    ``located``: each node's block (default: by module, :func:`locate_blocks`); ``same_source``: whether
    a block-0 node and its block-1 counterpart come from corresponding nodes (lowered graphs);
    ``retag(old, j, meta)``: the meta of ``old``'s new node in block ``j`` (None: its one place),
    given the renamed one (default: it, with autograd's sequence numbers shifted)."""
    prefix, count = blocks.prefix, blocks.count
    located, runs, corr = check_copyable(captured, blocks, located, same_source)
    template = set(located.nodes[1])
    seq = _SequenceNumbers(runs[0][0], count)
    same = lambda value: value  # noqa: E731 - outside code keeps its names

    def default_retag(old: fx.Node, j: int | None, meta: dict) -> dict:
        if "seq_nr" in old.meta:
            meta["seq_nr"] = seq.renumber(old.meta["seq_nr"], j)
        return meta

    retag = retag or default_retag
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copies: dict[int, dict[fx.Node, fx.Node]] = {j: {} for j in range(1, count)}
    inputs = []
    old_placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    counters: dict[str, int] = {}

    def placeholder(old: fx.Node, info, rename, j: int | None) -> fx.Node:
        kind = unnumbered(old.name)  # primals_3, tangents_1; a lowered graph's arg0_3, arg1_1
        counters[kind] = counters.get(kind, 0) + 1
        new = graph.placeholder(f"{kind}_{counters[kind]}")
        new.meta = retag(old, j, _rename_meta(old.meta, rename))
        inputs.append(dataclasses.replace(info, name=rename(info.name)))
        return new

    renamers = {j: renamer(prefix, 1, j) for j in range(1, count)}
    param_runs = _contiguous_runs(located.params[1])
    in_runs = set(located.params[1])
    for i, (old, info) in enumerate(zip(old_placeholders, captured.inputs)):
        if i in param_runs:  # every block's parameters (buffers) where block 1's were
            for j in range(1, count):
                for k in param_runs[i]:
                    copies[j][old_placeholders[k]] = placeholder(old_placeholders[k], captured.inputs[k],
                                                                 renamers[j], j)
        elif i not in in_runs:
            env[old] = placeholder(old, info, same, None)

    def read(x: fx.Node, j: int | None, from_block0: bool) -> fx.Node:
        """The new node standing for old ``x`` where copy ``j`` (None: code outside the copies)
        reads it."""
        if j is not None:
            if x in copies[j]:
                return copies[j][x]
            if x in corr.chained:
                direction, other = corr.chained[x]
                if direction == "forward":  # the block before's value (block 0's for copy 1)
                    return env[x] if j == 1 else copies[j - 1][corr.node[other]]
                return env[x] if j == count - 1 else copies[j + 1][other]  # the block after's gradient
        elif x in template:  # block 0 reads the first copy, other code the last
            return copies[1 if from_block0 else count - 1][x]
        return env[x]

    def emit(old: fx.Node, j: int | None) -> fx.Node:
        rename = renamers[j] if j is not None else same
        from_block0 = located.of.get(old) == 0
        args, kwargs = fx.node.map_aggregate(
            (old.args, old.kwargs), lambda x: read(x, j, from_block0) if isinstance(x, fx.Node) else rename(x))
        new = compat.create_node_unchecked(graph, old.op, old.target, args, kwargs, base_name(old))
        new.meta = retag(old, j, _rename_meta(old.meta, rename))
        return new

    starts = {run[0]: (run, ascending) for run, ascending in runs}
    in_template_runs = {n for run, _ in runs for n in run}
    outputs = None
    for old in captured.gm.graph.nodes:
        if old.op == "placeholder":
            continue
        if old.op == "output":
            outputs = _emit_output(graph, old, captured, copies, read, prefix, count, retag)
        elif old in starts:
            run, ascending = starts[old]
            for j in (range(1, count) if ascending else range(count - 1, 0, -1)):
                for t in run:
                    copies[j][t] = emit(t, j)
        elif old not in in_template_runs:
            env[old] = emit(old, None)

    graph._codegen = _resized_codegen(captured, inputs, outputs)
    gm = compat.lazy_graph_module(captured.gm, graph, class_name=type(captured.gm).__name__)
    return Instantiated(dataclasses.replace(captured, gm=gm, inputs=inputs, outputs=outputs), env, copies,
                        located, corr.node)


def _emit_output(graph: fx.Graph, old: fx.Node, captured: CapturedGraph, copies, read, prefix: str, count: int,
                 retag) -> list:
    """The output node with every block's gradient (and buffer update) slot where block 1's
    were; returns the matching OutputInfo list."""
    slots = list(old.args[0])
    descs = old.meta.get("desc")
    own = [i for i, info in enumerate(captured.outputs)
           if info.kind in (OutputKind.GRAD, OutputKind.BUFFER_UPDATE)
           and block_index(info.name.rsplit(".", 1)[0], prefix) == 1]
    runs = _contiguous_runs(own)
    in_runs = set(own)
    new_slots, new_descs, outputs = [], [], []
    for i, slot in enumerate(slots):
        if i in runs:
            for j in range(1, count):
                rename = renamer(prefix, 1, j)
                for k in runs[i]:
                    value = slots[k]
                    new_slots.append(None if value is None else copies[j][value])
                    outputs.append(dataclasses.replace(captured.outputs[k], name=rename(captured.outputs[k].name)))
                    if descs is not None:
                        new_descs.append(_rename_desc(descs[k], rename))
        elif i not in in_runs:
            new_slots.append(None if slot is None else read(slot, None, False))
            outputs.append(captured.outputs[i])
            if descs is not None:
                new_descs.append(descs[i])
    node = graph.output(type(old.args[0])(new_slots))
    node.meta = retag(old, None, dict(old.meta))
    if descs is not None:
        node.meta["desc"] = new_descs
    return outputs


def _resized_codegen(captured: CapturedGraph, inputs: list, outputs: list):
    """The graph's calling convention with as many primals and gradient slots as the blocks now
    have: the joint graph's ``(primals, tangents) -> (forward outputs, gradients)`` pytrees, or a
    lowered graph's ``(primals, tangents) -> [every slot]``."""
    codegen = copy.copy(captured.gm.graph._codegen)
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return codegen
    structure = lambda spec: pytree.tree_unflatten([None] * spec.num_leaves, spec)  # noqa: E731
    primals, tangents = structure(info.in_spec)
    num_tangents = sum(i.kind == InputKind.TANGENT for i in inputs)
    in_spec = pytree.tree_structure((type(primals)([None] * (len(inputs) - num_tangents)),
                                     type(tangents)([None] * num_tangents)))
    returned = structure(info.out_spec)
    if len(returned) == 2 and all(isinstance(r, (tuple, list)) for r in returned) and \
            info.out_spec.num_leaves == len(captured.outputs):
        forward, grads = returned
        num_forward = len(forward) + sum(o.kind == OutputKind.BUFFER_UPDATE for o in outputs) - \
            sum(o.kind == OutputKind.BUFFER_UPDATE for o in captured.outputs)
        out_spec = pytree.tree_structure((type(forward)([None] * num_forward),
                                          type(grads)([None] * (len(outputs) - num_forward))))
    else:
        out_spec = pytree.tree_structure(type(returned)([None] * len(outputs)))
    codegen.pytree_info = info._replace(in_spec=in_spec, out_spec=out_spec)
    return codegen
