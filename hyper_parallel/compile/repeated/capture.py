"""Repeated blocks at capture: trace two blocks of the repeated list, or every block.

:func:`capture_blocks_once` is capture with ``parallelize``'s ``repeated_blocks``: when the list
qualifies (:mod:`.eligibility`) and its two traced blocks correspond (:mod:`.correspondence`), the
other blocks are written as copies (:mod:`.instantiation`) when the full graph is first asked
for; else every block is traced and the INFO log says why.

Reads: the model, its inputs and the plan's boundaries. Writes: a :class:`BlockCapture`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Callable

import torch.fx as fx
import torch.nn as nn

from ... import compat
from ...errors import internal_error
from ...ir.graph import CapturedGraph
from ..capture import capture
from .correspondence import block_index
from .eligibility import TRACED, BlocksDiffer, RepeatedBlocks, find_repeated_blocks, first_blocks_only
from .instantiation import check_copyable, instantiate_blocks

log = logging.getLogger(__name__)


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
        try:
            failed = None
            with first_blocks_only(model, blocks) as cut:
                try:
                    two = capture(model, args, kwargs, traced_boundaries, experts)
                except Exception as exc:
                    failed = exc
            if failed is not None and not cut.seen:  # not the cut's doing: the full trace fails alike
                raise failed
            if cut.seen:  # what it read (or failed on: an index past the cut) differs with every block
                raise BlocksDiffer(f"the forward computes with the number of blocks ({cut.seen[0]})")
            check_copyable(two, blocks)
            return BlockCapture(None, f"{TRACED} of {blocks.count} blocks of {blocks.prefix} traced", two, blocks,
                                _copy_captured(two))
        except BlocksDiffer as exc:
            why = f"{blocks.prefix}: {exc}"
            forget_annotations()
    # "auto" is the default: a model without a list long enough to copy (none, or two blocks) is
    # not news. A longer list that could not be copied, or one the user named, is: the compile is
    # slower than it could be, and the reason says what to change.
    long_list = any(isinstance(m, nn.ModuleList) and len(m) > TRACED for m in model.modules())
    level = logging.INFO if option != "auto" or long_list else logging.DEBUG
    log.log(level, "repeated_blocks=%r: tracing every block: %s", option, why)
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
