"""Why each collective and layout change of a compiled program is there, one line per node.

Read by ``layouts.tsv``'s ``why`` column (analysis/debug.py), the report's Layouts table, and the warning for
collectives a plan adds beyond its own boundaries (compile/extra_collectives.py). Every reason
starts with its category, so a user can filter on it: ``plan:`` (a plan entry's boundary),
``FSDP unit …:``, ``gradient of …:``, ``loss:``, ``op rule:``, ``no rule:``, ``context parallel:``,
``expert parallel:``, ``output:``, ``fused:``.

Lowering records the reason of every redistribution it inserts (``hp_why``), from the joint-graph
node the redistribution serves (``lowering_reason``); nodes the passes create carry their own marks
(a bucket's label, the FSDP unit and phase, a ring transfer), which ``reason`` reads.
"""

from __future__ import annotations

import re

import torch

from ..ir.graph import module_fqn_of
from ..ir import meta

_C10D_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _op_name(target) -> str:
    name = str(target)
    return name[: -len(".default")] if name.endswith(".default") else name


def is_communication(node: torch.fx.Node) -> bool:
    """A collective, its wait, or a layout change lowering or a pass inserted."""
    if node.op != "call_function":
        return False
    return meta.is_redistribute(node) or getattr(node.target, "namespace", None) in _C10D_NAMESPACES


def lowering_reason(src: torch.fx.Node, node_meta: dict, context=None, tangents=frozenset()) -> str:
    """Why lowering moved a value for joint-graph node ``src``; ``node_meta`` is the meta of the
    lowered node (its ``hp_redistribute`` change, ``hp_grad_of`` parameter); ``context`` the plan's
    ``ContextPlan`` or None; ``tangents`` the joint graph's tangent placeholders."""
    change = node_meta.get(meta.REDISTRIBUTE, "")
    layout = src.meta.get(meta.LAYOUT)
    how = getattr(layout, "how", None)
    grad_of = node_meta.get(meta.GRAD_OF)
    if grad_of is not None:
        return f"gradient of {grad_of}: to the parameter's layout ({change})"
    if how in ("boundary", "boundary_grad"):
        entry = src.meta.get(meta.PLAN_ENTRY, "a plan entry")
        return f"plan: {entry}" + (" (its gradient)" if how == "boundary_grad" else "")
    if how == "unshard":
        return f"FSDP unit {src.meta.get(meta.FSDP_UNIT) or '<root>'}: gather {src.meta.get(meta.FSDP_PARAM)}"
    if change.endswith(" order"):
        return f"context parallel: load-balanced sequence order ({change})"
    if src.op == "output":
        return f"output: to its returned layout ({change})"
    if any(isinstance(a, torch.fx.Node) and a in tangents for a in src.args):
        # The gradient of a returned value arrives in the layout the value was returned in (the
        # plan's ``outputs``), which the op combining it with other gradients may not compute in.
        return f"output: the gradient of a returned value, from its returned layout ({change})"
    if src.meta.get(meta.LOSS_MEAN):
        return "loss: global token mean (the loss's sum and token count over the data-parallel ranks)"
    op = _op_name(src.target)
    if how == "experts":
        return f"expert parallel: {change}"
    if context is not None and _in_modules(module_fqn_of(src), context.modules):
        return f"context parallel: {op} in {module_fqn_of(src)}, {context.mode} ({change})"
    if how == "fallback":
        return f"no rule: {op} has no sharding rule and runs replicated ({change})"
    if any(name in op for name in _CROSS_ENTROPY):
        return f"op rule: {op}, vocab-parallel cross-entropy ({change})"
    return f"op rule: {op} ({change})"


_CROSS_ENTROPY = ("_log_softmax", "nll_loss")


def _in_modules(fqn: str, modules) -> bool:
    return any(fqn == m or fqn.startswith(m + ".") for m in modules)


def reason(node: torch.fx.Node) -> str:
    """Why ``node`` (a collective, wait or layout change) is in the program; "" for other nodes."""
    if not is_communication(node):
        return ""
    if node.target is torch.ops._c10d_functional.wait_tensor.default and node.args:
        return reason(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else ""
    recomputed = " (recomputed in backward)" if meta.RECOMPUTE in node.meta else ""
    bucket = node.meta.get(meta.BUCKET)
    if bucket is not None:
        return _bucket_reason(bucket) + recomputed
    why = node.meta.get(meta.WHY)
    if why is not None:
        return why + recomputed
    ring = node.meta.get(meta.CP_RING)
    if ring is not None:
        if ring.get("exchange") == "all_gather":
            what = "every rank's K/V block gathered" if ring["moves"] == "kv" else "dK/dV shares home"
            return f"context parallel: all-gather attention {ring['attention']}, {what}" + recomputed
        return (f"context parallel: ring attention {ring['attention']}, {ring['moves']} block of step "
                f"{ring['step']} to the next rank") + recomputed
    if meta.FSDP_PARAM in node.meta:
        again = " again for backward (reshard_after_forward)" if node.meta.get(meta.FSDP_PHASE) else ""
        return f"FSDP unit {node.meta.get(meta.FSDP_UNIT) or '<root>'}: gather {node.meta[meta.FSDP_PARAM]}{again}"
    if meta.REDISTRIBUTE in node.meta:
        return f"pass: {node.meta[meta.REDISTRIBUTE]}"
    return ""


_FSDP_BUCKET = re.compile(
    r"^(?P<unit>\S+) (?:(?P<phase>forward|backward) )?(?P<kind>all_gather|reduce_scatter|all_reduce) \((?P<n>.*)\)$")
_FSDP_WHAT = {
    "all_gather": "all-gather of its parameters for {phase}",
    "reduce_scatter": "reduce-scatter of its gradients to their shards",
    "all_reduce": "all-reduce of its gradient shards over the HSDP replicas",
}


def _bucket_reason(label: str) -> str:
    """A fused collective's reason from its bucket label (passes/bucketing.py,
    passes/fuse_small_reductions.py)."""
    if label.startswith("gradient bucket"):
        return f"gradients (data parallel): {label}, fused by bucketing"
    if label.startswith("small reductions"):
        return f"fused: {label}, packed by fuse_small_reductions"
    match = _FSDP_BUCKET.match(label)
    if match is None:
        return f"fused: {label}"
    what = _FSDP_WHAT[match["kind"]].format(phase=match["phase"] or "forward")
    if match["phase"] == "backward":
        what += ", gathered again after reshard_after_forward"
    return f"FSDP unit {match['unit']}: {what} ({match['n']}; bucketing)"
