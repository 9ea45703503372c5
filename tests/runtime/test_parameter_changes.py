"""Parameters changed between calls: frozen or unfrozen (staged fine-tuning: a frozen backbone
first), or cast (``model.to(torch.bfloat16)`` to evaluate after training).

The program computes gradients for the parameters that required them when it was captured, in the
dtypes they had then. The cache used to ignore both: a parameter unfrozen after the first call
silently got no gradient and never trained, and a cast model failed inside the program ("expected
scalar type Float but found BFloat16"). Now both select the program; each state is checked against
one device. A pipeline, whose ranks capture the stages they do not hold with the values of the
first step, refuses either change on every rank."""

import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, build_plan, error_message, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper


def _set_frozen(models, frozen_prefixes) -> None:
    for m in models:
        for name, p in m.named_parameters():
            p.requires_grad_(not name.startswith(frozen_prefixes))


def _freeze_unfreeze(model_name: str, plan_name: str, axis: str) -> int:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    reference = build_model(model_name)
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan_name), mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    # Frozen embedding and first layer; everything trainable; the head frozen.
    frozen = (("model.embed_tokens", "model.layers.0."), (), ("lm_head",))
    # Each step: the loss, every trainable gradient, none for a frozen parameter on either side.
    ParityStepper(reference, model, mesh=mesh, batch=lambda step: full, optimizer=None,
                  before_step=lambda r: _set_frozen((reference, model), frozen[r.step])).run(len(frozen))
    return len(model._hp.cache)


@pytest.mark.parametrize("model,plan,axis", [("llama", "dp", "dp"), ("hf_llama", "fsdp", "dp_shard")])
def test_unfrozen_parameters_get_their_gradients(dist2, model, plan, axis):
    if model.startswith("hf"):
        pytest.importorskip("transformers")
    assert dist2.run(_freeze_unfreeze, model, plan, axis) == [3, 3]  # one program per frozen set


def _cast_after_training(plan_name: str, axis: str) -> int:
    """A training step in fp32, then evaluation in bf16, then fp32 again: each against one device."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan_name), mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    for dtype, tolerance in ((torch.float32, {}), (torch.bfloat16, {"rtol": 1e-2, "atol": 1e-2}), (torch.float32, {})):
        for m in (reference, model):
            m.to(dtype)
        with torch.no_grad():
            loss, ref_loss = model(**local_batch(full, mesh)).loss, reference(**full).loss
        torch.testing.assert_close(loss, ref_loss.float(), **tolerance, msg=lambda m, d=dtype: f"{d}: {m}")
    return len(model._hp.cache)


@pytest.mark.parametrize("plan,axis", [("dp", "dp"), ("fsdp", "dp_shard")])
def test_cast_model_compiles_its_own_program(dist2, plan, axis):
    pytest.importorskip("transformers")
    assert dist2.run(_cast_after_training, plan, axis) == [2, 2]  # fp32 and bf16, the first reused


def _pipeline_unfreeze() -> str:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    model = build_model("llama", num_hidden_layers=4)
    model.model.layers[0].requires_grad_(False)
    plan = {"pipeline": {"split_points": ["model.layers.2"], "schedule": "1F1B", "num_microbatches": 2}}
    model = hp.parallelize(model, plan, mesh)
    batch = global_batch("llama", 2, 16)
    model.step(batch)
    for p in model.parameters():  # only the rank holding layer 0 sees a change
        p.requires_grad_(True)
    return error_message(lambda: model.step(batch))


def test_pipeline_refuses_a_requires_grad_change(dist2):
    for message in dist2.run(_pipeline_unfreeze):
        assert "requires_grad or dtype changed on 'model.layers.0." in message and "pipeline" in message, message
