"""swap: saved activations marked for swap wait for backward in host memory.

For every forward value the recompute pass marked (``meta["hp_swap"]``: a ``MUST_SWAP`` policy
decision, a swap region, or the inputs of ``hp.checkpoint(swap_inputs=True)``) that backward reads,
a copy to host memory is placed right after its last forward use, and backward reads a copy back to
the device instead; so only the host copy crosses from forward to backward. Copies back are issued
one group ahead: the values of the group backward needs k-th are copied back when group k-1 starts,
so on an accelerator the transfer overlaps group k-1's backward: the copies run on a side stream, and
the first use of a group waits for its copy's event (``swap_wait``), not for the whole stream. With ``group_swap`` the values of
one region (and dtype) travel as one flat buffer: one copy each way instead of one per tensor.

On a CPU mesh the host copy is a copy on the host: the graph structure (and its numerics) is the
same as on an accelerator, which is what the tests check here.

Reads: ``hp_swap`` / ``hp_swap_group`` (recompute pass), ``partitioner_tag`` / ``hp_fsdp_phase``,
``val``. Writes: ``hyper_parallel::swap_out`` / ``swap_in`` / ``swap_wait`` nodes
(runtime/host_copies.py; the first two with ``meta["hp_swap_copy"] = "to_host" | "to_device"``) and
the cat/split of grouped swaps. Idempotent (a value whose backward uses read a copy is not
swapped again); numerics unchanged (copies).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from .. import compat
from ..runtime.host_copies import SWAP_IN, SWAP_OUT, SWAP_WAIT
from ..ir import meta
from ..ir.phase import BACKWARD, FORWARD, is_tagged_backward, tag
from ..propagation import recompile

aten = torch.ops.aten
HOST = torch.device("cpu")


def _fake(like: torch.Tensor, shape, device) -> torch.Tensor:
    return compat.fake_empty(like, shape, device=device)


def _emit(graph, where, target, args, kwargs, val, phase, copy=None):
    """A new node at ``where()`` (a fresh insertion point: fx's take effect when created)."""
    with where():
        node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = val
    tag(node, phase)
    if copy is not None:
        node.meta[meta.SWAP_COPY] = copy
    return node


def swap_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        region = node.meta.get(meta.SWAP)
        val = node.meta.get("val")
        if region is None or is_tagged_backward(node) or not isinstance(val, torch.Tensor):
            continue
        if not any(is_tagged_backward(u) for u in node.users):
            continue  # not saved for backward: nothing to swap
        if any(u.op == "output" for u in node.users):
            continue  # returned to the caller, who holds it anyway: swapping it frees nothing
        key = (region, val.dtype) if node.meta.get(meta.SWAP_GROUP) else (region, node.name)
        groups[key].append(node)
    if not groups:
        return gm

    def first_backward_use(members):
        return min((u for m in members for u in m.users if is_tagged_backward(u)), key=order.__getitem__)

    # Backward order of the groups: each group's copy back is issued when the previous one is used.
    ordered = sorted(groups.values(), key=lambda ms: order[first_backward_use(ms)])
    anchors = [first_backward_use(ordered[max(i - 1, 0)]) for i in range(len(ordered))]
    for members, anchor in zip(ordered, anchors):
        backward_users = {m: [u for u in m.users if is_tagged_backward(u)] for m in members}
        last_forward = max(
            (u for m in members for u in m.users if not is_tagged_backward(u)), key=order.__getitem__, default=None
        )
        after = max([*members, *([last_forward] if last_forward is not None else [])], key=order.__getitem__)
        sample = members[0].meta["val"]
        device = sample.device
        first_use = first_backward_use(members)
        to_host = lambda: graph.inserting_after(after)  # noqa: E731
        to_device = lambda: graph.inserting_before(anchor)  # noqa: E731
        at_use = lambda: graph.inserting_before(first_use)  # noqa: E731
        if len(members) == 1:
            host = _emit(graph, to_host, SWAP_OUT, (members[0],), None,
                         _fake(sample, sample.shape, HOST), FORWARD, meta.SWAP_TO_HOST)
            back = _emit(graph, to_device, SWAP_IN, (host, device), None,
                         _fake(sample, sample.shape, device), BACKWARD, meta.SWAP_TO_DEVICE)
            ready = _emit(graph, at_use, SWAP_WAIT, (back,), None, _fake(sample, sample.shape, device), BACKWARD)
            restored = {members[0]: ready}
        else:
            numels = [m.meta["val"].numel() for m in members]
            total = sum(numels)
            # Built bottom-up: each node is inserted after ``after``, so emit in reverse order.
            host = _emit(graph, to_host, SWAP_OUT, (None,), None,
                         _fake(sample, [total], HOST), FORWARD, meta.SWAP_TO_HOST)
            with graph.inserting_before(host):
                flats = [graph.call_function(aten.reshape.default, (m, [-1])) for m in members]
                flat = graph.call_function(aten.cat.default, (flats,))
            for f, m, n in zip(flats, members, numels):
                f.meta["val"] = _fake(m.meta["val"], [n], device)
                tag(f, FORWARD)
            flat.meta["val"] = _fake(sample, [total], device)
            tag(flat, FORWARD)
            host.args = (flat,)
            back = _emit(graph, to_device, SWAP_IN, (host, device), None,
                         _fake(sample, [total], device), BACKWARD, meta.SWAP_TO_DEVICE)
            ready = _emit(graph, at_use, SWAP_WAIT, (back,), None, _fake(sample, [total], device), BACKWARD)
            parts = _emit(graph, at_use, aten.split_with_sizes.default, (ready, numels), None,
                          [_fake(sample, [n], device) for n in numels], BACKWARD)
            restored = {}
            for i, m in enumerate(members):
                piece = _emit(graph, at_use, operator.getitem, (parts, i), None,
                              _fake(sample, [numels[i]], device), BACKWARD)
                shape = list(m.meta["val"].shape)
                restored[m] = _emit(graph, at_use, aten.reshape.default, (piece, shape), None,
                                    _fake(m.meta["val"], shape, device), BACKWARD)
        for key in ("nn_module_stack", "stack_trace"):  # dumps attribute copies to the region
            if key in members[0].meta:
                host.meta[key] = back.meta[key] = ready.meta[key] = members[0].meta[key]
        for m, users in backward_users.items():
            for u in users:
                u.replace_input_with(m, restored[m])
    graph.lint()
    recompile(gm)
    return gm
