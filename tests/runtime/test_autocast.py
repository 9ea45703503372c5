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
from hyper_parallel.testing.parity import build_model, build_plan, global_batch
from hyper_parallel.testing.stepper import ParityStepper, sgd

STEPS, LR = 3, 0.1


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


# bf16 compute: both sides round, at different points: the loss within bf16's tolerances, each
# gradient against the exact one, within a few times the device's own error.
AUTOCAST = {"forward_context": _bf16_autocast, "rtol": 2e-2, "atol": 2e-3, "grads": "near_exact"}
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _autocast_then_fp32(plan_name: str, axis: str) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    master = build_model("hf_llama")
    reference = copy.deepcopy(master)
    model = hp.parallelize(copy.deepcopy(master), build_plan(plan_name), mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)

    def fp32_loss(record):
        assert record.loss.dtype == torch.float32, f"step {record.step}"

    stepper = ParityStepper(reference, model, mesh=mesh, batch=lambda step: full, optimizer=sgd(LR),
                            after_backward=fp32_loss)
    for _ in range(STEPS):  # steps 0-2 under autocast
        stepper.step(**AUTOCAST)
    with torch.no_grad():  # the same weights again, so the fp32 step is held to fp32's tolerance
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.full_tensor())
    stepper.step(**FP32)  # step 3: fp32 after autocast
    stepper.step(**AUTOCAST)  # step 4: autocast after fp32
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
    # The whole batch on every pp rank; ``step`` (forward and backward) inside the autocast region;
    # no optimizer: the gradients are dropped after each step.
    stepper = ParityStepper(reference, model, batch=lambda step: full, optimizer=None,
                            forward=lambda m, b: m.step(b), backward_in_forward=True)
    for settings in (AUTOCAST, FP32, AUTOCAST):
        stepper.step(**settings)
    return len(model._hp.pipeline.cache)


def test_pipeline_step_under_autocast(dist2):
    assert dist2.run(_pipeline_under_autocast) == [2, 2]
