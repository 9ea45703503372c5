"""fp16 mixed precision with ``torch.amp.GradScaler``, as training on fp16-only accelerators (many
Ascend and older NVIDIA parts) runs it: the scaled loss's gradients unscaled, checked for
overflow and stepped by torch's scaler on the parallel model's DTensor gradients. Under FSDP each
rank holds only a shard of every gradient, so an overflow one rank sees must make every rank skip
the step (torch's ``ShardedGradScaler`` exists for FSDP1's plain tensors; DTensor gradients reduce
the found-inf flag over their sharded axes)."""

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

PLANS = {"dp": {}, "fsdp": {"fully_shard": {"units": ["model.layers.*", ""]}}}


def _fp16_steps(plan_name: str) -> dict:
    """3 steps with padded labels against one device under the same autocast and scaler; at
    step 1 rank 0 alone finds an overflow in its part of one gradient (FSDP: its shard)."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("hf_llama")  # transformers' Llama
    model = hp.parallelize(copy.deepcopy(reference), PLANS[plan_name], mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    skipped = []
    for step in range(3):
        full = global_batch("llama", 4, 16, seed=step + 1, ignore_fraction=0.3)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss, loss = reference(**full)["loss"], model(**local_batch(full, mesh))["loss"]
        for scaler, l in zip(scalers, (ref_loss, loss)):
            scaler.scale(l).backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
        overflow = step == 1 and plan_name == "fsdp"
        if overflow:
            for m in (reference, model):
                grad = m.get_parameter("model.layers.0.mlp.up_proj.weight").grad
                if m is reference:
                    grad[0, 0] = float("inf")
                elif dist.get_rank() == 0:  # row 0 is in rank 0's shard only
                    grad.to_local()[0, 0] = float("inf")
        before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        for scaler, opt in zip(scalers, optimizers):
            scaler.step(opt)
            scaler.update()
        stepped = any(not torch.equal(p.detach().full_tensor(), before[n]) for n, p in model.named_parameters())
        skipped.append(not stepped)
        assert scalers[1].get_scale() == scalers[0].get_scale(), step
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach().full_tensor(), ref_params[name].detach(), rtol=1e-3, atol=1e-4,
                                       msg=lambda m, name=name: f"step {step} {name}: {m}")
        for opt in optimizers:
            opt.zero_grad()
    return {"skipped": skipped, "scale": scalers[1].get_scale()}


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_grad_scaler_fp16_matches_one_device(dist2, plan_name):
    pytest.importorskip("transformers")
    results = dist2.run(_fp16_steps, plan_name)
    assert results[0] == results[1], results  # every rank skipped (or stepped) alike
    expected = [False, True, False] if plan_name == "fsdp" else [False, False, False]
    assert results[0]["skipped"] == expected, results
