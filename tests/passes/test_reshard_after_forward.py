"""The reshard_after_forward pass on the joint graph it gets in a real compile: a 3-layer MLP (plus
a root head) under FSDP on simulated ranks (torch's ``fake`` backend: one process, no collective
runs), captured and lowered, then handed to ``reshard_after_forward_pass`` alone.

What the pass promises (its docstring): for units that reshard, every backward use of an
all-gathered parameter (or a cheap view of it computed in forward) reads a copy of that chain made
in backward right before its first backward use, so no gathered parameter is saved for backward,
only the shard (a graph input); the copies compute the same values; units that do not reshard keep
theirs; ``reshard_after_forward=k`` keeps this rank's 1/k rows after the forward wait and gathers
them over a k-rank group in backward; idempotent."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.ir.phase import is_tagged_backward
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.passes.reshard_after_forward import (
    POST_FORWARD, gathered_param_region, reshard_after_forward_pass,
)
from hyper_parallel.testing.pass_inputs import (
    LayerStack, assert_right_before_first_use, assert_valid_order, copy_graph_module, pass_input,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG, WAIT = c10d.all_gather_into_tensor.default, c10d.wait_tensor.default
UNITS = ["layers.*", ""]
# The weights backward reads (for the gradient of each layer's input); layers.0's input is data,
# and no bias is read in backward.
BACKWARD_WEIGHTS = {"head.weight", "layers.2.proj.weight", "layers.1.proj.weight"}


Net = functools.partial(LayerStack, 3)


@functools.lru_cache(maxsize=None)
def _lowered(mixed: bool):
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else None
    return pass_input(Net, {"fully_shard": hp.FullyShard(units=UNITS, mixed_precision=policy)}, 2,
                      "reshard_after_forward")


def _fresh(mixed=False):
    gm, ctx = _lowered(mixed)
    return copy_graph_module(gm), ctx


def _run(gm, ctx):
    gm = reshard_after_forward_pass(gm, ctx)
    assert_valid_order(gm)
    code = gm.code
    assert reshard_after_forward_pass(gm, ctx).code == code  # idempotent
    return gm


def _backward_readers(node):
    return [u for u in node.users if is_tagged_backward(u) or u.op == "output"]


def _params(ctx, resharding=True):
    return {p for u in ctx.fsdp.units if bool(u.reshard_after_forward) == resharding for p in u.params}


def _origins(gm, old: set[str]):
    """``{copy: the forward node it copies}`` for the nodes the pass added (names not in ``old``):
    the same op on the same inputs, once copies are mapped back to their originals."""
    origin = {}
    forward = [n for n in gm.graph.nodes if n.name in old and n.op == "call_function" and not is_tagged_backward(n)]
    for node in gm.graph.nodes:
        if node.name in old:
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: origin.get(a, a))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: origin.get(a, a))
        match = [f for f in forward if f.target is node.target and f.args == args and f.kwargs == kwargs]
        assert len(match) == 1, f"{node.name} ({node.target}) is not a copy of one forward node: {match}"
        origin[node] = match[0]
    return origin


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-params"])
def test_backward_reads_regathered_copies_and_no_gathered_parameter_is_saved(mixed):
    gm, ctx = _fresh(mixed)
    old = {n.name for n in gm.graph.nodes}
    old_order = [n.name for n in gm.graph.nodes]
    region = gathered_param_region(gm.graph, _params(ctx))
    saved_before = {n.name for n in region if _backward_readers(n)}
    # Without the pass, backward reads gathered weights (views of them, e.g. ``t(w)``) from forward.
    assert saved_before
    region_names = {n.name for n in region}

    gm = _run(gm, ctx)
    # No forward node holding a gathered parameter (or a view of one) is read by backward.
    for node in gm.graph.nodes:
        if node.name in region_names:
            assert not _backward_readers(node), f"{node.name} is still saved for backward"
    new = {n for n in gm.graph.nodes if n.name not in old}
    assert new
    for node in new:
        assert node.meta["hp_fsdp_phase"] == "backward" and node.meta["partitioner_tag"] == "is_backward"
    # One backward all-gather per weight backward reads, of the same shard over the same group as
    # the forward one, keeping the meta bucketing fuses a unit's backward gathers by.
    origin = _origins(gm, old)
    gathers = {n.meta["hp_fsdp_param"]: n for n in new if n.target is AG}
    assert set(gathers) == BACKWARD_WEIGHTS
    for param, g in gathers.items():
        forward = origin[g]
        # The same shard: under mixed precision through a backward copy of its forward cast.
        assert forward.meta["hp_fsdp_param"] == param and tuple(origin.get(a, a) for a in g.args) == forward.args
        assert g.meta["hp_fsdp_unit"] == forward.meta["hp_fsdp_unit"] and g.meta["hp_role"] == "redistribute"
    # Every copy is a copy of a node of the gathered-parameter region, or (mixed precision) of the
    # cast of a shard (a graph input) to param_dtype that the gather reads.
    for copied in origin.values():
        assert copied.name in region_names or (
            mixed and copied.target is aten._to_copy.default and copied.args[0].op == "placeholder"), copied.name
    if mixed:  # the gathered values are bf16 as in forward
        assert all(g.meta["val"].dtype == torch.bfloat16 for g in gathers.values())
    # Placed right before their first backward use; the original nodes keep their order.
    assert_right_before_first_use(gm, new)
    assert [n.name for n in gm.graph.nodes if n.name in old] == old_order
    # What crosses from forward to backward now: no gathered value, only graph inputs (the shards)
    # and activations.
    crossing = {a for n in gm.graph.nodes if is_tagged_backward(n) for a in n.all_input_nodes if not is_tagged_backward(a)}
    assert not any(a.target in (AG, WAIT) for a in crossing)


def test_only_the_shard_crosses_to_backward_under_mixed_precision():
    gm, ctx = _fresh(mixed=True)
    old = {n.name for n in gm.graph.nodes}
    gm = _run(gm, ctx)
    for g in (n for n in gm.graph.nodes if n.name not in old and n.target is AG):
        source = g.args[0]
        assert source.op == "placeholder" or is_tagged_backward(source), \
            f"{g.meta['hp_fsdp_param']}: backward gathers {source.name} ({source.target}), computed in forward"


def test_units_that_keep_their_parameters_are_left_alone():
    """``layers.1`` with reshard_after_forward=False: its gathered weight is still saved (backward
    reads the forward view of it), no gather of it is added; the other units are re-gathered."""
    gm, ctx = _fresh()
    fsdp = dataclasses.replace(ctx.fsdp, units=tuple(
        dataclasses.replace(u, reshard_after_forward=u.module_fqn != "layers.1") for u in ctx.fsdp.units))
    ctx = dataclasses.replace(ctx, fsdp=fsdp)
    old = {n.name for n in gm.graph.nodes}
    kept = {n.name for n in gathered_param_region(gm.graph, _params(ctx, resharding=False)) if _backward_readers(n)}
    assert kept
    gm = _run(gm, ctx)
    assert {n.meta["hp_fsdp_param"] for n in gm.graph.nodes if n.name not in old and n.target is AG} == \
        BACKWARD_WEIGHTS - {"layers.1.proj.weight"}
    assert all(_backward_readers(n) for n in gm.graph.nodes if n.name in kept)


def test_no_resharding_unit_no_change():
    gm, ctx = _fresh()
    fsdp = dataclasses.replace(ctx.fsdp, units=tuple(
        dataclasses.replace(u, reshard_after_forward=False) for u in ctx.fsdp.units))
    code = gm.code
    assert _run(gm, dataclasses.replace(ctx, fsdp=fsdp)).code == code
    assert _run(gm, dataclasses.replace(ctx, fsdp=None)).code == code


def test_reshard_to_k_ranks_keeps_this_ranks_rows_and_regathers_over_k():
    """reshard_after_forward=2 on 4 ranks, seen from rank 1 (position 1 of the k-group {0, 1}): after
    each forward wait of a weight backward reads, rows 4:8 of the gathered [8, 8] are sliced and
    cloned (forward, marked with k); backward gathers those clones over the 2-rank group into the
    full weight; nothing else of the gathered chain is saved."""
    with fake_world(4, rank=1):
        gm, ctx = pass_input(Net, {"fully_shard": hp.FullyShard(units=UNITS, reshard_after_forward=2)}, 4,
                             "reshard_after_forward", rank=1)
        (unit,) = {(u.post_forward_group, u.post_forward_rank) for u in ctx.fsdp.units}
        group, position = unit
        assert position == 1
        shard_group = ctx.mesh.get_group(0).group_name
        assert group != shard_group
        old = {n.name for n in gm.graph.nodes}
        region_names = {n.name for n in gathered_param_region(gm.graph, _params(ctx))}
        gm = _run(gm, ctx)
    new = [n for n in gm.graph.nodes if n.name not in old]
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    kept = [n for n in new if POST_FORWARD in n.meta]
    regathers = [n for n in new if n.target is AG]
    assert {g.meta["hp_fsdp_param"] for g in regathers} == BACKWARD_WEIGHTS
    assert len(kept) == 2 * len(regathers)  # a slice and a clone per weight
    for g in regathers:
        clone = g.args[0]
        (piece,) = clone.args
        (wait,) = piece.all_input_nodes
        assert g.args[1:] == (2, group)
        assert g.meta["hp_fsdp_phase"] == "backward" and g.meta["partitioner_tag"] == "is_backward"
        assert g.meta["hp_role"] == "redistribute" and g.meta["hp_fsdp_unit"] == wait.meta["hp_fsdp_unit"]
        assert tuple(g.meta["val"].shape) == (8, 8)  # the full weight, as the forward wait holds
        assert clone.target is aten.clone.default and piece.target is aten.slice.Tensor
        assert piece.args == (wait, 0, 4, 8)  # position 1 of 2: rows [4, 8) of 8
        assert wait.target is WAIT and wait.args[0].args[1:] == (4, shard_group)  # the forward gather
        for n in (piece, clone):
            assert n.meta[POST_FORWARD] == 2 and n.meta["partitioner_tag"] == "is_forward"
            assert tuple(n.meta["val"].shape) == (4, 8)
        # Right after the forward wait.
        assert nodes[order[wait] + 1] is piece and nodes[order[wait] + 2] is clone
    # From the gathered chain only the kept pieces cross to backward.
    for node in gm.graph.nodes:
        if node.name in region_names:
            assert [u for u in _backward_readers(node)] == [], node.name
    crossing = {a for n in gm.graph.nodes if is_tagged_backward(n) for a in n.all_input_nodes if not is_tagged_backward(a)}
    assert {a for a in crossing if a.target in (AG, WAIT, aten.slice.Tensor)} == set()
    assert {a for a in crossing if POST_FORWARD in a.meta} == {g.args[0] for g in regathers}
