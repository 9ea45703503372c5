"""FSDP over several mesh axes (dp_shard x cp here): each unit's gather and reduce-scatter is one
collective over the mesh flattened from those axes, which parallelize creates on a plain mesh and
reuses where the mesh has one (a ParallelDims mesh)."""

import pytest

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

PLAN = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel(mode="ring")},
        "fully_shard": hp.FullyShard(units=("model.layers.*", ""))}


@pytest.mark.slow
def test_a_plain_mesh_runs_one_collective_per_unit():
    with fake_world(4, 1):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
        batch = local_batch(global_batch("llama", 4, 16, ignore_fraction=0.3), mesh)
        pmodel = compile_for_explain(build_model("llama", num_hidden_layers=2), PLAN, mesh, (), batch)
        assert list(compat.flattened_meshes(mesh)) == ["dp_shard_cp"]
        summary = pmodel.compile_summary(memory=False)
    forward, backward = summary["collectives"]["forward"], summary["collectives"]["backward"]
    # 3 units (2 layers and the root): one fused gather each in forward, one reduce-scatter each in
    # backward, over the flattened mesh; nothing runs once per axis.
    assert forward["all_gather"]["dp_shard+cp"]["count"] == 3
    assert list(backward["reduce_scatter"]) == ["dp_shard+cp"]
    assert backward["reduce_scatter"]["dp_shard+cp"]["count"] == 3
    assert list(forward["all_reduce"]) == ["dp_shard+cp"]  # the loss's sum and token count, once
    per_step = summary["collectives_per_step"]
    assert all("dp_shard" not in table for table in per_step.values()), per_step


def test_an_existing_flattened_mesh_is_reused_and_a_taken_name_avoided():
    with fake_world(4, 0):
        mesh = hp.ParallelDims(dp_shard=2, cp=2, world_size=4, ulysses_degree=1).build_mesh("cpu")
        before = compat.flattened_meshes(mesh)
        model = hp.parallelize(build_model("llama", num_hidden_layers=2), PLAN, mesh)
        assert compat.flattened_meshes(mesh).keys() == before.keys()
        assert model._hp.resolved.fsdp.joint_axes == ("dp_shard", "cp")

        plain = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
        compat.flatten_mesh(plain, ("cp",), "dp_shard_cp")  # the name taken by other ranks
        hp.parallelize(build_model("llama", num_hidden_layers=2), PLAN, plain)
        assert sorted(compat.flattened_meshes(plain)) == ["dp_shard_cp", "dp_shard_cp_2"]
