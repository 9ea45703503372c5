"""Dropout under parallel plans (HF GPT-2, whose dropouts default to 0.1: the usual fine-tuning
model with dropout on).

Under tensor parallelism GPT-2's residual and embedding dropouts act on values replicated over
``tp`` (the attention too when its fused ``c_attn`` is split by contiguous columns: its output is
then gathered), so every rank computes them and must drop the same elements. Two defects lived
here:

* attention dropout failed to lower (``InternalError`` at the attention backward's ``bmm``): specs
  hyper_parallel rebuilt from placements alone read a ``_StridedShard`` another way than the spec
  DTensor's view rule made (``compat.respec``);
* ranks seeded differently (``torch.manual_seed(seed + rank)``) dropped different elements of the
  replicated values: the tp ranks returned different losses and trained on a mix of activations,
  with no error. The ranks of a replicated random op now draw from one state, the axis's first
  rank's (runtime/random_state.py).

The oracle: one device seeded as rank 0, with every rank seeded differently, over three SGD steps
(loss and every gradient), and the losses of tp peers equal under FSDP x TP in bf16."""

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import assert_same_step, build_model, global_batch, local_batch

pytest.importorskip("transformers")

DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
STEPS, LR = 3, 0.1


def _tp_plan(attention_replicated: bool = False) -> dict:
    """hf_zoo's GPT-2 plan (q, k and v split per head: the attention and its dropout sharded over
    tp), or with ``c_attn`` split by contiguous columns, which makes the attention gather and run
    replicated: then every random op is replicated and one device's numbers are the oracle."""
    from torch.distributed.tensor import Shard

    from hyper_parallel.models.hf_zoo import gpt2_tp_layouts

    layouts = gpt2_tp_layouts()
    if attention_replicated:
        layouts["transformer.h.*.attn.c_attn"] = {"parameter": {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}}
    return {"layouts": layouts}


def _tp_dropout_against_one_device() -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    reference = build_model("hf_gpt2", **DROPOUT)
    model = hp.parallelize(copy.deepcopy(reference), _tp_plan(attention_replicated=True), mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (reference, model)]
    losses = []
    # Seeded once: each step draws on from where the last left off (rank 0's stream must advance
    # as one device's does, also when its peers borrow its state).
    reference_generator = torch.Generator().manual_seed(1000)  # rank 0's seed
    torch.manual_seed(1000 + dist.get_rank())  # every rank its own
    for step in range(STEPS):
        batch = global_batch("llama", 4, 16, seed=step + 1)
        mine = torch.get_rng_state()
        torch.set_rng_state(reference_generator.get_state())
        ref = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        reference_generator.set_state(torch.get_rng_state())
        torch.set_rng_state(mine)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        ref.backward()
        loss.backward()
        assert_same_step(model, loss, reference, ref, f"step {step}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # Eval: no dropout, so no random op and no agreement on generator states.
    model.eval()
    model(input_ids=batch["input_ids"], labels=batch["labels"])
    return {"losses": losses, "train_axes": model._hp.cache[next(iter(model._hp.cache))].random_axes,
            "eval_axes": model._hp.last.random_axes}


def test_replicated_dropout_draws_as_one_device_with_per_rank_seeds(dist2):
    results = dist2.run(_tp_dropout_against_one_device)
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["train_axes"] == ("tp",)
    assert results[0]["eval_axes"] == ()


def _fsdp_tp_bf16_dropout() -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {**_tp_plan(), "fully_shard": {"units": ["transformer.h.*", ""], "mixed_precision": policy}}
    model = hp.parallelize(build_model("hf_gpt2", **DROPOUT), plan, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(2):
        # Unequal token counts per dp rank (padded labels), a seed per rank.
        mine = local_batch(global_batch("llama", 4, 16, seed=step + 1, ignore_fraction=0.3), mesh)
        torch.manual_seed(7 + 10 * step + dist.get_rank())
        loss = model(input_ids=mine["input_ids"], labels=mine["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "axes": model._hp.last.random_axes, "coords": mesh.get_coordinate()}


def test_fsdp_tp_bf16_dropout_agrees_over_tp(dist4):
    results = dist4.run(_fsdp_tp_bf16_dropout)
    # The dp axis holds other rows (sharded dropout draws per rank); tp peers hold the same values.
    assert {r["axes"] for r in results} == {("tp",)}
    by_dp: dict = {}
    for r in results:
        by_dp.setdefault(r["coords"][0], []).append(r["losses"])
    for dp_rank, peers in by_dp.items():
        assert peers[0] == peers[1], f"tp peers of dp rank {dp_rank} returned different losses: {peers}"


def _dp_dropout_axes() -> tuple:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("hf_gpt2", **DROPOUT), {}, mesh)
    mine = local_batch(global_batch("llama", 4, 16, seed=1), mesh)
    model(input_ids=mine["input_ids"], labels=mine["labels"]).loss.backward()
    return model._hp.last.random_axes


def test_batch_sharded_dropout_needs_no_agreement(dist2):
    # Every dropout acts on this rank's rows: nothing to agree on, no exchange per call.
    assert dist2.run(_dp_dropout_axes) == [(), ()]


def _pipeline_tp_dropout(peer_seeds: bool) -> dict:
    """GPT-2 on pp=2 x tp=2, 2 micro-batches; ``peer_seeds``: tp peers seeded alike (each stage's
    first rank's seed), else every rank its own."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    plan = {**_tp_plan(), "pipeline": hp.PipelinePlan(split_points=["transformer.h.1"], schedule="1F1B",
                                                       num_microbatches=2)}
    # Untied head: a parameter lives in one stage.
    model = hp.parallelize(build_model("hf_gpt2", tie_word_embeddings=False, **DROPOUT), plan, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank = dist.get_rank()
    results = []
    for step in range(2):
        torch.manual_seed(10 * step + (rank - rank % 2 if peer_seeds else rank))
        loss = model.step(global_batch("llama", 4, 16, seed=step + 1))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results.append((loss.item(), grads))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"results": results, "axes": model._hp.pipeline.last.random_axes}


def test_pipeline_tp_dropout_agrees_over_tp(dist4):
    """Every rank seeded alone trains as tp peers seeded alike: the stage programs' replicated
    dropout draws from the stage's first rank's state on both tp ranks."""
    alike = dist4.run(_pipeline_tp_dropout, True)
    apart = dist4.run(_pipeline_tp_dropout, False)
    assert {r["axes"] for r in apart} == {("tp",)}
    for rank, (a, b) in enumerate(zip(alike, apart)):
        for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(a["results"], b["results"])):
            assert loss_a == loss_b, f"rank {rank} step {step}: {loss_a} vs {loss_b}"
            for name, g in grads_a.items():
                assert torch.equal(g, grads_b[name]), f"rank {rank} step {step} grad of {name}"
