"""``hp.register_sharding``: an op the propagation engine has no rule for runs replicated (listed
under ``fallbacks``, its inputs gathered); with a registered rule it runs on the shards, at parity
with one device and with no collective beyond the plan's.

The op is a ``torch.library`` custom op (a scaled SiLU, elementwise) with its backward as a second
custom op, wired by ``register_autograd``: the way a custom autograd function enters a compiled
program as single nodes. A two-layer MLP under Megatron tensor parallelism puts it between the
column-parallel and the row-parallel linear, where its input is sharded on the hidden dim."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.testing.parity import assert_same_step


@torch.library.custom_op("hp_test::scaled_silu", mutates_args=())
def scaled_silu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return alpha * F.silu(x)


@scaled_silu.register_fake
def _(x, alpha):
    return torch.empty_like(x)


@torch.library.custom_op("hp_test::scaled_silu_backward", mutates_args=())
def scaled_silu_backward(grad: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    s = torch.sigmoid(x)
    return grad * alpha * s * (1 + x * (1 - s))


@scaled_silu_backward.register_fake
def _(grad, x, alpha):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha = inputs[1]


def _backward(ctx, grad):
    return scaled_silu_backward(grad, ctx.saved_tensors[0], ctx.alpha), None


scaled_silu.register_autograd(_backward, setup_context=_setup)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x, target):
        out = self.down(scaled_silu(self.up(x), 0.5))
        return F.mse_loss(out, target)


PLAN = {"tensor_parallel": {"up": "colwise", "down": "rowwise"}}


def _elementwise(x, alpha):
    """Any dim sharded in, the same dim out; or everything replicated."""
    return [([Replicate()], [Replicate(), None])] + [([Shard(d)], [Shard(d), None]) for d in range(x.ndim)]


def _elementwise_backward(grad, x, alpha):
    return [([Replicate()], [Replicate(), Replicate(), None])] + [
        ([Shard(d)], [Shard(d), Shard(d), None]) for d in range(x.ndim)]


def _train(rules: bool) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    if rules:
        hp.register_sharding(torch.ops.hp_test.scaled_silu.default, _elementwise)
        hp.register_sharding(torch.ops.hp_test.scaled_silu_backward.default)(_elementwise_backward)
    torch.manual_seed(0)
    reference = MLP()
    model = hp.parallelize(copy.deepcopy(reference), PLAN, mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        loss, ref_loss = model(x, target), reference(x, target)
        loss.backward()
        ref_loss.backward()
        assert_same_step(model, loss, reference, ref_loss, f"step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
    summary = model.compile_summary()
    return {"fallbacks": summary["fallbacks"], "collectives": summary["collectives_per_step"]}


def _without_then_with_rules() -> tuple[dict, dict]:
    # One worker process: the registration is global, so "without" must run first.
    return _train(rules=False), _train(rules=True)


def test_custom_op_runs_replicated_without_a_rule_and_sharded_with_one(dist2):
    for without, with_rule in dist2.run(_without_then_with_rules):
        assert any("hp_test.scaled_silu.default" in f for f in without["fallbacks"]), without["fallbacks"]
        assert any("hp_test.scaled_silu_backward.default" in f for f in without["fallbacks"])
        assert "all_gather" in without["collectives"]  # the sharded input gathered for the fallback
        assert with_rule["fallbacks"] == []
        # Megatron's only: the row-parallel output's all-reduce (the input needs no gradient).
        assert with_rule["collectives"] == {"all_reduce": {"tp": {"count": 1, "bytes": 8 * 16 * 4}}}, \
            with_rule["collectives"]


def test_register_sharding_errors():
    import pytest

    op = torch.ops.hp_test.scaled_silu.default
    with pytest.raises(TypeError, match="not an op overload"):
        hp.register_sharding(scaled_silu, [([Replicate()], [Replicate(), None])])
    with pytest.raises(ValueError, match=r"1 output\(s\) and 2 argument\(s\) \(x, alpha\)"):
        hp.register_sharding(op, [([Replicate()], [Replicate()])])
    with pytest.raises(TypeError, match="use Shard"):
        hp.register_sharding(op, [([Replicate()], ["S(0)", None])])
