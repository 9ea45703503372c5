"""The overlap_reductions pass on the graph it gets in a real compile: a 4-layer MLP (plus a root
head) under FSDP (and, for DDP buckets, data parallelism) on 2 simulated ranks (torch's ``fake``
backend), captured, lowered, bucketed and prefetched, then handed to ``overlap_reductions_pass``
alone with each ``reductions_in_flight``.

What the pass promises (its docstring): reduction k is waited for (with its copy-out) just before
reduction k+N of its kind is issued, or before the first node that needs it; so at most N are in
flight; N = 0 moves nothing; only node order changes; idempotent."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from hyper_parallel.passes.overlap_reductions import overlap_reductions_pass
from hyper_parallel.testing.pass_inputs import LayerStack, assert_valid_order, copy_graph_module, pass_input

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RS, WAIT = c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default
AR_BUCKET = (c10d.all_reduce_.default, c10d.all_reduce.default)
LAYERS = 4

Net = functools.partial(LayerStack, LAYERS)
PLANS = {"fsdp": {"fully_shard": {"units": ["layers.*", ""]}}, "ddp": {}}


@functools.lru_cache(maxsize=None)
def _input(plan):
    # A tiny bucket cap so the DDP gradients form several buckets (one per parameter here).
    return pass_input(Net, PLANS[plan], 2, "overlap_reductions", bucket_cap_mb=1e-4)


def _fresh(plan, in_flight):
    gm, ctx = _input(plan)
    return copy_graph_module(gm), dataclasses.replace(ctx, reductions_in_flight=in_flight)


def _dataflow(gm):
    def norm(a):
        return a.name if isinstance(a, torch.fx.Node) else a

    return {n.name: (n.op, str(n.target), torch.fx.node.map_aggregate(n.args, norm)) for n in gm.graph.nodes}


def _run(gm, ctx):
    """The pass, checked: a valid graph, the same data flow, idempotent."""
    before = _dataflow(gm)
    gm = overlap_reductions_pass(gm, ctx)
    assert_valid_order(gm)
    assert _dataflow(gm) == before  # node order only
    code = gm.code
    assert overlap_reductions_pass(gm, ctx).code == code
    return gm


def _reductions(gm, plan):
    targets = (RS,) if plan == "fsdp" else AR_BUCKET
    return [n for n in gm.graph.nodes if n.target in targets and "hp_bucket" in n.meta]


def _wait(node):
    (wait,) = [u for u in node.users if u.target is WAIT]
    return wait


def _most_in_flight(gm, reductions):
    waits = {_wait(r) for r in reductions}
    pending = most = 0
    for node in gm.graph.nodes:
        pending += node in reductions
        pending -= node in waits
        most = max(most, pending)
    return most


@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_the_input_waits_every_reduction_at_once(plan):
    """The starting point (bucketing's output): one reduction per unit or bucket, each waited for
    right after it is issued."""
    gm, _ = _fresh(plan, 1)
    reductions = _reductions(gm, plan)
    # FSDP: one per unit; DDP: one per gradient here (the bucket cap is below one gradient).
    assert len(reductions) == LAYERS + 1 if plan == "fsdp" else len(reductions) > LAYERS + 1
    assert all(_wait(r) is r.next for r in reductions)


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_each_reduction_is_waited_just_before_the_one_n_later_is_issued(plan, in_flight):
    gm = _run(*_fresh(plan, in_flight))
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    reductions = _reductions(gm, plan)
    assert _most_in_flight(gm, reductions) == in_flight
    for k, reduction in enumerate(reductions):
        wait = _wait(reduction)
        if k + in_flight < len(reductions):
            later = reductions[k + in_flight]
            assert order[wait] < order[later]
            # Waited as late as allowed: only its own copy-out sits between it and that issue.
            between = nodes[order[wait] + 1:order[later]]
            assert all(wait in _ancestors(n) for n in between), [n.name for n in between]
    # Backward computes while they are in flight (a matmul between issue and wait): every unit's
    # but the last two (FSDP); with one bucket per gradient (DDP here) a layer's weight and bias
    # gradients come out together, so at least one per layer.
    overlapped = [any(n.target is aten.mm.default for n in nodes[order[r]:order[_wait(r)]]) for r in reductions]
    assert sum(overlapped) >= (len(reductions) - 2 if plan == "fsdp" else LAYERS - 1), overlapped


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_zero_in_flight_moves_nothing(plan):
    gm, ctx = _fresh(plan, 0)
    code = gm.code
    assert _run(gm, ctx).code == code
