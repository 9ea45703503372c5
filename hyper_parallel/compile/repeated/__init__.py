"""Repeated blocks: trace, rewrite, propagate and lower two blocks of a list of identical blocks,
write the others as copies.

Tracing is most of a compile and grows with depth: ``torch.export`` and aot_autograd's joint trace
run through every transformer block although each gives the same graph up to renaming. With
``parallelize(..., repeated_blocks="auto" | "<ModuleList FQN>")`` capture traces the model with the
list cut to its first two blocks, then writes blocks 2 .. N-1 into the joint graph as copies of
block 1. The result is the joint graph a trace of all N blocks gives: the same nodes in the same
order, module stacks, source lines and autograd sequence order, named as a fresh trace numbers them
(``tests/compile/test_repeated_blocks.py`` compares the two node by node, and the compiled dumps byte
for byte). The same instantiation writes out the two-block graph after propagation and after
lowering, with the checks that concern layouts and lowered nodes added.

One module per job:

* :mod:`.eligibility`: which blocks may be traced once and copied (``parallelize``'s option, the
  blocks' classes, parameters, hooks, attributes and plan);
* :mod:`.correspondence`: where blocks 0 and 1 sit in the two-block trace, and which node of one
  matches which node of the other;
* :mod:`.instantiation`: the graph of all blocks written from the two-block one;
* :mod:`.renaming`: block i's names (module paths, stacks, parameter FQNs, descriptors) as block j's;
* :mod:`.capture`: capture tracing two blocks, or every block when the copies would not be exact;
* :mod:`.lowering`: the rewrites, propagation and lowering run on two blocks, their results copied.

``"auto"`` is ``parallelize``'s default. When a check fails the compile traces every block, as
with ``repeated_blocks=None``, and the log says why (INFO when the list was named or has more than two
blocks, DEBUG when ``"auto"`` found no list that long). Code outside the
blocks that computes with their number (``len(self.layers)`` in a formula, an index from the end,
a partial slice) is noticed while the two blocks are traced (:class:`.eligibility.FirstBlocks`)
and makes the compile trace every block too.

Reads: the model, the two-block :class:`~...ir.graph.CapturedGraph` (traced, propagated or
lowered). Writes: a new CapturedGraph of all blocks (the two-block one is not changed by the
copying).
"""

from .capture import BlockCapture, capture_blocks_once
from .eligibility import check_option
from .lowering import CopiedLowering, lower_blocks_once

__all__ = ["BlockCapture", "CopiedLowering", "capture_blocks_once", "check_option", "lower_blocks_once"]
