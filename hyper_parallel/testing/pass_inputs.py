"""The graph a pass receives in a real compile, for pass-level unit tests (tests/passes/).

``pass_input`` compiles a small model on torch's ``fake`` process-group backend (one process, meta
tensors) through the real pipeline, with the pass under test replaced by a recorder and the passes
after it disabled: the test gets exactly the joint graph and ``PassContext`` the pass would see, with
real lowering meta, and runs the pass itself.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import torch
import torch.nn as nn

import hyper_parallel as hp
from .. import passes
from ..compat import copy_graph_module
from ..tools.explain import compile_for_explain, fake_world

__all__ = ["LayerStack", "assert_right_before_first_use", "assert_valid_order", "copy_graph_module", "pass_input"]


def pass_input(model_fn, plan, world: int, upto: str, rank: int = 0, *, axis: str = "dp", inputs=None,
               **options):
    """``(gm, ctx)``: a copy of the joint graph pass ``upto`` receives when ``model_fn()`` is
    parallelized with ``plan`` on a simulated ``world``-rank mesh of one ``axis`` as ``rank``, and
    the pass context it runs with (``on_pass`` and ``disable_passes`` cleared). The model takes one
    ``(4, 8)`` input, or the keyword arguments ``inputs`` (meta tensors, this rank's shapes)."""
    seen = {}

    def record(gm, ctx):
        seen["gm"] = copy_graph_module(gm)
        seen["ctx"] = dataclasses.replace(ctx, on_pass=None, disable_passes=frozenset())
        return gm

    names = passes.pass_names()
    recording = [(name, record if name == upto else fn) for name, fn in passes.PASSES]
    with fake_world(world, rank), mock.patch.object(passes, "PASSES", recording):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        with hp.init_empty_weights():
            model = model_fn()
        args = () if inputs is not None else (torch.empty(4, 8, device="meta"),)
        compile_for_explain(model, plan, mesh, args, inputs, disable_passes=names[names.index(upto) + 1:], **options)
    return seen["gm"], seen["ctx"]


def assert_valid_order(gm: torch.fx.GraphModule) -> None:
    """Every node after its inputs, and fx's own consistency checks."""
    seen = set()
    for node in gm.graph.nodes:
        assert all(a in seen for a in node.all_input_nodes), f"{node.name} runs before one of its inputs"
        seen.add(node)
    gm.graph.lint()


def assert_right_before_first_use(gm: torch.fx.GraphModule, new: set) -> None:
    """Each added node sits in a block of added nodes that ends at the first node reading it
    (directly or through other added nodes)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for node in new:
        i = order[node]
        while nodes[i] in new:
            i += 1
        readers, frontier = set(), [node]
        while frontier:
            for u in frontier.pop().users:
                if u in new:
                    frontier.append(u)
                else:
                    readers.add(u)
        assert nodes[i] in readers and min(order[r] for r in readers) == i, (node.name, nodes[i].name)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x))


class LayerStack(nn.Module):
    """``num_layers`` blocks ``layers.<i>`` (Linear(8, 8) + ReLU) and a ``head``; returns a scalar:
    the smallest model with repeated FSDP units for the pass tests."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(num_layers)])
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def in_flight_per_group(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The most collectives of one process group issued and not yet waited at any point of the
    program, per group name."""
    c10d = torch.ops._c10d_functional
    in_flight: dict[str, set] = {}
    most: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is c10d.wait_tensor.default:
            for open_ in in_flight.values():
                open_.discard(node.args[0])
        elif getattr(node.target, "namespace", None) == "_c10d_functional":
            group = [a for a in node.args if isinstance(a, str)][-1]
            in_flight.setdefault(group, set()).add(node)
            most[group] = max(most.get(group, 0), len(in_flight[group]))
    return most
