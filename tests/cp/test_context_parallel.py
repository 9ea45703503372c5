"""Context parallelism: the sequence sharded over ``cp``, attention made exact around it.

Every mode: all-to-all (``hp.ContextParallel()``: heads and sequence swapped around each
attention), ring (``hp.ContextParallel(mode="ring")``: K/V blocks around the cp ring, with and
without the load-balanced causal order; ``hp.AsyncContextParallel()``: each transfer overlapping
the current block) and all-gather (``mode="all_gather"``: the ring's blocks gathered at once).
Parity with one device (loss and every gradient, 3 SGD steps, padded labels) for the example Llama
and HF Llama, alone and composed with data parallelism, FSDP (fp32 and bf16), tensor parallelism
and a pipeline; the collectives counted and read from the programs; the per-rank attention work
(also under transformers' padded causal mask); errors."""

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.ir import meta
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import (assert_matches_bf16_reference, bf16_reference_step, build_model, build_plan,
                                           error_message, global_batch, local_batch, run_parity, run_pipeline_parity)

ATTENTION = "model.layers.*.self_attn"
STYLES = {
    "all_to_all": hp.ContextParallel(),
    "ring": hp.ContextParallel(mode="ring"),
    "ring_flat": hp.ContextParallel(mode="ring", load_balance=False),
    "async": hp.AsyncContextParallel(),
    "hybrid": hp.AsyncContextParallel(ulysses_degree=2),  # cp=4: 2 Ulysses groups of 2 on a ring of 2
    "gather": hp.ContextParallel(mode="all_gather"),
    "gather_flat": hp.ContextParallel(mode="all_gather", load_balance=False),
    "async_gather": hp.AsyncContextParallel(mode="all_gather"),
}
BATCH, SEQ, HEADS, HEAD_DIM, LAYERS, FP32 = 4, 16, 4, 16, 2, 4
c10d = torch.ops._c10d_functional
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _plan(style: str, **extra) -> dict:
    return {"context_parallel": {ATTENTION: STYLES[style]}, **extra}


def _per_layer_all_to_all_bytes(cp: int, batch: int = BATCH, backward: bool = False) -> int:
    """All-to-all mode, one attention, this rank's inputs of its all-to-alls: forward query, key,
    value and output [B, H, S/cp, D] and the log-sum-exp [B, H, S/cp]; backward the output, its
    gradient, the log-sum-exp and the three gradients (forward's head-sharded query, key and
    value are reused). Key/value are repeated to the query heads before attention, as the example
    Llama and HF Llama do, so (fp32) query, key and value travel in one all-to-all and the output
    with the log-sum-exp in another: 2 per direction."""
    local = batch * HEADS * (SEQ // cp)
    return (5 if backward else 4) * local * HEAD_DIM * FP32 + local * FP32


def _kv_block_bytes(cp: int, batch: int = BATCH) -> int:
    """Ring mode: one transfer carries a rank's key and value blocks [2, B, H, S/cp, D] (fp32);
    backward's dK/dV accumulators are the same size."""
    return 2 * batch * HEADS * (SEQ // cp) * HEAD_DIM * FP32


def _check_gathered_blocks(collectives: dict, cp: int, batch: int = BATCH) -> None:
    """All-gather mode, per attention: forward gathers every rank's K/V block once (this rank
    sends its block), backward gathers them again and reduce-scatters the dK/dV shares (this rank
    sends its fp32 share of every rank's block): 1 + 2 collectives whatever ``cp``. Forward's
    other gather on the cp axis is the labels' one-token shift (integers, not activations)."""
    block = _kv_block_bytes(cp, batch)
    forward, backward = collectives["forward"], collectives["backward"]
    gathers = forward["all_gather"]["cp"]
    labels = {"count": gathers["count"] - LAYERS, "bytes": gathers["bytes"] - LAYERS * block}
    assert labels["count"] == 1 and 0 < labels["bytes"] <= BATCH * SEQ * 8, forward
    assert backward["all_gather"]["cp"] == {"count": LAYERS, "bytes": LAYERS * block}, backward
    assert backward["reduce_scatter"]["cp"] == {"count": LAYERS, "bytes": LAYERS * cp * block}, backward
    assert "send_recv" not in forward and "send_recv" not in backward


def _check_ring_transfers(collectives: dict, cp: int, batch: int = BATCH) -> None:
    """Per attention, (cp-1) K/V blocks forward; backward the K/V blocks again and (cp-1) dK/dV
    accumulators: exactly these sends, with these bytes."""
    forward, backward = collectives["forward"]["send_recv"]["cp"], collectives["backward"]["send_recv"]["cp"]
    block = _kv_block_bytes(cp, batch)
    assert forward == {"count": LAYERS * (cp - 1), "bytes": LAYERS * (cp - 1) * block}, forward
    assert backward == {"count": LAYERS * 2 * (cp - 1), "bytes": LAYERS * 2 * (cp - 1) * block}, backward


@pytest.mark.parametrize("model,style", [
    ("llama", "all_to_all"), ("hf:LlamaForCausalLM", "all_to_all"),
    ("llama", "ring"), ("llama", "ring_flat"), ("hf:LlamaForCausalLM", "async"),
    ("hf:LlamaForCausalLM", "gather"),
])
def test_cp2_parity_and_collectives(dist2, model, style):
    """All-to-all mode, per attention: forward moves query, key, value to head-sharded and output
    and log-sum-exp back (5 all-to-alls); backward the output gradient, output and log-sum-exp to
    heads and the three gradients back (6; forward's head-sharded q/k/v are reused). Ring mode:
    one K/V block forward, a K/V block and a dK/dV accumulator backward; all-gather mode one gather
    forward, one gather and one reduce-scatter backward. Nothing else crosses cp
    but the labels' one-token shift (an all-gather of the integer labels), the loss's sum and token
    count, the parameters' gradients and, with load balancing, the reordering of the inputs and the
    logits between the user's sequence order and the balanced one."""
    results = dist2.run(run_parity, model, _plan(style), (2,), ("cp",), ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": LAYERS})
    collectives = results[0]["summary"]["collectives"]
    forward, backward = collectives["forward"], collectives["backward"]
    if style == "all_to_all":
        assert forward["all_to_all"]["cp"] == {"count": LAYERS * 2, "bytes": LAYERS * _per_layer_all_to_all_bytes(2)}
        assert backward["all_to_all"]["cp"] == {"count": LAYERS * 2,
                                                "bytes": LAYERS * _per_layer_all_to_all_bytes(2, backward=True)}
        assert "send_recv" not in forward
    elif style == "gather":
        _check_gathered_blocks(collectives, 2)
        assert forward["all_to_all"]["cp"]["count"] == 2  # balanced order: ids and labels in, logits out
        return
    else:
        _check_ring_transfers(collectives, 2)
        balanced = style != "ring_flat"
        # Input ids and labels in (stacked: one shape and dtype, one all-to-all), logits out (and
        # the logits' tangent in backward), when balanced.
        assert forward.get("all_to_all", {}).get("cp", {}).get("count", 0) == (2 if balanced else 0)
    assert forward["all_gather"]["cp"]["bytes"] <= BATCH * SEQ * 8  # the labels, never activations
    assert "all_gather" not in backward
    assert results[0]["summary"]["fallbacks"] == []


@pytest.mark.parametrize("style", ["all_to_all", "ring"])
def test_cp_without_grouped_query_attention(dist2, style):
    """As many key/value heads as query heads: no repeat before attention, so the graph views the
    transposes of the key/value gradients the kernels return (laid out as one device's)."""
    dist2.run(run_parity, "llama", _plan(style), (2,), ("cp",), steps=2,
              model_overrides={"num_hidden_layers": 1, "num_key_value_heads": HEADS})


def _attention_schedule(style: str) -> dict[str, list[str]]:
    """Rank 0's compiled programs reduced to their attention kernels, all-to-alls and ring
    transfers (issue and wait), in program order; and under "why", what ``why.reason`` says of
    each K/V exchange (the dumps' ``why`` column)."""
    from hyper_parallel.analysis.why import reason

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=LAYERS), _plan(style), mesh)
    model(**local_batch(global_batch("llama", BATCH, SEQ), mesh))["loss"].backward()
    schedules = {"why": sorted({reason(n) for p in model.compiled_programs() for n in p.graph.nodes
                                if meta.CP_RING in n.meta and reason(n)})}
    for phase, program in zip(("forward", "backward"), model.compiled_programs()):
        events = []
        for node in program.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in (SDPA, SDPA_BACKWARD):
                events.append("attention")
            elif node.target is c10d.all_to_all_single.default:
                events.append(f"send {node.meta[meta.CP_RING]['moves']}" if meta.CP_RING in node.meta else "a2a")
            elif node.target in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default):
                if meta.CP_RING in node.meta:
                    verb = "gather" if node.target is c10d.all_gather_into_tensor.default else "scatter"
                    events.append(f"{verb} {node.meta[meta.CP_RING]['moves']}")
            elif node.target is c10d.wait_tensor.default and meta.CP_RING in node.args[0].meta:
                events.append(f"wait {node.args[0].meta[meta.CP_RING]['moves']}")
        schedules[phase] = [e for e in events if e != "a2a" or style == "all_to_all"]
    return schedules


def test_all_to_alls_surround_each_attention(dist2):
    """Read from the compiled forward: each attention kernel is preceded by exactly one all-to-all
    (query, key and value packed) and followed by one (output and log-sum-exp), layer after layer."""
    layer = ["a2a", "attention", "a2a"]
    assert dist2.run(_attention_schedule, "all_to_all")[0]["forward"] == layer * LAYERS


def test_async_ring_transfers_overlap_the_current_block(dist2):
    """ContextParallel(mode="ring") waits for each K/V block before the attention of the block it
    holds; AsyncContextParallel (the ring_overlap pass) waits after it, forward and backward, so
    the transfer is in flight while the current block computes. cp=2: forward is own block, then
    the received one; backward the same, then the dK/dV accumulator goes home."""
    sync, overlapped = dist2.run(_attention_schedule, "ring")[0], dist2.run(_attention_schedule, "async")[0]
    assert sync["forward"] == ["send kv", "wait kv", "attention", "attention"] * LAYERS
    assert overlapped["forward"] == ["send kv", "attention", "wait kv", "attention"] * LAYERS
    assert overlapped["backward"] == ["send kv", "attention", "wait kv", "attention", "send dkv", "wait dkv"] * LAYERS


def test_async_all_gather_overlaps_the_own_block(dist2):
    """All-gather mode gathers every block before the rank's own block's attention; with
    AsyncContextParallel the wait sinks past that attention (it needs only local K/V), forward
    and backward; backward's dK/dV shares go home in one reduce-scatter after the last block."""
    sync, overlapped = dist2.run(_attention_schedule, "gather")[0], dist2.run(_attention_schedule, "async_gather")[0]
    assert sync["forward"] == ["gather kv", "wait kv", "attention", "attention"] * LAYERS
    kernel = "_scaled_dot_product_flash_attention_for_cpu"
    gathered, home = "every rank's K/V block gathered", "dK/dV shares home"
    expected = [(f"{kernel}{layer}", gathered) for layer in ("", "_1")]
    expected += [(f"{kernel}_backward{layer}", what) for layer in ("", "_1") for what in (gathered, home)]
    assert sync["why"] == sorted(f"context parallel: all-gather attention {node}, {what}" for node, what in expected)
    assert overlapped["forward"] == ["gather kv", "attention", "wait kv", "attention"] * LAYERS
    assert overlapped["backward"] == ["gather kv", "attention", "wait kv", "attention", "scatter dkv",
                                      "wait dkv"] * LAYERS


def test_async_ring_without_ring_overlap_gives_the_same_numbers(dist2):
    """The ring_overlap pass only moves waits: disabled, the async plan still matches one device."""
    dist2.run(run_parity, "llama", _plan("async"), (2,), ("cp",), ignore_fraction=0.3, steps=2,
              model_overrides={"num_hidden_layers": 1}, disable_passes=("ring_overlap",))


CASES = {
    "a2a_cp4": ("llama", _plan("all_to_all"), (4,), ("cp",)),
    "a2a_dp_cp": ("llama", _plan("all_to_all"), (2, 2), ("dp", "cp")),
    "ring_cp4": ("llama", _plan("ring"), (4,), ("cp",)),
    "ring_flat_cp4_hf": ("hf:LlamaForCausalLM", _plan("ring_flat"), (4,), ("cp",)),
    "ring_fsdp_cp": ("llama", _plan("ring", fully_shard={"units": ["model.layers.*", ""]}), (2, 2), ("dp_shard", "cp")),
    "async_tp_cp": ("llama", _plan("async", **llama_tp_plan()), (2, 2), ("cp", "tp")),
    "hybrid_cp4_hf": ("hf:LlamaForCausalLM", _plan("hybrid"), (4,), ("cp",)),
    "gather_cp4": ("llama", _plan("async_gather"), (4,), ("cp",)),
    "gather_flat_cp4": ("llama", _plan("gather_flat"), (4,), ("cp",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_composes(dist4, case):
    """cp=4 in both modes (ring with and without load balancing); dp=2 x cp=2 (ranks take
    different rows and tokens, padded labels); FSDP over dp_shard x cp (dense weights sharded over
    all four ranks, reduce-scattered over both axes, no gradient all-reduce over cp); tensor
    parallelism x cp (heads split over tp, the ring over cp)."""
    model, plan, shape, names = CASES[case]
    results = dist4.run(run_parity, model, plan, shape, names, ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": LAYERS})
    collectives = results[0]["summary"]["collectives"]
    cp = shape[names.index("cp")]
    batch = BATCH // 2 if "dp" in names or "dp_shard" in names else BATCH
    if case.startswith("a2a"):
        assert collectives["forward"]["all_to_all"]["cp"]["count"] == LAYERS * 2
    elif case == "async_tp_cp":  # the heads are split over tp: half the block per transfer
        assert collectives["forward"]["send_recv"]["cp"]["count"] == LAYERS * (cp - 1)
        assert collectives["forward"]["send_recv"]["cp"]["bytes"] == LAYERS * (cp - 1) * _kv_block_bytes(cp) // 2
    elif case == "hybrid_cp4_hf":
        # All-to-alls inside each Ulysses pair, as all-to-all mode's; then a ring of 2 whose one
        # transfer carries the pair's block (S/2 tokens) of half the heads.
        forward, backward = collectives["forward"], collectives["backward"]
        assert forward["all_to_all"]["cp/ulysses"] == {"count": LAYERS * 2,
                                                       "bytes": LAYERS * _per_layer_all_to_all_bytes(4)}
        # Output gradient, output and log-sum-exp to heads, three gradients back (forward's
        # head-sharded q/k/v are reused, as in all-to-all mode).
        assert backward["all_to_all"]["cp/ulysses"] == {
            "count": LAYERS * 2, "bytes": LAYERS * _per_layer_all_to_all_bytes(4, backward=True)}
        block = _kv_block_bytes(2) // 2
        assert forward["send_recv"] == {"cp/ring": {"count": LAYERS, "bytes": LAYERS * block}}, forward
        assert backward["send_recv"] == {"cp/ring": {"count": 2 * LAYERS, "bytes": 2 * LAYERS * block}}, backward
        assert forward["all_to_all"]["cp"]["count"] == 2  # ids and labels (stacked) in, logits out
    elif case.startswith("gather"):
        # Unbalanced, rank 0's queries see no other rank's keys: it reads nothing it gathers, and
        # still gathers (and sends its zero shares home) as every rank must.
        _check_gathered_blocks(collectives, cp, batch)
    else:
        _check_ring_transfers(collectives, cp, batch)
    if case == "ring_fsdp_cp":
        # FSDP over dp_shard x cp: one reduce-scatter per unit over the mesh flattened from the two
        # axes (parallelize creates it on this plain mesh), none per axis, and no all-reduce.
        scatters = collectives["backward"]["reduce_scatter"]
        assert list(scatters) == ["dp_shard+cp"] and scatters["dp_shard+cp"]["count"] == 3, scatters
        assert not collectives["backward"].get("all_reduce"), collectives["backward"]
        assert "dp_shard" not in collectives["forward"]["all_gather"], collectives["forward"]


def test_fewer_sequences_than_cp_ranks(dist4):
    """Fewer sequences than cp ranks (2 sequences over cp=4: the long-context configuration) on a
    ("dp", "cp") mesh: DTensor's view rule refuses to turn the [batch * sequence] rows back into
    [batch, sequence] there, propagation/strided_views.py decides it. dp=1 keeps it on 4 ranks:
    DTensor refuses the same views as at dp=2 x cp=4 with one sequence per data-parallel rank
    (checked in tests/propagation/test_strided_views.py), and the local views are the same kernel."""
    dist4.run(run_parity, "llama", _plan("ring"), (1, 4), ("dp", "cp"), batch=2, steps=2, ignore_fraction=0.3,
              model_overrides={"num_hidden_layers": 1})


def test_fsdp_cp_labels_shift_at_many_tokens_per_rank(dist4):
    """FSDP over dp_shard x load-balanced cp with 16k tokens per data-parallel rank (64 sequences
    of 256; the planner's long-sequence candidates hold as many as 2 x 8k): there DTensor would
    move the labels' cp shard from the sequence to the batch dim for their one-token shift, a shard
    the balanced order cannot permute ("must reorder a tensor of shape [64, 256]" before
    propagation/balanced_order.py). The shift gathers the integer labels over cp, as it does at
    fewer tokens, and the run matches one device."""
    results = dist4.run(run_parity, "llama", _plan("ring", fully_shard={"units": ["model.layers.*", ""]}),
                        (2, 2), ("dp_shard", "cp"), batch=128, seq_len=256, steps=2, ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": 1})
    forward = results[0]["summary"]["collectives"]["forward"]
    # The only gather over cp: this rank's [64, 128] int64 labels; the only all-to-alls the
    # reordering of ids and labels (stacked) into the balanced order and of the logits out of it.
    assert forward["all_gather"]["cp"] == {"count": 1, "bytes": 64 * 128 * 8}, forward
    assert forward["all_to_all"]["cp"]["count"] == 2, forward


@pytest.mark.parametrize("style", ["async", "gather"])
def test_ring_cp_with_a_pipeline(dist4, style):
    """Two pipeline stages, each a cp=2 ring (async, load-balanced) or all-gather attention:
    gradients reduced over cp once per step, each stage's attention with its K/V exchange."""
    plan = {"pipeline": hp.PipelinePlan(split_points=["model.layers.1"], schedule="1F1B", num_microbatches=2),
            **_plan(style)}
    results = dist4.run(run_pipeline_parity, plan, (2, 2), ("pp", "cp"), num_layers=LAYERS, batch=BATCH,
                        ignore_fraction=0.3)
    stage0 = results[0]["summary"]["collectives"]
    if style == "async":
        assert stage0["stage0 forward"]["send_recv"]["cp"]["count"] == 1  # one layer per stage, cp - 1 blocks
        assert stage0["stage0 backward"]["send_recv"]["cp"]["count"] == 2
    else:  # one layer per stage: a gather forward, a gather and a reduce-scatter backward
        assert stage0["stage0 forward"]["all_gather"]["cp"]["count"] == 1
        assert stage0["stage0 backward"]["all_gather"]["cp"]["count"] == 1
        assert stage0["stage0 backward"]["reduce_scatter"]["cp"]["count"] == 1
    # Gradients reduced once per step: two micro-batches, the first one's variant reduces nothing.
    assert "all_reduce" not in stage0["stage0 backward (first micro-batch)"]


def _bf16_fsdp_cp(style: str = "ring", hf_packed: bool = False) -> dict:
    """FSDP (bf16 parameters, fp32 reduction) over dp_shard x cp with ``style`` (the load-balanced
    ring: fp32 merging and dK/dV accumulation) against one device computing in bf16 from the same
    fp32 master weights; returns the compile summary's collectives. ``hf_packed``: HF Llama on
    packed sequences (position ids restarting per document), whose mask is within the causal one:
    the all-gather kernel skips the keys after the queries."""
    import copy

    from hyper_parallel.cp.attention_ops import arguments_by_name, family_of

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    master = build_model("hf:LlamaForCausalLM" if hf_packed else "llama", num_hidden_layers=LAYERS)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = _plan(style, fully_shard=hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy))
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    full = global_batch("llama", BATCH, SEQ, ignore_fraction=0.3)
    if hf_packed:
        full["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(SEQ - c)]) for c in (3, 6, 9, 12)])
    compute, ref_loss = bf16_reference_step(master, full)
    loss = model(**local_batch(full, mesh))["loss"]
    loss.backward()
    assert_matches_bf16_reference(model, loss, compute, ref_loss, full)
    if hf_packed:  # keys after the queries skipped: each layer's own block and half the other rank's
        pairs = [(a["query"].meta["val"].shape[-2], a["key"].meta["val"].shape[-2])
                 for n in model.compiled_programs()[0].graph.nodes
                 if n.op == "call_function" and family_of(n.target) is not None
                 for a in [arguments_by_name(n.target, n.args, n.kwargs)]]
        assert sum(q * k for q, k in pairs) == LAYERS * 3 * (SEQ // 2) ** 2 // 2, pairs
    return model.compile_summary()["collectives"]


@pytest.mark.parametrize("style", ["all_to_all", "gather"])  # ring: test_cp_bf16_with_the_gpu_flash_kernel
def test_cp_bf16_mixed_precision_fsdp(dist4, style):
    """The all-gather case runs HF Llama on packed sequences (its mask within the causal one)."""
    collectives = dist4.run(_bf16_fsdp_cp, style, style == "gather")[0]
    if style == "all_to_all":
        # The bf16 output and its fp32 log-sum-exp travel in one all-to-all (the latter's bytes as
        # bf16 columns): two per direction per attention, as in fp32. Each rank's share is half the
        # fp32 bytes for the D-sized tensors, the same for the log-sum-exp.
        local = (BATCH // 2) * HEADS * (SEQ // 2)
        for phase, d_sized in (("forward", 4), ("backward", 5)):
            assert collectives[phase]["all_to_all"]["cp"] == {
                "count": LAYERS * 2, "bytes": LAYERS * (d_sized * local * HEAD_DIM * 2 + local * FP32)}, collectives


def _attention_flops(model) -> float:
    """Attention FLOPs (forward and backward) of ``model``'s compiled programs, by the cost
    model's per-node count."""
    from hyper_parallel.cost.compute import node_work
    from hyper_parallel.cp.attention_ops import family_of

    return sum(node_work(n).flops for program in model.compiled_programs() for n in program.graph.nodes
               if n.op == "call_function" and family_of(n.target) is not None)


def _attention_flops_per_rank(style: str) -> float:
    """This rank's attention FLOPs (forward and backward) by the cost model's per-node count."""
    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=1), _plan(style), mesh)
    model(**local_batch(global_batch("llama", 2, 64), mesh))["loss"].backward()
    return _attention_flops(model)


def test_load_balance_evens_the_causal_attention_work(dist4):
    """cp=4, causal: with load balancing each rank computes one causal block of its two chunks and
    half of every other rank's block, so the attention FLOPs per rank agree within 5%; without it
    the last rank attends to the whole sequence and the first to its own slice only."""
    balanced = dist4.run(_attention_flops_per_rank, "ring")
    flat = dist4.run(_attention_flops_per_rank, "ring_flat")
    assert max(balanced) <= 1.05 * min(balanced), balanced
    assert flat[3] > 5 * flat[0] and flat == sorted(flat), flat
    assert abs(sum(balanced) - sum(flat)) <= 0.01 * sum(flat)  # the same work, spread differently


def _errors() -> dict:
    cp2 = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    # 3 heads of 16 dims: all-to-all mode cannot split them over cp=2 (ring mode can).
    odd_heads = build_model("llama", num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
                            hidden_size=48)
    odd_tokens = local_batch(global_batch("llama", 2, 14), cp2)  # 7 tokens per rank: no 2 * cp chunks
    eager = build_model("hf:LlamaForCausalLM", num_hidden_layers=1, attn_implementation="eager")
    eager_batch = local_batch(global_batch("llama", 2, 16), cp2)

    def first_call(model, plan, batch):
        return hp.parallelize(model, plan, cp2)(**batch)

    ring_odd = build_model("llama", num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    return {
        "unused": error_message(hp.parallelize, build_model("llama", num_hidden_layers=1), {}, cp2),
        "heads": error_message(hp.parallelize, odd_heads, build_plan("cp"), cp2),
        "ring_heads": error_message(hp.parallelize, ring_odd, _plan("ring"), cp2),
        "odd_tokens": error_message(first_call, build_model("llama", num_hidden_layers=1), _plan("ring"), odd_tokens),
        "eager": error_message(first_call, eager, _plan("ring"), eager_batch),
        "glob": error_message(hp.parallelize, build_model("llama", num_hidden_layers=1),
                              {"context_parallel": {"model.layers.*.attn": hp.ContextParallel()}}, cp2),
        "shard": error_message(hp.shard_sequence, {"input_ids": torch.zeros(2, 7)}, cp2),
    }


def test_errors_name_the_entry_and_the_fix(dist2):
    errors = dist2.run(_errors)[0]
    assert errors["unused"].startswith("ValueError: mesh axis 'cp' (size 2) is used by no plan entry"), errors
    assert "hp.ContextParallel()" in errors["unused"]
    assert "module 'model.layers.0.self_attn' has 3 heads, which cp=2 does not divide" in errors["heads"], errors
    assert errors["ring_heads"] == "no error", errors  # the ring splits the sequence, not the heads
    assert "sequence of 14 tokens into 2*cp=4 chunks" in errors["odd_tokens"], errors
    assert "load_balance=False" in errors["odd_tokens"]
    assert errors["eager"].startswith("ValueError: context parallelism"), errors
    assert "would gather the whole sequence" in errors["eager"] and "attn_implementation='sdpa'" in errors["eager"]
    assert "modeling_llama.py" in errors["eager"]  # the source line of the op
    assert errors["glob"].startswith("ValueError: context_parallel") and "matches no module" in errors["glob"], errors
    assert errors["shard"].startswith("ValueError: shard_sequence: dim 1"), errors


def _ring_kernel_against_whole_sequence(balanced: bool, family: str = "cpu_flash", gather: bool = False) -> dict:
    """cp/ring.py's kernels run eagerly on this rank's tokens (real transfers) against the one-device
    kernel on the whole sequence: causal, and an explicit additive mask under which some query rows
    see none of another rank's keys and one row sees no key at all (for the kernel families that
    take a mask). ``family``: the SDPA kernels each block runs (cp/attention_ops.py; the GPU ones
    emulated on CPU); ``gather``: K/V all-gathered (mode="all_gather") instead of passed around."""
    from hyper_parallel.cp.attention_ops import FAMILIES
    from hyper_parallel.cp.load_balance import permute
    from hyper_parallel.cp.ring import Ring, backward, forward
    from hyper_parallel.testing.emulated_attention import register_cpu_emulation

    register_cpu_emulation()
    ops = next(f for f in FAMILIES if f.name == family)

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ring = Ring.on_axis(mesh, 0, balanced=balanced, overlap=False, name="sdpa", gather=gather)
    n, length = 2, 8
    seq = n * length
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, seq, 4, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.zeros(seq, seq, dtype=torch.float64)
    mask[:6, 4:] = float("-inf")  # rows 0-5 see keys 0-3 only: no key of the other rank's block
    mask[5, :] = float("-inf")  # row 5 sees nothing (the kernel gives 0 and a log-sum-exp of 0)
    # Causal and'ed with left padding (keys 0-2 hidden): rows 0-2 see nothing. Passed as known to be
    # within the causal mask, so the blocks after the queries are skipped.
    padded = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(),
                                                                   float("-inf"))
    padded[:, :3] = float("-inf")

    def mine(x, dim=2):  # this rank's tokens, in the program's order
        x = permute(x, dim, seq, n) if balanced else x
        return x.narrow(dim, ring.rank * length, length)

    def blockwise(causal, m, within=False):
        o, l, others = forward(ring, ops, mine(q), mine(k), mine(v), causal, m, None, within)
        rng = others[:2] if family != "cpu_flash" else ()
        return (o, l, *backward(ring, ops, mine(grad), mine(q), mine(k), mine(v), o, l, causal, m, None, rng,
                                within))

    cases = (("causal", True, None), ("mask", False, mask), ("padded causal", False, padded, True))
    return _errors_against_one_device(q, k, v, grad, cases if family != "flash" else cases[:1], blockwise, mine)


def _errors_against_one_device(q, k, v, grad, cases, blockwise, mine) -> dict:
    """For each (label, causal, mask[, within]) case: the largest difference between this rank's
    part (``mine``) of the one-device kernel's output, log-sum-exp and three gradients on the whole
    sequence and what ``blockwise(causal, mask[, within])`` computed for them."""
    errors = {}
    for label, causal, m, *within in cases:
        out, lse = SDPA(q, k, v, 0.0, causal, attn_mask=m)
        expected = (out, lse, *SDPA_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=m))
        computed = blockwise(causal, m, *within)
        errors[label] = max((a - mine(b)).abs().max().item() for a, b in zip(computed, expected))
    return errors


@pytest.mark.parametrize("balanced,family,gather", [
    (True, "cpu_flash", False), (False, "cpu_flash", False), (True, "flash", False), (True, "efficient", False),
    (False, "cudnn", False), (True, "cpu_flash", True), (False, "efficient", True),
])
def test_ring_kernel_matches_the_whole_sequence(dist2, balanced, family, gather):
    """Every SDPA kernel family (the GPU ones emulated on CPU: their log-sum-exp is float32, so
    fp64 inputs agree to float32's precision only), K/V passed around the ring or gathered."""
    bound = 1e-12 if family == "cpu_flash" else 1e-5
    for rank, errors in enumerate(dist2.run(_ring_kernel_against_whole_sequence, balanced, family, gather)):
        assert max(errors.values()) < bound, (rank, errors)


def _hybrid_kernel_against_whole_sequence(balanced: bool, kv_exchange: str = "ring") -> dict:
    """cp/hybrid.py's kernels on cp=4 as 2 Ulysses groups of 2 on a ring of 2, eagerly on this
    rank's tokens (real all-to-alls and transfers), against the one-device kernel on the whole
    sequence: causal, and an additive mask with one entry per head."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyper_parallel.cp.hybrid import hybrid_kernels
    from hyper_parallel.cp.load_balance import permute
    from hyper_parallel.cp.resolve import ContextPlan, attach_context_groups

    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    context = attach_context_groups(ContextPlan("cp", 4, "hybrid", balanced, False, (), "test", ulysses=2,
                                                kv_exchange=kv_exchange), mesh)
    from hyper_parallel.cp.attention_ops import CpuFlash

    forward, backward = hybrid_kernels(0, context, "sdpa", CpuFlash())
    n, length, heads = 4, 4, 4
    seq = n * length
    rank = mesh.get_local_rank(0)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.zeros(1, heads, seq, seq, dtype=torch.float64)
    mask[0, 1, :, 9:] = float("-inf")  # head 1 sees the first 9 keys only
    mask[0, 2, 3, :] = float("-inf")  # head 2's query 3 sees nothing

    def mine(x, dim=2):  # this rank's tokens, in the program's order (2 ring ranks' chunks)
        x = permute(x, dim, seq, 2) if balanced else x
        return x.narrow(dim, rank * length, length)

    def shard(local):
        return DTensor.from_local(local, mesh, [Shard(2)], run_check=False)

    def blockwise(causal, m):
        whole = None if m is None else DTensor.from_local(m, mesh, [Replicate()], run_check=False)
        qs, ks, vs = (shard(mine(x)) for x in (q, k, v))
        o, l = forward(qs, ks, vs, 0.0, causal, attn_mask=whole)
        grads = backward(shard(mine(grad)), qs, ks, vs, shard(o), shard(l), 0.0, causal, attn_mask=whole)
        return (o, l, *grads)

    return _errors_against_one_device(q, k, v, grad, (("causal", True, None), ("mask", False, mask)), blockwise, mine)


@pytest.mark.parametrize("balanced,kv_exchange", [(True, "ring"), (False, "ring"), (True, "all_gather")])
def test_hybrid_kernel_matches_the_whole_sequence(dist4, balanced, kv_exchange):
    for rank, errors in enumerate(dist4.run(_hybrid_kernel_against_whole_sequence, balanced, kv_exchange)):
        assert max(errors.values()) < 1e-12, (rank, errors)


def _logits_against_one_device(style: str) -> float:
    """The logits a context-parallel model returns: a DTensor over cp in sequence order (the
    load-balanced program puts them back), whose whole tensor is one device's logits."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    reference = build_model("llama", num_hidden_layers=1)
    import copy

    model = hp.parallelize(copy.deepcopy(reference), _plan(style), mesh)
    batch = global_batch("llama", 2, SEQ)
    logits = model(**local_batch(batch, mesh))["logits"]
    assert isinstance(logits, torch.distributed.tensor.DTensor), type(logits)
    return (logits.full_tensor() - reference(**batch)["logits"]).abs().max().item()


@pytest.mark.parametrize("style", ["ring", "all_to_all"])
def test_returned_logits_are_in_sequence_order(dist2, style):
    assert max(dist2.run(_logits_against_one_device, style)) < 1e-5


def _padded_attention_mask(style: str, inputs: str = "padding") -> dict:
    """HF Llama trained on left-padded sequences (``inputs="padding"``: an ``attention_mask``
    input, labels -100 on the padding) or packed ones (``"packed"``: position ids restarting at
    each document, propagation/packed_sequences.py): the mask depends on an input, so the
    ``causal_mask`` rewrite keeps it and the context-parallel kernels compute with it. Parity over
    2 SGD steps; returns the attention nodes' mask arguments in the compiled forward (they must be
    there), and this rank's attention FLOPs against those of the same plan with the rewrite
    disabled (the mask not known to be within the causal one)."""
    import copy

    from hyper_parallel.cp.attention_ops import family_of
    from hyper_parallel.testing.parity import assert_same_step

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    reference = build_model("hf:LlamaForCausalLM", num_hidden_layers=LAYERS)
    parallel = hp.parallelize(copy.deepcopy(reference), _plan(style), mesh)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (parallel, reference))
    for step in range(2):
        full = global_batch("llama", BATCH, SEQ, seed=step + 1, ignore_fraction=0.3)
        if inputs == "packed":  # two documents per row, of lengths differing by row and step
            cuts = [(3 + b + step) % (SEQ - 2) + 1 for b in range(BATCH)]
            full["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(SEQ - c)]) for c in cuts])
        else:
            padding = torch.ones(BATCH, SEQ, dtype=torch.long)
            padding[1, :5] = padding[3, :2 + step] = 0  # uneven: cp ranks see different amounts
            full = {**full, "attention_mask": padding, "labels": full["labels"].masked_fill(padding == 0, -100)}
        loss, ref_loss = parallel(**local_batch(full, mesh)).loss, reference(**full).loss
        loss.backward()
        ref_loss.backward()
        assert_same_step(parallel, loss, reference, ref_loss, f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    forward = parallel.compiled_programs()[0]
    masks = [str(family_of(n.target).bind(n.target, n.args, n.kwargs).mask) for n in forward.graph.nodes
             if n.op == "call_function" and family_of(n.target) is not None]
    unmarked = hp.parallelize(copy.deepcopy(reference), _plan(style), mesh, disable_passes=["causal_mask"])
    unmarked(**local_batch(full, mesh)).loss.backward()
    return {"masks": masks, "flops": _attention_flops(parallel), "unmarked_flops": _attention_flops(unmarked)}


@pytest.mark.parametrize("style,inputs", [("ring", "padding"), ("gather", "padding"), ("all_to_all", "padding"),
                                          ("ring", "packed")])
def test_padding_attention_mask(dist2, style, inputs):
    """Ring and all-gather attention skip the K/V blocks after the queries under transformers'
    padded causal mask and its packed-sequence mask as under ``is_causal`` (cp=2, load-balanced:
    each rank computes its own block and half of the other's, 3/4 of the work without the skip);
    Ulysses computes whole sequences either way."""
    for rank, result in enumerate(dist2.run(_padded_attention_mask, style, inputs)):
        assert result["masks"] and "None" not in result["masks"], result
        ratio = result["flops"] / result["unmarked_flops"]
        assert ratio == 1.0 if style == "all_to_all" else ratio == 0.75, (rank, ratio)


# --- the GPU SDPA kernels (flash, memory-efficient, cuDNN), emulated on CPU ---------------------------

def _attention_ops(model) -> dict[str, list[str]]:
    """The SDPA ops in each of the compiled programs, in program order."""
    from hyper_parallel.cp.attention_ops import ATTENTION_OPS

    return {phase: [str(n.target) for n in program.graph.nodes if n.target in ATTENTION_OPS]
            for phase, program in zip(("forward", "backward"), model.compiled_programs())}


def _kernel_family_parity(family: str, model: str, style: str, keep_mask: bool) -> dict:
    """run_parity with ``F.scaled_dot_product_attention`` going through the GPU kernel ``family``
    (hyper_parallel.testing.emulated_attention: its CPU emulation), on one device and in the
    context-parallel program alike; returns the compile summary and the programs' attention ops.
    ``keep_mask``: transformers' causal mask stays the kernels' bias (the ``causal_mask`` rewrite off)."""
    from hyper_parallel.testing.emulated_attention import sdpa_as

    with sdpa_as(family):
        result = run_parity(model, _plan(style), (2,), ("cp",), steps=2, ignore_fraction=0.3,
                            model_overrides={"num_hidden_layers": LAYERS}, inspect=_attention_ops,
                            disable_passes=("causal_mask",) if keep_mask else ())
    return {"summary": result["summary"], "ops": result["inspected"]}


@pytest.mark.parametrize("family,model,style,keep_mask", [
    ("flash", "llama", "async", False),
    ("flash", "llama", "all_to_all", False),
    ("efficient", "hf:LlamaForCausalLM", "async", True),
    ("efficient", "llama", "all_to_all", False),
    ("cudnn", "hf:LlamaForCausalLM", "ring_flat", True),
    ("cudnn", "hf:LlamaForCausalLM", "ring_flat", False),
])
def test_gpu_attention_kernels(dist2, family, model, style, keep_mask):
    """Context parallelism on the kernels GPUs run (flash for bf16/fp16 without a mask, memory-
    efficient and cuDNN with transformers' causal mask as their bias, or causal once the
    ``causal_mask`` rewrite has recognised that mask), each with its own arguments and outputs (the
    log-sum-exp padded to 32 tokens / with a trailing 1; sequence lengths and RNG state in the
    output): parity with one device, the programs compute with that family's ops and no other, and
    the collectives are the CPU kernel's."""
    result = dist2.run(_kernel_family_parity, family, model, style, keep_mask)[0]
    forward_op, backward_op = f"aten._scaled_dot_product_{family}_attention.default", \
        f"aten._scaled_dot_product_{family}_attention_backward.default"
    ring = style != "all_to_all"
    # Rank 0's kernel calls per attention: one on whole sequences (all-to-all); on the ring, its own
    # block, and the other rank's when it sees any of it (always under a mask; balanced causal: the
    # half of it before its second chunk; flat causal: none, it comes after).
    per_layer = 1 if not ring else 2 if keep_mask or style != "ring_flat" else 1
    assert result["ops"]["forward"] == [forward_op] * LAYERS * per_layer, result["ops"]
    assert set(result["ops"]["backward"]) == {backward_op}, result["ops"]
    collectives = result["summary"]["collectives"]
    if not ring:
        assert collectives["forward"]["all_to_all"]["cp"]["count"] == LAYERS * 2
        assert collectives["backward"]["all_to_all"]["cp"]["count"] == LAYERS * 2
    else:
        assert collectives["forward"]["send_recv"]["cp"] == {"count": LAYERS, "bytes": LAYERS * _kv_block_bytes(2)}
    assert result["summary"]["fallbacks"] == []


def _bf16_fsdp_cp_with_flash() -> None:
    from hyper_parallel.testing.emulated_attention import sdpa_as

    with sdpa_as("flash"):
        _bf16_fsdp_cp()


def test_cp_bf16_with_the_gpu_flash_kernel(dist4):
    """The configuration GPUs train in: bf16 compute (FSDP mixed precision over dp_shard x cp), the
    flash kernel, the load-balanced ring, against one device in bf16 through the same kernel."""
    dist4.run(_bf16_fsdp_cp_with_flash)


def _eager_dtensor_attention_error() -> float:
    """After a context-parallel compile, a user's own eager DTensor attention on sequence-sharded
    inputs (no compiler involved): its largest difference from one device."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=1), _plan("ring"), mesh)
    model(**local_batch(global_batch("llama", 2, SEQ), mesh))["loss"].backward()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, SEQ, 4, generator=g) for _ in range(3))
    shards = [DTensor.from_local(x.chunk(2, dim=2)[mesh.get_local_rank(0)], mesh, [Shard(2)], run_check=False)
              for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*shards, is_causal=True)
    return (out.full_tensor() - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()


def test_eager_dtensor_attention_is_not_given_the_sequence_rule(dist2):
    """The sequence-sharded attention strategy exists only while the compiler propagates (where
    the context-parallel kernels compute it): eager DTensor must not run the plain kernel on
    sequence shards, which would attend to each rank's own keys only."""
    assert max(dist2.run(_eager_dtensor_attention_error)) < 1e-6


def _two_equal_meshes_made_first() -> list:
    """Two (dp, cp) meshes over the same ranks, both created before either model compiles (a user
    comparing two runs in one process): each compile lowers onto its own mesh's groups."""
    import copy

    meshes = [hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")) for _ in range(2)]
    master = build_model("llama", num_hidden_layers=1)
    batch = local_batch(global_batch("llama", BATCH, SEQ, ignore_fraction=0.3), meshes[0])
    losses, axes = [], set()
    for mesh in meshes:
        model = hp.parallelize(copy.deepcopy(master), _plan("ring"), mesh)
        loss = model(**batch)["loss"]
        loss.backward()
        losses.append(loss.item())
        for phase in model.compile_summary()["collectives"].values():
            axes.update(axis for per_axis in phase.values() for axis in per_axis)
    return [losses, sorted(axes)]


def test_two_equal_meshes_alive_at_once(dist4):
    """DTensor caches sharding decisions by a mesh's value, each holding the mesh it was made for:
    without a fresh cache per compile the second model lowered onto the first mesh's process groups,
    whose (rank-dependent) names its SPMD check did not know, and it raised on every rank."""
    for losses, axes in dist4.run(_two_equal_meshes_made_first):
        assert losses[0] == losses[1], losses
        assert axes == ["cp", "dp"], axes
