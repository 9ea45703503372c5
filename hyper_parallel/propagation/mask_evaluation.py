"""Compile-time values of constant attention masks, without holding ``batch · seq²`` of them.

The ``causal_mask`` rewrite must know every entry of a mask the program computes from constants
(``propagation/causal_mask.py``). At the sequence lengths context parallelism is for, the mask has
more entries than fit in memory (a 128k-token sequence: 16 G per batch row), so the computation is
evaluated in a compressed form that is exact, then compared with the causal mask a block of query
rows at a time:

* **uniform dims**: every value is held with size 1 along each dim it does not vary on (the batch of
  ``arange``-based positions, the head dim). A value computed by an op that is not pointwise is
  checked for it (dim by dim, against its first slice); a pointwise op of such values is computed on
  them as they are, and its result is uniform where all its inputs are;
* **lazy values**: a pointwise op (or an ``expand``) whose result would exceed
  ``LAZY_ABOVE_ELEMENTS`` is not computed but remembered; :func:`row_blocks` computes it for a
  range of query rows (dim −2, which broadcasting keeps aligned), from its inputs' rows.

Anything else (an op that is not pointwise reading a lazy value, a value over the budget computed
whole) makes the evaluation give up (``None``): the mask then stays as captured.

Reads: the mask node's ancestors (no placeholder among them: :func:`constant_ancestors`) and their
``meta["val"]`` shapes; runs their ops on the CPU, outside any fake-tensor mode.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.fx as fx

from .. import compat

aten = torch.ops.aten
log = logging.getLogger(__name__)

# A value an op that is not pointwise computes whole has at most this many elements (a ``tril``
# mask of 16k tokens: 256 MB of bools).
MAX_MATERIALIZED_ELEMENTS = 2 ** 28
# A pointwise result with more elements than this is lazy: computed by row blocks (faster than whole,
# which is bound by memory traffic: a 16k-token causal mask checks in ~1 s instead of ~25).
LAZY_ABOVE_ELEMENTS = 2 ** 24
# Entries a row block of a lazy mask computes at once.
ROW_BLOCK_ELEMENTS = 2 ** 22


@dataclasses.dataclass
class Lazy:
    """A pointwise op's (or an expand's) result, not computed: ``target(*args, **kwargs)`` with
    ``args`` holding tensors, lazy values and constants; ``shape`` its compressed shape."""

    target: object
    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    dtype: torch.dtype


def constant_ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and every node it is computed from, in graph order; None if any is a placeholder
    (a parameter, buffer, input or tangent) or a random op: ``node`` is then no constant."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        tags = getattr(current.target, "tags", ())
        if current.op not in ("call_function", "get_attr") or torch.Tag.nondeterministic_seeded in tags:
            return None
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


_VIEWS = (aten.view.default, aten._unsafe_view.default)
# Ops whose result has their input's entries, only broadcast or copied (causal_mask.py and
# packed_sequences.py read masks through them).
SAME_ENTRIES = (aten.expand.default, aten.clone.default, aten.alias.default)


class _GiveUp(Exception):
    """The value cannot be computed within the budget, or not in compressed form."""


def evaluate(gm: fx.GraphModule, nodes: list[fx.Node]):
    """The last of ``nodes`` (its constant ancestors, in order) as a compressed tensor or a
    :class:`Lazy`; None where the evaluation gives up (module docstring)."""
    values: dict[fx.Node, object] = {}
    try:
        with compat.real_tensors(), torch.no_grad():
            for node in nodes:
                values[node] = _evaluate_node(gm, node, values)
    except _GiveUp:
        return None
    except RuntimeError as exc:  # an op this evaluation cannot run on the CPU: the mask stays
        log.info("causal_mask: could not evaluate %s at compile time (%s); its mask stays", node.name, exc)
        return None
    return values[nodes[-1]]


def _full_shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _on_cpu(kwargs: dict) -> dict:
    """The capture ran on fake tensors of the training device: factories make CPU tensors here."""
    return {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs


def _evaluate_node(gm: fx.GraphModule, node: fx.Node, values: dict):
    if node.op == "get_attr":
        return _compressed(getattr(gm, node.target))
    shape = _full_shape(node)
    if shape is not None and torch.Tag.pointwise in getattr(node.target, "tags", ()):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        return _pointwise(node.target, args, _on_cpu(kwargs), node.meta["val"].dtype)
    if node.target is aten.expand.default:  # adds leading dims and broadcasts size-1 ones
        held = values[node.args[0]]
        leading = len(shape) - len(shape_of(held))
        if isinstance(held, Lazy):
            return Lazy(_with_leading, (held, leading), {}, (1,) * leading + held.shape, held.dtype)
        return held.reshape((1,) * leading + tuple(held.shape))
    if shape is not None and math.prod(shape) > MAX_MATERIALIZED_ELEMENTS:
        raise _GiveUp

    def whole(source: fx.Node):
        value = values[source]
        if isinstance(value, Lazy):
            raise _GiveUp
        full = _full_shape(source)
        return value.expand(full) if isinstance(value, torch.Tensor) and full is not None else value

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), whole)
    # The arguments may be broadcast views, which ``view`` refuses: reshape copies them if it must.
    target = aten.reshape.default if node.target in _VIEWS else node.target
    result = target(*args, **_on_cpu(kwargs))
    return _compressed(result) if isinstance(result, torch.Tensor) else result


def shape_of(value) -> tuple[int, ...]:
    return value.shape if isinstance(value, Lazy) else tuple(value.shape)


def _with_leading(value: torch.Tensor, leading: int) -> torch.Tensor:
    return value.reshape((1,) * leading + tuple(value.shape))


def _pointwise(target, args, kwargs, dtype: torch.dtype):
    """A pointwise op on compressed values: computed (uniform where all its inputs are) or, over the
    budget or reading a lazy value, a :class:`Lazy` of them."""
    flat = []
    fx.node.map_aggregate((args, kwargs), lambda a: flat.append(a))
    shapes = [shape_of(a) for a in flat if isinstance(a, (torch.Tensor, Lazy))]
    shape = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    if any(isinstance(a, Lazy) for a in flat) or math.prod(shape) > LAZY_ABOVE_ELEMENTS:
        return Lazy(target, args, kwargs, shape, dtype)
    return target(*args, **kwargs)


def _compressed(value: torch.Tensor) -> torch.Tensor:
    """``value`` with size 1 along every dim it is the same along."""
    for dim in range(value.dim()):
        if value.shape[dim] > 1 and bool((value == value.narrow(dim, 0, 1)).all()):
            value = value.narrow(dim, 0, 1)
    return value


def rows(value, start: int, stop: int) -> torch.Tensor:
    """Query rows ``start:stop`` (dim −2) of a compressed or lazy value, computed; a value uniform
    along dim −2 (or without it) is returned as it is, to broadcast."""
    if isinstance(value, Lazy):
        args, kwargs = fx.node.map_aggregate(
            (value.args, value.kwargs), lambda a: rows(a, start, stop) if isinstance(a, (torch.Tensor, Lazy)) else a)
        return value.target(*args, **kwargs)
    if value.dim() >= 2 and value.shape[-2] > 1:
        return value.narrow(-2, start, stop - start)
    return value


def row_blocks(value, query_rows: int):
    """``(start, stop, rows)`` of ``value`` in blocks of about ``ROW_BLOCK_ELEMENTS`` entries."""
    shape = shape_of(value)
    per_row = max(1, math.prod(shape) // max(1, shape[-2] if len(shape) >= 2 else 1))
    step = max(1, ROW_BLOCK_ELEMENTS // per_row)
    for start in range(0, query_rows, step):
        stop = min(query_rows, start + step)
        yield start, stop, rows(value, start, stop)
