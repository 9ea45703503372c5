"""Gradient accumulation without communication for parameters no FSDP unit owns: ``model.no_sync()``.

DDP users accumulate micro-batches with ``with model.no_sync(): loss.backward()`` and let the last
backward reduce the sum. Under a data-parallel plan every backward used to all-reduce anyway (same
numbers, M times the traffic). Now the programs inside the context keep each rank's gradients
unreduced over the data-parallel axes and the first one after it adds them in before its own
bucketed all-reduce; reductions over other axes (tensor parallelism's) still run each micro-step.
Checked on transformers' Llama under DP x TP with sequence parallelism, padded labels (ranks count
different tokens), fp32 and bf16 autocast: one device's gradients, the same as reducing every
micro-step, and where the collectives sit in the compiled backward."""

import contextlib
import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.analysis.debug import group_axis_names
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.testing.parity import assert_same_step, build_model, build_plan, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper, batches, strided

MICRO = 3
c10d = torch.ops._c10d_functional
REDUCTIONS = (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default)


def _backward_reductions(model) -> dict:
    """{axis: count} of the gradient reductions (all-reduces, reduce-scatters: per parameter or
    bucketed) in the last call's backward program. Reductions of activations (a loss's token
    count, MoE routing statistics: fused "small reductions") are not counted; they are not
    gradients and run whatever no_sync says."""
    axis_of = group_axis_names(model._hp.mesh)
    counts: dict = {}
    for node in model.compiled_programs()[1].graph.nodes:
        if node.target not in REDUCTIONS:
            continue
        bucket = node.meta.get("hp_bucket", "")
        if "hp_grad_of" in node.meta or (bucket and not bucket.startswith("small reductions")):
            axis = axis_of[node.args[-1]]
            counts[axis] = counts.get(axis, 0) + 1
    return counts


def _tolerance(mixed_precision: bool) -> dict:
    """The loss: bf16 autocast rounds where the two sides' reduction orders differ; fp32 is compared
    with ``assert_close``'s defaults."""
    return {"rtol": 5e-2, "atol": 2e-3} if mixed_precision else {}


def _grads(mixed_precision: bool) -> dict:
    """Every gradient of the model (gathered whole) against one device's after the step's micro-steps
    (each loss divided by their number, both sides): equal (``assert_close`` defaults), or under bf16
    autocast (both sides' forwards) no further from the exact gradient than a few times that
    device's own error."""
    if not mixed_precision:
        return {}
    return {"forward_context": lambda: torch.autocast("cpu", dtype=torch.bfloat16), "grads": "near_exact"}


def _accumulate_then_sync(mixed_precision: bool, use_no_sync: bool) -> dict:
    """2 optimizer steps of MICRO micro-batches each (the step's loss is the mean of the
    micro-batch losses), on a (dp 2, tp 2) mesh; gradients checked against one device at the end
    of each step's accumulation."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), llama_tp_plan(sequence_parallel=True), mesh)
    reductions, grads = [], []

    @contextlib.contextmanager
    def micro_step(record, i):
        with model.no_sync() if use_no_sync and i < MICRO - 1 else contextlib.nullcontext():
            yield
        reductions.append(_backward_reductions(model))

    ParityStepper(reference, model, mesh=mesh, batch=batches(batch=8 * MICRO, ignore_fraction=0.3),
                  micro_batches=MICRO, split=strided, micro_context=micro_step, check_loss=False,
                  before_optimizer=lambda r: grads.append({n: p.grad.full_tensor().clone()
                                                           for n, p in model.named_parameters()}),
                  **_grads(mixed_precision)).run(2)
    return {"reductions": reductions, "grads": grads, "programs": len(model._hp.cache)}


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-autocast"])
def test_no_sync_skips_data_parallel_reductions(dist4, mixed_precision):
    pytest.importorskip("transformers")
    synced = dist4.run(_accumulate_then_sync, mixed_precision, False)[0]
    skipped = dist4.run(_accumulate_then_sync, mixed_precision, True)[0]
    every = synced["reductions"]
    # Reducing every micro-step: each backward reduces gradients over dp and over tp (sequence
    # parallelism's norm weights: partial sums over the sequence shards).
    assert all(r.get("dp", 0) > 0 and r.get("tp", 0) > 0 for r in every), every
    for i, r in enumerate(skipped["reductions"]):
        if i % MICRO < MICRO - 1:  # inside no_sync: nothing over dp, tp's unchanged
            assert r.get("dp", 0) == 0 and r.get("tp") == every[i]["tp"], (i, r, every[i])
        else:  # the synchronising backward reduces the sum in as many buckets as any step
            assert r == every[i], (i, r, every[i])
    # No-sync (first micro-step), no-sync adding the kept sums, sync adding them.
    assert skipped["programs"] == 3
    # The same numbers as reducing every micro-step (the reductions are linear).
    for a, b in zip(synced["grads"], skipped["grads"]):
        for name in a:
            torch.testing.assert_close(b[name], a[name], msg=lambda m, name=name: f"{name}: {m}")


# transformers' Mixtral with its router's auxiliary loss, through grouped experts (as
# tests/moe/test_expert_parallel.py runs it).
HF_MOE = {"experts_implementation": "batched_mm", "output_router_logits": True, "router_aux_loss_coef": 0.01}


def _plan_accumulation(model_name: str, plan: str, names: tuple, mixed_precision: bool) -> list:
    """2 optimizer steps of 2 micro-batches (the first under no_sync) on a 2 x 2 mesh, padded
    labels, fp32 or under bf16 autocast (both sides); one device's gradients after each step.
    Returns each backward's reductions by axis."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    overrides = HF_MOE if "Mixtral" in model_name else {}
    reference = build_model(model_name, num_hidden_layers=2, **overrides)
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan), mesh)
    reductions = []

    @contextlib.contextmanager
    def micro_step(record, i):
        with model.no_sync() if i == 0 else contextlib.nullcontext():
            yield
        reductions.append(_backward_reductions(model))

    # Each micro-batch's loss (/ 2) against one device's, then every gradient after the two.
    ParityStepper(reference, model, mesh=mesh, batch=batches(model_name, batch=8, ignore_fraction=0.3),
                  micro_batches=2, split=strided, micro_context=micro_step, micro_losses=True,
                  **{f"loss_{k}": v for k, v in _tolerance(mixed_precision).items()},
                  **_grads(mixed_precision)).run(2)
    return reductions




@pytest.mark.parametrize("model_name,plan,names,mixed_precision", [
    # The expert axis is a data axis for everything but the experts.
    ("hf:MixtralForCausalLM", "ep", ("dp", "ep"), False),
    ("hf:MixtralForCausalLM", "ep", ("dp", "ep"), True),
    # Gradients are partial sums over the sequence axis too.
    ("hf:LlamaForCausalLM", "cp", ("dp", "cp"), False),
    ("hf:LlamaForCausalLM", "cp", ("dp", "cp"), True),
], ids=["dp-x-ep-fp32", "dp-x-ep-bf16-autocast", "dp-x-cp-fp32", "dp-x-cp-bf16-autocast"])
def test_no_sync_under_expert_and_context_parallelism(dist4, model_name, plan, names, mixed_precision):
    pytest.importorskip("transformers")
    reductions = dist4.run(_plan_accumulation, model_name, plan, names, mixed_precision)[0]
    inside, synced = reductions[0::2], reductions[1::2]
    assert all(not r for r in inside), inside  # nothing reduced over any data axis
    assert all(r.get(a, 0) > 0 for r in synced for a in names), synced


def _abandoned_accumulation(plan: str) -> None:
    """A loop that abandons an accumulation (a skipped step: ``model.zero_grad()`` after a no-sync
    micro-step) and starts over: the kept gradients went into the next step's (DDP keeps them in
    ``.grad``, which ``zero_grad`` clears; here they are kept aside, which it did not reach)."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan), mesh)
    full = global_batch("llama", 8, 16, seed=1, ignore_fraction=0.3)
    micro = [{k: v[i::2] for k, v in full.items()} for i in range(2)]
    with model.no_sync():
        model(**local_batch(global_batch("llama", 4, 16, seed=9), mesh))["loss"].backward()
    model.zero_grad()  # abandoned
    for i, batch in enumerate(micro):
        (reference(**batch)["loss"] / 2).backward()
        with model.no_sync() if i == 0 else contextlib.nullcontext():
            loss = model(**local_batch(batch, mesh))["loss"] / 2
            loss.backward()
    assert_same_step(model, loss, reference, (reference(**micro[1])["loss"] / 2), what=plan)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_zero_grad_drops_kept_gradients(dist2, plan):
    dist2.run(_abandoned_accumulation, plan)
