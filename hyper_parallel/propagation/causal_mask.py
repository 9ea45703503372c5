"""Constant causal attention masks become ``is_causal``, before propagation.

transformers builds its causal mask whenever it is traced: under ``torch.export`` it cannot look at
values, so it never takes the shortcut it takes in eager mode (no mask, ``is_causal=True`` when
nothing is padded). Every captured Hugging Face model therefore reaches attention with a
``[batch, 1, seq, seq]`` additive mask computed from ``arange``s, and so do models that build a
``triu`` mask themselves. That mask costs what ``is_causal`` does not:

* its ``batch · seq²`` values are computed every step and saved for backward;
* on a GPU it keeps attention on the kernels that take a bias (memory-efficient, cuDNN);
* under context parallelism ring attention computes every K/V block with its slice of the mask:
  twice the work of causal attention, which skips the blocks whose keys all follow the queries
  (``explain`` of transformers' Llama 3 8B, 2 layers, 32k tokens, cp=4: 226 ms → 192 ms per step,
  0.5 GiB less saved per rank).

The rewrite finds attention masks that are *constants of the program*: no placeholder (parameter,
buffer, user input, tangent) among their ancestors and no random op. It evaluates such a mask once,
at compile time, on the CPU; when every entry is the one-device causal mask's (the ``tril`` of
``is_causal``: 0 or ``True`` on and below the diagonal, ``-inf``, ``finfo.min`` or ``False``
above, the same for every batch row and head), the attention forward and backward nodes that read
it are given ``is_causal=True`` and no mask, and the nodes that computed it are removed. A mask
that hides nothing (an encoder's, built from no padding: all zeros or ``True``) goes the same way,
with ``is_causal`` left false. Softmax gives masked scores exactly zero weight either way (each
causal row keeps its diagonal), so the result is what the mask computes up to the kernels'
summation order. A mask that depends on an input (a padding ``attention_mask``, packed-sequence
position ids) is left alone, as is one with more than ``MAX_CHECKED_ELEMENTS`` distinct entries
(the INFO log names it). The evaluation holds the mask compressed along the dims it does not vary
on and checks it a block of query rows at a time (``propagation/mask_evaluation.py``), so a
128k-token causal mask is checked without its 16 G entries in memory.

A boolean mask that reads an input but is the ``and`` of such a constant causal mask with anything
(transformers' mask when an ``attention_mask`` is passed: causal ``&`` padding) stays, but hides
every key after its query. Its attention nodes are marked ``hp_mask_within_causal``, and ring
attention skips the K/V blocks whose keys all follow the queries, as under ``is_causal``, applying
the mask's slice in the others (``cp/ring.py``): without it a padded batch costs the ring twice the
causal work and load balancing evens nothing. So is transformers' packed-sequence mask, whose
same-document and position-causal factors only hide the later keys together
(``propagation/packed_sequences.py``).

Optional: ``parallelize(disable_passes=["causal_mask"])`` keeps every mask as captured and marks
none.

Reads: the SDPA forward and backward nodes of the four kernel families (``cp/attention_ops.py``)
and their masks' ancestors. Writes: those nodes' ``is_causal`` and mask arguments, or their
``hp_mask_within_causal``; erases the mask computations no other node reads.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx

from ..cp.attention_ops import arguments_by_name, family_of, with_arguments
from ..ir import meta
from . import packed_sequences, recompile
from .mask_evaluation import SAME_ENTRIES, constant_ancestors, evaluate, row_blocks, shape_of

log = logging.getLogger(__name__)

# Masks with up to this many entries are checked (propagation/mask_evaluation.py: compressed, a
# block of rows at a time): one sequence of 128k tokens; per batch row and head when they differ.
MAX_CHECKED_ELEMENTS = 2 ** 34


def make_constant_causal_masks_causal(gm: fx.GraphModule) -> list[str]:
    """Rewrite the attention nodes reading a constant causal mask, or one that hides nothing
    (module docstring), and mark those whose kept mask is within the causal one; returns the
    forward nodes changed, as ``"<name> (causal|unmasked|mask within causal)"``."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or family_of(node.target) is None:
            continue
        # By name, not AttentionOps.bind: that refuses what only context parallelism cannot do.
        a = arguments_by_name(node.target, node.args, node.kwargs)
        mask = a.get("attn_mask", a.get("attn_bias"))
        if isinstance(mask, fx.Node) and not a.get("is_causal"):
            readers.setdefault(mask, []).append(node)
    changed = []
    for mask, nodes in readers.items():
        kind = _constant_kind(gm, mask, nodes[0])
        if kind is None:
            if _within_causal(gm, mask, nodes[0]):
                for node in nodes:
                    node.meta[meta.MASK_WITHIN_CAUSAL] = True
                changed += [f"{n.name} (mask within causal)" for n in nodes if n.target is family_of(n.target).forward]
            continue
        for node in nodes:
            ops = family_of(node.target)
            node.args, node.kwargs = with_arguments(node.target, node.args, node.kwargs, mask=None,
                                                    is_causal=kind == "causal")
            if node.target is ops.forward:
                changed.append(f"{node.name} ({kind})")
        _erase_unused(gm.graph, mask)
    if changed:
        log.info("causal_mask: %d attention node(s) read a constant mask that is the causal one or "
                 "hides nothing (they compute without it), or a mask within the causal one (ring "
                 "attention skips its later blocks): %s", len(changed), ", ".join(changed))
        recompile(gm)
    return changed


def _lengths(attention: fx.Node) -> tuple[int, int]:
    """``attention``'s query and key lengths."""
    key = arguments_by_name(attention.target, attention.args, attention.kwargs)["key"].meta["val"].shape[-2]
    return attention.meta["val"][0].shape[-2], key


def _constant_value(gm: fx.GraphModule, mask: fx.Node, attention: fx.Node):
    """``mask``'s compile-time value (mask_evaluation's compressed or lazy form) when it is a
    constant of the program shaped for ``attention`` and small enough to check, else None."""
    nodes = constant_ancestors(mask)
    if nodes is None:
        return None
    shape = tuple(mask.meta["val"].shape)
    if len(shape) < 2 or shape[-2:] != _lengths(attention):
        return None
    value = evaluate(gm, nodes)
    if value is None:
        return None
    entries = math.prod(shape_of(value))
    if entries > MAX_CHECKED_ELEMENTS:
        log.info("causal_mask: the attention mask of %s is a constant of the program, but has %d distinct "
                 "entries (more than %d to check); it is kept as captured", attention.name, entries,
                 MAX_CHECKED_ELEMENTS)
        return None
    return value


# Ops that and two boolean masks (SAME_ENTRIES: those a mask keeps its entries' meaning through).
_AND = (torch.ops.aten.bitwise_and.Tensor, torch.ops.aten.logical_and.default)


def _scalar(gm: fx.GraphModule, x) -> float | None:
    """``x`` (a number, or a one-element constant of the program) as a float, else None."""
    if isinstance(x, (int, float)):
        return float(x)
    nodes = constant_ancestors(x) if isinstance(x, fx.Node) and x.meta["val"].numel() == 1 else None
    value = evaluate(gm, nodes) if nodes is not None else None
    return float(value.reshape(())) if isinstance(value, torch.Tensor) else None


def _within_causal(gm: fx.GraphModule, mask: fx.Node, attention: fx.Node) -> bool:
    """Whether ``mask`` (computed from inputs) hides every key after its query. A boolean mask
    does when it is an ``and`` (through expands and copies) of masks one of which does, or a
    constant of the program with each entry above the diagonal ``False``; an additive one when it
    is ``where(m, 0, -inf)`` of a boolean ``m`` that does (transformers' form). Not with
    ``finfo.min`` for hidden entries: a row hiding every key then averages all of them, later ones
    included, which skipping the later blocks would change."""
    dtype, (query, key) = mask.meta["val"].dtype, _lengths(attention)
    if tuple(mask.meta["val"].shape[-2:]) != (query, key):
        return False
    if dtype.is_floating_point and mask.op == "call_function" and mask.target is torch.ops.aten.where.self:
        condition, visible, hidden = mask.args
        hidden = _scalar(gm, hidden)
        return (isinstance(condition, fx.Node) and _scalar(gm, visible) == 0.0 and hidden == float("-inf")
                and _within_causal(gm, condition, attention))
    if dtype != torch.bool:
        return False
    if mask.op == "call_function" and mask.target in SAME_ENTRIES + _AND:
        factors = _and_factors(mask)
        return (any(_within_causal(gm, f, attention) for f in factors)
                or packed_sequences.hides_later_keys(gm, factors, (query, key)))
    value = _constant_value(gm, mask, attention)
    if value is None:
        return False
    keys = torch.arange(key)
    return all(not bool((block & (keys > torch.arange(start, stop).unsqueeze(-1))).any())
               for start, stop, block in row_blocks(value, query))


def _and_factors(mask: fx.Node) -> list[fx.Node]:
    """The boolean masks (of two dims or more) ``mask`` is the ``and`` of, through expands and
    copies; ``[mask]`` itself when it is neither."""
    if mask.op == "call_function" and mask.target in SAME_ENTRIES + _AND:
        args = mask.args[:1] if mask.target in SAME_ENTRIES else mask.args[:2]
        return [f for a in args if isinstance(a, fx.Node) and a.meta["val"].dim() >= 2 for f in _and_factors(a)]
    return [mask]


def _constant_kind(gm: fx.GraphModule, mask: fx.Node, attention: fx.Node) -> str | None:
    """"causal" if ``mask`` is a constant of the program equal everywhere to the causal mask of
    ``attention``'s query and key lengths, "unmasked" if it is one that hides nothing (zeros, or
    ``True`` everywhere), else None."""
    value = _constant_value(gm, mask, attention)
    if value is None:
        return None
    query, key = _lengths(attention)
    dtype = mask.meta["val"].dtype
    keys = torch.arange(key)
    kinds = {"causal", "unmasked"}
    for start, stop, block in row_blocks(value, query):
        causal = keys <= torch.arange(start, stop).unsqueeze(-1)
        if dtype == torch.bool:
            visible, hidden = block, ~block
        else:
            visible = block == 0
            hidden = torch.isneginf(block) | (block <= torch.finfo(dtype).min)
        if "causal" in kinds and not bool((visible == causal).all() and (hidden == ~causal).all()):
            kinds.discard("causal")
        if "unmasked" in kinds and not bool(visible.all()):
            kinds.discard("unmasked")
        if not kinds:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _erase_unused(graph: fx.Graph, mask: fx.Node) -> None:
    """Erase ``mask`` and the nodes computing it that nothing else reads any more."""
    for node in reversed(constant_ancestors(mask) or []):
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
