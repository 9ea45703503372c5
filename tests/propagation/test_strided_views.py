"""propagation/strided_views.py: the placements it gives a view that splits a dim sharded over
dp x cp back into (rows, positions) hold, on every rank, exactly the elements DTensor's own
placement semantics put there; views it cannot describe are left to DTensor."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.propagation.strided_views import _dtensor_refuses, unflatten_placements


def _spec(shape, mesh_shape, placements):
    mesh = SimpleNamespace(size=lambda axis: mesh_shape[axis])
    return SimpleNamespace(tensor_meta=SimpleNamespace(shape=torch.Size(shape)), placements=placements, mesh=mesh)


def _local(tensor, mesh_shape, placements, coordinate):
    """This rank's piece under DTensor's semantics: placements applied left to right."""
    for n, p, c in zip(mesh_shape, placements, coordinate):
        if not isinstance(p, Replicate):
            tensor = p._split_tensor(tensor, n, with_padding=False)[0][c]
    return tensor


@pytest.mark.parametrize("rows,positions,mesh_shape,placements", [
    (2, 16, (2, 4), (Shard(0), _StridedShard(0, split_factor=1))),  # one row per dp rank, cp=4 > rows
    (4, 16, (2, 4), (Shard(0), _StridedShard(0, split_factor=2))),
    (2, 16, (2, 2), (Shard(0), _StridedShard(0, split_factor=1))),
    (2, 16, (1, 4), (Shard(0), _StridedShard(0, split_factor=2))),  # dp=1: two rows, cp=4 > rows
    (3, 8, (4,), (_StridedShard(0, split_factor=3),)),
    (2, 8, (2, 2, 2), (Shard(0), _StridedShard(0, split_factor=1), Replicate())),
])
def test_unflatten_keeps_every_ranks_elements(rows, positions, mesh_shape, placements):
    hidden = 3
    flat = torch.arange(rows * positions * hidden).view(rows * positions, hidden)
    out = unflatten_placements(_spec(flat.shape, mesh_shape, placements), (rows, positions, hidden))
    assert out is not None
    whole = flat.view(rows, positions, hidden)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        mine = _local(flat, mesh_shape, placements, coordinate)
        theirs = _local(whole, mesh_shape, out, coordinate)
        assert torch.equal(mine.reshape(-1), theirs.reshape(-1)), (coordinate, out)


def test_views_it_cannot_describe_are_left_alone():
    # A strided split factor that is not the rows left: not a [rows * positions] flatten.
    assert unflatten_placements(_spec((32, 3), (4,), (_StridedShard(0, split_factor=4),)), (2, 16, 3)) is None
    # Not a split of one dim into two.
    assert unflatten_placements(_spec((32, 3), (4,), (_StridedShard(0, split_factor=2),)), (96,)) is None


@pytest.mark.parametrize("mesh_shape,rows,refused", [
    ((2, 4), 2, True),   # one sequence per dp rank over cp=4: DTensor refuses, this module decides
    ((1, 4), 2, True),   # the 4-rank configuration tests/cp/test_context_parallel.py trains
    ((2, 2), 2, False),  # as many cp ranks as rows: DTensor's own rule
])
def test_where_dtensor_refuses_the_unflatten(mesh_shape, rows, refused):
    """The views the distributed test's dp=1 x cp=4 mesh sends through this module's local kernel
    are those of dp=2 x cp=4 with one sequence per dp rank: DTensor refuses both."""
    from torch.distributed.tensor import DTensor

    positions, hidden = 16, 8
    with fake_world(mesh_shape[0] * mesh_shape[1]):
        mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "cp"))
        local = torch.zeros(rows // mesh_shape[0], positions // mesh_shape[1], hidden)
        x = DTensor.from_local(local, mesh, (Shard(0), Shard(1)), run_check=False,
                               shape=torch.Size([rows, positions, hidden]), stride=(positions * hidden, hidden, 1))
        flat = x.view(rows * positions, hidden)
        assert isinstance(flat.placements[1], _StridedShard), flat.placements
        spec = compat.spec_of(flat)
        assert _dtensor_refuses(torch.ops.aten.view.default, spec, [rows, positions, hidden]) is refused
        assert unflatten_placements(spec, (rows, positions, hidden)) == (Shard(0), Shard(1))
