"""``torch.autocast`` around a parallelized model, the mixed precision of DDP-style training loops.

The program is captured inside the caller's autocast region, so it holds that region's casts. It
is checked here against one device running the same loop eagerly (HF Llama, padded labels, SGD):
under autocast (bf16 on CPU) for three steps, then without it (an fp32 evaluation), then under
it again. Each state must run its own program: the cache used to ignore autocast, so the fp32
call reused the bf16 program and returned bf16 numbers, silently."""

import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.testing.parity import (
    assert_gradients_near_exact, build_model, build_plan, float64_gradients, global_batch, local_batch,
)

STEPS, LR = 3, 0.1


def _loss(out) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def _grads_close(model, reference, rtol, atol, what) -> None:
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, grads[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def _autocast_then_fp32(plan_name: str, axis: str) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    master = build_model("hf_llama")
    reference = copy.deepcopy(master)
    model = hp.parallelize(copy.deepcopy(master), build_plan(plan_name), mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (reference, model)]
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    mine = local_batch(full, mesh)

    def step(autocast: bool, what: str, rtol: float, atol: float) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref_loss, loss = _loss(reference(**full)), _loss(model(**mine))
        ref_loss.backward()
        loss.backward()
        assert loss.dtype == torch.float32, what
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"{what} loss: {m}")
        if autocast:  # each gradient against the exact one, within a few times the device's own error
            exact = float64_gradients(reference, lambda m: _loss(m(**full)).backward())
            assert_gradients_near_exact(model, exact, {n: p.grad for n, p in reference.named_parameters()},
                                        f"{what} ")
        else:
            _grads_close(model, reference, rtol, atol, f"{what} grad of")
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    for i in range(STEPS):  # bf16 compute: both sides round, at different points
        step(True, f"autocast step {i}", rtol=2e-2, atol=2e-3)
    with torch.no_grad():  # the same weights again, so the fp32 step is held to fp32's tolerance
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.full_tensor())
    step(False, "fp32 step after autocast", rtol=1e-5, atol=1e-5)
    step(True, "autocast step after fp32", rtol=2e-2, atol=2e-3)
    return {"programs": len(model._hp.cache)}


@pytest.mark.parametrize("plan,axis", [("dp", "dp"), ("fsdp", "dp_shard")])
def test_autocast_then_fp32_match_one_device(dist2, plan, axis):
    pytest.importorskip("transformers")
    for result in dist2.run(_autocast_then_fp32, plan, axis):
        assert result["programs"] == 2, result  # one per autocast state, reused when it comes back


def _pipeline_under_autocast() -> int:
    """pp=2, 1F1B over 4 micro-batches: ``step`` under autocast, then without it."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    master = build_model("llama", num_hidden_layers=4)
    reference = copy.deepcopy(master)
    plan = {"pipeline": {"split_points": ["model.layers.2"], "schedule": "1F1B", "num_microbatches": 4}}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    for autocast, rtol, atol in ((True, 2e-2, 2e-3), (False, 1e-5, 1e-5), (True, 2e-2, 2e-3)):
        what = "autocast" if autocast else "fp32 after autocast"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref_loss = _loss(reference(**full))
            loss = model.step(full)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what} loss: {m}")
        if autocast:
            exact = float64_gradients(reference, lambda m: _loss(m(**full)).backward())
            assert_gradients_near_exact(model, exact, {n: p.grad for n, p in reference.named_parameters()},
                                        f"{what} ")
        else:
            _grads_close(model, reference, rtol, atol, f"{what} grad of")
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
    return len(model._hp.pipeline.cache)


def test_pipeline_step_under_autocast(dist2):
    assert dist2.run(_pipeline_under_autocast) == [2, 2]
