"""Cut a per-rank program into compute regions for a kernel generator, keeping its schedule.

A program after our passes is a sequence of compute (aten ops) and scheduling decisions: when each
collective is issued and waited, when collective inputs are released, when activations go to host
memory and come back, where profiler ranges open. A kernel generator (Inductor) is free to reorder
and fuse what it is given; it must not move any of those decisions. So only *compute regions* go
to it: maximal runs of consecutive compute nodes in program order. Everything else stays a node of
the program, in its place, between the regions: the collectives run in exactly the order and at
exactly the points the passes chose (tests read the generated program to show it).

A node is compute when it is a functional aten op on tensors: not a collective or wait (other
namespaces), not an in-place or ``out=`` op (a mutation of a value the program holds elsewhere),
not a seeded random op (its generator draws stay in program order, bit for bit), no device change
(a swap copy to or from host memory), no symbolic sizes in or out (an expert region's split sizes,
computed at run time), not the ``cat`` packing a fused reduction's gradients (``hp_pack``, from the
bucketing pass): Inductor would allocate the packed buffer when the region starts and write each
gradient into it as it is made, so the bucket would live beside every saved activation through the
region (a DP bucket holding all of backward's gradients: 1.41x the eager step's peak on 2 ranks);
op by op it is allocated once its gradients are ready, and the copy is the one eager makes too;
nor an FSDP unit's copy-out of its gathered parameters (``hp_pack`` too): in a region each
parameter would be copied where it is first read, holding the gathered buffer beside the unit's
activations; op by op the copies follow the wait and the buffer is freed before the unit computes.
``getitem`` of a compute node belongs to its region; ``get_attr`` constants
stay in the program and enter a region as its inputs.

:func:`cut_regions` returns the regions; :func:`outline` replaces each one worth compiling by one
``call_module`` node whose submodule the caller supplies, called with one list of the region's
inputs (``region_arguments``, built right before, so the program's own references to inputs it
reads no later are dropped and the submodule can free each input after its last use) and followed
by ``getitem`` of its outputs.
Nothing here knows about Inductor (codegen/inductor.py does).
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import torch

from .. import compat
from ..ir import meta
from ..ir.ops import aliases_input, draws_random_numbers


@dataclasses.dataclass
class Region:
    """A maximal run of consecutive compute nodes of one program."""

    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]  # values defined before the region that it reads, first use first
    outputs: list[torch.fx.Node]  # its values read after it (by later nodes or the program's output)

    @property
    def work(self) -> int:
        """Ops that do work (not views, not ``getitem``): what makes a region worth compiling."""
        return sum(1 for n in self.nodes if not aliases_input(n.target) and n.target is not operator.getitem)


def _tensor_vals(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)) and val:
        return all(v is None or isinstance(v, torch.Tensor) for v in val)
    return False


def _devices(node: torch.fx.Node) -> set:
    found = set()
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            found.add(val.device)
    val = node.meta.get("val")
    for v in (val if isinstance(val, (tuple, list)) else (val,)):
        if isinstance(v, torch.Tensor):
            found.add(v.device)
    return found


def is_compute(node: torch.fx.Node) -> bool:
    """Whether ``node`` may go to a kernel generator (module docstring)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and is_compute(source)
    if not isinstance(target, compat.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if compat.is_mutating_op(target) or draws_random_numbers(node) or node.meta.get(meta.PACK):
        return False
    if not _tensor_vals(node.meta.get("val")):
        return False
    for arg in node.all_input_nodes:
        if not isinstance(arg.meta.get("val"), torch.Tensor):
            return False  # a symbolic size or a scalar computed at run time
    return len(_devices(node)) <= 1


def cut_regions(graph: torch.fx.Graph) -> list[Region]:
    """The maximal runs of consecutive compute nodes of ``graph``, in program order.

    A ``getitem`` of a compute node's outputs joins its source's region wherever the program has
    it: a pass may have put a scheduling node between an op returning several tensors and the
    ``getitem`` of one (the swap pass's copy of attention's log-sum-exp), and the region would
    then return the op's whole tuple, which a kernel generator cannot (Inductor asserts on it).
    A ``getitem`` only reads its source, so taking it early moves no decision of the program."""
    runs: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    projections: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.target is operator.getitem and is_compute(node):
            projections.append(node)  # neither starts nor ends a run: joins its source's below
        elif is_compute(node):
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    run_of = {node: k for k, run in enumerate(runs) for node in run}
    for item in projections:  # in program order: a projection's source is placed before it
        run_of[item] = run_of[item.args[0]]
        runs[run_of[item]].append(item)
    position = {node: i for i, node in enumerate(graph.nodes)}
    runs = [sorted(run, key=position.__getitem__) for run in runs]
    regions = []
    for nodes in runs:
        inside = set(nodes)
        inputs: dict[torch.fx.Node, None] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in inside:
                    inputs.setdefault(arg)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        regions.append(Region(nodes, list(inputs), outputs))
    return regions


def region_graph_module(region: Region, owner: torch.nn.Module) -> torch.fx.GraphModule:
    """The region as a standalone GraphModule: placeholders ``arg<i>`` for its inputs, nodes
    renamed ``n<i>`` in order, returning its outputs as a tuple. Two regions that compute the same
    thing (the same layer's forward in two layers) give the same code, so a cache keyed on it
    compiles them once."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(region.inputs):
        env[node] = graph.placeholder(f"arg{i}")
        env[node].meta = dict(node.meta)
    for i, node in enumerate(region.nodes):
        new = graph.node_copy(node, lambda a: env[a])
        new.name = f"n{i}"
        new.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
        env[node] = new
    graph.output(tuple(env[n] for n in region.outputs))
    return torch.fx.GraphModule(owner, graph)


def outline(gm: torch.fx.GraphModule, regions: list[Region], make_module) -> torch.fx.GraphModule:
    """A copy of ``gm``'s program (same calling convention) with each region for which
    ``make_module(index, region)`` returns a module replaced by one ``call_module`` node of it
    (named ``region<index>``) and ``getitem`` of its outputs; regions it returns None for stay as
    they are. The copy's other nodes are ``gm``'s, in the same order."""
    graph = copy.deepcopy(gm.graph)  # the calling convention (boxed) and node meta come with it
    by_name = {n.name: n for n in graph.nodes}
    root = torch.nn.Module()
    for name, value in gm.named_children():
        root.add_module(name, value)
    for name in _attr_names(gm.graph):
        _set_dotted(root, name, _resolve(gm, name))
    for index, region in enumerate(regions):
        module = make_module(index, region)
        if module is None:
            continue
        name = f"region{index}"
        root.add_module(name, module)
        nodes = [by_name[n.name] for n in region.nodes]
        inputs = [by_name[n.name] for n in region.inputs]
        outputs = [by_name[n.name] for n in region.outputs]
        with graph.inserting_before(nodes[0]):
            # The inputs go in one list the region empties (Inductor's boxed call): the program
            # drops its own references to the inputs this is the last use of right after building
            # it, so the region frees each input after its last use inside, as the eager program
            # would, instead of holding them all (every saved activation of a backward region)
            # until it returns.
            boxed = graph.call_function(region_arguments, tuple(inputs))
            call = graph.call_module(name, (boxed,))
            call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
            results = []
            for i, out in enumerate(outputs):
                item = graph.call_function(operator.getitem, (call, i))
                item.meta = dict(out.meta)
                results.append(item)
        for out, item in zip(outputs, results):
            out.replace_all_uses_with(item)
            by_name[out.name] = item  # later regions read the output through its getitem
        for node in reversed(nodes):
            graph.erase_node(node)
    graph.lint()
    return torch.fx.GraphModule(root, graph)


def region_arguments(*values) -> list:
    """The list a region module is called with (``outline``), which it empties."""
    return list(values)


def _attr_names(graph: torch.fx.Graph) -> list[str]:
    return sorted({n.target for n in graph.nodes if n.op == "get_attr"})


def _set_dotted(root: torch.nn.Module, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    setattr(root, last, value)


def _resolve(gm: torch.nn.Module, dotted: str):
    value = gm
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
