"""Context parallelism (hp.ContextParallel, all-to-all mode): the sequence sharded over ``cp``,
attention made exact by swapping heads and sequence around it. Parity with one device (loss and
every gradient, 3 SGD steps, padded labels) for the example Llama and HF Llama, alone and composed
with data parallelism, FSDP and tensor parallelism; the all-to-alls read from the programs; errors."""

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import (assert_matches_bf16_reference, bf16_reference_step, build_model, build_plan, error_message, global_batch,
                                           local_batch, run_parity)

CP = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel()}}
BATCH, SEQ, HEADS, HEAD_DIM, FP32 = 4, 16, 4, 16, 4


def _per_layer_all_to_all_bytes(cp: int, batch: int = BATCH) -> int:
    """Forward, one attention: query, key, value and output [B, H, S/cp, D] and the log-sum-exp
    [B, H, S/cp], each this rank's input of one all-to-all (key/value repeated to the query heads
    before attention, as the example Llama and HF Llama do)."""
    local = batch * HEADS * (SEQ // cp)
    return 4 * local * HEAD_DIM * FP32 + local * FP32


@pytest.mark.parametrize("model", ["llama", "hf:LlamaForCausalLM"])
def test_cp2_parity_and_all_to_alls(dist2, model):
    """Per attention: forward moves query, key, value to head-sharded and output and log-sum-exp
    back (5 all-to-alls); backward moves the output gradient, the output and log-sum-exp to heads
    and the three gradients back (6; the head-sharded query/key/value of forward are reused).
    Nothing else crosses cp but the labels' one-token shift (a small all-gather of the integer
    labels), the loss's sum and token count, and the parameters' gradients."""
    results = dist2.run(run_parity, model, "cp", (2,), ("cp",), ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    forward, backward = collectives["forward"], collectives["backward"]
    assert forward["all_to_all"]["cp"] == {"count": 2 * 5, "bytes": 2 * _per_layer_all_to_all_bytes(2)}
    assert backward["all_to_all"]["cp"]["count"] == 2 * 6
    assert forward["all_gather"]["cp"]["bytes"] <= BATCH * SEQ * 8  # the labels, never activations
    assert "all_gather" not in backward
    assert results[0]["summary"]["fallbacks"] == []


def _attention_schedule() -> list[str]:
    """Rank 0's compiled forward, reduced to its all-to-alls and attention kernels, in order."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=2), build_plan("cp"), mesh)
    model(**local_batch(global_batch("llama", BATCH, SEQ), mesh))["loss"].backward()
    forward, _ = model.compiled_programs()
    kinds = {torch.ops._c10d_functional.all_to_all_single.default: "a2a",
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "attention"}
    return [kinds[n.target] for n in forward.graph.nodes if n.op == "call_function" and n.target in kinds]


def test_cp_all_to_alls_surround_each_attention(dist2):
    """Read from the compiled forward: each attention kernel is preceded by exactly its query, key
    and value all-to-alls and followed by its output and log-sum-exp ones, layer after layer."""
    layer = ["a2a"] * 3 + ["attention"] + ["a2a"] * 2
    assert dist2.run(_attention_schedule)[0] == layer * 2


@pytest.mark.parametrize("case", ["cp4", "dp_cp", "fsdp_cp", "tp_cp"])
def test_cp_composes(dist4, case):
    """cp=4; dp=2 x cp=2 (ranks take different rows and tokens, padded labels); FSDP over
    dp_shard x cp (dense weights sharded over all four ranks, reduce-scattered over both axes, no
    gradient all-reduce over cp); tensor parallelism x cp (heads split over tp, then over cp)."""
    plans = {
        "cp4": (CP, (4,), ("cp",)),
        "dp_cp": (CP, (2, 2), ("dp", "cp")),
        "fsdp_cp": ({**CP, "fully_shard": {"units": ["model.layers.*", ""]}}, (2, 2), ("dp_shard", "cp")),
        "tp_cp": ({**CP, **llama_tp_plan()}, (2, 2), ("cp", "tp")),
    }
    plan, shape, names = plans[case]
    results = dist4.run(run_parity, "llama", plan, shape, names, ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    assert collectives["forward"]["all_to_all"]["cp"]["count"] == 2 * 5
    if case == "fsdp_cp":
        assert collectives["backward"]["reduce_scatter"]["cp"]["count"] == 3  # one per unit
        assert "cp" not in collectives["backward"].get("all_reduce", {})


def _bf16_fsdp_cp() -> None:
    """FSDP (bf16 parameters, fp32 reduction) over dp_shard x cp against one device computing in
    bf16 from the same fp32 master weights."""
    import copy

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    master = build_model("llama", num_hidden_layers=2)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {**CP, "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    full = global_batch("llama", BATCH, SEQ, ignore_fraction=0.3)
    compute, ref_loss = bf16_reference_step(master, full)
    loss = model(**local_batch(full, mesh))["loss"]
    loss.backward()
    assert_matches_bf16_reference(model, loss, compute, ref_loss)


def test_cp_bf16_mixed_precision_fsdp(dist4):
    dist4.run(_bf16_fsdp_cp)


def _errors() -> dict:
    cp2 = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    # 3 heads of 16 dims: cp=2 cannot split them.
    odd_heads = build_model("llama", num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                            hidden_size=48)
    ring = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel(mode="ring")}}
    return {
        "unused": error_message(hp.parallelize, build_model("llama", num_hidden_layers=1), {}, cp2),
        "heads": error_message(hp.parallelize, odd_heads, build_plan("cp"), cp2),
        "ring": error_message(hp.parallelize, build_model("llama", num_hidden_layers=1), ring, cp2),
        "glob": error_message(hp.parallelize, build_model("llama", num_hidden_layers=1),
                              {"context_parallel": {"model.layers.*.attn": hp.ContextParallel()}}, cp2),
    }


def test_errors_name_the_entry_and_the_fix(dist2):
    errors = dist2.run(_errors)[0]
    assert errors["unused"].startswith("ValueError: mesh axis 'cp' (size 2) is used by no plan entry"), errors
    assert "hp.ContextParallel()" in errors["unused"]
    assert "module 'model.layers.0.self_attn' has 3 heads, which cp=2 does not divide" in errors["heads"], errors
    assert "ring attention" in errors["ring"] and "mode='all_to_all'" in errors["ring"], errors
    assert errors["glob"].startswith("ValueError: context_parallel") and "matches no module" in errors["glob"], errors
