"""The captured joint graph as it travels between the stages: :class:`CapturedGraph` and what each
of its placeholders and output slots is (:class:`InputInfo`, :class:`OutputInfo`).

Capture (compile/capture.py) builds a ``CapturedGraph``: one joint forward+loss+backward aten graph,
one ``InputInfo`` per placeholder and one ``OutputInfo`` per output slot (their kinds are the enums
of kinds.py), and the pytree specs that call it like the original module. The rewrites,
propagation, lowering, the passes, the pipeline split and the runtime read and extend it (a
rewrite adds inputs through :meth:`CapturedGraph.add_input`; lowering fills ``pending_inputs``).
Nodes are named for messages and dumps by their module (``nn_module_stack``, or
``fwd_nn_module_stack`` in backward) and source line (``stack_trace``), as
:func:`module_fqn_of`, :func:`source_line` and :func:`describe_node` read them; user inputs and
outputs by their pytree path (:func:`flat_paths`). See docs/architecture.md §3, "The graph
contract" (§3.1: the inputs and outputs of the joint graph, slot order).
"""

from __future__ import annotations

import dataclasses

import torch

from ..compat import pytree
from .kinds import InputKind, OutputKind


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """What one placeholder of the joint graph is."""

    kind: InputKind
    name: str  # parameter/buffer FQN, user-input path (e.g. "input_ids"), or "tangent of <output>"
    index: int  # flat user-input index, output index for tangents, or -1


INPUT_GRAD = OutputKind.INPUT_GRAD
# OutputInfo kind: the new value of a buffer the forward updates in place (BatchNorm's running
# statistics, step counters). Not a user output and without a tangent: the forward program returns
# it after the user outputs and the runtime writes it into the module's buffer.
BUFFER_UPDATE = OutputKind.BUFFER_UPDATE


@dataclasses.dataclass(frozen=True)
class OutputInfo:
    """What one output slot of the joint graph is."""

    kind: OutputKind
    name: str  # output path (e.g. "loss"), the buffer / parameter FQN or the input path whose gradient this is
    index: int  # flat user-output index, flat user-input index (input_grad) or -1


@dataclasses.dataclass
class CapturedGraph:
    """The joint graph plus everything needed to call it like the original module.

    Output slots, in order: the user outputs, the buffer updates (``BUFFER_UPDATE``), one gradient
    slot per primal, then whatever passes append (kept gathered parameters)."""

    gm: torch.fx.GraphModule
    inputs: list[InputInfo]  # one per placeholder, in order
    outputs: list[OutputInfo]  # one per output slot, in order
    in_spec: pytree.TreeSpec  # of (args, kwargs) as the user calls the model
    out_spec: pytree.TreeSpec  # of the model's return value
    num_user_outputs: int
    input_paths: list[str]  # readable path of every flat user input
    output_paths: list[str]  # readable path of every flat user output
    # Gradient output slot -> placeholder of the gradient accumulated for it by earlier micro-steps
    # (propagation/accumulation.py); lowering adds the two.
    pending_inputs: dict[int, torch.fx.Node] = dataclasses.field(default_factory=dict)
    # expert_parallel: module fqn -> (moe.resolve.ExpertRegionPlan, the experts module); lowering
    # traces the module's forward on each rank's received rows (moe/lowering.py).
    expert_regions: dict[str, tuple] = dataclasses.field(default_factory=dict)

    @property
    def buffer_updates(self) -> tuple[str, ...]:
        """FQNs of the buffers the forward updates, in the order of their output slots."""
        return tuple(o.name for o in self.outputs if o.kind == BUFFER_UPDATE)

    @property
    def num_forward_outputs(self) -> int:
        """Output slots the forward produces for the caller: user outputs, then buffer updates."""
        return self.num_user_outputs + len(self.buffer_updates)

    def add_input(self, kind: str, name: str, val: torch.Tensor) -> torch.fx.Node:
        """A new non-differentiable primal input, placed after the last primal (the joint graph
        keeps primals before tangents) with a ``None`` gradient slot (one slot per primal)."""
        graph = self.gm.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        last = max(i for i, info in enumerate(self.inputs) if info.kind != InputKind.TANGENT)
        with graph.inserting_after(placeholders[last]):
            node = graph.placeholder(f"{kind}_{sum(i.kind == kind for i in self.inputs)}")
        node.meta["val"] = val
        # Its gradient slot follows the other primals' (outputs that are not gradients, such as
        # kept gathered parameters, stay last).
        grad_end = self.num_forward_outputs + sum(i.kind != InputKind.TANGENT for i in self.inputs)
        self.inputs.insert(last + 1, InputInfo(kind, name, -1))
        output = graph.output_node()
        slots = list(output.args[0])
        output.args = (type(output.args[0])(slots[:grad_end] + [None] + slots[grad_end:]),)
        self.outputs.insert(grad_end, OutputInfo(OutputKind.NONE, "", -1))
        return node


def _path_str(path) -> str:
    text = pytree.keystr(path)
    # "[0][1]['input_ids']" → "input_ids" for the common kwargs case
    return text.replace("[1]['", "", 1).rstrip("]'") if text.startswith("[1]['") else text


def flat_paths(tree) -> list[str]:
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [_path_str(p) for p, _ in leaves]


def module_fqn_of(node: torch.fx.Node) -> str:
    """The FQN of the innermost module a joint-graph node belongs to ("" = root, forward or backward)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _normalize_fqn(path)


def _normalize_fqn(path: str) -> str:
    # export writes list indices as "layers.0" or "layers[0]" depending on the container; normalise.
    return path.replace("[", ".").replace("]", "").replace("L['self'].", "").lstrip(".")


def describe_node(node: torch.fx.Node) -> str:
    """``node 'x' (op) in module 'm' at file:line: code``: how errors and dumps name a node."""
    where = source_line(node)
    module = module_fqn_of(node)
    text = f"node '{node.name}' ({node.target})"
    if module:
        text += f" in module '{module}'"
    if where:
        text += f" at {where}"
    return text


def source_line(node: torch.fx.Node) -> str:
    """The user's source line that produced a node (last frame of its stack trace), or ""."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        if trace[i].lstrip().startswith("File "):
            where = trace[i].strip()
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f"{where}: {code}" if code else where
    return trace[-1].strip() if trace else ""
