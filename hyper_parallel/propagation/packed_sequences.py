"""transformers' packed-sequence (document) mask hides every key after its query.

Packed training puts several documents in one row and restarts the position ids at each
(``position_ids = [0, 1, 2, 0, 1, 0, 1, 2, 3]``; transformers' ``DataCollatorWithFlattening``).
Under tracing transformers then builds its attention mask from the position ids ``P`` of each row:

* ``same document``: ``D[q] == D[k]`` with ``D = cumsum(diff(P) != 1)`` (a new document wherever
  the position does not go up by one; ``diff`` with ``P[0] − 1`` prepended);
* ``causal``: ``P[k] <= P[q]`` (positions, not token indices);

and'ed (with a padding mask when there is one). The mask depends on an input, so
``propagation/causal_mask.py`` cannot evaluate it, and neither factor alone hides the later keys.
Together they do: if ``D[q] == D[k]`` and ``k > q``, no document starts in ``(q, k]``, so every
step there adds one to the position and ``P[k] = P[q] + (k − q) > P[q]``, which the causal factor
hides. This module recognises the two factors in the graph, so ring attention skips the blocks
after the queries (``hp_mask_within_causal``) as it does for a causal or padded causal mask.

What is checked, exactly (anything else: not recognised, the mask keeps its full cost):

* ``D`` is ``cumsum(ne(Y[1:] − Y[:-1], 1), -1)`` with ``Y = cat([P[:, :1] − 1, P], -1)``;
* both factors index ``D`` and ``P`` (or an ``expand`` of it) of the same 2-d node ``P`` with the
  same batch index, and an index that is ``arange(query length)`` along dim −2 for the query and
  ``arange(key length)`` along dim −1 for the key (compile-time constants of the program);
* the query, key and ``P``'s sequence lengths are equal.

Reads: the mask's ``and`` factors (``causal_mask._within_causal`` collects them) and their
ancestors. Writes nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .mask_evaluation import SAME_ENTRIES, constant_ancestors, evaluate

aten = torch.ops.aten


def hides_later_keys(gm: fx.GraphModule, factors: list[fx.Node], lengths: tuple[int, int]) -> bool:
    """Whether two of ``factors`` (boolean masks and'ed together) are transformers' same-document
    and position-causal masks of one position tensor (module docstring)."""
    query, key = lengths
    if query != key:
        return False
    documents = {found for f in factors if (found := _same_document(gm, f, query)) is not None}
    causal = {found for f in factors if (found := _position_causal(gm, f, query)) is not None}
    return bool(documents & causal)


def _same_document(gm, node: fx.Node, length: int):
    """``(P, batch index)`` when ``node`` is ``D[b, q] == D[b, k]`` for transformers' document ids
    ``D`` of the positions ``P``, else None."""
    if node.op != "call_function" or node.target is not aten.eq.Tensor:
        return None
    sides = [_indexed(gm, a, length) for a in node.args[:2]]
    if None in sides or {sides[0][2], sides[1][2]} != {"query", "key"}:
        return None
    (ids, batch, _), (other, other_batch, _) = sides
    if ids is not other or not torch.equal(batch, other_batch):
        return None
    positions = _document_source(ids)
    return (positions, _key(batch)) if positions is not None and _sequence(positions) == length else None


def _position_causal(gm, node: fx.Node, length: int):
    """``(P, batch index)`` when ``node`` is ``P[b, k] <= P[b, q]`` (or ``P[b, q] >= P[b, k]``)."""
    if node.op != "call_function" or node.target not in (aten.le.Tensor, aten.ge.Tensor):
        return None
    sides = [_indexed(gm, a, length) for a in node.args[:2]]
    if None in sides:
        return None
    roles = ("key", "query") if node.target is aten.le.Tensor else ("query", "key")
    if (sides[0][2], sides[1][2]) != roles:
        return None
    (left, batch, _), (right, other_batch, _) = sides
    left, right = _through(left), _through(right)
    if left is not right or not torch.equal(batch, other_batch) or _sequence(left) != length:
        return None
    return left, _key(batch)


def _indexed(gm, node, length: int):
    """``(source, batch index value, "query" | "key")`` for ``source[batch, index]`` whose index is
    ``arange(length)`` along dim −2 (query) or −1 (key), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not aten.index.Tensor:
        return None
    source, indices = node.args
    if not isinstance(source, fx.Node) or len(indices) != 2 or source.meta["val"].dim() != 2:
        return None
    batch, index = (_constant(gm, i) for i in indices)
    # ``length`` entries along one of the last two dims (every other dim of size 1), 0 .. length-1.
    if (batch is None or index is None or index.dim() < 2 or index.numel() != length
            or not torch.equal(index.reshape(-1), torch.arange(length, dtype=index.dtype))):
        return None
    role = {(length, 1): "query", (1, length): "key"}.get(tuple(index.shape[-2:]))
    return (source, batch, role) if role is not None else None


def _document_source(ids: fx.Node) -> fx.Node | None:
    """``P`` when ``ids`` is ``cumsum(ne(Y[..., 1:] - Y[..., :-1], 1), -1)``, ``Y = cat([P[:, :1] - 1,
    P], -1)``, else None."""
    if not _call(ids, aten.cumsum.default) or _dim(ids.args[1], 2) != 1:
        return None
    starts = ids.args[0]
    if not _call(starts, aten.ne.Scalar) or starts.args[1] != 1:
        return None
    step = starts.args[0]
    if not _call(step, aten.sub.Tensor) or len(step.args) != 2:
        return None
    later, earlier = step.args
    if not (_call(later, aten.slice.Tensor) and _call(earlier, aten.slice.Tensor)):
        return None
    joined = later.args[0]
    cat_dim = joined.args[1] if len(joined.args) > 1 else 0
    if earlier.args[0] is not joined or not _call(joined, aten.cat.default) or _dim(cat_dim, 2) != 1:
        return None
    n = joined.meta["val"].shape[-1]
    if _slice(later) != (1, n) or _slice(earlier) != (0, n - 1):
        return None
    pieces = joined.args[0]
    if len(pieces) != 2:
        return None
    before, positions = pieces
    if not (_call(before, aten.sub.Tensor) and before.args[1] == 1):
        return None
    first = before.args[0]
    if not _call(first, aten.slice.Tensor) or first.args[0] is not positions or _slice(first) != (0, 1):
        return None
    return positions


def _slice(node: fx.Node) -> tuple[int, int] | None:
    """``(start, end)`` of a slice along the last dim of a 2-d value (ends clamped), else None."""
    defaults = [None, 0, None, None, 1]  # aten.slice.Tensor(self, dim, start, end, step)
    source, dim, start, end, stride = (list(node.args) + defaults[len(node.args):])[:5]
    size = source.meta["val"].shape[-1]
    if _dim(dim, 2) != 1 or stride != 1:
        return None
    end = size if end is None else min(end, size)
    return (start or 0), end


def _through(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in SAME_ENTRIES:
        node = node.args[0]
    return node


def _sequence(positions: fx.Node) -> int | None:
    val = positions.meta.get("val")
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _constant(gm, node) -> torch.Tensor | None:
    nodes = constant_ancestors(node) if isinstance(node, fx.Node) else None
    value = evaluate(gm, nodes) if nodes else None
    return value if isinstance(value, torch.Tensor) else None


def _key(batch: torch.Tensor) -> tuple:
    return tuple(batch.shape), tuple(batch.reshape(-1).tolist())


def _call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _dim(dim, ndim: int) -> int | None:
    return dim % ndim if isinstance(dim, int) else None
