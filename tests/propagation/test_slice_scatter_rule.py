"""``slice_scatter`` into a replicated buffer from a sharded source stays local
(propagation/rules.py ``_slice_scatter_following_source``).

DTensor's rule follows the input's layout only, so a buffer filled slice by slice (T5's shifted
labels, DeepSeek-V3's key with its shared RoPE part) gathered its source: under data parallelism an
all-gather of activations in every layer, which the plan-boundary warning does not report on batch
axes. Propagation runs on a fake mesh here; the models' parity is in
tests/end_to_end/test_hf_models.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.propagation.engine import make_spec
from hyper_parallel.propagation.rules import propagate_op

aten = torch.ops.aten


def _spec(mesh, placements, shape):
    return make_spec(mesh, placements, torch.empty(shape, device="meta"))


def test_a_replicated_buffer_takes_the_sources_shard():
    with fake_world(4):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        buf = _spec(mesh, (Replicate(), Replicate()), (4, 8, 6, 16))
        src = _spec(mesh, (Shard(0), Shard(1)), (4, 8, 6, 12))  # batch over dp, heads over tp
        out, wanted = propagate_op(aten.slice_scatter.default, (buf, src, 3, 4, 16, 1), {})
    assert out.placements == (Shard(0), Shard(1)), out
    assert [w.placements for w in wanted] == [(Shard(0), Shard(1))] * 2, wanted


def test_a_source_sharded_on_the_scattered_dim_is_left_to_dtensor():
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        buf = _spec(mesh, (Replicate(),), (4, 16))
        src = _spec(mesh, (Shard(1),), (4, 12))
        out, wanted = propagate_op(aten.slice_scatter.default, (buf, src, 1, 4, 16, 1), {})
    # Scattered along the sharded dim: the source is read whole (DTensor's rule), not sliced wrong.
    assert out.placements == (Replicate(),) and wanted[1].placements == (Replicate(),), (out, wanted)

