"""Insert one ``hyper_parallel::unshard`` node per FSDP parameter, before propagation.

Reads: ``resolved.fsdp`` (which parameters are stored sharded, the mixed-precision policy) and the
placeholders' descriptors. Writes: the joint graph, in place: each FSDP parameter placeholder's uses
are rerouted through an ``unshard(param, fqn)`` node placed right before its first use, so the
all-gather it lowers to sits where the parameter is needed (the prefetch pass may move it earlier).
The node's ``meta`` gets ``hp_fsdp_param`` (FQN) and ``hp_fsdp_unit`` (unit module FQN).

Mixed precision (each unit's policy, ``fsdp.policy_of``): the model was captured with these
parameters in ``param_dtype`` (so the whole forward and backward compute in it); here the
placeholder goes back to the storage dtype and a cast
to ``param_dtype`` (``meta["hp_fsdp_cast"]`` = the FQN) is placed before the unshard, so the
all-gather moves ``param_dtype`` bytes. The
parameter's gradient is cast to ``reduce_dtype`` (default: ``param_dtype``, as FSDP2) before it leaves
the graph, so its reduce-scatter runs in that dtype; the runtime casts the result to the storage dtype.

Gathered ahead (``unshard()``, units in ``fsdp.pregathered``): the parameter's forward uses read a
new ``pregathered`` input holding the gathered value instead; only when the unit reshards after
forward does an unshard node remain, tagged backward (``hp_fsdp_phase``), for the backward uses.
Kept after backward (``set_reshard_after_backward(False)`` on a unit, ``fsdp.keeps_gathered``): each
of its gathered parameters becomes an extra output of the joint graph, after the gradients.

CPU offload (``CPUOffloadPolicy``): shards, gradients and optimizer state stay on the host; when the
mesh computes elsewhere, a host-to-device copy of the shard precedes the cast and the unshard (the
runtime moves each gradient back to its parameter's device). On a CPU mesh there is nothing to copy.
"""

from __future__ import annotations

import torch

from ..ir.kinds import InputKind, OutputKind
from ..compile.annotations import UNSHARD
from ..ir.graph import CapturedGraph, OutputInfo
from ..ir import meta
from ..ir.phase import BACKWARD, FORWARD, is_tagged_backward, tag
from . import recompile

PREGATHERED = InputKind.PREGATHERED
GATHERED = OutputKind.GATHERED


def _retyped(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with val.fake_mode:
        return torch.empty_like(val, dtype=dtype)


def insert_unshard_nodes(
    captured: CapturedGraph, resolved, storage_dtypes: dict, compute_device: str = "cpu"
) -> int:
    """``storage_dtypes``: parameter FQN -> dtype of the stored shard (the model's dtype);
    ``compute_device``: the mesh's device type (where an offloaded shard must be copied to)."""
    fsdp = resolved.fsdp
    if fsdp is None:
        return 0
    graph = captured.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    inserted = 0
    kept: dict[str, torch.fx.Node] = {}  # parameter FQN -> its gathered value at the end of backward
    for node, info in zip(list(graph.find_nodes(op="placeholder")), list(captured.inputs)):
        if info.kind != InputKind.PARAM or info.name not in fsdp.unit_of or not node.users:
            continue
        compute_val = node.meta["val"]
        users = list(node.users)
        phase = FORWARD
        if fsdp.unit_of[info.name] in fsdp.pregathered:
            users, kept[info.name] = _route_to_pregathered(captured, node, info.name, fsdp)
            if not users:
                continue
            phase = BACKWARD
        first_user = min(users, key=order.__getitem__)
        source = node
        storage_dtype = storage_dtypes[info.name]
        if compute_val.dtype != storage_dtype:
            node.meta["val"] = _retyped(compute_val, storage_dtype)
            with graph.inserting_before(first_user):
                source = graph.call_function(
                    torch.ops.aten._to_copy.default, (node,), {"dtype": compute_val.dtype}
                )
            source.meta["val"] = compute_val
            source.meta[meta.FSDP_CAST] = info.name
            tag(source, phase)
        if fsdp.offloaded(info.name) and compute_val.device.type != compute_device:
            # CPU offload: the shard lives on the host; copy it to the compute device first.
            with graph.inserting_before(first_user):
                source = graph.call_function(
                    torch.ops.aten._to_copy.default, (source,), {"device": torch.device(compute_device)}
                )
            with compute_val.fake_mode:
                source.meta["val"] = torch.empty_like(compute_val, device=compute_device)
            tag(source, phase)
        with graph.inserting_before(first_user):
            gathered = graph.call_function(UNSHARD, (source, info.name))
        gathered.meta["val"] = source.meta["val"]
        gathered.meta[meta.FSDP_PARAM] = info.name
        gathered.meta[meta.FSDP_UNIT] = fsdp.unit_of[info.name]
        if phase == BACKWARD:  # gathered again for backward only (the unit reshards)
            tag(gathered, BACKWARD)
            gathered.meta[meta.FSDP_PHASE] = BACKWARD
        for key in ("nn_module_stack", "stack_trace"):
            if key in first_user.meta:
                gathered.meta[key] = first_user.meta[key]
        node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user in users)
        kept[info.name] = gathered
        inserted += 1
    kept = {fqn: node for fqn, node in kept.items() if fsdp.keeps_gathered(fqn)}
    if kept:
        _keep_gathered(captured, kept)
    _prepare_gradients(captured, fsdp, resolved)
    recompile(captured.gm)
    return inserted


def _route_to_pregathered(captured: CapturedGraph, node: torch.fx.Node, fqn: str, fsdp) -> list:
    """``unshard()`` gathered ``fqn`` ahead: its forward uses read a new ``pregathered`` input (the
    gathered value, in the compute dtype) instead. Returns the uses still to be served by an
    all-gather of the shard: the backward ones when the unit reshards after forward, else none."""
    val = node.meta["val"]
    with val.fake_mode:
        gathered = captured.add_input(PREGATHERED, fqn, torch.empty_like(val))
    reshards = fsdp.unit(fsdp.unit_of[fqn]).reshard_after_forward
    regather = [u for u in node.users if is_tagged_backward(u)] if reshards else []
    node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user not in regather)
    return regather, gathered


def _keep_gathered(captured: CapturedGraph, kept: dict[str, torch.fx.Node]) -> None:
    """``set_reshard_after_backward(False)``: the joint graph also returns every gathered FSDP
    parameter (``OutputInfo("gathered", fqn)`` slots after the gradients), for the next forward
    to use instead of gathering again. The reshard_after_forward pass points each at its backward
    copy when the unit reshards after forward, so forward does not keep it."""
    output = captured.gm.graph.output_node()
    output.args = (type(output.args[0])(list(output.args[0]) + list(kept.values())),)
    captured.outputs = list(captured.outputs) + [OutputInfo(GATHERED, fqn, -1) for fqn in kept]


def _prepare_gradients(captured: CapturedGraph, fsdp, resolved) -> None:
    """Cast each FSDP gradient to its unit's ``reduce_dtype`` and scale it by its unit's
    ``FsdpPlan.gradient_scale`` (reduce op "sum", a custom divide factor), before it leaves the
    graph (and is reduced)."""
    graph = captured.gm.graph
    output = graph.output_node()
    slots = list(output.args[0])
    for i, (slot, info) in enumerate(zip(slots, captured.outputs)):
        if info.kind != OutputKind.GRAD or info.name not in fsdp.unit_of or slot is None:
            continue
        policy = fsdp.policy_of(info.name)
        reduce_dtype = (policy.reduce_dtype or policy.param_dtype) if policy is not None else None
        scale = fsdp.gradient_scale(info.name, resolved.mesh_dim_names, resolved.mesh_shape)
        if reduce_dtype is None and scale == 1:
            continue
        grad = slot
        # Right after the gradient is computed, not at the end of backward: the unit's reduce-scatter
        # follows its last input (passes/bucketing.py), so a cast placed late would hold every
        # unit's reduction (and its unsharded gradient) until backward ends.
        where = (lambda: graph.inserting_before(output)) if slot.op == "placeholder" else (lambda: graph.inserting_after(grad))
        if scale != 1:
            with where():
                grad = graph.call_function(torch.ops.aten.mul.Tensor, (grad, scale))
            grad.meta["val"] = slot.meta["val"]
            tag(grad, BACKWARD)
        if reduce_dtype is not None and grad.meta["val"].dtype != reduce_dtype:
            with where():
                cast = graph.call_function(torch.ops.aten._to_copy.default, (grad,), {"dtype": reduce_dtype})
            cast.meta["val"] = _retyped(grad.meta["val"], reduce_dtype)
            tag(cast, BACKWARD)
            grad = cast
        slots[i] = grad
    output.args = (type(output.args[0])(slots),)
