"""Repeated blocks through propagation and lowering: run them on two blocks, copy the result.

Capture traces two blocks of a repeated list and writes the others as copies
(:mod:`.capture`). Propagation and lowering cost as much per block as tracing did, and
they too compute the same thing for every block once the blocks' inputs have the same layouts.
So the pre-propagation rewrites, propagation and lowering run on the two-block joint graph, and
both their results are written out for every block with the same machinery
(:func:`~.instantiation.instantiate`):

* the rewritten, propagated joint graph: every block's nodes with block 1's layouts; this is exact
  when each copy reads its chained values (the hidden state, its gradient) in the layouts block 1
  read them in, which the instantiation checks;
* the lowered local joint graph: every node lowering emitted for block 1 (its collectives, local
  views, the way of its parameters' gradients to their storage) copied per block, each naming the
  copied joint-graph node it serves (``hp_source``), with that node's layout, module stack, source
  line and autograd sequence number;
* the propagation report, read back from the copied graph's nodes.

The result is what the same steps give on the full joint graph: the dumps, from the rewrites to the
partitioned programs, are the same files (``tests/compile/test_repeated_blocks.py``). Where a check
fails (block 0 and 1 lowered differently, a gradient accumulated over micro-steps, context
parallelism's ring transfers, which name their attention node) the steps run on the full graph, as
without copying, and the INFO log says why.

Reads: the two-block :class:`~...ir.graph.CapturedGraph` as capture traced it. Writes: the full
joint graph (rewritten, with layouts), its :class:`~...propagation.engine.PropagationReport` and
the lowered :class:`torch.fx.GraphModule`; the two-block graph is rewritten in place.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch.fx as fx

from ...ir import meta
from ...ir.graph import CapturedGraph
from ...progress import Progress
from ...propagation.engine import PropagationReport, report_of
from .correspondence import block_index, locate_blocks
from .eligibility import BlocksDiffer, RepeatedBlocks
from .instantiation import Instantiated, check_rewrites_copyable, instantiate
from .renaming import renamer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CopiedLowering:
    """What propagation and lowering of the full joint graph give, built from two blocks."""

    captured: CapturedGraph  # every block, rewritten, with layouts
    report: PropagationReport
    local: fx.GraphModule  # the lowered local joint graph


def lower_blocks_once(two: CapturedGraph, blocks: RepeatedBlocks,
                      front_end: Callable[..., tuple[PropagationReport, fx.GraphModule]],
                      dump_rewrite: Callable[[str, fx.GraphModule], None] | None,
                      context=None, progress: Progress | None = None) -> CopiedLowering | None:
    """Rewrite, propagate and lower ``two`` with ``front_end(captured, on_rewrite, check_rewritten)
    -> (report, lowered)``, then copy. ``dump_rewrite(stage, gm)``: where each rewrite's full graph
    is dumped (None: not dumping). ``context``: the plan's context parallelism, whose lowering is not copied;
    ``progress``: where the copying's seconds go (phase "copy blocks").
    None when the copies would not be exact: the caller then runs the steps on the full graph."""
    if context is not None:
        log.info("repeated_blocks: lowering every block: context parallelism's ring transfers name their "
                 "attention node")
        return None
    rewrites: list[tuple[str, fx.GraphModule]] = []

    def on_rewrite(stage: str, gm: fx.GraphModule) -> None:
        if dump_rewrite is not None:
            rewrites.append((stage, instantiate(dataclasses.replace(two, gm=gm), blocks).captured.gm))

    try:
        # Refused before propagating and lowering two blocks for nothing (and before the progress
        # log shows those phases twice).
        report, local = front_end(two, on_rewrite, check_rewrites_copyable)
        with (progress or Progress("", enabled=False)).phase("copy blocks"):
            full = instantiate(two, blocks)
            local = _instantiate_lowered(two, local, full, blocks)
    except BlocksDiffer as exc:
        log.info("repeated_blocks: propagating and lowering every block: %s: %s", blocks.prefix, exc)
        return None
    for stage, gm in rewrites:
        dump_rewrite(stage, gm)
    return CopiedLowering(full.captured, report_of(full.captured.gm, report.output_placements), local)


def _instantiate_lowered(two: CapturedGraph, local: fx.GraphModule, full: Instantiated,
                         blocks: RepeatedBlocks) -> fx.GraphModule:
    """The lowered graph of every block from ``local``, the lowering of ``two``; ``full``: ``two``
    written out for every block (the joint-graph nodes the copies name)."""
    prefix = blocks.prefix
    sources = {n.name: n for n in two.gm.graph.nodes}
    full_output = full.captured.gm.graph.output_node()
    to_block1 = renamer(prefix, 0, 1)

    def source_of(node: fx.Node) -> fx.Node | None:
        return sources.get(node.meta.get(meta.SOURCE))

    def block_of(node: fx.Node, of: dict) -> int | None:
        src = source_of(node)
        if src is None or src.op == "placeholder":
            return None
        if src.op == "output":  # a gradient's way to its storage: its parameter's block
            grad_of = node.meta.get(meta.GRAD_OF)
            return block_index(grad_of.rsplit(".", 1)[0], prefix) if grad_of else None
        return full.located.of.get(src)

    def same_source(a: fx.Node, b: fx.Node) -> bool:
        sa, sb = source_of(a), source_of(b)
        if sa is None or sb is None or sa.op == "output" or sb.op == "output":
            corresponds = (sa is None) == (sb is None) and getattr(sa, "op", None) == getattr(sb, "op", None)
        else:
            corresponds = full.counterpart.get(sa) is sb
        own = {k for k in (*a.meta, *b.meta) if k.startswith("hp_") and k != meta.SOURCE
               and isinstance(a.meta.get(k, b.meta.get(k)), str)}
        return corresponds and all(to_block1(a.meta.get(k)) == b.meta.get(k) for k in own)

    def retag(old: fx.Node, j: int | None, new_meta: dict) -> dict:
        src = source_of(old)
        if src is None:
            return new_meta
        target = full_output if src.op == "output" else full.new_node(src, j)
        new_meta[meta.SOURCE] = target.name
        if isinstance(new_meta.get("custom"), dict) and meta.SOURCE in new_meta["custom"]:
            new_meta["custom"] = {**new_meta["custom"], meta.SOURCE: target.name}
        for key in meta.COPIED_BY_LOWERING:
            if key in target.meta:
                new_meta[key] = target.meta[key]
        if new_meta.get(meta.ROLE) == meta.ROLE_COMPUTE:
            new_meta[meta.LAYOUT] = target.meta[meta.LAYOUT]
        return new_meta

    lowered = dataclasses.replace(two, gm=local)
    located = locate_blocks(lowered, prefix, block_of)
    return instantiate(lowered, blocks, located, same_source, retag).captured.gm
