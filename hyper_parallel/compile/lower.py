"""Lowering: joint graph + layouts → the per-rank local joint graph with explicit collectives.

Reads ``node.meta["hp_layout"]`` (propagation/engine.py). Writes a new GraphModule over *local*
tensors with the same placeholders (``primals_*``, ``tangents_*``) and the same output slots, in
which every layout change is an explicit ``torch.ops._c10d_functional`` collective followed by its
``wait_tensor``. Each new node carries in ``meta``: ``hp_source`` (the joint-graph node it comes
from), ``hp_role`` ("compute", "redistribute", or "accumulate" for the add of a gradient accumulated by
earlier micro-steps), ``hp_layout`` of its source for compute nodes, ``hp_redistribute``
("S(0) -> R") and ``hp_why`` (analysis/why.py) for communication, and the source's ``stack_trace`` and
module stacks, so dumps and errors point at the user's code.

How: the joint graph is interpreted once under ``make_fx`` with every value a DTensor wrapping a
local fake tensor. Before each op its arguments are redistributed to the layouts propagation chose
(compile/moves.py traces each change: DTensor's ``redistribute_local_tensor`` for most, a few ops of
its own where DTensor's tracing makes a node per rank; traced, not executed), then the
op runs through DTensor's dispatch, which computes it on the local shards (with shape arguments of
view/expand/new_* ops rewritten to local sizes). DTensor's choice must agree with ours; a mismatch is
an internal error, never a silent difference.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Partial

from ..ir.kinds import InputKind, OutputKind
from ..compat import pytree
from .. import compat
from .moves import move
from .annotations import BOUNDARY, BOUNDARY_GRAD, UNSHARD
from ..ir.graph import CapturedGraph, module_fqn_of
from ..errors import internal_error
from ..ir import meta
from ..ir.names import renumber
from ..cp.load_balance import Balancer, balanced_sequence_length
from ..layout import dims_by_stride, format_placements
from ..moe.lowering import ExpertLowering
from ..moe.region import EXPERTS, EXPERTS_BACKWARD
from ..propagation import attention_rules, decision_cache, rules
from ..analysis.why import lowering_reason

log = logging.getLogger(__name__)


def local_shape(spec) -> tuple[int, ...]:
    shape, _ = compat.compute_local_shape_and_global_offset(
        spec.tensor_meta.shape, spec.mesh, spec.placements
    )
    return tuple(shape)


def _redistribute(dt: DTensor, target, source_node_name: str, grad_of: str | None = None,
                  balancer: Balancer | None = None) -> DTensor:
    """Move ``dt`` to ``target``'s placements, tracing the collectives this needs.

    ``grad_of`` names the parameter when this is a gradient's way to its storage layout;
    ``balancer`` keeps the load-balanced sequence order of ring attention (cp/load_balance.py)."""
    current = compat.spec_of(dt)
    if current.placements == target.placements:
        return dt
    local = compat.local_of(dt)
    placements = list(current.placements)
    annotation = {meta.SOURCE: source_node_name, meta.ROLE: meta.ROLE_REDISTRIBUTE,
                  meta.REDISTRIBUTE: f"{format_placements(current.placements)} -> {format_placements(target.placements)}"}
    if grad_of is not None:
        annotation[meta.GRAD_OF] = grad_of
    with fx_traceback.annotate(annotation):
        # Partial(avg) is reduced as a sum of pre-divided shards: backends without an average
        # reduction (gloo) need it, and dividing by a power of two first is exact.
        for axis, p in enumerate(placements):
            if isinstance(p, Partial) and p.reduce_op == "avg" and target.placements[axis] != p:
                local = local / current.mesh.size(axis)
                placements[axis] = Partial("sum")
        src = compat.respec(current, placements)
        dst = compat.respec(target, tensor_meta=current.tensor_meta)
        if balancer is not None:
            local = balancer.redistribute(local, src, dst, move)
        else:
            local = move(local, src, dst)
    return compat.dtensor_from_spec(local, dst)


_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _in_memory_order_of(local: torch.Tensor, tensor_meta) -> torch.Tensor:
    """``local`` with its dims laid out in memory in the order of the whole tensor's strides (itself
    when they already are; else a copy).

    The program was captured on whole tensors, and a ``view`` in it may rely on their layout (CPU
    flash attention returns [B, H, S, D] laid out as [B, S, H, D]; transposed back, it views
    without a copy). A collective hands back a dense shard in its own order (a shard-to-shard
    all-to-all puts its pieces side by side along the new dim; an all-gather of a transposed
    weight is laid out as its shape), which such a view cannot always take. Only a view's input
    is put back in order: elsewhere any strides do."""
    if tensor_meta is None or local.dim() != len(tensor_meta.shape) or local.dim() < 2:
        return local
    order = sorted(range(local.dim()), key=lambda d: (-tensor_meta.stride[d], d))
    if dims_by_stride(local.stride(), local.shape) == [d for d in order if local.shape[d] > 1]:
        return local
    inverse = sorted(range(local.dim()), key=order.__getitem__)
    return local.permute(order).contiguous().permute(inverse)


def _is_masked(placement) -> bool:
    return isinstance(placement, Partial) and type(placement) is not Partial


def _check_agrees(node, got, want) -> None:
    if isinstance(want, compat.DTensorSpec):
        # Compared by their text: a masked partial's equality also compares its mask buffer.
        if not isinstance(got, DTensor) or format_placements(compat.spec_of(got).placements) != format_placements(want.placements):
            have = format_placements(compat.spec_of(got).placements) if isinstance(got, DTensor) else type(got).__name__
            # The program would not compute what propagation planned (and the dumps show).
            module = module_fqn_of(node)
            raise internal_error(
                "lowering", f"DTensor's dispatch computed the layout {have} but propagation chose "
                f"{format_placements(want.placements)}: the two sharding decisions disagree", node=node,
                workaround="give this op's inputs other layouts in the plan, e.g. change or drop the plan "
                f"entry of module {module or '<root>'!r} (or of the module feeding it)",
            )
    elif isinstance(want, (tuple, list)):
        for g, w in zip(got, want):
            if w is not None:
                _check_agrees(node, g, w)


def _wrap_replicated(value, mesh, node):
    spec = node.meta[meta.LAYOUT].output
    if isinstance(value, torch.Tensor):
        return compat.dtensor_from_spec(value, spec)
    if isinstance(value, (tuple, list)):
        return type(value)(
            compat.dtensor_from_spec(v, s) if isinstance(v, torch.Tensor) else v
            for v, s in zip(value, spec)
        )
    return value


class _LocalInterpreter:
    def __init__(self, captured: CapturedGraph, mesh, context=None, stack_inputs: bool = True):
        self.captured = captured
        self.stack_inputs = stack_inputs
        self.mesh = mesh
        self.context = context  # cp/resolve.py:ContextPlan or None
        self.experts = ExpertLowering(captured.expert_regions, mesh)
        self.balancer = _balancer(captured, mesh, context)

    def redistribute(self, dt, target, source_node_name: str, grad_of: str | None = None, *,
                     parameter: bool = False):
        """``_redistribute`` keeping the balanced sequence order for activations. A parameter's
        way from storage to compute (``parameter``) or a gradient's to its storage (``grad_of``) may
        be sharded over the cp axis too (FSDP over dp_shard x cp), but not along a sequence."""
        activation = not parameter and grad_of is None
        return _redistribute(dt, target, source_node_name, grad_of, self.balancer if activation else None)

    def __call__(self, primals, tangents):
        graph = self.captured.gm.graph
        env: dict[torch.fx.Node, object] = {}
        flat_inputs = list(primals) + list(tangents)
        placeholders = list(zip(graph.find_nodes(op="placeholder"), flat_inputs, self.captured.inputs))
        if self.balancer is not None:  # the user's sequence order -> balanced, inputs and tangents apart
            for kind in (InputKind.INPUT, InputKind.TANGENT):
                mine = [i for i, (_, _, info) in enumerate(placeholders) if info.kind == kind]
                moved = self.balancer.entry_all([(placeholders[i][1], placeholders[i][0].meta[meta.LAYOUT].output,
                                                  placeholders[i][0].name) for i in mine], self.stack_inputs)
                for i, local in zip(mine, moved):
                    placeholders[i] = (placeholders[i][0], local, placeholders[i][2])
        for node, local, info in placeholders:
            env[node] = compat.dtensor_from_spec(local, node.meta[meta.LAYOUT].output)
        result = None
        for node in graph.nodes:
            if node.op == "placeholder":
                continue
            layout = node.meta[meta.LAYOUT]
            if node.op == "output":
                result = self.outputs(node, env)
                continue
            if node.op == "get_attr":
                env[node] = _wrap_replicated(getattr(self.captured.gm, node.target), self.mesh, node)
                continue
            env[node] = self.call(node, layout, env)
        return result

    def call(self, node, layout, env):
        if node.target is operator.getitem:
            parent, idx = node.args
            return env[parent][idx]
        if node.target in (BOUNDARY, BOUNDARY_GRAD, UNSHARD):
            return self.redistribute(env[node.args[0]], layout.output, node.name, parameter=node.target is UNSHARD)

        flat, tree = pytree.tree_flatten((node.args, node.kwargs))
        wanted = iter(layout.inputs)
        values = []
        for a in flat:
            if isinstance(a, torch.fx.Node):
                v = env[a]
                if isinstance(v, DTensor):
                    target = next(wanted)
                    # Masked partials (vocab-parallel embedding indices) carry the mask they were
                    # made with; DTensor's dispatch creates them itself from the same choice.
                    if not any(_is_masked(p) for p in target.placements):
                        v = self.redistribute(v, target, node.name)
                    if node.target in _VIEW_OPS and not values:
                        local = compat.local_of(v)
                        ordered = _in_memory_order_of(local, compat.spec_of(v).tensor_meta)
                        if ordered is not local:
                            v = compat.dtensor_from_spec(ordered, compat.spec_of(v))
                values.append(v)
            else:
                values.append(a)
        with fx_traceback.annotate({meta.SOURCE: node.name, meta.ROLE: meta.ROLE_COMPUTE}):
            if layout.how in ("fallback", "factory"):
                locals_ = [compat.local_of(v) if isinstance(v, DTensor) else v for v in values]
                args, kwargs = pytree.tree_unflatten(locals_, tree)
                return _wrap_replicated(node.target(*args, **kwargs), self.mesh, node)
            args, kwargs = pytree.tree_unflatten(values, tree)
            if node.target in (EXPERTS, EXPERTS_BACKWARD):
                return self.expert_region(node, args, layout)
            # Ops our own rules shard where DTensor's kernels cannot (vocab-parallel loss).
            kernel = rules.local_kernel(node.target, node.args, layout, self.context, node.name,
                                        mask_within_causal=node.meta.get(meta.MASK_WITHIN_CAUSAL, False)) or node.target
            out = kernel(*args, **kwargs)
        _check_agrees(node, out, layout.output)
        return out

    def expert_region(self, node, args, layout):
        """Dispatch, local experts, combine (moe/lowering.py) on this rank's local tensors."""
        local = [compat.local_of(a) if isinstance(a, DTensor) else a for a in pytree.tree_leaves(args)]
        key = local[-1]
        if node.target is EXPERTS:
            x, top_k_index, top_k_weights, *params = local[:-1]
            out = self.experts.forward(x, top_k_index, top_k_weights, params, key)
            return compat.dtensor_from_spec(out, layout.output)
        grads = self.experts.backward(local[0], key)
        return [compat.dtensor_from_spec(g, s) for g, s in zip(grads, layout.output)]

    def outputs(self, node, env):
        results = []
        slots = zip(node.args[0], node.meta[meta.LAYOUT].inputs, self.captured.outputs)
        for i, (slot, want, info) in enumerate(slots):
            if slot is None or want is None:
                results.append(None)
                continue
            # A gradient goes to its parameter's layout, a buffer's new value to the buffer's (a
            # Partial batch statistic is all-reduced here), a user output to the user-facing one.
            grad_of = info.name if info.kind == OutputKind.GRAD else None
            value = env[slot]
            pending = self.captured.pending_inputs.get(i)
            if pending is not None:
                value = _add_pending(value, env[pending], slot.name, grad_of)
            user_facing = info.kind in (OutputKind.OUTPUT, OutputKind.INPUT_GRAD)
            local = compat.local_of(self.redistribute(value, want, "output", grad_of, parameter=not user_facing))
            if self.balancer is not None and user_facing:
                with fx_traceback.annotate({meta.SOURCE: slot.name}):
                    local = self.balancer.exit(local, want)  # balanced -> the user's sequence order
            results.append(local)
        return results


def _add_pending(grad: DTensor, pending: DTensor, source_node_name: str, grad_of: str) -> DTensor:
    """``grad`` + the gradient accumulated for it by earlier micro-steps, added where ``grad``'s
    way to its final layout passes through ``pending``'s layout (propagation/accumulation.py)."""
    spec = compat.spec_of(pending)
    grad = _redistribute(grad, spec, source_node_name, grad_of)
    with fx_traceback.annotate({meta.SOURCE: source_node_name, meta.ROLE: meta.ROLE_ACCUMULATE}):
        total = compat.local_of(grad) + compat.local_of(pending)
    return compat.dtensor_from_spec(total, spec)


def _balancer(captured: CapturedGraph, mesh, context) -> Balancer | None:
    """The load-balanced order's bookkeeping when ring attention balances the sequence."""
    seq_len = balanced_sequence_length(captured, mesh, context)
    return None if seq_len is None else Balancer(mesh, context.axis, seq_len, ring=context.ring)


def placeholder_local_values(captured: CapturedGraph, fake_mode) -> tuple[list, list]:
    """Fake local tensors for every placeholder (primals, tangents), from its layout."""
    primals, tangents = [], []
    for node, info in zip(captured.gm.graph.find_nodes(op="placeholder"), captured.inputs):
        spec = node.meta[meta.LAYOUT].output
        shape = local_shape(spec)  # outside the fake mode: it reads the rank's mesh coordinate
        with fake_mode:
            val = torch.empty(shape, dtype=spec.tensor_meta.dtype, device=node.meta["val"].device)
        (tangents if info.kind == InputKind.TANGENT else primals).append(val)
    return primals, tangents


def lower(captured: CapturedGraph, mesh, context=None, stack_inputs: bool = True) -> torch.fx.GraphModule:
    """Build the local joint graph of this rank (see module docstring). ``context``: the plan's
    ``ContextPlan`` (sequence-parallel attention kernels, the load-balanced order).
    ``stack_inputs``: inputs of one shape and dtype enter the balanced order in one all-to-all
    (not for a pipeline, whose stages read different inputs)."""
    compat.eager_strided_shard_sizes()  # a strided shard's sizes are integers: not traced
    # A shape environment lets data-dependent sizes (an expert region's received rows) be traced as
    # unbacked symbols; every other size stays a plain int.
    fake_mode = compat.FakeTensorMode(allow_non_fake_inputs=True, shape_env=compat.ShapeEnv())
    primals, tangents = placeholder_local_values(captured, fake_mode)
    interpreter = _LocalInterpreter(captured, mesh, context, stack_inputs)
    # DTensor's dispatch reuses the sharding decisions propagation cached for the same schemas
    # (tracing alone would make it search every op's strategies again); not the attention ops,
    # whose strategies differ inside the sequence-sharding scope (attention_rules.py).
    with fx_traceback.preserve_node_meta(), decision_cache.cached_sharding_decisions(attention_rules.ATTENTION_OPS):
        local_gm = compat.make_fx(interpreter, tracing_mode="fake", pre_dispatch=False)(primals, tangents)
    sources = {n.name: n for n in captured.gm.graph.nodes}
    tangents = frozenset(node for node, info in zip(captured.gm.graph.find_nodes(op="placeholder"), captured.inputs)
                         if info.kind == InputKind.TANGENT)
    for node in local_gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        src = sources.get(custom.get(meta.SOURCE))
        if src is None:
            continue
        node.meta[meta.SOURCE] = src.name
        node.meta[meta.ROLE] = custom[meta.ROLE]
        for key in (meta.REDISTRIBUTE, meta.GRAD_OF, meta.EXPERT_CHUNK, meta.CP_RING):
            if key in custom:
                node.meta[key] = custom[key]
        region = (src.meta.get("custom") or {}).get(meta.REGION)
        if region is not None:  # hp.checkpoint / hp.swap call the node was computed in
            node.meta[meta.REGION] = region
        if custom[meta.ROLE] == meta.ROLE_COMPUTE:
            node.meta[meta.LAYOUT] = src.meta[meta.LAYOUT]
        elif custom[meta.ROLE] == meta.ROLE_REDISTRIBUTE:
            node.meta[meta.WHY] = lowering_reason(src, node.meta, context, tangents)
        for key in meta.COPIED_BY_LOWERING:
            if key in src.meta:
                node.meta[key] = src.meta[key]
    local_gm.graph.eliminate_dead_code(is_impure_node=_kept_when_unused)
    # make_fx compiled the graph before the dead code went; its names close the gaps it left
    return renumber(local_gm)


def _kept_when_unused(node: torch.fx.Node) -> bool:
    """Whether an unused node of the lowered graph must stay. DTensor's dispatch computes some
    output metadata by running the op on empty tensors (memory-efficient attention on CUDA); under
    tracing that call lands in the graph, unused. It is random-seeded, so fx would keep it as
    impure; only collectives and in-place ops have effects worth keeping here."""
    if node.op != "call_function":
        return node.is_impure()
    target = node.target
    if getattr(target, "namespace", None) in ("_c10d_functional", "c10d_functional"):
        return True
    return compat.is_mutating_op(target) or (node.is_impure() and not compat.is_random_op(target))
