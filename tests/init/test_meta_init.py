"""hyper_parallel.init without a process group: the device context managers, manual_seed, and the
errors distribute_parameters raises before it touches the mesh."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.init import InitStats, distribute_parameters, init_empty_weights, init_on_device, manual_seed
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM


def test_init_empty_weights_puts_parameters_and_buffers_on_meta_without_drawing():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with init_empty_weights() as device:
        model = LlamaForCausalLM(LlamaConfig())
        bn = nn.BatchNorm1d(4)
    assert device == torch.device("meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.is_meta  # non-persistent buffer computed in __init__
    assert all(b.is_meta for b in bn.buffers())
    assert torch.equal(torch.get_rng_state(), state), "building on meta must not consume random numbers"
    assert torch.empty(1).device.type == "cpu", "the default device is restored on exit"


def test_init_on_device_nests_and_accepts_devices():
    with init_empty_weights():
        with init_on_device(torch.device("cpu")) as device:
            real = nn.Linear(2, 2)
        meta = nn.Linear(2, 2)
    assert device == torch.device("cpu")
    assert real.weight.device.type == "cpu" and meta.weight.is_meta
    with init_on_device("meta"):
        assert torch.zeros(3).is_meta


def test_manual_seed_is_deterministic_and_checks_its_argument():
    manual_seed(123)
    a = torch.rand(4)
    manual_seed(123)
    assert torch.equal(a, torch.rand(4))
    with pytest.raises(TypeError, match="seed must be an int"):
        manual_seed(1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        manual_seed(True)


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_meta_module_without_initialiser_is_named_with_the_fix():
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), _NoReset())
    placements = {fqn: (Replicate(),) for fqn, _ in model.named_parameters()}
    # Raised before the mesh is used, so no process group is needed here.
    with pytest.raises(ValueError, match=r"module '1' \(_NoReset\) has 'gain' on the meta device") as err:
        distribute_parameters(model, placements, mesh=None)
    assert "reset_parameters()" in str(err.value) and "init_on_device('cpu')" in str(err.value)
    assert model[1].gain.is_meta and model[0].weight.is_meta, "the model is left as it was"


def test_missing_and_conflicting_placements_are_named():
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True))
    placements = {fqn: (Replicate(),) for fqn, _ in model.named_parameters()}
    with pytest.raises(ValueError, match=r"no placements for buffer 'model.rotary_emb.inv_freq'"):
        distribute_parameters(model, placements, mesh=None)
    placements["model.rotary_emb.inv_freq"] = (Replicate(),)
    placements["lm_head.weight"] = (Shard(0),)
    with pytest.raises(ValueError, match=r"tied parameter 'model.embed_tokens.weight' and 'lm_head.weight'"):
        distribute_parameters(model, placements, mesh=None)


def test_init_stats_defaults():
    stats = InitStats()
    assert stats.peak_bytes == stats.final_bytes == 0 and stats.init_hook == ""
