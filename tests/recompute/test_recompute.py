"""Activation recompute as a pass: single-device parity for each policy, alone and with FSDP and
TP, and the saved set the policy promises, read from the compile summary."""

import pytest

import hyper_parallel as hp
from hyper_parallel.testing.parity import run_parity

LAYERS = 2  # build_model("llama")'s default depth
LAYER_MODULES = [f"model.layers.{i}" for i in range(LAYERS)]


def _layer_activations(summary):
    """{layer: {"count", "bytes"}} of activations saved for backward, summed over each layer's
    submodules (the modules that computed them)."""
    out = {}
    for fqn, entry in summary["saved_for_backward"]["activations_by_module"].items():
        layer = next((m for m in LAYER_MODULES if fqn == m or fqn.startswith(m + ".")), None)
        if layer is not None:
            acc = out.setdefault(layer, {"count": 0, "bytes": 0})
            acc["count"] += entry["count"]
            acc["bytes"] += entry["bytes"]
    return out


def _keep_matmuls(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy signature."""
    import torch

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return hp.CheckpointPolicy.MUST_SAVE if keep else hp.CheckpointPolicy.PREFER_RECOMPUTE


PLANS = {
    "none": {},
    "full": {"recompute": {"model.layers.*": "full"}},
    "selective": {"recompute": {"model.layers.*": "selective"}},
    "policy": {"recompute": {"model.layers.*": _keep_matmuls}},
}


_SUMMARIES: dict = {}


def _dp_summary(pool, name: str) -> dict:
    """The compile summary of ``PLANS[name]`` on 2 data-parallel ranks, after run_parity has
    checked the loss and every gradient against one device (on the workers). Computed once per
    session: several tests read the same plan's summary."""
    if name not in _SUMMARIES:
        _SUMMARIES[name] = pool.run(run_parity, "llama", PLANS[name], (2,), ("dp",))[0]["summary"]
    return _SUMMARIES[name]


@pytest.mark.parametrize("policy", ["full", "selective", "policy"])
def test_recompute_parity_and_saved_set(dist2, policy):
    none, summary = _dp_summary(dist2, "none"), _dp_summary(dist2, policy)
    saved, baseline = _layer_activations(summary), _layer_activations(none)
    total = lambda table: sum(v["bytes"] for v in table.values())  # noqa: E731
    assert total(saved) < total(baseline)
    if policy == "full":
        # Only a layer's output crosses to backward (the next layer's input, from which backward
        # recomputes that layer); everything computed inside a layer is recomputed. The last
        # layer's output is read by the final norm, which keeps what its backward needs itself.
        hidden = 2 * 16 * 64 * 4  # local batch x seq x hidden, fp32
        assert {m: saved.get(m) for m in LAYER_MODULES} == {
            **{m: {"count": 1, "bytes": hidden} for m in LAYER_MODULES[:-1]}, LAYER_MODULES[-1]: None,
        }, saved
    else:
        assert all(saved[m]["count"] > 1 for m in LAYER_MODULES), saved
    # The same collectives per step as without recompute on DP (nothing inside a layer communicates).
    assert summary["collectives_per_step"] == none["collectives_per_step"]


def test_recompute_with_fsdp_and_tensor_parallel(dist4):
    plan = {**PLANS["full"], "fully_shard": {"units": ["model.layers.*", ""]}}
    summary = dist4.run(run_parity, "llama", plan, (4,), ("dp",))[0]["summary"]
    assert summary["saved_for_backward"]["gathered_param_bytes"] == 0
    from hyper_parallel.models.plans import llama_tp_plan

    tp_plan = {**llama_tp_plan(), "recompute": {"model.layers.*": "selective"}}
    dist4.run(run_parity, "llama", tp_plan, (2, 2), ("dp", "tp"))


def test_policy_callable_and_swap(dist2):
    """A torch-style per-op policy keeping only matmuls, and swap regions (per tensor and grouped):
    parity, and the swapped values cross to backward as host copies."""
    none, policy, selective = (_dp_summary(dist2, name) for name in ("none", "policy", "selective"))
    # Keeping only matmuls keeps less than selective (which also keeps attention outputs).
    total = lambda summary: sum(v["bytes"] for v in _layer_activations(summary).values())  # noqa: E731
    assert 0 < total(policy) < total(selective) < total(none)
    swapped = {}
    for name, swap in (("per_tensor", True), ("grouped", {"group_swap": True})):
        summary = dist2.run(run_parity, "llama", {"swap": {"model.layers.*": swap}}, (2,), ("dp",))[0]["summary"]
        saved = summary["saved_for_backward"]
        # Every activation a layer saves crosses to backward as a host copy, nothing else does.
        assert saved["swapped"]["bytes"] == total(summary) == total(none)
        swapped[name] = saved["swapped"]["count"]
    per_layer = sum(v["count"] for v in _layer_activations(none).values())
    assert swapped["per_tensor"] == per_layer
    assert swapped["grouped"] < swapped["per_tensor"] and swapped["grouped"] >= LAYERS


@pytest.mark.parametrize("mode", ["checkpoint", "swap"])
def test_functional_checkpoint_and_swap_in_the_model(dist2, mode):
    """hp.checkpoint / hp.swap called by the model (LlamaConfig.layer_activations) compile like the
    plan entries; eagerly (the single-device reference) they are torch.utils.checkpoint / save_on_cpu."""
    overrides = {"layer_activations": mode}
    summary = dist2.run(run_parity, "llama", {}, (2,), ("dp",), model_overrides=overrides)[0]["summary"]
    if mode == "checkpoint":
        full = dist2.run(run_parity, "llama", PLANS["full"], (2,), ("dp",))[0]["summary"]
        assert _layer_activations(summary) == _layer_activations(full)
    else:
        plan = dist2.run(run_parity, "llama", {"swap": {"model.layers.*": True}}, (2,), ("dp",))[0]["summary"]
        assert summary["saved_for_backward"]["swapped"] == plan["saved_for_backward"]["swapped"]
        assert summary["saved_for_backward"]["swapped"]["count"] > 0


def auto_recompute_within_budget():
    """recompute='auto' fits a budget halfway between no recompute and full recompute, recomputes
    no more than full recompute, keeps parity; an infeasible budget says the smallest peak."""
    import copy

    import torch
    import torch.distributed as dist

    from hyper_parallel.testing.parity import build_model, global_batch, local_batch

    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    batch = local_batch(global_batch("llama", 4, 64), mesh)
    reference = build_model("llama", max_position_embeddings=64)

    def peak(plan, **options):
        model = hp.parallelize(copy.deepcopy(reference), plan, mesh, **options)
        model(**batch)["loss"].backward()
        return model

    none, full = (peak(PLANS[p]).compile_summary()["memory"]["peak"] for p in ("none", "full"))
    budget = (none + full) // 2
    import json
    import os
    import tempfile

    dump_dir = tempfile.mkdtemp()
    auto = peak({"recompute": "auto"}, memory_budget_bytes=budget, dump_dir=dump_dir)
    chosen = auto.compile_summary()["recompute_auto"]
    # The dump describes the chosen program (not the last candidate tried), captured once.
    folder = os.path.join(dump_dir, f"rank{dist.get_rank()}")
    with open(os.path.join(folder, "summary.json")) as f:
        dumped = json.load(f)
    assert dumped["recompute_auto"]["chosen"] == chosen["chosen"], (dumped["recompute_auto"], chosen)
    assert dumped["memory"]["peak"] == auto.compile_summary()["memory"]["peak"]
    assert sum(name.endswith("_captured.py") for name in os.listdir(folder)) == 1
    loss = auto(**batch)["loss"]
    loss.backward()
    ref_loss = reference(**global_batch("llama", 4, 64))["loss"]
    torch.testing.assert_close(loss, ref_loss)
    try:
        peak({"recompute": "auto"}, memory_budget_bytes=full // 2)
        error = ""
    except ValueError as e:
        error = str(e)
    for plan, options in (({"recompute": "auto"}, {}), ({}, {"memory_budget_bytes": budget})):
        try:
            hp.parallelize(copy.deepcopy(reference), plan, mesh, **options)
        except ValueError as e:
            error += "\n" + str(e)
    return none, full, budget, chosen, auto.compile_summary()["memory"]["peak"], error


def test_auto_recompute_fits_a_budget(dist2):
    none, full, budget, chosen, peak, error = dist2.run(auto_recompute_within_budget)[0]
    assert full < budget < none
    assert peak <= budget and chosen["estimated_peak"] <= budget
    # Something is recomputed, and never more than full recompute of every layer.
    assert chosen["chosen"] and set(chosen["chosen"]) <= set(LAYER_MODULES)
    assert chosen["chosen"] != {m: "full" for m in LAYER_MODULES}
    assert "cannot be met" in error and f"{full:,}" in error
    assert "needs parallelize(..., memory_budget_bytes=" in error
    assert "memory_budget_bytes applies to recompute='auto'" in error


@pytest.mark.parametrize("mode", ["selective", "policy", "swap", "auto"])
def test_policies_with_fsdp(dist2, mode):
    """Each policy composed with FSDP keeps single-device parity (loss and every gradient)."""
    fsdp = {"fully_shard": {"units": ["model.layers.*", ""]}}
    options = {}
    if mode == "auto":
        none = dist2.run(run_parity, "llama", fsdp, (2,), ("dp",), steps=1)[0]["summary"]["memory"]["peak"]
        full = dist2.run(run_parity, "llama", {**fsdp, **PLANS["full"]}, (2,), ("dp",), steps=1)[0]["summary"]["memory"]["peak"]
        plan, options = {**fsdp, "recompute": "auto"}, {"memory_budget_bytes": (none + full) // 2}
    elif mode == "swap":
        plan = {**fsdp, "swap": {"model.layers.*": {"group_swap": True}}}
    else:
        plan = {**fsdp, **PLANS[mode]}
    summary = dist2.run(run_parity, "llama", plan, (2,), ("dp",), parallelize_options=options)[0]["summary"]
    if mode == "auto":
        assert summary["recompute_auto"]["estimated_peak"] <= options["memory_budget_bytes"]


def _hf_gradient_checkpointing(reentrant: bool, plan_name: str) -> dict:
    """HF Llama after ``gradient_checkpointing_enable()``, reentrant torch.utils.checkpoint or not
    (transformers' default has been each): each layer's checkpoint call becomes a full-recompute
    region, so the saved set is that of ``recompute={"model.layers.*": "full"}``; one device runs
    the real torch checkpoint. Reentrant checkpointing used to break capture (it runs the layer under
    no_grad), and the non-reentrant one was traced through, keeping every activation."""
    import copy

    from hyper_parallel.testing.parity import build_model, build_plan, global_batch, local_batch
    from hyper_parallel.testing.stepper import ParityStepper, batches

    axis = "dp_shard" if plan_name == "fsdp" else "dp"
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    reference = build_model("hf_llama")
    plain = copy.deepcopy(reference)
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan_name), mesh)
    ParityStepper(reference, model, mesh=mesh, batch=batches(ignore_fraction=0.3)).run(2)
    saved = {"checkpointed": _layer_activations(model.compile_summary())}
    batch = local_batch(global_batch("llama", 4, 16), mesh)
    for name, plan in (("none", {}), ("plan_full", {"recompute": {"model.layers.*": "full"}})):
        other = hp.parallelize(copy.deepcopy(plain), {**build_plan(plan_name), **plan}, mesh)
        other(**batch).loss.backward()
        saved[name] = _layer_activations(other.compile_summary())
    return saved


@pytest.mark.parametrize("reentrant,plan", [(True, "dp"), (False, "fsdp")])
def test_hf_gradient_checkpointing_becomes_recompute(dist2, reentrant, plan):
    pytest.importorskip("transformers")
    saved = dist2.run(_hf_gradient_checkpointing, reentrant, plan)[0]
    assert saved["checkpointed"] == saved["plan_full"], saved
    total = lambda layers: sum(v["bytes"] for v in layers.values())  # noqa: E731
    assert total(saved["checkpointed"]) < total(saved["none"]) / 2, saved


def _offloaded_checkpoint(mode: str) -> dict:
    """Two blocks, each ``torch.utils.checkpoint`` inside ``save_on_cpu`` (what transformers'
    ``activation_checkpointing_enable(offload=True)`` wraps every layer in; transformers itself
    pins memory, which a CPU-only host refuses, so the blocks here call the two directly), or
    ``hp.checkpoint(swap_inputs=True)``: the same saved and swapped set, at parity with one device
    running the real save_on_cpu + checkpoint. Captured, the save_on_cpu used to be dropped: the
    region was recomputed but its inputs stayed on the device."""
    import copy

    import torch
    import torch.nn as nn
    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import checkpoint

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                        for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                if mode == "hp":
                    x = hp.checkpoint(layer, x, swap_inputs=True)
                else:
                    with save_on_cpu(pin_memory=False, device_type="cpu"):
                        x = checkpoint(layer, x, use_reentrant=mode == "reentrant")
            return x.square().mean()

    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = Blocks()
    model = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    x = torch.randn(8, 32, requires_grad=mode == "reentrant")  # reentrant needs an input that requires grad
    rank = torch.distributed.get_rank()
    reference(x).backward()
    model(x[4 * rank: 4 * rank + 4]).backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    saved = model.compile_summary()["saved_for_backward"]
    return {"bytes": saved["bytes"], "swapped": saved["swapped"]}


def test_save_on_cpu_around_checkpoint_swaps_region_inputs(dist2):
    hp_swap = dist2.run(_offloaded_checkpoint, "hp")[0]
    assert hp_swap["swapped"]["count"] > 0
    for mode in ("non_reentrant", "reentrant"):
        assert dist2.run(_offloaded_checkpoint, mode)[0] == hp_swap, mode
