"""Sharding rules for elementwise ops DTensor has none for (propagation/elementwise_rules.py).

Without a rule an op runs replicated: under data parallelism its operands were all-gathered over
the batch in every layer (GPT-OSS's experts' backward: 16 all-gathers per step of the tiny model).
Propagation here runs on a fake mesh of two; the parity of the models that need the rules is in
tests/end_to_end/test_hf_models.py (GPT-OSS, Qwen3-Next, T5, DeepSeek-V3, Falcon without any op
running replicated)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.propagation import elementwise_rules
from hyper_parallel.propagation.engine import make_spec
from hyper_parallel.propagation.rules import has_rule, propagate_op, register_own_rules

aten = torch.ops.aten
SHAPE = (4, 6, 8)


def _spec(mesh, placement, shape=SHAPE, dtype=torch.float32):
    return make_spec(mesh, (placement,), torch.empty(shape, dtype=dtype, device="meta"))


def _args(op, mesh, placement):
    """The op's arguments: every tensor of SHAPE laid out as ``placement`` (a boolean mask for the
    condition / mask operands, a 0-d replicated value where the op takes one), scalars as the
    models pass them."""
    x = _spec(mesh, placement)
    mask = _spec(mesh, placement, dtype=torch.bool)
    scalar = _spec(mesh, Replicate(), shape=())
    return {
        aten.copy.default: (x, x), aten.fill.Scalar: (x, 0.5), aten.fill.Tensor: (x, scalar),
        aten.masked_fill.Tensor: (x, mask, scalar), aten.where.ScalarOther: (mask, x, 0.0),
        aten.where.ScalarSelf: (mask, 0.0, x), aten.lift_fresh_copy.default: (x,),
        aten.softplus_backward.default: (x, x, 1.0, 20.0), aten.elu_backward.default: (x, 1.0, 1, 1, False, x),
        aten.leaky_relu_backward.default: (x, x, 0.01, False), aten.hardswish.default: (x,),
        aten.hardswish_backward.default: (x, x), aten.hardsigmoid_backward.default: (x, x),
        aten.hardtanh_backward.default: (x, x, -1.0, 1.0), aten.mish_backward.default: (x, x),
        aten.softshrink_backward.default: (x, x, 0.5), aten.hardshrink_backward.default: (x, x, 0.5),
    }[op]


@pytest.mark.parametrize("op", elementwise_rules.OPS, ids=str)
def test_batch_sharded_operands_stay_sharded(op):
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        register_own_rules()
        assert has_rule(op)
        out, wanted = propagate_op(op, _args(op, mesh, Shard(0)), {})
    assert out.placements == (Shard(0),), out
    assert wanted is None or all(w.placements in ((Shard(0),), (Replicate(),)) and
                                 (w.placements == (Shard(0),) or w.tensor_meta.shape == ()) for w in wanted), wanted


def test_copy_broadcasts_its_source_and_keeps_a_partial_source_of_one_dtype():
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        # src broadcast over the sharded dim: read whole, the result stays sharded.
        out, wanted = propagate_op(aten.copy.default, (_spec(mesh, Shard(0)), _spec(mesh, Replicate(), (6, 8))), {})
        assert out.placements == (Shard(0),) and (wanted is None or wanted[1].placements == (Replicate(),))
        # A partial source of self's dtype stays partial (copying is linear) ...
        out, _ = propagate_op(aten.copy.default, (_spec(mesh, Replicate()), _spec(mesh, Partial())), {})
        assert out.placements == (Partial(),), out
        # ... but not through a cast: the sum of rounded partial values is not the rounded sum.
        bf16 = _spec(mesh, Replicate(), dtype=torch.bfloat16)
        out, wanted = propagate_op(aten.copy.default, (bf16, _spec(mesh, Partial())), {})
        assert not out.placements[0].is_partial() and not wanted[1].placements[0].is_partial(), (out, wanted)


@pytest.mark.parametrize("op,args", [
    (aten.softplus_backward.default, lambda g, x: (g, x, 1.0, 20.0)),
    (aten.elu_backward.default, lambda g, x: (g, 1.0, 1, 1, False, x)),
    (aten.hardswish_backward.default, lambda g, x: (g, x)),
    (aten.hardsigmoid_backward.default, lambda g, x: (g, x)),
    (aten.hardtanh_backward.default, lambda g, x: (g, x, -1.0, 1.0)),
], ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_backward_kernels_lay_their_result_out_as_captured(op, args):
    """The CPU kernel lays the result out like grad_output, fake tensors like self; the local kernel
    makes the run follow the captured layout (a later view relies on it), with the same values."""
    grad, x = torch.randn(4, 8, 6).transpose(1, 2), torch.randn(4, 6, 8)
    real = op(*args(grad, x))
    with FakeTensorMode() as fake_mode:
        captured = op(*args(fake_mode.from_tensor(grad), fake_mode.from_tensor(x)))
    assert real.stride() != captured.stride()  # the torch behaviour the kernel is for
    with fake_world(1):
        mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        spec = _spec(mesh, Replicate(), shape=(4, 6, 8))
        layout = type("Layout", (), {"output": spec})()
        kernel = elementwise_rules.local_kernel(op, layout)
        out = compat.local_of(kernel(*args(compat.dtensor_from_spec(grad, spec), compat.dtensor_from_spec(x, spec))))
    assert out.stride() == captured.stride()
    assert torch.equal(out, real)


def test_a_batched_tril_stays_sharded_on_its_leading_dims():
    """tril / triu are elementwise but for the last two dims (propagation/elementwise_rules.py):
    DTensor replicates them; a batch of matrices keeps its batch shard, and the local kernel gives
    the shard of the whole result."""
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for op in (aten.tril.default, aten.triu.default):
            out, wanted = propagate_op(op, (_spec(mesh, Shard(0), (4, 2, 8, 8)), 1), {})
            assert out.placements == (Shard(0),) and wanted is None, (op, out, wanted)
            out, _ = propagate_op(op, (_spec(mesh, Shard(2), (4, 2, 8, 8)),), {})
            assert out.placements == (Replicate(),), (op, out)  # rows: the diagonal's offset differs
    with fake_world(1):
        mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        x = torch.randn(4, 2, 8, 8)
        spec = _spec(mesh, Shard(0), (4, 2, 8, 8))
        layout = type("Layout", (), {"inputs": [spec], "output": spec})()
        kernel = elementwise_rules.local_kernel(aten.tril.default, layout)
        assert torch.equal(compat.local_of(kernel(compat.dtensor_from_spec(x, spec), -1)), torch.tril(x, -1))
