"""Parity with the single-device run (loss and every gradient, 3 SGD steps) for each plan of issue 2,
plus the collective structure each plan must compile to (read from the compile summary)."""

import pytest

from hyper_parallel.testing.parity import run_parity


def _counts(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {}).get("count", 0)


NUM_LAYERS = 2  # build_model("llama")'s default depth


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_data_parallel_2_ranks(dist2, model):
    results = dist2.run(run_parity, model, "dp", (2,), ("dp",))
    summary = results[0]["summary"]
    # All gradients fit one 25 MB bucket: one all-reduce.
    assert _counts(summary, "backward", "all_reduce", "dp") == 1
    # Forward: the global loss; cross-entropy's mean also needs the global count of non-ignored
    # tokens (reduced in forward and reused by backward), packed with the summed loss in one.
    assert _counts(summary, "forward", "all_reduce", "dp") == 1


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_tied_embedding_and_head(dist2, plan):
    """A weight shared by the embedding and the output head is one parameter (named as
    named_parameters() names it): its gradient sums both uses, as on one device."""
    results = dist2.run(run_parity, "llama", plan, (2,), ("dp",), model_overrides={"tie_word_embeddings": True})
    assert results[0]["losses"] == results[1]["losses"]


def test_data_parallel_gradient_buckets(dist2):
    """bucket_cap_mb cuts the gradient all-reduces like DDP (here with one bucket in flight while
    backward goes on, as on NCCL by default); without the bucketing pass there is one per
    parameter. Both keep single-device numbers (run_parity checks every gradient), with padded
    labels, so the two ranks count different numbers of tokens."""
    grad_bytes = 106_816 * 4  # the example Llama's parameters at 2 layers, fp32
    small = dist2.run(run_parity, "llama", "dp", (2,), ("dp",), ignore_fraction=0.3,
                      parallelize_options={"bucket_cap_mb": 0.25, "reductions_in_flight": 1})
    summary = small[0]["summary"]["collectives"]["backward"]["all_reduce"]["dp"]
    assert summary["count"] == -(-grad_bytes // (256 * 1024))  # ceil(bytes / cap) buckets
    assert summary["bytes"] == grad_bytes
    unfused = dist2.run(run_parity, "llama", "dp", (2,), ("dp",), disable_passes=("bucketing",))
    # One per parameter: 9 per layer, then the embedding, the final norm and the head.
    assert _counts(unfused[0]["summary"], "backward", "all_reduce", "dp") == NUM_LAYERS * 9 + 3


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_data_parallel_4_ranks(dist4, model):
    dist4.run(run_parity, model, "dp", (4,), ("dp",))


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_tensor_parallel(dist2, dist4, tp):
    pool = {2: dist2, 4: dist4}[tp]
    # tp=4 needs as many key/value heads as ranks: 2 kv heads cannot be split 4 ways.
    results = pool.run(run_parity, "llama", "tp", (tp,), ("tp",),
                       model_overrides={"num_key_value_heads": 4} if tp == 4 else None)
    summary = results[0]["summary"]
    # Megatron: 2 all-reduces per layer forward (o_proj, down_proj) + the vocab-parallel embedding;
    # backward mirrored (attention and MLP block inputs) + the lm_head input. The cross-entropy runs
    # on the vocab-sharded logits: + the log-softmax's per-token max and exp-sum and the loss's
    # partial sum forward, + the log-softmax backward's per-token sum.
    assert _counts(summary, "forward", "all_reduce", "tp") == 2 * NUM_LAYERS + 1 + 3
    assert _counts(summary, "backward", "all_reduce", "tp") == 2 * NUM_LAYERS + 1 + 1
    # The logits are never gathered: not for the loss, not for the caller (a vocab-sharded DTensor).
    assert _counts(summary, "forward", "all_gather", "tp") == 0
    assert summary["fallbacks"] == []


def test_turning_cse_off_keeps_numerics(dist2):
    # run_parity asserts loss and gradients against the single device at every step.
    results = dist2.run(run_parity, "llama", "tp", (2,), ("tp",), disable_passes=("cse",))
    assert _counts(results[0]["summary"], "forward", "all_reduce", "tp") == 2 * NUM_LAYERS + 1 + 3


def test_sequence_parallel(dist2):
    results = dist2.run(run_parity, "llama", "sp", (2,), ("tp",))
    summary = results[0]["summary"]
    # Forward per layer: all-gather before attention and MLP, reduce-scatter after them; plus the
    # embedding's reduce-scatter and the final norm's all-gather (+ logits gathered for the loss).
    assert _counts(summary, "forward", "reduce_scatter", "tp") == 2 * NUM_LAYERS + 1
    assert _counts(summary, "forward", "all_gather", "tp") == 2 * NUM_LAYERS + 2
    # Backward mirrored: reduce-scatter where forward gathered and vice versa.
    assert _counts(summary, "backward", "all_gather", "tp") == 2 * NUM_LAYERS + 1
    assert _counts(summary, "backward", "reduce_scatter", "tp") == 2 * NUM_LAYERS + 1
    # The replicated norm weights see a partial gradient from each sequence shard: all-reduced,
    # in one gradient bucket.
    assert _counts(summary, "backward", "all_reduce", "tp") == 1


def test_2d_data_and_tensor_parallel(dist4):
    results = dist4.run(run_parity, "llama", "tp", (2, 2), ("dp", "tp"))
    summary = results[0]["summary"]
    # + the vocab-parallel loss's per-token max and exp-sum and the loss's partial sum.
    assert _counts(summary, "forward", "all_reduce", "tp") == 2 * NUM_LAYERS + 1 + 3
    assert summary["fallbacks"] == []


@pytest.mark.parametrize("model,plan,names", [("llama", "tp", ("dp", "tp")), ("hf_llama", "fsdp_tp", ("dp_shard", "tp"))])
def test_batch_of_one_on_a_data_axis_of_one(dist2, model, plan, names):
    """Long-context runs train on one sequence per step, on meshes whose data axis has one rank.
    Inputs were Shard(0) there, a sharded batch dim of one that DTensor's view rules refuse to
    flatten ([1, S, H] -> [S, H]): the compile failed in the first linear layer."""
    if model.startswith("hf"):
        pytest.importorskip("transformers")
    results = dist2.run(run_parity, model, plan, (1, 2), names, batch=1)
    assert results[0]["summary"]["fallbacks"] == []


def test_hf_llama_tensor_parallel(dist2):
    pytest.importorskip("transformers")
    results = dist2.run(run_parity, "hf_llama", "tp", (2,), ("tp",))
    assert results[0]["summary"]["fallbacks"] == [], results[0]["summary"]["fallbacks"]


def test_adamw_tracks_reference_loss(dist2):
    results = dist2.run(run_parity, "llama", "tp", (2,), ("tp",), optimizer="adamw", loss_rtol=1e-4)
    assert len(results[0]["losses"]) == 3


def test_uneven_heads_error_names_the_node(dist4):
    # 2 key/value heads on tp=4: the head split is uneven; the error names the view and the fix.
    with pytest.raises(ValueError, match=r"(?s)cannot shard node 'view.*self_attn.*key-value heads"):
        dist4.run(run_parity, "llama", "tp", (4,), ("tp",), steps=1)


def _step_without_pipeline():
    import copy

    import torch

    import hyper_parallel as hp
    from hyper_parallel.testing.parity import build_model, error_message, global_batch, local_batch

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("llama")
    pmodel = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    full = global_batch("llama", 4, 16)
    loss = pmodel.step(local_batch(full, mesh))
    ref_loss = reference(**full)["loss"]
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert not loss.requires_grad
    ref = dict(reference.named_parameters())
    for name, p in pmodel.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref[name].grad)
    return error_message(pmodel.step, local_batch(full, mesh), full["labels"])


def test_step_without_a_pipeline(dist2):
    """pmodel.step(inputs) is forward + backward for any plan; targets need loss_fn (pipelines)."""
    for message in dist2.run(_step_without_pipeline):
        assert "targets are for parallelize(..., loss_fn=...)" in message, message
