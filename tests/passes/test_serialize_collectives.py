"""serialize_collectives: on gloo process groups, at most one collective in flight per group, read
from the compiled programs; other backends keep every collective the earlier passes put in flight."""

import torch

from hyper_parallel.passes.serialize_collectives import serialize_collectives
from hyper_parallel.testing.pass_inputs import LayerStack, assert_valid_order, in_flight_per_group, pass_input

c10d = torch.ops._c10d_functional


def _issues(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is not c10d.wait_tensor.default
            and getattr(n.target, "namespace", None) == "_c10d_functional"]


def test_prefetched_fsdp_program_keeps_one_collective_per_group_in_flight():
    """The FSDP graph after prefetch (depth 2) and overlap_reductions (2 in flight) has several
    collectives of the data-parallel group in flight; serialized, one, and every collective is
    still issued before the compute it overlaps (the waits moved, nothing else)."""
    plan = {"fully_shard": {"units": ["layers.*", ""]}}
    gm, _ = pass_input(lambda: LayerStack(6), plan, world=4, upto="serialize_collectives",
                       prefetch_depth=2, reductions_in_flight=2)
    before = in_flight_per_group(gm)
    assert max(before.values()) >= 2, before
    issues = _issues(gm)
    serialize_collectives(gm, frozenset(before))
    assert_valid_order(gm)
    after = in_flight_per_group(gm)
    assert set(after) == set(before) and max(after.values()) == 1, after
    # Same collectives, issued in the same order.
    assert issues == _issues(gm)
    # Prefetch survives: some all-gather is still issued before compute that it overlaps.
    nodes = list(gm.graph.nodes)
    gaps = [nodes.index(next(iter(n.users))) - nodes.index(n) for n in nodes
            if n.op == "call_function" and n.target is c10d.all_gather_into_tensor.default]
    assert max(gaps) > 1, gaps
    # Idempotent.
    order = [n.name for n in gm.graph.nodes]
    serialize_collectives(gm, frozenset(before))
    assert [n.name for n in gm.graph.nodes] == order


def test_groups_not_named_are_left_alone():
    def program(x):
        a = c10d.all_reduce.default(x, "sum", "g1")
        b = c10d.all_reduce.default(x * 2.0, "sum", "g2")
        c = c10d.all_reduce.default(x * 3.0, "sum", "g1")
        return c10d.wait_tensor.default(a) + c10d.wait_tensor.default(b) + c10d.wait_tensor.default(c)

    gm = torch.fx.symbolic_trace(program)
    assert in_flight_per_group(gm) == {"g1": 2, "g2": 1}
    serialize_collectives(gm, frozenset({"g2"}))
    assert in_flight_per_group(gm) == {"g1": 2, "g2": 1}
    serialize_collectives(gm, frozenset({"g1"}))
    assert in_flight_per_group(gm) == {"g1": 1, "g2": 1}
    assert_valid_order(gm)


def test_fake_backend_simulations_keep_their_overlap():
    """explain and the pass tests compile on torch's fake backend: nothing is serialized there,
    so the simulated timelines keep every collective the schedule overlaps."""
    from hyper_parallel.passes.serialize_collectives import serialized_groups
    from hyper_parallel.tools.explain import fake_world
    import hyper_parallel as hp

    with fake_world(4, 0):
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        group = mesh.get_group(0).group_name
        gm = torch.fx.symbolic_trace(
            lambda x: c10d.wait_tensor.default(c10d.all_reduce.default(x, "sum", group)))
        assert serialized_groups(gm) == frozenset()
