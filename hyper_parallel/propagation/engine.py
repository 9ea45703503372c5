"""Layout propagation over the joint forward+backward graph.

Reads: the captured joint graph, the resolved plan (parameter layouts, module-boundary constraints,
input overrides) and the mesh. Writes ``node.meta["hp_layout"]`` (a :class:`NodeLayout`) on every
node, and returns a :class:`PropagationReport`.

Seeds: parameters and buffers take their planned storage layout; user inputs are Shard(0) over the
data-parallel axes and Replicate elsewhere unless ``plan.inputs`` says otherwise; each tangent takes
the layout of the output it belongs to. Every other node is visited once in topological order (so
forward first, then backward) and gets the cheapest strategy of its op given its inputs' layouts
(rules.py). Boundary nodes apply the plan: the forward ``boundary`` moves the value to the planned
layout on the constrained axes; the matching ``boundary_grad`` moves the gradient back to the layout
the value had before the boundary (Partial read as Replicate, since a gradient leaving a module must
be complete), which is exactly the transpose Megatron's f/g operators hand-code.

Sinks: user outputs are brought to the user-facing layout (0-d results such as the loss
Replicate, i.e. the global value; other outputs Shard(0) over the data-parallel axes like the
inputs and, on the other axes, the Shard they were computed with, else Replicate: vocab-parallel
logits are returned as a DTensor over those axes instead of being gathered; ``plan.outputs``
overrides that per output), and each parameter gradient to its parameter's layout, so that a Partial gradient becomes an
all-reduce (or reduce-scatter for a sharded parameter) and nothing is assumed. A buffer's new value
(BatchNorm running statistics) goes to the buffer's storage layout (Replicate, normally): the value
one device computes on the global batch, which every rank then writes into its copy.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import operator
import re
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .. import compat
from ..compat import pytree
from ..compile.annotations import BOUNDARY, BOUNDARY_GRAD, UNSHARD, parse_boundary_key
from ..cp.load_balance import balanced_sequence_length
from ..ir.graph import BUFFER_UPDATE, INPUT_GRAD, CapturedGraph, module_fqn_of
from ..ir.graph import describe_node as _describe
from ..errors import internal_error
from ..ir import meta
from ..ir.kinds import InputKind, OutputKind
from ..layout import format_placements, with_shard_dim
from ..moe.propagation import expert_op_layout
from ..moe.region import EXPERTS, EXPERTS_BACKWARD
from . import balanced_order
from .accumulation import GRAD_ACCUM, unreduced_placements
from .attention_rules import sequence_sharded_attention
from .rules import NoShardingRule, has_partial, propagate_op, propagate_token_mean
from .unshard import GATHERED, PREGATHERED

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The layout decision for one node.

    ``output``: DTensorSpec of the result (a tuple of them for multi-output ops, None for
    non-tensors). ``inputs``: for every tensor argument (pytree order of args then kwargs), the spec it
    must have when the op runs; lowering inserts the redistribution from the producer's layout.
    ``how``: "placeholder", "rule", "fallback", "boundary", "boundary_grad", "unshard", "factory",
    "getitem" or "output".
    """

    output: Any
    inputs: tuple
    how: str


@dataclasses.dataclass
class PropagationReport:
    """What propagation decided that a user should know about."""

    fallbacks: list[str] = dataclasses.field(default_factory=list)  # ops run replicated (no rule)
    boundaries: list[str] = dataclasses.field(default_factory=list)  # plan-imposed layout changes
    # Flat user-output index -> full-mesh placements it is returned in.
    output_placements: dict[int, tuple] = dataclasses.field(default_factory=dict)


def tensor_meta_of(val) -> compat.TensorMeta:
    return compat.TensorMeta(tuple(val.shape), tuple(val.stride()), val.dtype)


def make_spec(mesh, placements, val) -> compat.DTensorSpec:
    return compat.DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta_of(val))


def normalize_placement(p, ndim: int):
    if isinstance(p, (Shard, compat.StridedShard)) and p.dim < 0:
        return with_shard_dim(p, p.dim + ndim)
    return p


def data_parallel_placements(mesh, val, dp_axes) -> tuple:
    """The per-rank data convention: Shard(0) over the data-parallel axes when dim 0 divides, else R."""
    names = mesh.mesh_dim_names or ()
    ndim = val.dim()
    dp_size = math.prod(mesh.size(names.index(a)) for a in dp_axes) if dp_axes else 1
    shard_batch = ndim >= 1 and dp_size > 1 and val.shape[0] % dp_size == 0
    return tuple(
        Shard(0) if (shard_batch and name in dp_axes) else Replicate() for name in names
    )


def check_divisible(node, spec, mesh, what: str) -> None:
    """A Shard placement on a dim its mesh axes do not divide is a user error (uneven sharding
    is not supported yet): say which node, dim, size and axes, and what to do."""
    shape = spec.tensor_meta.shape
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    per_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            per_dim.setdefault(p.dim, []).append(axis)
    for dim, axes in per_dim.items():
        size = math.prod(mesh.size(a) for a in axes)
        if dim >= len(shape) or shape[dim] % size != 0:
            axes_text = " x ".join(f"{names[a]}={mesh.size(a)}" for a in axes)
            raise ValueError(
                f"{what}: {_describe(node)} has shape {tuple(shape)}, and dim {dim} "
                f"({shape[dim] if dim < len(shape) else 'missing'}) is not divisible by mesh axes "
                f"{axes_text}. Uneven sharding is not supported: choose sizes divisible by the "
                "parallel degree, or a layout that shards another dim."
            )


class _Propagator:
    def __init__(self, captured: CapturedGraph, resolved, mesh):
        self.captured = captured
        self.resolved = resolved
        self.mesh = mesh
        self.axis_names = tuple(mesh.mesh_dim_names or ())
        self.report = PropagationReport()
        # key -> (placements before the boundary, the constrained axes, the plan entry's text)
        self.forward_boundary_source: dict[str, tuple] = {}
        self.output_specs: dict[int, compat.DTensorSpec] = {}

    # --- helpers ---------------------------------------------------------------------------------
    def spec_of(self, node: torch.fx.Node):
        return node.meta[meta.LAYOUT].output

    def with_constraint(self, base_placements, constraint: dict, ndim: int) -> tuple:
        placements = list(base_placements)
        for axis, p in constraint.items():
            placements[self.axis_names.index(axis)] = normalize_placement(p, ndim)
        return tuple(placements)

    def user_output_spec(self, index: int) -> compat.DTensorSpec:
        """The layout user output ``index`` is returned in, which its tangent then has. Asked first
        when backward reads the tangent, after forward computed the value, so the value's own
        layout is known."""
        if index not in self.output_specs:
            node = self._user_output_node(index)
            val = node.meta["val"]
            computed = node.meta[meta.LAYOUT].output if meta.LAYOUT in node.meta else None
            name = plan_output_name(self.captured.outputs[self._output_slot(index)].name)
            spec = make_spec(self.mesh, self._returned_placements(name, val, computed), val)
            check_divisible(node, spec, self.mesh, f"returned value {name!r}")
            self.output_specs[index] = spec
            self.report.output_placements[index] = spec.placements
        return self.output_specs[index]

    def _returned_placements(self, name: str, val, computed) -> tuple:
        """Data-parallel axes: this rank's part of the batch (Shard(0), as inputs). Other axes:
        ``plan.outputs``, else the plain Shard the value was computed with (so nothing is gathered
        just to be returned), else Replicate (a Partial value is reduced)."""
        dp_axes = self.resolved.data_parallel_axes
        placements = list(data_parallel_placements(self.mesh, val, dp_axes))
        batch_dims = {p.dim for p in placements if isinstance(p, Shard)}
        override = self.resolved.output_override(name)
        for i, axis in enumerate(self.axis_names):
            if axis in dp_axes:
                continue
            if axis in override:
                p = normalize_placement(override[axis], val.dim())
                if isinstance(p, Shard) and (val.dim() == 0 or p.dim in batch_dims):
                    raise ValueError(
                        f"outputs: {name!r} cannot be {p} on {axis!r}: "
                        + ("it is a scalar" if val.dim() == 0 else
                           f"dim {p.dim} is the batch dim the data-parallel axes {list(dp_axes)} split")
                        + "; use Replicate() or shard another dim"
                    )
            elif self.resolved.whole_outputs or computed is None or val.dim() == 0:
                p = Replicate()
            else:
                c = computed.placements[i]
                # Only a plain Shard: a strided one has no DTensor form over the sub-mesh alone.
                p = c if type(c) is Shard and c.dim not in batch_dims else Replicate()
            placements[i] = p
        return tuple(placements)

    def _output_slot(self, index: int) -> int:
        return next(pos for pos, o in enumerate(self.captured.outputs)
                    if o.kind == OutputKind.OUTPUT and o.index == index)

    def _user_output_node(self, index: int) -> torch.fx.Node:
        return list(self.captured.gm.graph.output_node().args[0])[self._output_slot(index)]

    def check_output_globs(self) -> None:
        """Every ``plan.outputs`` glob names at least one returned value."""
        names = [plan_output_name(o.name) for o in self.captured.outputs if o.kind == OutputKind.OUTPUT]
        for glob in self.resolved.outputs:
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                raise ValueError(
                    f"outputs[{glob!r}] matches none of the values the model returns {names}; "
                    "name one of them (or a glob over them)"
                )

    # --- visitors --------------------------------------------------------------------------------
    def placeholder(self, node, info) -> NodeLayout:
        val = node.meta["val"]
        if info.kind in (InputKind.PARAM, InputKind.BUFFER):
            placements = self.resolved.param_placements[info.name]
        elif info.kind == PREGATHERED:  # gathered ahead by unshard(): the computing layout
            spec = make_spec(self.mesh, self.resolved.fsdp.compute_placements[info.name], val)
            return NodeLayout(spec, (), "placeholder")
        elif info.kind == GRAD_ACCUM:  # gradients pending from earlier micro-steps
            fsdp = self.resolved.fsdp
            if fsdp is not None and info.name in fsdp.unit_of:
                placements = fsdp.gradient_placements(
                    info.name, fsdp.accumulated, self.axis_names, self.resolved.param_placements[info.name]
                )
            else:  # a replicated parameter's, kept by no_sync() micro-steps
                placements = unreduced_placements(self.resolved, info.name)
            return NodeLayout(make_spec(self.mesh, placements, val), (), "placeholder")
        elif info.kind == InputKind.INPUT:
            override = self.resolved.inputs.get(info.name)
            placements = (
                tuple(normalize_placement(p, val.dim()) for p in override)
                if override is not None
                else data_parallel_placements(self.mesh, val, self.resolved.data_parallel_axes)
            )
        else:  # tangent: the layout of the output it is the gradient of
            return NodeLayout(self.user_output_spec(info.index), (), "placeholder")
        spec = make_spec(self.mesh, placements, val)
        if not (info.kind == InputKind.PARAM and self.resolved.fsdp is not None and info.name in self.resolved.fsdp.unit_of):
            # FSDP storage may be uneven on dim 0 (padded inside its all-gather/reduce-scatter, as
            # FSDP2); everything else must divide (the plan layer checked parameters already).
            check_divisible(node, spec, self.mesh, f"{info.kind} '{info.name}'")
        return NodeLayout(spec, (), "placeholder")

    def boundary(self, node) -> NodeLayout:
        x, key = node.args
        src = self.spec_of(x)
        module_fqn, kind, index = parse_boundary_key(key)
        cons = self.resolved.modules[module_fqn]
        constraint = (
            cons.inputs[int(index)] if kind == "in"
            else cons.kwarg_inputs[index] if kind == "kw"
            else cons.outputs[int(index)]
        )
        val = node.meta["val"]
        target = self.with_constraint(src.placements, constraint.placements, val.dim())
        spec = make_spec(self.mesh, target, val)
        check_divisible(node, spec, self.mesh, constraint.source)
        self.forward_boundary_source[key] = (src.placements, tuple(constraint.placements), constraint.source)
        node.meta[meta.PLAN_ENTRY] = constraint.source
        if src.placements != target:
            node.meta[meta.BOUNDARY_CHANGE] = (
                f"{key}: {format_placements(src.placements)} -> {format_placements(target)}  ({constraint.source})"
            )
            self.report.boundaries.append(node.meta[meta.BOUNDARY_CHANGE])
        return NodeLayout(spec, (src,), "boundary")

    def boundary_grad(self, node) -> NodeLayout:
        g, key = node.args
        src = self.spec_of(g)
        before, axes, node.meta[meta.PLAN_ENTRY] = self.forward_boundary_source[key]
        target = list(src.placements)
        for axis in axes:
            i = self.axis_names.index(axis)
            p = before[i]
            target[i] = Replicate() if isinstance(p, Partial) else p
        spec = make_spec(self.mesh, target, node.meta["val"])
        return NodeLayout(spec, (src,), "boundary_grad")

    def call(self, node) -> NodeLayout:
        if node.target is operator.getitem:
            parent, idx = node.args
            out = self.spec_of(parent)
            spec = out[idx] if isinstance(out, (tuple, list)) else None
            if spec is None and _is_tensor(node):
                # An output its op's rule gives no layout to, such as memory-efficient attention's
                # RNG seed and offset on CUDA: scalars every rank holds alike.
                spec = self._replicated_output(node)
            return NodeLayout(spec, (), "getitem")
        if node.target is BOUNDARY:
            return self.boundary(node)
        if node.target is BOUNDARY_GRAD:
            return self.boundary_grad(node)
        if node.target is UNSHARD:
            src = self.spec_of(node.args[0])
            compute = self.resolved.fsdp.compute_placements[node.args[1]]
            return NodeLayout(make_spec(self.mesh, compute, node.meta["val"]), (src,), "unshard")
        if node.target in (EXPERTS, EXPERTS_BACKWARD):
            output, wanted = expert_op_layout(node, self.spec_of, make_spec, self.mesh, self.resolved,
                                              backward=node.target is EXPERTS_BACKWARD)
            return NodeLayout(output, wanted, "experts")

        flat, tree = pytree.tree_flatten((node.args, node.kwargs))
        tensor_nodes = [a for a in flat if isinstance(a, torch.fx.Node) and _is_tensor(a)]
        if not tensor_nodes:
            return NodeLayout(self._replicated_output(node), (), "factory")

        current = tuple(self.spec_of(a) for a in tensor_nodes)
        decided = self._decide(node, flat, tree, tensor_nodes, current)
        if isinstance(decided, NodeLayout):
            return decided
        output_spec, wanted = decided
        order = self._balanced_order()
        if order is not None and (unordered := balanced_order.unordered_inputs(current, wanted, *order)):
            # A cp shard off the sequence has no balanced order: decide again with those inputs
            # gathered over the cp axis (balanced_order.py).
            gathered = tuple(balanced_order.gathered_on(c, order[0]) if i in unordered else c
                             for i, c in enumerate(current))
            decided = self._decide(node, flat, tree, tensor_nodes, gathered)
            if isinstance(decided, NodeLayout):
                return decided
            output_spec, wanted = decided
            if balanced_order.unordered_inputs(gathered, wanted, *order):
                context = self.resolved.context
                raise ValueError(
                    f"context parallelism ({context.source}): {_describe(node)} can only run with an "
                    f"input sharded over {context.axis!r} along a dim that does not hold whole sequences "
                    f"({', '.join(format_placements(w.placements) for w in wanted)}), which the "
                    "load-balanced order cannot permute; use load_balance=False in the "
                    "hp.ContextParallel entry, or compute this op outside the context-parallel modules"
                )
        return NodeLayout(_with_meta(output_spec, node, self.mesh), wanted, "rule")

    def _decide(self, node, flat, tree, tensor_nodes, current):
        """The op's rule given its tensor inputs' layouts ``current``: ``(output spec, the layout
        each tensor input must have)``, or the NodeLayout of a fallback."""
        given = iter(current)
        flat_specs = [next(given) if isinstance(a, torch.fx.Node) and _is_tensor(a) else
                      (a.meta.get("val") if isinstance(a, torch.fx.Node) else a) for a in flat]
        args_schema, kwargs_schema = pytree.tree_unflatten(flat_specs, tree)
        try:
            if node.meta.get(meta.LOSS_MEAN) and any(has_partial(s) for s in current):
                output_spec, suggested = propagate_token_mean(node.target, args_schema, kwargs_schema)
            else:
                output_spec, suggested = propagate_op(node.target, args_schema, kwargs_schema)
        except NoShardingRule as exc:
            return self.fallback(node, tensor_nodes, str(exc))
        except (RuntimeError, AssertionError, ValueError) as exc:
            layouts = ", ".join(
                f"{a.name}: {format_placements(spec.placements) if (spec := self.spec_of(a)) is not None else '?'}"
                for a in tensor_nodes
            )
            raise ValueError(
                f"cannot shard {_describe(node)} with inputs {layouts}: {exc}\n"
                "The plan makes this op's inputs sharded in a way it cannot run on. Check that the "
                "sharded sizes divide the mesh axis (e.g. the number of attention / key-value heads "
                "for tensor parallelism) or change the plan entry for this module."
            ) from exc
        if output_spec is None and _produces_tensor(node):
            return self.fallback(node, tensor_nodes, "rule gave no output layout")
        if suggested is None:
            return output_spec, current
        if len(suggested) != len(current):
            # Lowering would pair input layouts with the wrong inputs.
            raise internal_error(
                "layout propagation", f"the sharding rule of {node.target} gave {len(suggested)} input "
                f"layouts for the op's {len(current)} tensor inputs", node=node,
                workaround="a plan that gives this op's inputs other layouts avoids the rule's "
                f"strategy, e.g. change the plan entry of module {module_fqn_of(node) or '<root>'!r}",
            )
        return output_spec, tuple(compat.respec(s, mesh=self.mesh, tensor_meta=c.tensor_meta)
                                  for s, c in zip(suggested, current))

    def _balanced_order(self) -> tuple[int, int] | None:
        """``(cp mesh axis, sequence length)`` while load-balanced ring attention orders the
        sequence, else None; read once the user inputs have their layouts."""
        if not hasattr(self, "_order"):
            context = getattr(self.resolved, "context", None)
            seq_len = balanced_sequence_length(self.captured, self.mesh, context)
            self._order = None if seq_len is None else (self.axis_names.index(context.axis), seq_len)
        return self._order

    def fallback(self, node, tensor_nodes, why: str) -> NodeLayout:
        node.meta[meta.FALLBACK] = why.splitlines()[0][:120]
        self.report.fallbacks.append(_fallback_line(node))
        wanted = tuple(
            make_spec(self.mesh, (Replicate(),) * self.mesh.ndim, a.meta["val"]) for a in tensor_nodes
        )
        return NodeLayout(self._replicated_output(node), wanted, "fallback")

    def _replicated_output(self, node):
        val = node.meta.get("val")
        rep = (Replicate(),) * self.mesh.ndim
        if isinstance(val, torch.Tensor):
            return make_spec(self.mesh, rep, val)
        if isinstance(val, (tuple, list)):
            return tuple(make_spec(self.mesh, rep, v) if isinstance(v, torch.Tensor) else None for v in val)
        return None

    def output(self, node) -> NodeLayout:
        wanted = []
        for slot, info in zip(node.args[0], self.captured.outputs):
            if slot is None or info.kind == OutputKind.NONE:
                wanted.append(None)
            elif info.kind == OutputKind.OUTPUT:
                wanted.append(self.user_output_spec(info.index))
            elif info.kind == BUFFER_UPDATE:  # written back into the buffer: its storage layout
                wanted.append(make_spec(self.mesh, self.resolved.param_placements[info.name], slot.meta["val"]))
            elif info.kind == INPUT_GRAD:  # a differentiable user input's gradient: the input's layout
                wanted.append(make_spec(self.mesh, self.input_specs[info.index].placements, slot.meta["val"]))
            elif info.kind == GATHERED:  # kept after backward: as computed with
                spec = make_spec(self.mesh, self.resolved.fsdp.compute_placements[info.name], slot.meta["val"])
                wanted.append(spec)
            else:  # gradient of a parameter: the parameter's own layout
                wanted.append(make_spec(self.mesh, self._grad_placements(info.name), slot.meta["val"]))
        return NodeLayout(None, tuple(wanted), "output")

    def _grad_placements(self, param: str) -> tuple:
        storage = self.resolved.param_placements[param]
        fsdp = self.resolved.fsdp
        if fsdp is None or param not in fsdp.unit_of:
            if not self.resolved.replicated_sync:  # no_sync(): this rank's partial sum, kept aside
                return unreduced_placements(self.resolved, param) or storage
            return storage
        # Accumulating: unreduced, or reduced over the shard axis only (fsdp.plan.GRADIENT_LAYOUTS).
        return fsdp.gradient_placements(param, fsdp.gradient_layout, self.axis_names, storage)

    def run(self) -> PropagationReport:
        graph = self.captured.gm.graph
        placeholders = iter(self.captured.inputs)
        self.input_specs = {}  # flat user-input index -> its layout
        self.check_output_globs()
        # A tangent's layout is its output's, known once forward computed that output: given when
        # backward first reads the tangent.
        tangents: dict[torch.fx.Node, Any] = {}

        def give_tangents(users_of) -> None:
            for t in [t for t in users_of if t in tangents]:
                t.meta[meta.LAYOUT] = self.placeholder(t, tangents.pop(t))

        for node in graph.nodes:
            if node.op != "placeholder":
                give_tangents(node.all_input_nodes)
            if node.op == "placeholder":
                info = next(placeholders)
                if info.kind == InputKind.TANGENT:
                    tangents[node] = info
                    continue
                node.meta[meta.LAYOUT] = self.placeholder(node, info)
                if info.kind == InputKind.INPUT:
                    self.input_specs[info.index] = node.meta[meta.LAYOUT].output
            elif node.op == "call_function":
                node.meta[meta.LAYOUT] = self.call(node)
            elif node.op == "get_attr":
                node.meta[meta.LAYOUT] = NodeLayout(self._replicated_output(node), (), "factory")
            elif node.op == "output":
                node.meta[meta.LAYOUT] = self.output(node)
            else:
                raise internal_error(
                    "layout propagation", f"a {node.op!r} node in the captured joint graph (capture emits "
                    "placeholder, call_function, get_attr and output nodes only)", node=node,
                )
        give_tangents(list(tangents))  # tangents nothing reads
        return self.report


def plan_output_name(path: str) -> str:
    """How ``plan.outputs`` names a returned value: its pytree path dotted, ``['logits']`` ->
    ``logits``, ``[0]`` -> ``0``, ``[1]['aux'].z`` -> ``1.aux.z``."""
    return ".".join(a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)) or path


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _produces_tensor(node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _with_meta(spec, node, mesh):
    """Rebuild a rule's output spec on our mesh with the node's tensor meta. A cached DTensor
    decision may carry another mesh object of the same shape (and that mesh's groups)."""
    val = node.meta.get("val")
    if isinstance(spec, compat.DTensorSpec) and isinstance(val, torch.Tensor):
        return compat.respec(spec, mesh=mesh, tensor_meta=tensor_meta_of(val))
    if isinstance(spec, (tuple, list)) and isinstance(val, (tuple, list)):
        return tuple(
            compat.respec(s, mesh=mesh, tensor_meta=tensor_meta_of(v))
            if isinstance(s, compat.DTensorSpec) and isinstance(v, torch.Tensor) else None
            for s, v in zip(spec, val)
        )
    return spec


def _fallback_line(node: torch.fx.Node) -> str:
    return f"{_describe(node)}: ran replicated ({node.meta[meta.FALLBACK]})"


def report_of(gm: torch.fx.GraphModule, output_placements: dict) -> PropagationReport:
    """The report propagation gives for ``gm``, read back from its nodes (a graph whose layouts were
    copied, not propagated: compile/repeated/lowering.py); ``output_placements`` as propagation's."""
    nodes = list(gm.graph.nodes)
    return PropagationReport(
        fallbacks=[_fallback_line(n) for n in nodes if meta.FALLBACK in n.meta],
        boundaries=[n.meta[meta.BOUNDARY_CHANGE] for n in nodes if meta.BOUNDARY_CHANGE in n.meta],
        output_placements=dict(output_placements),
    )


def propagate(captured: CapturedGraph, resolved, mesh) -> PropagationReport:
    """Give every node of ``captured.gm`` a layout (``node.meta["hp_layout"]``), after the
    pre-propagation rewrites (passes/__init__.py: ``run_rewrites``) have run on it. Attention may be
    sharded on the sequence meanwhile (attention_rules.py: the context-parallel kernels compute it)."""
    with sequence_sharded_attention():
        report = _Propagator(captured, resolved, mesh).run()
    for line in report.fallbacks:
        log.warning("[propagate] %s", line)
    return report
