"""The prefetch pass on the joint graph it gets in a real compile: a 4-layer MLP (plus a root
head) under FSDP on 2 simulated ranks (torch's ``fake`` backend: one process, no collective runs),
captured, lowered and bucketed, then handed to ``prefetch_pass`` alone with each option.

What the pass promises (its docstring): unit k's fused all-gather (with the copy-in it reads) is
issued right after unit k-depth has unpacked its gathered buffer (its wait and the copies of its
parameters out of it), before that unit computes, in forward and in backward; depth 0 moves nothing
but the explicit lists; only node order changes; idempotent. (Where reductions are waited for is the
``overlap_reductions`` pass's, tests/passes/test_overlap_reductions.py.)"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import torch

from hyper_parallel.ir.graph import module_fqn_of
from hyper_parallel.passes.prefetch import prefetch_pass
from hyper_parallel.testing.pass_inputs import LayerStack, assert_valid_order, copy_graph_module, pass_input

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG, RS, WAIT = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default
LAYERS = 4


Net = functools.partial(LayerStack, LAYERS)


@functools.lru_cache(maxsize=None)
def _bucketed():
    return pass_input(Net, {"fully_shard": {"units": ["layers.*", ""]}}, 2, "prefetch")


def _fresh(**ctx_changes):
    gm, ctx = _bucketed()
    return copy_graph_module(gm), dataclasses.replace(ctx, **ctx_changes)


def _dataflow(gm):
    """Every node with its op and inputs, by name: what the graph computes, independent of order."""
    def norm(a):
        return a.name if isinstance(a, torch.fx.Node) else a

    return {
        n.name: (n.op, str(n.target), torch.fx.node.map_aggregate(n.args, norm),
                 torch.fx.node.map_aggregate(n.kwargs, norm))
        for n in gm.graph.nodes
    }


def _run(gm, ctx, idempotent=True):
    """The pass, checked: a valid graph, the same data flow, idempotent."""
    before = _dataflow(gm)
    gm = prefetch_pass(gm, ctx)
    assert_valid_order(gm)
    assert _dataflow(gm) == before  # node order only: nothing added, removed or rewired
    if idempotent:
        code = gm.code
        assert prefetch_pass(gm, ctx).code == code
    return gm


def _fused(gm, target, phase=None):
    """The fused collectives of ``target`` (in graph order), optionally of one FSDP phase."""
    return [
        n for n in gm.graph.nodes
        if n.target is target and "hp_bucket" in n.meta
        and (phase is None or n.meta.get("hp_fsdp_phase", "forward") == phase)
    ]


def _wait(node):
    (wait,) = [u for u in node.users if u.target is WAIT]
    return wait


def _pos(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


_VIEWS = {aten.view.default, aten.reshape.default, aten.split_with_sizes.default, aten.t.default}


def _unpack_end(gm, gather):
    """The position of the last node of ``gather``'s unpack: the views, splits and copies of its
    waited buffer that follow the wait."""
    nodes, order = list(gm.graph.nodes), _pos(gm)
    seen, i = {_wait(gather)}, order[_wait(gather)]
    while nodes[i + 1].target in _VIEWS or str(nodes[i + 1].target) == "<built-in function getitem>":
        if not any(a in seen for a in nodes[i + 1].all_input_nodes):
            break
        seen.add(nodes[i + 1])
        i += 1
    return i


def test_the_input_has_one_gather_per_unit_issued_right_before_its_wait():
    """The starting point the pass is written for (bucketing's output): nothing overlaps yet."""
    gm, _ = _fresh()
    forward, backward = _fused(gm, AG, "forward"), _fused(gm, AG, "backward")
    assert [g.meta["hp_fsdp_unit"] for g in forward] == [f"layers.{i}" for i in range(LAYERS)] + [""]
    # Backward runs the units in reverse; layers.0 needs no weight in backward (its input is data).
    assert [g.meta["hp_fsdp_unit"] for g in backward] == [""] + [f"layers.{i}" for i in range(LAYERS - 1, 0, -1)]
    order = _pos(gm)
    for g in forward + backward:
        assert order[_wait(g)] == order[g] + 1


def test_depth_one_issues_the_next_units_gather_after_the_current_unpack():
    gm = _run(*_fresh(prefetch_depth=1))
    order = _pos(gm)
    nodes = list(gm.graph.nodes)
    for phase in ("forward", "backward"):
        gathers = _fused(gm, AG, phase)
        assert order[gathers[0]] < order[_wait(gathers[0])]
        for prev, cur in zip(gathers, gathers[1:]):
            # Issued (with its copy-in) right after the previous unit's unpack: its buffer is dead
            # (its parameters copied out) before this unit's buffer exists ...
            end = _unpack_end(gm, prev)
            chain = nodes[end + 1:order[cur] + 1]
            assert all(n in _ancestors(cur) for n in chain), (phase, cur.name, [n.name for n in chain])
            assert all(order[a] < order[cur] for a in cur.all_input_nodes)
            # ... so it is in flight while the previous unit computes: the previous unit's
            # matmul (forward) lies between the issue and the wait of this unit's gather.
            if phase == "forward":
                unit = prev.meta["hp_fsdp_unit"]
                compute = [n for n in nodes[order[cur]:order[_wait(cur)]]
                           if n.target is aten.addmm.default and module_fqn_of(n).startswith(unit)]
                assert compute, f"nothing of {unit} runs while {cur.meta['hp_bucket']} is in flight"
        # Never more than the depth ahead: the gather is issued after the previous unit's wait.
        for prev, cur in zip(gathers, gathers[1:]):
            assert order[_wait(prev)] < order[cur]


def test_depth_two_issues_each_gather_after_the_unpack_two_units_ahead():
    """The docstring's rule, literally: unit k's gather goes right after the unpack of unit k-2,
    so it is in flight before unit k-1 waits."""
    gm = _run(*_fresh(prefetch_depth=2))
    order = _pos(gm)
    for phase in ("forward", "backward"):
        gathers = sorted(_fused(gm, AG, phase), key=lambda g: order[_wait(g)])  # in need order
        for k in range(2, len(gathers)):
            assert _unpack_end(gm, gathers[k - 2]) < order[gathers[k]] < order[_wait(gathers[k - 1])], (phase, k)


def test_depth_two_keeps_the_next_unit_prefetched_and_gathers_in_need_order():
    """With depth d every unit among the next d - 1 is already in flight when a unit waits (and
    the next d once it has unpacked), and the gathers are issued in the order they are waited for (collectives on one stream complete in
    issue order, so an out-of-order issue makes a wait also wait for a later unit's transfer)."""
    gm = _run(*_fresh(prefetch_depth=2))
    order = _pos(gm)
    for phase in ("forward", "backward"):
        gathers = sorted(_fused(gm, AG, phase), key=lambda g: order[_wait(g)])  # in need order
        assert sorted(gathers, key=order.__getitem__) == gathers, phase
        # The first unit's wait has only its own gather in flight: the next two are issued once it
        # has unpacked (before it computes); from then on each unit waits with the next in flight.
        for k in range(2, len(gathers)):
            assert order[gathers[k]] < order[_wait(gathers[k - 1])], (phase, k)


def test_depth_two_is_idempotent():
    _run(*_fresh(prefetch_depth=2))


def test_depth_zero_moves_nothing():
    gm, ctx = _fresh(prefetch_depth=0, explicit_prefetch={})
    code = gm.code
    assert _run(gm, ctx).code == code


def test_explicit_lists_are_applied_at_depth_zero():
    """set_modules_to_forward_prefetch / _backward_prefetch: the listed units' gathers are issued
    after the unpack of the unit that names them, before its compute; nothing else moves (depth 0)."""
    gm, ctx = _fresh(prefetch_depth=0, explicit_prefetch={
        "forward": {"layers.0": ("layers.2", "layers.3")}, "backward": {"": ("layers.1",)}})
    forward = {g.meta["hp_fsdp_unit"]: g for g in _fused(gm, AG, "forward")}
    backward = {g.meta["hp_fsdp_unit"]: g for g in _fused(gm, AG, "backward")}
    listed = [forward["layers.2"], forward["layers.3"], backward["layers.1"]]
    # The listed gathers and their copy-in (the reshapes and cat of the shards they read).
    moved = {n for g in listed for n in _ancestors(g)}
    unmoved_before = [n.name for n in gm.graph.nodes if n not in moved]
    gm = _run(gm, ctx)
    order = _pos(gm)
    layer0_matmul = next(order[n] for n in gm.graph.nodes
                         if n.target is aten.addmm.default and module_fqn_of(n).startswith("layers.0"))
    for target in ("layers.2", "layers.3"):
        assert _unpack_end(gm, forward["layers.0"]) < order[forward[target]] < layer0_matmul
    assert order[forward["layers.2"]] < order[forward["layers.3"]]  # in the listed order
    assert _unpack_end(gm, backward[""]) < order[backward["layers.1"]]
    # Nothing else moved: the other gathers, every reduce-scatter and its wait, all compute.
    assert [n.name for n in gm.graph.nodes if n not in moved] == unmoved_before
    nodes = list(gm.graph.nodes)
    for g in [*forward.values(), *backward.values()]:
        if g not in listed:  # still issued right before its own wait
            assert all(n in moved for n in nodes[order[g] + 1:order[_wait(g)]]), g.meta["hp_bucket"]


def _ancestors(node):
    out, frontier = {node}, [node]
    while frontier:
        for a in frontier.pop().all_input_nodes:
            if a.op == "call_function" and a not in out:
                out.add(a)
                frontier.append(a)
    return out


def test_the_next_buffer_is_allocated_after_the_current_one_is_unpacked():
    """What the placement is for, in the memory estimate of the whole compiled program: a unit's
    parameters are strided in its gathered buffer and copied out of it, so the buffer dies once
    unpacked; with the next gather issued only then, one gathered buffer is alive at a time in
    forward, and the peak is lower than with the gather issued before the wait (as until
    2026-11-28), which kept the next buffer, the current one and its copies alive together."""
    import torch.nn as nn

    import hyper_parallel as hp
    import hyper_parallel.passes.prefetch as prefetch
    from hyper_parallel.tools.explain import compile_for_explain, fake_world
    from hyper_parallel.analysis.memory import CATEGORIES, estimate_program

    class Wide(nn.Module):  # parameters far larger than activations, so their buffers decide the peak
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu()
            return x.sum()

    def forward_memory():
        """(the most gathered-buffer bytes alive at once in forward, forward's peak)."""
        with fake_world(2, 0):
            mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            with hp.init_empty_weights():
                model = Wide()
            plan = {"fully_shard": hp.FullyShard(units=("layers.*", ""))}
            entry = compile_for_explain(model, plan, mesh, (torch.empty(4, 256, device="meta"),), None)._last_entry()
        series = []
        estimate = estimate_program(entry.program, entry.captured, series=series)
        comm = CATEGORIES.index("comm_buffers")
        return max(p["live"][comm] for p in series if p["phase"] == "forward"), estimate.peak_forward

    unit = (256 * 256 + 256) * 4  # one layer's weight and bias, fp32, whole
    gathered, peak = forward_memory()
    assert gathered == unit
    before_wait = lambda wait, issued: wait  # noqa: E731 - the old anchor: the wait itself
    with mock.patch.object(prefetch, "_after_unpack", before_wait):
        old_gathered, old_peak = forward_memory()
    assert old_gathered == 2 * unit
    assert old_peak - peak >= 0.95 * unit, (peak, old_peak)  # about one unit's parameters less
