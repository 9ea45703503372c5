"""A mesh from hp.ParallelDims goes straight into hp.parallelize: FSDP + TP on (dp_shard=2, tp=2)
over 4 gloo ranks matches the single-device example Llama (loss and every gradient, 2 SGD steps),
and the flattened aliases are real process groups of the expected ranks; and the torch behaviour
over such aliases that FSDP's storage layouts avoid (an uneven nested shard gathered wrongly)."""

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, build_plan
from hyper_parallel.testing.stepper import ParityStepper


def _parity_on_parallel_dims_mesh(steps: int = 2) -> dict:
    pd = hp.ParallelDims(dp_shard=-1, tp=2)  # world_size from the process group
    reference = build_model("llama")
    pd.validate_model(reference, seq_len=16)
    mesh = pd.build_mesh("cpu")
    parallel = hp.parallelize(copy.deepcopy(reference), build_plan("fsdp_tp"), mesh)
    ParityStepper(reference, parallel, mesh=mesh).run(steps)
    # The aliases are usable groups: the sum of ranks over "dp" (= dp_shard here) pairs each rank
    # with the one two apart.
    rank = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(rank, group=pd.get_mesh("dp").get_group())
    summary = parallel.compile_summary()
    return {"dims": pd.mesh_axes(), "dp_rank_sum": rank.item(), "rank": dist.get_rank(),
            "collective_axes": sorted({axis for d in summary["collectives"].values()
                                       for by_axis in d.values() for axis in by_axis})}


def test_parallel_dims_mesh_fsdp_tp_parity(dist4):
    results = dist4.run(_parity_on_parallel_dims_mesh)
    for r in results:
        assert r["dims"] == {"dp_shard": 2, "tp": 2}
        assert r["dp_rank_sum"] == {0: 2, 1: 4, 2: 2, 3: 4}[r["rank"]]
        assert r["collective_axes"] == ["dp_shard", "tp"]


def _uneven_nested_gather() -> list:
    """torch's DTensor alone: a [2, 3] tensor nested-sharded Shard(0) x Shard(0) over a 2 x 2 mesh
    (one row on two ranks, none on the other two: uneven), gathered whole with a mesh flattened
    from the two axes."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from hyper_parallel import compat

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = torch.arange(6.0).reshape(2, 3)
    local = distribute_tensor(full, mesh, [Shard(0), Shard(0)]).to_local()
    compat.flatten_mesh(mesh, ("a", "b"), "a_b")
    nested = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], shape=full.shape, stride=full.stride())
    return nested.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "torch 2.13: with a mesh flattened from both axes, DTensor merges the two all-gathers of an "
    "uneven nested Shard(0) into one and reads the pieces as one even chunking (row 1 comes back "
    "as zeros). fsdp/resolve._storage_placements therefore never stores such a shard; when this "
    "passes, torch is fixed and that rule can go"))
def test_torch_gathers_an_uneven_nested_shard_over_a_flattened_mesh(dist4):
    for gathered in dist4.run(_uneven_nested_gather):
        assert gathered == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
