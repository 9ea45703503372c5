"""``testing.parity.assert_bf16_gradients_near_exact``: the bound the Inductor mixed-precision parity
test holds gradients to must pass a correct bf16 step and fail a wrong one."""

from __future__ import annotations

import copy

import pytest
import torch

from hyper_parallel.testing.parity import assert_bf16_gradients_near_exact, build_model, global_batch


def _bf16_step(master):
    """A bf16 copy of ``master`` (fp32 weights) with its gradients, cast to fp32 as a mixed-precision
    step reduces them, and the batch."""
    batch = global_batch("llama", 4, 16, ignore_fraction=0.3)
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    compute(**batch)["loss"].backward()
    for p, cp in zip(master.parameters(), compute.parameters()):
        p.grad = cp.grad.float()
    return batch


def test_one_bf16_device_is_within_the_bound():
    master = build_model("llama")
    batch = _bf16_step(master)
    assert_bf16_gradients_near_exact(master, build_model("llama"), batch)


@pytest.mark.parametrize("wrong", ["scaled by 1.03", "one gradient halved"])
def test_a_wrong_gradient_is_not(wrong):
    master = build_model("llama")
    batch = _bf16_step(master)
    if wrong == "scaled by 1.03":  # e.g. a loss divided by a slightly wrong token count
        for p in master.parameters():
            p.grad.mul_(1.03)
    else:  # e.g. a reduction over half the ranks
        master.lm_head.weight.grad.mul_(0.5)
    with pytest.raises(AssertionError, match="from the exact gradient"):
        assert_bf16_gradients_near_exact(master, build_model("llama"), batch)

