"""Module attribute values a compiled program read (runtime/attribute_guards.py).

A program is captured once per input signature. What its forward read from Python besides its
inputs was baked into it: a norm's epsilon, a dropout probability, transformers'
``gradient_checkpointing`` flag set after the first step. Changed later, the cached program ran on
with the old value, silently (wrong numbers, or no recompute). Now a changed value selects or
compiles another program, at one device's numbers; ranks changing it differently get a ValueError
naming the attribute; a counter the forward advances, or a value that differs between ranks but
stays put, causes neither recompiles nor errors."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper, batches

EPS = "model.layers.0.input_layernorm.variance_epsilon"


def _set_eps(model, value) -> None:
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = value


def _changed_value_recompiles(mixed_precision: bool) -> dict:
    """DP over 2 ranks, padded labels (unequal token counts). Steps 0-2: RMSNorm epsilon 1e-6,
    0.5, back to 1e-6 (the first program again); each step at one device's loss and gradients."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    epsilons, programs = (1e-6, 0.5, 1e-6), []

    def set_eps(record):
        for m in (reference, model):
            _set_eps(m, epsilons[record.step])

    # bf16 autocast: one device's loss within bf16's precision; fp32: the loss and every gradient.
    autocast = {"forward_context": lambda: torch.autocast("cpu", dtype=torch.bfloat16), "rtol": 2e-2, "atol": 2e-2,
                "grads": None}
    stepper = ParityStepper(reference, model, mesh=mesh, batch=batches(ignore_fraction=0.3), optimizer=None,
                            before_step=set_eps, before_optimizer=lambda r: programs.append(len(model._hp.cache)),
                            **(autocast if mixed_precision else {}))
    stepper.run(len(epsilons))
    return {"programs": programs, "losses": stepper.losses[-1:]}


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-autocast"])
def test_changed_attribute_recompiles_at_parity(dist2, mixed_precision):
    pytest.importorskip("transformers")
    results = dist2.run(_changed_value_recompiles, mixed_precision)
    assert results[0]["programs"] == [1, 2, 2], results  # the third step reuses the first program
    assert results[0]["losses"] == results[1]["losses"]


def _checkpointing_enabled_after_first_step() -> dict:
    """transformers' ``gradient_checkpointing_enable()`` called after the first step: the layers
    read their ``gradient_checkpointing`` flag, so the next program recomputes them."""
    from test_recompute import _layer_activations

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    saved = []

    def enable_after_first_step(record):
        if record.step == 1:
            for m in (reference, model):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    ParityStepper(reference, model, mesh=mesh, optimizer=None, before_step=enable_after_first_step,
                  before_optimizer=lambda r: saved.append(
                      sum(v["bytes"] for v in _layer_activations(model.compile_summary()).values()))).run(2)
    return {"saved_bytes": saved}


def test_gradient_checkpointing_enabled_after_first_step(dist2):
    pytest.importorskip("transformers")
    saved = dist2.run(_checkpointing_enabled_after_first_step)[0]["saved_bytes"]
    assert saved[1] < saved[0] / 2, saved  # the layers' activations are recomputed, not kept


def _changed_on_one_rank() -> str:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("hf_llama"), {}, mesh)
    batch = local_batch(global_batch("llama", 4, 16), mesh)
    model(**batch).loss.backward()
    if dist.get_rank() == 1:
        _set_eps(model, 0.5)
    with pytest.raises(ValueError) as info:
        model(**batch)
    return str(info.value)


def test_attribute_changed_on_one_rank_is_an_error_on_every_rank(dist2):
    pytest.importorskip("transformers")
    messages = dist2.run(_changed_on_one_rank)
    for message in messages:
        assert "ranks disagree" in message and "module attribute values" in message, message
        assert f"{EPS} 1e-06 -> 0.5" in message, message  # names what rank 1 changed


class _Counting(nn.Module):
    """Reads a counter its forward advances (the compiled program runs no Python, so it never
    advances again: no recompile), a value that differs between ranks but never changes (no
    recompile, no disagreement), and a scale the test changes (a recompile)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls = 0
        self.rank_seen = dist.get_rank()
        self.scale = 1.0

    def forward(self, x):
        self.calls += 1
        _ = self.rank_seen  # read, baked, harmless: the program does not depend on it
        return (self.proj(x) * self.scale).pow(2).mean()


def _counters_and_rank_values() -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = _Counting()
    model = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    programs = []

    def scale_at_step_2(record):
        if record.step == 2:
            reference.scale = model.scale = 3.0

    # The same x every step, this rank's half of its rows; the input passed positionally.
    ParityStepper(reference, model, batch=lambda step: {"x": x}, local=lambda b: {"x": b["x"].chunk(2)[dist.get_rank()]},
                  forward=lambda m, b: m(b["x"]), optimizer=None, before_step=scale_at_step_2,
                  before_optimizer=lambda r: programs.append(len(model._hp.cache))).run(4)
    return {"programs": programs, "guarded": sorted(label for _, _, label in model._hp.attributes.guards)}


def test_counters_and_per_rank_values_neither_recompile_nor_disagree(dist2):
    results = dist2.run(_counters_and_rank_values)
    assert results[0]["programs"] == [1, 1, 2, 2], results
    guarded = results[0]["guarded"]
    assert "<root>.scale" in guarded and "<root>.rank_seen" in guarded, guarded


def _pipeline_attribute_change() -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    reference = build_model("llama", num_hidden_layers=2)
    plan = {"pipeline": hp.PipelinePlan(split_points=["model.layers.1"], schedule="1F1B", num_microbatches=2)}
    model = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    losses, programs = [], []
    for step, eps in enumerate((1e-6, 0.5)):
        for m in (reference, model):
            for module in m.modules():
                if hasattr(module, "eps"):
                    module.eps = eps
        batch = global_batch("llama", 4, 16, seed=step + 1)
        loss = model.step(batch)
        ref_loss = reference(**batch)["loss"]
        torch.testing.assert_close(loss, ref_loss.detach(), msg=lambda m, s=step: f"step {s}: {m}")
        losses.append(loss.item())
        programs.append(len(model._hp.pipeline.cache))
    return {"programs": programs, "losses": losses}


def test_pipeline_recompiles_on_a_changed_attribute(dist2):
    results = dist2.run(_pipeline_attribute_change)
    assert results[0]["programs"] == [1, 2]
    assert results[0]["losses"] == results[1]["losses"]
