"""propagation/balanced_order.py: which rule choices would shard, on the cp axis, a dim the
load-balanced order cannot permute (the labels' shift under FSDP x cp at many tokens per rank, run
end to end in tests/cp/test_context_parallel.py), and what the engine decides instead."""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.propagation.balanced_order import gathered_on, unordered_inputs
from hyper_parallel.tools.explain import fake_world

SEQ = 256


def _spec(mesh, shape, placements):
    return compat.DTensorSpec(mesh, tuple(placements),
                              compat.TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.int64))


def test_only_new_cp_shards_off_whole_sequences_are_unordered():
    with fake_world(4):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
        labels = _spec(mesh, (128, SEQ), (Shard(0), Shard(1)))  # the user's labels: batch x sequence
        by_batch = _spec(mesh, (128, SEQ), (Shard(0), Shard(0)))
        gathered = _spec(mesh, (128, SEQ), (Shard(0), Replicate()))
        rows = _spec(mesh, (128 * SEQ,), (Shard(0), _StridedShard(0, split_factor=2)))  # [batch * seq]
        cos = _spec(mesh, (SEQ, 16), (Replicate(), Replicate()))
        # The cp shard moved to the batch dim (128 rows, no whole sequence): unordered.
        assert unordered_inputs([labels], [by_batch], 1, SEQ) == [0]
        # Gathering, keeping the shard, sharding rows of whole sequences or the sequence itself: fine.
        assert unordered_inputs([labels], [gathered], 1, SEQ) == []
        assert unordered_inputs([by_batch], [by_batch], 1, SEQ) == []  # no new shard: not this rule's
        assert unordered_inputs([gathered, labels], [rows, labels], 1, SEQ) == []
        assert unordered_inputs([cos], [_spec(mesh, (SEQ, 16), (Replicate(), Shard(0)))], 1, SEQ) == []
        # ... but not the other dim of the rotary table, and not on the dp_shard axis's terms.
        assert unordered_inputs([labels, cos], [labels, _spec(mesh, (SEQ, 16), (Replicate(), Shard(1)))],
                                1, SEQ) == [1]
        assert unordered_inputs([gathered], [by_batch], 0, SEQ) == []  # axis 0 keeps its Shard(0)
        assert gathered_on(labels, 1).placements == (Shard(0), Replicate())
        assert gathered_on(labels, 1).tensor_meta == labels.tensor_meta
