"""cleanup: drop what lowering leaves behind that computes nothing.

Reads: nothing from ``node.meta``. Writes: nothing; removes ``aten.detach`` nodes (no-ops in a
functional graph that autograd does not run through) and dead code. Idempotent.
"""

from __future__ import annotations

import torch
from ..propagation import recompile

aten = torch.ops.aten


def cleanup_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    recompile(gm)
    return gm
