"""Hand-built fx graphs for unit tests of analyses (memory estimator, cost model): each node gets
the fake ``val`` its op computes, as a captured graph's nodes have."""

from __future__ import annotations

import os

import torch

from ..compat import pytree
from .. import compat

__all__ = ["GraphBuilder", "read_tree"]


class GraphBuilder:
    """Builds an fx graph node by node: ``x = g.input("x", 16, 16)``, ``y = g(aten.mm.default, x, x)``,
    then ``g.module(y)``. Values are fake tensors (no memory)."""

    def __init__(self, default_shape: tuple[int, ...] = ()):
        self.graph = torch.fx.Graph()
        self.mode = compat.FakeTensorMode()
        self.default_shape = tuple(default_shape)

    def input(self, name: str, *shape: int) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape or self.default_shape)
        return node

    def __call__(self, target, *args, **meta) -> torch.fx.Node:
        """A call of ``target`` on ``args`` (nodes or constants); ``meta`` goes into ``node.meta``."""
        node = self.graph.call_function(target, args)
        vals = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], args)
        with self.mode:
            node.meta["val"] = target(*vals)
        node.meta.update(meta)
        return node

    def module(self, *outputs: torch.fx.Node) -> torch.fx.GraphModule:
        self.graph.output(tuple(outputs))
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def read_tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` as ``{relative path: bytes}`` (to compare dump directories)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out
