"""Node names as a graph built afresh in its order gives them: ``mm``, ``mm_1``, ``mm_2``.

Tracing and rewriting leave gaps in the numbering (nodes dropped as dead, boundaries merged away),
so the same program built two ways, by tracing every block or by copying two of them
(compile/repeated/lowering.py), would be named differently. Every stage that may leave gaps
(capture, each rewrite, lowering) renumbers its graph before anything reads the names: dumps,
``hp_source``, the propagation report. Placeholders keep their names (``primals_3``), which name
their slot."""

from __future__ import annotations

import re

import torch

from .. import compat

_NUMBERED = re.compile(r"_\d+$")


def unnumbered(name: str) -> str:
    """``name`` without its number: ``mm_5`` -> ``mm``, ``_to_copy_default_3`` -> ``_to_copy_default``."""
    return _NUMBERED.sub("", name)


def base_name(node: torch.fx.Node) -> str:
    """What a node is named from when the graph is numbered afresh: its name without the number;
    a placeholder's whole name."""
    return node.name if node.op == "placeholder" else unnumbered(node.name)


def renumber(gm: torch.fx.GraphModule, recompile: bool = True) -> torch.fx.GraphModule:
    """Rename ``gm``'s nodes densely in graph order (see the module docstring); returns ``gm``."""
    compat.renumber_node_names(gm.graph, base_name)
    if recompile:
        gm.recompile()
    return gm
