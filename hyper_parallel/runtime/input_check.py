"""Checks of a call's inputs that one device would fail loudly on and a parallel run would not.

* **Token ids out of range.** One device raises ``IndexError`` in the embedding. Under tensor
  parallelism the vocabulary-parallel embedding masks ids outside a rank's slice to zero, so an
  out-of-range id is *silently* an all-zero embedding; under data parallelism only the rank holding
  it raises and its peers wait in the next collective. The ids are checked against the embedding's
  (global) vocabulary before the program runs.
* **Labels out of range.** Likewise for the targets of the loss: a label that is neither a class
  nor the loss's ``ignore_index`` raises on one device, and under data parallelism on one rank only.
* **Empty batches.** A rank with no rows fails deep inside capture; it is said up front.

Which inputs are checked is read from the captured graph (an input reaching an embedding's
indices or a loss's targets through reshapes and slices). The problems found go into the per-call agreement (spmd.agree), so one rank's bad input ends the
step on every rank with the rank and the call named.

Cost: the range checks are a min/max over the index tensors. On the CPU it is done by default; on an
accelerator it needs a device synchronisation, so it runs there only with
``parallelize(..., check_inputs=True)``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir.kinds import InputKind
from ..compile.annotations import BOUNDARY
from ..ir.graph import CapturedGraph, module_fqn_of

aten = torch.ops.aten

# Ops an index tensor may pass through between the user's input and its use: they only reshape or
# select, or pad (a label shift pads with the ignore index and slices), so every value they pass on
# is one of the input's or a padding value; the input's own values are what is checked.
_PASS_THROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.alias.default, aten.contiguous.default, aten.flatten.using_ints, aten.slice.Tensor, BOUNDARY,
    aten.constant_pad_nd.default,
}
_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)


@dataclasses.dataclass(frozen=True)
class IndexInput:
    """A user input whose values index a table: token ids (an embedding) or labels (a loss)."""

    input_index: int  # position among the call's flat inputs
    path: str  # the input's name ("input_ids")
    size: int  # valid values are [0, size): the global vocabulary or number of classes
    what: str  # "embedding" or "loss"
    module: str  # FQN of the embedding module, or of the module computing the loss
    ignore_index: int | None = None  # a label value the loss skips


def index_inputs(captured: CapturedGraph) -> tuple[IndexInput, ...]:
    """The user inputs of ``captured`` that index an ``aten.embedding`` or are a loss's targets."""
    infos = dict(zip(captured.gm.graph.find_nodes(op="placeholder"), captured.inputs))
    found: dict[tuple, IndexInput] = {}

    def source(node):
        while node.op == "call_function" and node.target in _PASS_THROUGH:
            node = node.args[0]
        info = infos.get(node)
        return info if info is not None and info.kind == InputKind.INPUT else None

    for node in captured.gm.graph.find_nodes(op="call_function", target=aten.embedding.default):
        info = source(node.args[1])
        if info is not None:
            vocab = int(node.args[0].meta["val"].shape[0])
            found.setdefault((info.index, vocab, None), IndexInput(info.index, info.name, vocab, "embedding",
                                                                   module_fqn_of(node)))
    for target in _LOSSES:
        for node in captured.gm.graph.find_nodes(op="call_function", target=target):
            info = source(node.args[1])
            if info is not None:
                logits = node.args[0].meta["val"]
                classes = int(logits.shape[1] if logits.dim() > 1 else logits.shape[0])
                ignore = int(node.args[4]) if len(node.args) > 4 else -100
                found.setdefault((info.index, classes, ignore), IndexInput(info.index, info.name, classes, "loss",
                                                                           module_fqn_of(node), ignore))
    return tuple(found.values())


def index_problem(checks: tuple[IndexInput, ...], flat: list, force: bool) -> str | None:
    """A sentence naming the first input holding an index outside its table, or None. Tensors off
    the CPU are checked only with ``force`` (it synchronises the device)."""
    for check in checks:
        values = flat[check.input_index]
        if not isinstance(values, torch.Tensor) or values.numel() == 0 or (values.device.type != "cpu" and not force):
            continue
        if check.ignore_index is not None:
            values = values[values != check.ignore_index]
            if values.numel() == 0:
                continue
        low, high = (int(v) for v in torch.aminmax(values))
        bad = low if low < 0 else high if high >= check.size else None
        if bad is None:
            continue
        if check.what == "embedding":
            return (
                f"input '{check.path}' holds token id {bad}, outside the vocabulary of embedding "
                f"'{check.module}' (ids must be in [0, {check.size})). One device would raise "
                "IndexError here; check the tokenizer and the model's vocab_size"
            )
        return (
            f"input '{check.path}' holds label {bad}, neither a class of the loss in "
            f"'{check.module or 'the model'}' ([0, {check.size})) nor its ignore_index "
            f"({check.ignore_index}). One device would raise IndexError here"
        )
    return None


def empty_problem(flat: list, paths) -> str | None:
    """A sentence naming the first empty tensor input (a rank without data), or None."""
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 0:
            name = paths()[i]
            return (
                f"input '{name}' is empty (shape {tuple(x.shape)}): every rank needs at least one "
                "sample per step (drop the last incomplete batch, e.g. DataLoader(drop_last=True), "
                "or pad it)"
            )
    return None
