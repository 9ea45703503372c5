"""Repeated blocks: trace two blocks of a list of identical blocks, write the others as copies.

Tracing is most of a compile and grows with depth: ``torch.export`` and aot_autograd's joint trace
run through every transformer block although each gives the same graph up to renaming. With
``parallelize(..., repeated_blocks="auto" | "<ModuleList FQN>")`` capture traces the model with the
list cut to its first two blocks, then writes blocks 2 .. N-1 into the joint graph as copies of
block 1 (:func:`instantiate_blocks`). The result is the joint graph a trace of all N blocks gives:
the same nodes in the same order, module stacks, source lines and autograd sequence order, named
as a fresh trace numbers them (``tests/unit/test_repeated_blocks.py`` compares the two node by
node, and the compiled dumps byte for byte). The same :func:`instantiate` writes out the two-block
graph after propagation and after lowering (``repeated_lowering.py``), with the checks that
concern layouts and lowered nodes added (:func:`check_copyable`).

The copies are exact when:

* the blocks are one class with the same parameters and buffers (names, shapes, dtypes), the same
  submodule classes and the same plain attributes, where an attribute may differ only by holding
  the block's own index (transformers' ``layer_idx``); their hooks are the same code over equal
  values (FSDP's mixed-precision casts); no block shares a parameter with another or is planned
  differently from block 1 (:func:`find_repeated_blocks`);
* in the two-block trace, blocks 0 and 1 correspond node for node, forward and backward: the same
  ops, constants (up to the block index), shapes, module stacks and source lines, the same shared
  inputs (rotary tables, masks), differing only in their own parameters and in where their chained
  values come from: the hidden state from the block before, its gradient from the block after
  (:func:`_correspondence`);
* nothing outside the blocks runs between two of them, or reads a block other than the last
  (forward) or the first (backward); each block is a few runs of nodes, the k-th run of block 0
  next to the k-th of block 1 (:func:`_check_layout`);
* in a propagated graph, the chained values have the layouts block 1 read them in
  (:func:`_check_chained_layouts`).

When any of this fails the compile traces every block, as without the option, and the INFO log
says why. Not checked, and the reason the option is not on by default: code outside the blocks
that computes with their number (``len(self.layers)`` in a formula).

Reads: the model, the two-block :class:`~..ir.graph.CapturedGraph` (traced, propagated or lowered).
Writes: a new CapturedGraph of all blocks (the two-block one is not changed).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .. import compat
from ..compat import pytree
from ..errors import internal_error
from ..ir.graph import CapturedGraph, module_fqn_of
from ..ir.kinds import InputKind, OutputKind
from ..ir.meta import LAYOUT, SOURCE
from ..ir.names import base_name, unnumbered
from .capture import capture

log = logging.getLogger(__name__)

TRACED = 2  # blocks traced: block 0, and block 1 as the template of the others

_SIMPLE = (int, float, str, bool, type(None))


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """The ModuleList whose blocks are traced two and copied: its FQN and its length."""

    prefix: str
    count: int


class BlocksDiffer(Exception):
    """Why the traced blocks cannot stand for the others; the compile then traces them all."""


@dataclasses.dataclass
class BlockCapture:
    """What :func:`capture_blocks_once` traced: every block, or two and what copies them."""

    captured: CapturedGraph | None  # every block (None until :meth:`full` writes the copies)
    traced: str = ""  # "2 of 32 blocks of model.layers traced" when blocks are copied
    two: CapturedGraph | None = None  # the two-block trace (later steps rewrite it and copy again)
    blocks: RepeatedBlocks | None = None
    pristine: CapturedGraph | None = None  # ``two`` as traced, for :meth:`full`

    def full(self) -> CapturedGraph:
        """The joint graph of every block as capture gives it (written on first use: the compile
        needs it only to dump it, or when the later steps cannot copy)."""
        if self.captured is None:
            self.captured = instantiate_blocks(self.pristine, self.blocks)
        return self.captured


def capture_blocks_once(model: nn.Module, args: tuple, kwargs: dict, boundaries, experts, option,
                        forget_annotations: Callable[[], None]) -> BlockCapture:
    """:func:`~.capture.capture`, tracing two blocks of the repeated list when ``option``
    (``parallelize``'s ``repeated_blocks``) asks, the blocks qualify and the two traced blocks
    correspond (the others are then copies, :meth:`BlockCapture.full`); else every block (logged at
    INFO with the reason). ``forget_annotations`` drops the hp.checkpoint / hp.swap regions an
    abandoned two-block trace recorded."""
    if option is None:
        return BlockCapture(capture(model, args, kwargs, boundaries, experts))
    blocks, why = find_repeated_blocks(model, option, boundaries)
    if blocks is not None and experts:
        blocks, why = None, "expert-parallel regions are traced block by block"
    if blocks is not None:
        traced_boundaries = {fqn: cons for fqn, cons in (boundaries or {}).items()
                             if (block_index(fqn, blocks.prefix) or 0) < TRACED}
        with first_blocks_only(model, blocks):
            two = capture(model, args, kwargs, traced_boundaries, experts)
        try:
            check_copyable(two, blocks)
            return BlockCapture(None, f"{TRACED} of {blocks.count} blocks of {blocks.prefix} traced", two, blocks,
                                _copy_captured(two))
        except BlocksDiffer as exc:
            why = f"{blocks.prefix}: {exc}"
            forget_annotations()
    log.info("repeated_blocks=%r: tracing every block: %s", option, why)
    return BlockCapture(capture(model, args, kwargs, boundaries, experts))


def _copy_captured(captured: CapturedGraph) -> CapturedGraph:
    """A copy whose graph, node meta (shallowly) and slot lists later steps' in-place changes to
    ``captured`` leave alone."""
    if captured.pending_inputs:  # only a rewrite adds them, after this copy was taken
        raise internal_error("capture", "a captured graph to copy has pending gradients already",
                             workaround="pass repeated_blocks=None to parallelize")
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(captured.gm.graph._codegen)
    old_output = captured.gm.graph.output_node()
    graph.output(graph.graph_copy(captured.gm.graph, {})).meta = copy.copy(old_output.meta)
    gm = compat.lazy_graph_module(captured.gm, graph, class_name=type(captured.gm).__name__)
    # Fresh containers: a rewrite of ``captured`` (gradient accumulation's pending inputs) must not
    # show in the copy, the full graph a refused copy falls back to.
    return dataclasses.replace(captured, gm=gm, inputs=list(captured.inputs), outputs=list(captured.outputs),
                               pending_inputs={}, expert_regions=dict(captured.expert_regions))


def check_option(value, model: nn.Module):
    """``repeated_blocks`` as ``parallelize`` accepts it: None, ``"auto"`` or a ModuleList's FQN."""
    if value is None or value == "auto":
        return value
    lists = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not isinstance(value, str):
        raise TypeError(f"repeated_blocks is None, 'auto' or the FQN of a ModuleList, got {value!r}")
    if value not in lists:
        raise ValueError(
            f"repeated_blocks={value!r}: {type(model).__name__} has no ModuleList of that name; "
            f"its ModuleLists are {lists or 'none'}. Pass one of them, 'auto', or None")
    return value


def find_repeated_blocks(model: nn.Module, option, boundaries) -> tuple[RepeatedBlocks | None, str]:
    """The list to trace two blocks of, or None and why not. ``option``: ``"auto"`` (the
    ModuleList of identical blocks holding the most parameters) or a ModuleList's FQN;
    ``boundaries``: the plan's module boundaries (capture's annotations), compared per block."""
    if option is None:
        return None, "not asked for"
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if option != "auto":
        lists = [(fqn, m) for fqn, m in lists if fqn == option]
    reasons = []
    found = []
    for fqn, blocks in lists:
        why = _why_not_repeated(fqn, list(blocks), boundaries)
        if why:
            reasons.append((sum(p.numel() for p in blocks.parameters()), f"{fqn}: {why}"))
        else:
            found.append((sum(p.numel() for p in blocks.parameters()), fqn, len(blocks)))
    if not found:  # the reasons of the largest lists: those a user means
        reasons.sort(key=lambda r: -r[0])
        return None, "; ".join(text for _, text in reasons[:2]) or "the model has no ModuleList"
    _, fqn, count = max(found)
    return RepeatedBlocks(fqn, count), ""


@contextlib.contextmanager
def first_blocks_only(model: nn.Module, blocks: RepeatedBlocks):
    """The model with its list cut to the first :data:`TRACED` blocks while the block runs."""
    parent_fqn, _, name = blocks.prefix.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    full = getattr(parent, name)
    parent._modules[name] = nn.ModuleList(list(full)[:TRACED])
    try:
        yield
    finally:
        parent._modules[name] = full


def _why_not_repeated(prefix: str, blocks: list[nn.Module], boundaries) -> str:
    if len(blocks) <= TRACED:
        return f"{len(blocks)} blocks: copying pays from {TRACED + 1}"
    if len({id(b) for b in blocks}) < len(blocks):
        return "one module appears twice in the list (shared weights)"
    template = _structure(blocks[1])
    for i, block in enumerate(blocks):
        if type(block) is not type(blocks[1]):
            return f"block {i} is a {type(block).__name__}, block 1 a {type(blocks[1]).__name__}"
        if _structure(block) != template:
            return f"block {i}'s submodules, parameters or buffers differ from block 1's"
        hooks, template_hooks = _hooks(block), _hooks(blocks[1])
        if hooks != template_hooks:
            name = next(n for n in {**hooks, **template_hooks} if hooks.get(n) != template_hooks.get(n))
            return f"block {i}'s hooks on {name or 'itself'!r} differ from block 1's"
    attributes = [_attributes(block) for block in blocks]
    for key in sorted({k for a in attributes for k in a}):
        values = [a.get(key) for a in attributes]
        if any(v != values[1] for v in values) and values != list(range(len(blocks))):
            where = ".".join(filter(None, key))
            return f"attribute {where!r} differs between blocks ({values[0]!r}, {values[1]!r}, ...)"
    params = {id(p) for b in blocks for p in b.parameters()}
    if len(params) < sum(1 for b in blocks for _ in b.parameters()):
        return "blocks share parameters"
    planned = _planned_boundaries(prefix, 1, boundaries)
    for i in range(len(blocks)):
        if _planned_boundaries(prefix, i, boundaries, rename=renamer(prefix, i, 1)) != planned:
            return f"the plan annotates block {i}'s inputs or outputs unlike block 1's"
    return ""


def _structure(block: nn.Module) -> tuple:
    """Submodule classes, parameter and buffer names/shapes/dtypes: equal for blocks that trace alike."""
    modules = tuple((name, type(m)) for name, m in block.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return modules, params, buffers


def _hooks(block: nn.Module) -> dict:
    """Submodule -> what its hooks do: the same hook code closing over equal values in every block
    (FSDP's mixed-precision casts) traces alike; anything else counts as different."""
    out = {}
    for name, m in block.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values(), *m._backward_pre_hooks.values(),
                 *m._backward_hooks.values()]
        if hooks:
            out[name] = tuple(_function_signature(h) for h in hooks)
    return out


def _function_signature(fn, depth: int = 0):
    if depth > 3 or not hasattr(fn, "__code__"):
        return fn if isinstance(fn, (*_SIMPLE, torch.dtype)) else ("object", id(fn))
    cells = tuple(_function_signature(c.cell_contents, depth + 1) for c in (fn.__closure__ or ()))
    return fn.__code__, cells


def _attributes(block: nn.Module) -> dict:
    """(submodule, attribute) -> value of every plain attribute: equal across blocks, or each
    block's own index (transformers' ``layer_idx``)."""
    attrs = {}
    for name, m in block.named_modules():
        for key, value in vars(m).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _SIMPLE):
                attrs[(name, key)] = value
            elif isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
                attrs[(name, key)] = (type(value).__name__, *value)
            elif isinstance(value, dict) and all(isinstance(v, _SIMPLE) for v in (*value, *value.values())):
                attrs[(name, key)] = ("dict", *sorted(value.items(), key=repr))
            elif isinstance(value, (torch.dtype, torch.device)):
                attrs[(name, key)] = str(value)
    return attrs


def _planned_boundaries(prefix: str, index: int, boundaries, rename: Callable[[str], str] | None = None) -> dict:
    own = f"{prefix}.{index}"
    return {
        (rename(fqn) if rename else fqn): (rename(repr(cons)) if rename else repr(cons))
        for fqn, cons in (boundaries or {}).items()
        if fqn == own or fqn.startswith(own + ".")
    }


def renamer(prefix: str, src: int, dst: int) -> Callable[[Any], Any]:
    """Rewrites block ``src``'s names to block ``dst``'s in strings (module paths, stack keys,
    parameter FQNs, boundary keys); other values pass through."""
    if src == dst:
        return lambda value: value
    pattern = re.compile(r"(?<![A-Za-z0-9.])(" + re.escape(prefix) + r")(\.|\[)" + str(src) + r"(?![0-9])")
    done: dict[str, str] = {}  # the same module paths recur on many nodes

    def rename(value):
        if isinstance(value, str):
            if value not in done:
                done[value] = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{dst}", value)
            return done[value]
        return value

    rename.stacks = {}  # id(module stack) -> (it, renamed): nodes share their stack dicts (_rename_meta)
    return rename


def _renamed_stack(stack: dict, rename) -> dict:
    """A module stack with its paths renamed. Traced nodes share stack dicts (a few hundred for
    thousands of nodes), so each is renamed once per renamer and its copy shared the same way."""
    cache = getattr(rename, "stacks", None)
    if cache is None:  # not a renamer: names stay
        return stack
    hit = cache.get(id(stack))
    if hit is not None and hit[0] is stack:
        return hit[1]
    renamed = {rename(k): (rename(path), cls) for k, (path, cls) in stack.items()}
    cache[id(stack)] = (stack, renamed)  # holding ``stack`` keeps its id from being reused
    return renamed


def _rename_meta(meta: dict, rename) -> dict:
    """A copy of a node's meta for another block: module stacks, annotations and descriptors renamed."""
    out = dict(meta)
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = meta.get(key)
        if stack:
            out[key] = _renamed_stack(stack, rename)
    if isinstance(meta.get("custom"), dict):
        out["custom"] = {k: rename(v) for k, v in meta["custom"].items()}
    for key, value in meta.items():  # our own annotations that name modules or parameters
        if key.startswith("hp_") and isinstance(value, str):
            out[key] = rename(value)
    if "desc" in meta:
        out["desc"] = _rename_desc(meta["desc"], rename)
    out.pop("from_node", None)  # provenance of the traced block; a copy has none of its own
    return out


def _rename_desc(desc, rename):
    """aot_autograd descriptors name parameters by FQN (``ParamAOTInput(target=...)``)."""
    if isinstance(desc, list):
        return [_rename_desc(d, rename) for d in desc]
    if dataclasses.is_dataclass(desc) and not isinstance(desc, type):
        changes = {}
        for f in dataclasses.fields(desc):
            value = getattr(desc, f.name)
            new = rename(value) if isinstance(value, str) else _rename_desc(value, rename)
            if new is not value and new != value:
                changes[f.name] = new
        return dataclasses.replace(desc, **changes) if changes else desc
    return desc


# --- the two-block trace ---------------------------------------------------------------------------


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


# --- writing all blocks --------------------------------------------------------------------------


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
