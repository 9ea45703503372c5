"""A transformers-Trainer-style loop, written as for one device, under FSDP on 2 ranks.

HF Llama with ``gradient_checkpointing_enable()`` (non-reentrant torch.utils.checkpoint, the
installed transformers' default), the loss computed by the caller from the returned logits on its own
rows, ``clip_grad_norm_``, AdamW, then ``save_pretrained``. Each piece had its own defect: the
checkpoint was traced through (every activation kept; the reentrant one broke capture), the
caller's per-rank loss trained with twice the gradient, and ``save_pretrained`` failed on the
sharded weights. Checked here together against one device
running the same loop: every gradient and the clipped norm at each step, and the saved weights."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.testing.parity import assert_same_step, build_model, build_plan, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper

STEPS = 3
LR = 1e-3


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _trainer_style_loop(directory: str) -> list[float]:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    reference = build_model("hf_llama")
    reference.gradient_checkpointing_enable()
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    norms = []

    def clip(record):  # after the gradients are compared, before AdamW steps
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {record.step} clipped norm: {m}")
        norms.append(norm.item())

    # The caller's loss on its own rows (not compared: the gradients are); every gradient each step.
    ParityStepper(reference, model, mesh=mesh, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
                  forward=lambda m, b: m(input_ids=b["input_ids"]),
                  loss=lambda out, b: _next_token_loss(out.logits, b["labels"]),
                  check_loss=False, rtol=1e-4, atol=1e-6, before_optimizer=clip).run(STEPS)
    model.save_pretrained(directory)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    saved = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    trained = {name: p.full_tensor() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        # save_pretrained writes exactly the weights the parallel model holds.
        torch.testing.assert_close(saved[name], trained[name], rtol=0, atol=0,
                                   msg=lambda m, n=name: f"saved {n} differs from the trained weight: {m}")
        # Those weights are one device's up to AdamW's rounding: its update m / sqrt(v) has size
        # about lr for every element, so gradients equal to rtol 1e-4 give weights equal to a
        # small fraction of lr (1.4e-6 of lr 1e-3 measured for one element of 8192), not to 1e-6.
        torch.testing.assert_close(trained[name], p, rtol=1e-5, atol=1e-2 * LR,
                                   msg=lambda m, n=name: f"trained {n}: {m}")
    return norms


def test_trainer_style_loop_matches_one_device(dist2, tmp_path):
    pytest.importorskip("transformers")
    norms = dist2.run(_trainer_style_loop, str(tmp_path))
    assert norms[0] == norms[1] and all(n > 1.0 for n in norms[0]), norms  # clipping was active


def _evaluate_first_composed(model_name: str, plan_name: str, names: tuple) -> dict:
    """The evaluation-first case on the composed plans (a 2 x 2 mesh): the forward-only program
    went through passes written for joint graphs (sequence parallelism's gathers, expert
    dispatch and combine, ring attention); its loss, then a training step's loss and every
    gradient, equal one device's."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    reference = build_model(model_name, num_hidden_layers=2)
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan_name), mesh)
    full = global_batch(model_name, 4, 16, ignore_fraction=0.3)
    with torch.no_grad():
        evaluated = model(**local_batch(full, mesh)).loss
    saved_by_evaluation = len(model._hp.last.program.saved_for_backward())
    loss = model(**local_batch(full, mesh)).loss
    loss.backward()
    ref_loss = reference(**full).loss
    ref_loss.backward()
    torch.testing.assert_close(evaluated, ref_loss.detach())
    assert_same_step(model, loss, reference, ref_loss, what=plan_name)
    return {"saved_by_evaluation": saved_by_evaluation, "programs": len(model._hp.cache)}


@pytest.mark.parametrize("model_name,plan_name,names", [
    ("hf_llama", "sp", ("dp", "tp")), ("moe", "ep", ("dp", "ep")), ("llama", "cp", ("dp", "cp")),
], ids=["dp-x-sp", "dp-x-ep", "dp-x-cp"])
def test_evaluation_before_training_composed(dist4, model_name, plan_name, names):
    if model_name.startswith("hf_"):
        pytest.importorskip("transformers")
    results = dist4.run(_evaluate_first_composed, model_name, plan_name, names)
    assert all(r == {"saved_by_evaluation": 0, "programs": 2} for r in results), results


def _evaluate_first(plan_name: str, mode: str) -> dict:
    """An evaluation before training (under ``torch.no_grad()`` or ``torch.inference_mode()``) is
    the first call, so it compiles; then training. The first call captured a program without
    backward, which training reused: ``loss.backward()`` raised that the loss needs no grad. Now
    the evaluation's program is forward-only (it keeps no activation: a frozen reference model
    stays lean) and training compiles its own; a pipeline compiles its training stages either way
    and runs only their forward steps for the evaluation."""
    plans = {"dp": ({}, "dp"), "fsdp": ({"fully_shard": {"units": ["model.layers.*", ""]}}, "dp_shard"),
             "pipeline": ({"pipeline": hp.PipelinePlan(split_points=["model.layers.1"], schedule="1F1B",
                                                         num_microbatches=2)}, "pp")}
    plan, axis = plans[plan_name]
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    mine = full if plan_name == "pipeline" else local_batch(full, mesh)
    run = (lambda: model.step(mine)) if plan_name == "pipeline" else (lambda: model(**mine).loss)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        evaluated = run()
    saved_by_evaluation = None if plan_name == "pipeline" else len(model._hp.last.program.saved_for_backward())
    loss = run()
    if plan_name != "pipeline":
        loss.backward()
    ref_loss = reference(**full).loss
    ref_loss.backward()
    torch.testing.assert_close(evaluated, ref_loss.detach())
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    grads = dict(reference.named_parameters())
    compared = 0
    for name, p in model.named_parameters():
        if p.grad is None and plan_name == "pipeline" and not p.to_local().numel():
            continue  # another stage's parameter
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")
        compared += 1
    return {"compared": compared, "saved_by_evaluation": saved_by_evaluation,
            "programs": len(model._hp.pipeline.cache if plan_name == "pipeline" else model._hp.cache)}


@pytest.mark.parametrize("plan_name,mode", [("dp", "no_grad"), ("fsdp", "inference_mode"), ("pipeline", "no_grad")])
def test_evaluation_before_training(dist2, plan_name, mode):
    pytest.importorskip("transformers")
    results = dist2.run(_evaluate_first, plan_name, mode)
    assert all(r["compared"] > 0 for r in results), results
    if plan_name == "pipeline":
        assert results[0]["programs"] == 1  # the evaluation ran the training stages' forward steps
    else:
        assert results[0]["programs"] == 2 and results[0]["saved_by_evaluation"] == 0, results
