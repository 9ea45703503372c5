"""Layout changes that DTensor traces with a node per rank are traced as a few ops (compile/moves.py).

Replicate -> Shard becomes one ``narrow`` of this rank's part; Partial -> Shard one pad, the
reduce-scatter and one narrow; Shard(d != 0) -> Replicate the all-gather and one permuting copy.
DTensor's own lowering chunks the tensor into one piece per rank of the axis: traced, thousands of
nodes over a large FSDP axis (issue 55: Llama 3 405B on 16,384 ranks). Ours must keep exactly
DTensor's values and sizes, uneven shapes included (sizes rounded up, the last parts shorter or
empty), on every rank (the reduce-scatter and all-gather on 4 gloo ranks), and a step that does
more (several axes, nested shards on one dim) still goes to DTensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel import compat
from hyper_parallel.compile.moves import local_splits as _local_splits, move as _move, reduction_steps
from hyper_parallel.distributed.mesh import init_device_mesh
from hyper_parallel.tools.explain import fake_world


def _spec(mesh, placements, shape):
    meta = compat.TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    return compat.DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


@pytest.mark.parametrize("rank", [0, 3, 5, 7])
@pytest.mark.parametrize("shape,src,dst", [
    ((10, 6), (Replicate(), Replicate()), (Shard(0), Replicate())),  # 10 rows over 4: 3, 3, 3, 1
    ((5, 6), (Replicate(), Replicate()), (Shard(0), Replicate())),   # 5 over 4: 2, 2, 1, then empty
    ((7, 9), (Replicate(), Replicate()), (Shard(1), Shard(0))),      # both axes, distinct dims
    ((8, 6), (Shard(0), Replicate()), (Shard(0), Shard(1))),         # a split beside a shard
])
def test_narrow_equals_dtensor_chunking(rank, shape, src, dst):
    with fake_world(8, rank=rank):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        local = full
        if src[0] == Shard(0):
            local = list(torch.chunk(full, 4, 0))[mesh.get_coordinate()[0]]
        src_spec, dst_spec = _spec(mesh, src, shape), _spec(mesh, dst, shape)
        assert _local_splits(src_spec, dst_spec) is not None
        ours = _move(local, src_spec, dst_spec)
        theirs = compat.redistribute_local_tensor(local, src_spec, dst_spec)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
        assert ours.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()  # owns its storage


def test_steps_that_do_more_than_split_go_to_dtensor():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        shape = (8, 8)

        def splits(src, dst):
            return _local_splits(_spec(mesh, src, shape), _spec(mesh, dst, shape))

        assert splits((Replicate(), Replicate()), (Shard(0), Shard(1))) == [(0, 0), (1, 1)]
        assert splits((Partial(), Replicate()), (Shard(0), Replicate())) is None  # a reduce-scatter
        assert splits((Shard(1), Replicate()), (Shard(0), Replicate())) is None  # an all-to-all
        assert splits((Replicate(), Replicate()), (Shard(0), Shard(0))) is None  # nested on one dim
        assert splits((Replicate(), Shard(0)), (Replicate(), Replicate())) is None  # an all-gather


def test_traced_split_is_one_narrow_not_a_node_per_rank():
    with fake_world(64, rank=9):
        mesh = init_device_mesh("cpu", (64,), mesh_dim_names=("dp",))
        src, dst = _spec(mesh, (Replicate(),), (128, 4)), _spec(mesh, (Shard(0),), (128, 4))
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: _move(x, src, dst))(torch.randn(128, 4))
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert ops == [torch.ops.aten.slice.Tensor, torch.ops.aten.clone.default], ops
        x = torch.randn(128, 4)
        assert torch.equal(gm(x), x[18:20])


@pytest.mark.parametrize("src,dst", [
    ((Replicate(), Replicate()), (Shard(0), Replicate())),  # FSDP's shard of a gradient on one rank
    ((Partial(), Replicate()), (Shard(0), Replicate())),    # its reduce-scatter
    ((Partial(), Replicate()), (Replicate(), Replicate())),
    ((Shard(1), Replicate()), (Replicate(), Replicate())),
])
def test_a_change_on_a_one_rank_axis_traces_nothing(src, dst):
    """On a mesh axis of one rank every placement holds the whole tensor: no node (DTensor skips
    it too), where a narrow and clone would copy every gradient (an 8B model's FSDP on one rank
    predicted 43.7 GiB reserved, not the H200's measured 47.7, because of where those copies
    land); the other axis still moves."""
    with fake_world(4, rank=3):
        mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
        src_spec, dst_spec = _spec(mesh, src, (8, 8)), _spec(mesh, dst, (8, 8))
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: _move(x, src_spec, dst_spec))(torch.randn(8, 8))
        assert [n.op for n in gm.graph.nodes] == ["placeholder", "output"], gm.code
        both = _spec(mesh, (Shard(0), Shard(1)), (8, 8))
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: _move(x, src_spec, both))(torch.randn(8, 8))
        x = torch.randn(8, 8)
        assert torch.equal(gm(x), compat.redistribute_local_tensor(x, src_spec, both))


_COLLECTIVES = {torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_gather_into_tensor.default}


def _traced_ops(world: int, src, dst, shape):
    with fake_world(world, rank=world - 1):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        src_spec, dst_spec = _spec(mesh, src, shape), _spec(mesh, dst, shape)
        local = torch.randn(compat.compute_local_shape_and_global_offset(torch.Size(shape), mesh, src)[0])
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: _move(x, src_spec, dst_spec))(local)
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("src,dst,shape", [
    ((Partial(),), (Shard(0),), (100, 3)),    # uneven rows: padded, scattered, narrowed
    ((Partial(),), (Shard(1),), (3, 4096)),   # scattered on dim 1: the parts moved first
    ((Shard(1),), (Replicate(),), (3, 100)),  # gathered on dim 1, uneven
])
def test_collective_steps_trace_a_few_nodes_at_any_axis_size(src, dst, shape):
    small, large = _traced_ops(64, src, dst, shape), _traced_ops(1024, src, dst, shape)
    for ops in (small, large):  # DTensor's tracing: over 64 and over 1,024 nodes
        assert len(ops) <= 8, ops
        assert sum(t in _COLLECTIVES for t in ops) == 1 and torch.ops.aten.cat.default not in ops, ops


# (mesh shape, src, dst, global shape): every kind of step moves.py traces itself, even and uneven.
_CASES = [
    ((4,), (Partial(),), (Shard(0),), (10, 3)),             # 10 rows over 4: 3, 3, 3, 1
    ((4,), (Partial(),), (Shard(0),), (3, 5)),              # 3 rows over 4: one rank empty
    ((4,), (Partial(),), (Shard(1),), (2, 7, 3)),           # dim 1, uneven
    ((4,), (Partial(),), (Shard(2),), (2, 3, 8)),           # dim 2, even
    ((4,), (Partial("max"),), (Shard(0),), (6, 2)),         # not a sum
    ((2, 2), (Partial(), Shard(1)), (Shard(0), Shard(1)), (5, 6)),  # beside a shard on another dim
    ((4,), (Shard(1),), (Replicate(),), (3, 10)),           # gather on dim 1, uneven
    ((4,), (Shard(2),), (Replicate(),), (2, 3, 8)),         # dim 2, even
    ((4,), (Shard(1),), (Replicate(),), (1, 3, 4)),         # leading size 1: a view would do
    ((2, 2), (Shard(1), Shard(0)), (Replicate(), Shard(0)), (4, 5)),
]


def _against_dtensor() -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    out = []
    for i, (mesh_shape, src, dst, shape) in enumerate(_CASES):
        names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        torch.manual_seed(i)
        full = torch.randn(shape)
        replicated = [p if not p.is_partial() else Replicate() for p in src]
        local = distribute_tensor(full, mesh, replicated).to_local().clone()
        if any(p.is_partial() for p in src):  # a different addend on every rank
            local = local * (dist.get_rank() + 1) + dist.get_rank()
        src_spec, dst_spec = _spec(mesh, src, shape), _spec(mesh, dst, shape)
        assert [s.placements for s in reduction_steps(src_spec, dst_spec)] == [dst_spec.placements]
        ours = _move(local, src_spec, dst_spec)
        theirs = compat.redistribute_local_tensor(local, src_spec, dst_spec)
        out.append((i, tuple(ours.shape) == tuple(theirs.shape) and torch.equal(ours, theirs),
                    tuple(ours.shape), tuple(theirs.shape)))
    return out


def test_reduce_scatter_and_all_gather_equal_dtensors_on_every_rank(dist4):
    for rank, results in enumerate(dist4.run(_against_dtensor)):
        for i, same, ours, theirs in results:
            assert same, f"rank {rank}, case {_CASES[i]}: ours {ours}, DTensor's {theirs}"
