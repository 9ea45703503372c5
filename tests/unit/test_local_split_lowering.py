"""Replicate -> Shard lowers as one ``narrow`` of this rank's part (compile/lower.py ``_move``).

DTensor's own lowering of the step chunks the tensor into one piece per rank of the axis and keeps
one: traced, that is a node per rank, thousands over a large FSDP axis (issue 55: Llama 3 405B on
16,384 ranks). The narrow must keep exactly DTensor's values and sizes, uneven shapes included
(sizes rounded up, the last parts shorter or empty), on every rank, and a step that does more than
split (a reduction, a shard moving dims) still goes to DTensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel import compat
from hyper_parallel.compile.lower import _local_splits, _move
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
