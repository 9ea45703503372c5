"""torch.fx: graph copies, calling conventions, node names and cheap node creation.

Private names: ``Graph._codegen`` and ``torch.fx.graph._BoxedCodeGen`` (aot_autograd's "boxed"
calling convention, so a program frees each argument after its last use), ``GraphModule._boxed_call``,
``torch.fx.graph._Namespace`` / ``Graph._graph_namespace`` (renumbering node names as a fresh
graph would), ``torch.fx._lazy_graph_module._LazyGraphModule`` (no code generation until a
module is called) and ``Node._update_args_kwargs`` (a node copied without ``create_node``'s walk
of its arguments: passes copy tens of thousands).
"""

from __future__ import annotations

import copy

import torch

__all__ = [
    "use_boxed_calling_convention",
    "copy_graph_module",
    "is_boxed_call",
    "renumber_node_names",
    "lazy_graph_module",
    "create_node_unchecked",
    "copy_node",
]


def use_boxed_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` take one list of arguments and clear it on entry (aot_autograd's "boxed"
    convention), so each argument can be freed inside the graph after its last use instead of
    living until the call returns."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph may be rewritten without touching ``gm`` (node meta copied shallowly),
    with ``gm``'s code generator, so its calling convention (boxed or not) too. Lazy
    (:func:`lazy_graph_module`): the passes that rewrite it, and explain's compiles that never run
    it, skip generating code for each version."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    return lazy_graph_module(gm, graph)


def is_boxed_call(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` uses the boxed calling convention (frees each argument after its last use)."""
    return bool(getattr(gm, "_boxed_call", False))


def renumber_node_names(graph: torch.fx.Graph, base_of) -> None:
    """Name ``graph``'s nodes as a new graph built in their order names them: ``base_of(node)``
    numbered by a fresh namespace (fx keeps its names in the graph's private namespace)."""
    namespace = torch.fx.graph._Namespace()
    for node in graph.nodes:
        node.name = namespace.create_name(base_of(node), node)
    graph._graph_namespace = namespace


def lazy_graph_module(root, graph: torch.fx.Graph, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A GraphModule that generates and compiles its Python code when first called or read, not
    when built (nor at each ``recompile``): a large graph that passes rewrite, or that is only
    dumped, skips code generation it does not need."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name=class_name)


def create_node_unchecked(graph: torch.fx.Graph, op: str, target, args: tuple, kwargs: dict, name: str,
                          type_expr=None) -> torch.fx.Node:
    """``graph.create_node(...)`` without its walk of the arguments looking for raw SymInts (it only
    warns): for copies, whose arguments are nodes and the constants a built graph already held. The
    walk is about 40% of the cost of a node; a 32-layer compile copies tens of thousands."""
    new = graph.create_node(op, target, (), {}, name, type_expr)
    new._update_args_kwargs(args, kwargs)  # what create_node does with them, less the walk
    return new


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node, arg_transform) -> torch.fx.Node:
    """``graph.node_copy(node, arg_transform)`` through :func:`create_node_unchecked`; ``meta`` is
    shared, not copied (callers that change it assign a new dict)."""
    args = torch.fx.node.map_arg(node.args, arg_transform)
    kwargs = torch.fx.node.map_arg(node.kwargs, arg_transform)
    new = create_node_unchecked(graph, node.op, node.target, args, kwargs, node.name, node.type)
    new.meta = node.meta
    return new
