"""Compile speed (issue 20): what the faster compile relies on keeps the same results.

* The pass runner recompiles a GraphModule once, after all its steps, instead of once per step
  (propagation/__init__.py); the graph's code is then current, and a pass called on its own
  still recompiles at once.
* Passes that reorder nodes compare nodes (``a < b``, fx's order key) instead of rebuilding a
  {node: index} map per moved node; the order key must follow insertions and moves.
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.fx as fx

from hyper_parallel.passes.context import PassContext
from hyper_parallel.passes.runner import Step, run_steps
from hyper_parallel.propagation import deferred_recompiles, recompile


def _gm() -> fx.GraphModule:
    def f(x):
        return (x + 1) * 2

    return fx.symbolic_trace(f)


def _replace_target(gm: fx.GraphModule, old, new) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is old:
            node.target = new


def _count_recompiles(gm: fx.GraphModule, monkeypatch) -> list:
    calls = []
    original = type(gm).recompile

    def counting(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(type(gm), "recompile", counting)
    return calls


def test_recompile_outside_a_runner_is_immediate(monkeypatch):
    gm = _gm()
    calls = _count_recompiles(gm, monkeypatch)
    _replace_target(gm, operator.mul, operator.sub)
    recompile(gm)
    assert len(calls) == 1
    assert gm(torch.tensor(3.0)).item() == 2.0  # (3 + 1) - 2


def test_recompile_inside_a_block_is_deferred_to_its_end(monkeypatch):
    gm = _gm()
    calls = _count_recompiles(gm, monkeypatch)
    with deferred_recompiles():
        _replace_target(gm, operator.mul, operator.sub)
        recompile(gm)
        _replace_target(gm, operator.add, operator.mul)
        recompile(gm)
        with deferred_recompiles():  # nested: the outer block recompiles
            recompile(gm)
        assert calls == []
    assert len(calls) == 1
    assert gm(torch.tensor(3.0)).item() == 1.0  # (3 * 1) - 2


def test_no_recompile_after_an_exception(monkeypatch):
    gm = _gm()
    calls = _count_recompiles(gm, monkeypatch)
    try:
        with deferred_recompiles():
            recompile(gm)
            raise KeyError("boom")
    except KeyError:
        pass
    assert calls == []
    recompile(gm)  # and the block is closed: immediate again
    assert len(calls) == 1


def test_run_steps_recompiles_once_and_observers_see_each_step(monkeypatch):
    gm = _gm()
    calls = _count_recompiles(gm, monkeypatch)
    seen = []

    def to_sub(g, ctx):
        _replace_target(g, operator.mul, operator.sub)
        recompile(g)
        return g

    def to_mul(g, ctx):
        _replace_target(g, operator.add, operator.mul)
        recompile(g)
        return g

    def observe(name, g):  # what the dumps do: print the graph itself, not gm.code
        seen.append((name, g.print_readable(print_output=False)))

    ctx = PassContext(on_pass=observe)
    out = run_steps([Step("to_sub", to_sub), Step("to_mul", to_mul)], gm, ctx)
    assert out is gm and len(calls) == 1
    assert gm(torch.tensor(3.0)).item() == 1.0
    assert "operator.sub" in gm.code or " - " in gm.code
    assert "mul" in seen[1][1] and ("sub" in seen[0][1] or " - " in seen[0][1])
    assert set(ctx.timings) == {"to_sub", "to_mul"}


def test_node_order_follows_insertions_and_moves():
    """bucketing, prefetch and overlap_reductions compare nodes (``a < b``) where they built a
    {node: index} map per fused bucket or moved node; the comparison must equal graph order."""
    gm = fx.symbolic_trace(lambda x: ((x + 1) * 2 - 3) / 4)
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    with graph.inserting_before(nodes[1]):
        extra = graph.call_function(operator.neg, (nodes[0],))
    nodes[2].append(nodes[0].next)  # move ``extra`` after the subtraction
    with graph.inserting_after(nodes[0]):
        graph.call_function(operator.pos, (nodes[0],))
    assert extra.prev is nodes[2]
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    for a in order:
        for b in order:
            assert (a < b) == (position[a] < position[b]), (a, b)
            assert (a <= b) == (position[a] <= position[b]), (a, b)
    assert sorted(reversed(order)) == order
    assert min(order[3:]) is order[3] and max(order[:4]) is order[3]


class _Cycle:
    def __init__(self):
        self.me = self


def test_older_objects_frozen_during_a_compile_only():
    """compile/gc_freeze.py: objects older than the compile are frozen while it runs (nested
    compiles freeze once), unfrozen after it, also after an error; garbage made during it is
    still collected; an application's own freeze, or a disabled collector, is left alone."""
    import gc

    from hyper_parallel.compile.gc_freeze import older_objects_frozen

    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with older_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert ref() is None  # the compile's own garbage is collected
    assert gc.get_freeze_count() == 0

    @older_objects_frozen()
    def failing_compile():
        assert gc.get_freeze_count() > 0
        raise ValueError("bad plan")

    try:
        failing_compile()
    except ValueError:
        pass
    assert gc.get_freeze_count() == 0

    gc.freeze()  # the application's
    try:
        # Left alone: not frozen again inside, not unfrozen after. (The count is of live frozen
        # objects: one freed meanwhile, by another test's worker thread, lowers it.)
        mine = gc.get_freeze_count()
        with older_objects_frozen():
            assert gc.get_freeze_count() <= mine
        assert 0 < gc.get_freeze_count() <= mine
        assert mine - gc.get_freeze_count() < mine // 100
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
