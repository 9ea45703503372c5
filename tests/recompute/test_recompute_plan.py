"""Recompute / swap plan entries: resolution, validation messages, and the eager forms of
hp.checkpoint / hp.swap (torch.utils.checkpoint / save_on_cpu) on one device."""

import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
from hyper_parallel.recompute import CheckpointPolicy, resolve_activation_plan


def _model(**overrides):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**overrides))


def test_plan_entries_resolve_to_module_regions_outermost_first():
    model = _model()
    hp.checkpoint_wrapper(model.model.layers[0].mlp, policy="selective")
    plan = resolve_activation_plan({"model.layers.*": "full"}, {"lm_head": True}, model)
    keys = [(r.key, r.kind, r.policy_name) for r in plan.modules]
    assert keys[0] == ("lm_head", "swap", "all")
    assert ("model.layers.0", "recompute", "full") in keys
    assert ("model.layers.0.mlp", "recompute", "selective") in keys


@pytest.mark.parametrize(
    "recompute,swap,error,words",
    [
        ({"model.blocks.*": "full"}, None, ValueError, ["recompute['model.blocks.*']", "matches no module"]),
        ({"model.layers.*": "most"}, None, ValueError, ["unknown recompute policy", "'full', 'selective'"]),
        (["model.layers.*"], None, TypeError, ["ParallelPlan.recompute must be a dict"]),
        ({"model.layers.*": "full"}, {"model.layers.*": True}, ValueError, ["both recompute and swap", "MUST_SWAP"]),
        (None, {"model.layers.*": "yes"}, ValueError, ["swap['model.layers.0']"]),
    ],
)
def test_bad_entries_say_what_to_do(recompute, swap, error, words):
    with pytest.raises(error) as info:
        resolve_activation_plan(recompute, swap, _model())
    for word in words:
        assert word in str(info.value)


def test_policy_values_from_torch_map_onto_ours():
    from torch.utils.checkpoint import CheckpointPolicy as T

    assert CheckpointPolicy.of(T.MUST_SAVE) is CheckpointPolicy.MUST_SAVE
    assert CheckpointPolicy.of(T.PREFER_RECOMPUTE) is CheckpointPolicy.PREFER_RECOMPUTE
    assert CheckpointPolicy.of(T.MUST_CPU_OFFLOAD) is CheckpointPolicy.MUST_SWAP
    assert CheckpointPolicy.of(True) is CheckpointPolicy.MUST_SAVE
    with pytest.raises(TypeError, match="return an hp.CheckpointPolicy"):
        CheckpointPolicy.of("save")


@pytest.mark.parametrize("mode", ["checkpoint", "swap"])
def test_eager_checkpoint_and_swap_keep_single_device_numbers(mode):
    plain = _model()
    marked = copy.deepcopy(plain)
    marked.model.layer_activations = mode
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, marked):
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), marked.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_eager_selective_policy_runs_through_torch():
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return hp.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else hp.CheckpointPolicy.PREFER_RECOMPUTE

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    hp.checkpoint(lambda t: torch.relu(lin(t)), x, policy_fn=policy).sum().backward()
    assert calls and x.grad is not None
