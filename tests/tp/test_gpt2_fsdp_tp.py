"""HF GPT-2 under FSDP x TP on a 2 x 2 mesh, with column-parallel Conv1D weights *and* biases
(issue 13): single-device parity of the loss and every gradient over 3 SGD steps, with the bucketing
pass on. GPT-2's Conv1D weight is [in, out], so c_attn / c_fc colwise are weight Shard(1) + bias
Shard(0) over tp, c_proj rowwise weight Shard(0) (plan "gpt2_fsdp_tp" of testing/parity.py).

In block 1 this plan reduces c_attn.weight's gradient over dp then tp and c_proj.weight's over tp
then dp, in one FSDP unit: bucketing used to fuse each axis's reduce-scatters into one collective
and so built a cycle (AssertionError); it now cuts the tp bucket in two."""

import pytest

from hyper_parallel.testing.parity import run_parity

pytest.importorskip("transformers")

UNITS = 3  # transformer.h.0, transformer.h.1 and the root (embeddings, final norm)


def _count(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {}).get("count", 0)


def test_gpt2_fsdp_tp_column_split_conv1d(dist4):
    # labels = input_ids (no -100): every rank counts the same number of tokens.
    results = dist4.run(run_parity, "hf_gpt2", "gpt2_fsdp_tp", (2, 2), ("dp", "tp"), steps=3, batch=4, seq_len=16)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    summary = results[0]["summary"]
    # FSDP fusion is kept where it is sound: one all-gather per unit forward and backward, one
    # reduce-scatter per unit over dp (the cut bucket is the tp one).
    assert _count(summary, "forward", "all_gather", "dp") == UNITS
    assert _count(summary, "backward", "all_gather", "dp") == UNITS
    assert _count(summary, "backward", "reduce_scatter", "dp") == UNITS


def _mixed_precision_step() -> dict:
    """bf16 parameters, fp32 reduction: hf_zoo's plan splits c_attn per third of q, k, v over tp
    (``_StridedShard(split_factor=3)``), so its bias, a 1-D strided shard FSDP cannot nest its own
    shard in, stays in its unit stored as computed (cast with the unit, its gradient all-reduced
    over dp): against one device computing in bf16 from the same fp32 weights, two steps."""
    import copy

    import torch

    import hyper_parallel as hp
    from hyper_parallel.testing.parity import build_model, build_plan, mixed_precision_steps

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = build_plan("gpt2_fsdp_tp")
    plan["fully_shard"]["mixed_precision"] = policy
    master = build_model("hf_gpt2")
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    mixed_precision_steps(master, model, mesh, steps=2)
    return model.compile_summary()["collectives"]["backward"]


def test_gpt2_fsdp_tp_mixed_precision(dist4):
    backward = dist4.run(_mixed_precision_step)[0]
    assert _count({"collectives": {"backward": backward}}, "backward", "reduce_scatter", "dp") == UNITS
