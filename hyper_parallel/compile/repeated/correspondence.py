"""Repeated blocks, correspondence: blocks 0 and 1 of the two-block trace matched node for node.

Copies of block 1 write the other blocks exactly when, in the two-block trace:

* blocks 0 and 1 correspond node for node, forward and backward: the same ops, constants (up to the
  block index), shapes, module stacks and source lines, the same shared inputs (rotary tables,
  masks), differing only in their own parameters and in where their chained values come from: the
  hidden state from the block before, its gradient from the block after (:func:`_correspondence`);
* nothing outside the blocks runs between two of them; each block is a few runs of nodes, the k-th
  run of block 0 next to the k-th of block 1 (:func:`_check_layout`; what outside code may read is
  checked in :mod:`.instantiation`);
* in a propagated graph, the chained values have the layouts block 1 read them in
  (:func:`_check_chained_layouts`).

Reads: the two-block :class:`~...ir.graph.CapturedGraph` (traced, propagated or lowered). Writes:
nothing (each node's block, the block-0 to block-1 map), or raises
:class:`~.eligibility.BlocksDiffer`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx

from ...compat import pytree
from ...ir.graph import CapturedGraph, module_fqn_of
from ...ir.kinds import InputKind
from ...ir.meta import LAYOUT, SOURCE
from .eligibility import TRACED, BlocksDiffer
from .renaming import _rename_meta, renamer


@dataclasses.dataclass
class _Blocks:
    """Where blocks 0 and 1 sit in the two-block joint graph."""

    nodes: dict[int, list[fx.Node]]  # block -> its compute nodes, in graph order
    of: dict[fx.Node, int]  # compute node -> its block
    params: dict[int, list[int]]  # block -> indices of its parameter/buffer placeholders


def block_index(fqn: str, prefix: str) -> int | None:
    """The index of the block of ``prefix`` that ``fqn`` (a module or parameter path) is in, or None."""
    if fqn == prefix or not fqn.startswith(prefix + "."):
        return None
    head = fqn[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def locate_blocks(captured: CapturedGraph, prefix: str,
                  block_of: Callable[[fx.Node, dict], int | None] | None = None) -> _Blocks:
    """Each compute node's block (``block_of(node, blocks of the nodes before)``; default
    :func:`_module_block`), and each block's parameter and buffer placeholders."""
    block_of = block_of or (lambda node, known: _module_block(node, known, prefix))
    params: dict[int, list[int]] = {0: [], 1: []}
    known: dict[fx.Node, int] = {}
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    for i, info in enumerate(captured.inputs):
        if info.kind in (InputKind.PARAM, InputKind.BUFFER):
            index = block_index(info.name.rsplit(".", 1)[0], prefix)
            if index is not None:
                params.setdefault(index, []).append(i)
                known[placeholders[i]] = index
    of: dict[fx.Node, int] = {}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        index = block_of(node, known)
        if index is not None:
            of[node] = known[node] = index
    nodes: dict[int, list[fx.Node]] = {0: [], 1: []}
    for node, index in of.items():
        if index not in nodes:
            raise BlocksDiffer(f"node {node.name!r} belongs to block {index}, but {TRACED} were traced")
        nodes[index].append(node)
    return _Blocks(nodes, of, params)


def _module_block(node: fx.Node, known: dict, prefix: str) -> int | None:
    """A joint-graph node's block: its module's; else (gradient accumulations, and the casts and
    gathers of parameters rewrites insert, carry no module) the earliest block of its inputs (a
    block's parameters belong to it)."""
    index = block_index(module_fqn_of(node), prefix)
    if index is None and not (node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")):
        # A gradient accumulated at a block's input adds the gradient coming from the block
        # after it: it belongs to the earlier block, whose backward runs next.
        sources = {known[a] for a in node.all_input_nodes if a in known}
        index = min(sources) if sources else None
    return index


def _runs(nodes: list[fx.Node], order: dict[fx.Node, int]) -> list[tuple[int, int]]:
    """[first, last] graph positions of each contiguous run of ``nodes``."""
    positions = sorted(order[n] for n in nodes)
    runs = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return [tuple(r) for r in runs]


def _check_layout(captured: CapturedGraph, blocks: _Blocks) -> list[tuple[list[fx.Node], bool]]:
    """Each block is a few contiguous runs of nodes (forward, backward; in a lowered graph also the
    gradients' way to storage), and the k-th run of block 0 is next to the k-th run of block 1, with
    nothing between them: block 0's first (forward, ascending copies) or block 1's (backward,
    descending). Returns block 1's runs, each with whether its copies go in ascending order."""
    all_nodes = list(captured.gm.graph.nodes)
    order = {n: i for i, n in enumerate(all_nodes)}
    runs0, runs1 = _runs(blocks.nodes[0], order), _runs(blocks.nodes[1], order)
    if not runs1 or len(runs0) != len(runs1):
        raise BlocksDiffer(f"blocks 0 and 1 are split into {len(runs0)} and {len(runs1)} runs of nodes "
                           "(other code runs inside them)")
    out = []
    for k, (a, b) in enumerate(zip(runs0, runs1)):
        if a[1] - a[0] != b[1] - b[0]:
            raise BlocksDiffer("blocks 0 and 1 have different numbers of nodes")
        if a[1] + 1 != b[0] and b[1] + 1 != a[0]:
            where = "forward" if k == 0 else "backward" if k == 1 else f"their run {k + 1}"
            raise BlocksDiffer(f"code outside the blocks runs between block 0 and block 1 in {where}")
        out.append((all_nodes[b[0]:b[1] + 1], a[1] + 1 == b[0]))
    return out


@dataclasses.dataclass
class _Correspondence:
    """Block 0's nodes to block 1's, and the values each takes from outside itself."""

    node: dict[fx.Node, fx.Node]  # block 0 node -> block 1 node
    # Block 1's input from outside -> ("forward", its block-0 counterpart's node in block 0's
    # input position) or ("backward", the block-1 node block 0 reads there).
    chained: dict[fx.Node, tuple[str, fx.Node]]


def _correspondence(captured: CapturedGraph, blocks: _Blocks, prefix: str,
                    same_source: Callable[[fx.Node, fx.Node], bool] | None = None) -> _Correspondence:
    """Match blocks 0 and 1 node for node (see the module docstring for what must agree)."""
    rename = renamer(prefix, 0, 1)
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    params0 = {placeholders[i]: captured.inputs[i].name for i in blocks.params[0]}
    params1 = {captured.inputs[i].name: placeholders[i] for i in blocks.params[1]}
    in0, in1 = set(blocks.nodes[0]), set(blocks.nodes[1])
    node: dict[fx.Node, fx.Node] = {}
    chained: dict[fx.Node, tuple[str, fx.Node]] = {}

    def match(x0, x1, where: str) -> None:
        if isinstance(x0, fx.Node) != isinstance(x1, fx.Node):
            raise BlocksDiffer(f"{where}: a value in one block is a constant in the other")
        if not isinstance(x0, fx.Node):
            if rename(x0) != x1 and not (x0 != x0 and x1 != x1):  # NaN constants are equal here
                raise BlocksDiffer(f"{where}: constant {x0!r} in block 0, {x1!r} in block 1")
            return
        if x0 in in0 or x1 in in1:
            if node.get(x0) is not x1:
                raise BlocksDiffer(f"{where}: inputs from inside the blocks do not correspond")
        elif x0 in params0 or x1 in params1.values():  # each block its own parameter, nothing else
            if x0 not in params0 or params1.get(rename(params0[x0])) is not x1:
                raise BlocksDiffer(f"{where}: the blocks do not read their own counterpart parameters")
        elif x0 is not x1:
            if x1 in in0 and x0 not in in1:
                link = ("forward", x1)
            elif x0 in in1 and x1 not in in0:
                link = ("backward", x0)
            else:
                raise BlocksDiffer(f"{where}: the blocks read different values from outside "
                                   f"({x0.name!r} and {x1.name!r}): one value per block (not copyable)")
            if chained.setdefault(x1, link) != link:
                raise BlocksDiffer(f"{where}: {x1.name!r} is chained two ways")

    for a, b in zip(blocks.nodes[0], blocks.nodes[1]):
        where = f"nodes {a.name!r} / {b.name!r}"
        if a.op != b.op or a.target != b.target:
            raise BlocksDiffer(f"{where}: {a.target} in block 0, {b.target} in block 1")
        flat0, spec0 = pytree.tree_flatten((a.args, a.kwargs))
        flat1, spec1 = pytree.tree_flatten((b.args, b.kwargs))
        if spec0 != spec1:
            raise BlocksDiffer(f"{where}: different argument structure")
        for x0, x1 in zip(flat0, flat1):
            match(x0, x1, where)
        _match_meta(a, b, rename, where)
        if same_source is not None and not same_source(a, b):
            raise BlocksDiffer(f"{where}: lowered from joint-graph nodes that do not correspond")
        node[a] = b
    return _Correspondence(node, chained)


def _match_meta(a: fx.Node, b: fx.Node, rename, where: str) -> None:
    """The two nodes' module stacks, source lines, annotations (``hp_source`` aside: the caller
    matches sources), shapes and dtypes agree up to the block index."""
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        if _rename_meta({key: a.meta.get(key)}, rename).get(key) != b.meta.get(key):
            raise BlocksDiffer(f"{where}: module stacks differ")
    if a.meta.get("stack_trace") != b.meta.get("stack_trace"):
        raise BlocksDiffer(f"{where}: traced from different source lines")
    if _custom(a, rename) != _custom(b, None):
        raise BlocksDiffer(f"{where}: different annotations (hp.checkpoint / hp.swap regions)")
    va, vb = a.meta.get("val"), b.meta.get("val")
    shapes = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
              for t in pytree.tree_leaves((va, vb))]
    half = len(shapes) // 2
    if len(shapes) % 2 or shapes[:half] != shapes[half:]:
        raise BlocksDiffer(f"{where}: different shapes or dtypes")


def _custom(node: fx.Node, rename) -> dict:
    custom = {k: v for k, v in (node.meta.get("custom") or {}).items() if k != SOURCE}
    return {k: rename(v) for k, v in custom.items()} if rename else custom


def _check_chained_layouts(corr: _Correspondence) -> None:
    """With layouts (a propagated graph): copy j reads copy j-1's value (forward) or copy j+1's
    (backward) where block 1 read block 0's or an outside one. The copies compute what block 1
    computes only if those values have the layouts block 1 read."""
    for x1, (direction, other) in corr.chained.items():
        if direction == "forward":  # block 1 reads block 0's x1; copies read block 1's counterpart
            read, copied = x1, corr.node[other]
        else:  # block 0 reads block 1's `other`; block 1 read the outside x1, copies read `other`
            read, copied = x1, other
        a, b = read.meta.get(LAYOUT), copied.meta.get(LAYOUT)
        if a is None and b is None:
            continue
        if a is None or b is None or str(a.output) != str(b.output):
            raise BlocksDiffer(f"block 1 reads {read.name!r} in layout {getattr(a, 'output', None)}, but its "
                               f"copies would read {copied.name!r} in {getattr(b, 'output', None)}")
