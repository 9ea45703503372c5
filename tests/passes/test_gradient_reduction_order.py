"""Where FSDP's gradient reductions sit in the compiled backward program (issue: reductions as soon
as possible). The example Llama and transformers' ``LlamaForCausalLM``, 8 layers, one FSDP unit per
layer plus the root, compiled on one simulated rank of 2 (torch's ``fake`` backend): each unit's fused reduce-scatter must follow that
unit's backward, interleaved with the other layers' backward compute, also under mixed precision
(bf16 parameters, fp32 reduction), where the gradient casts to the reduce dtype once all sat at the
end of backward and held every reduce-scatter (and every layer's unsharded fp32 gradient) there.
Data parallelism's gradient buckets likewise: lowering left every all-reduce at the end of
backward, and one 25 MB bucket was issued after the last gradient."""

from __future__ import annotations

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.api import compile_for_inputs
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

c10d = torch.ops._c10d_functional
LAYERS = 8


def _model(name, **config):
    if name == "hf_llama":
        pytest.importorskip("transformers")
        from hyper_parallel.models import tiny_hf_llama

        return tiny_hf_llama(num_hidden_layers=LAYERS, use_cache=False, **config)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=LAYERS, **config))


def _backward(name, mixed_precision, plan=None, world=2, config=None, pending=None, **options):
    """The compiled backward's nodes. ``pending``: compile the program of the synchronising
    micro-step after accumulation ("fsdp": FSDP gradients kept by set_requires_gradient_sync(False)
    micro-steps, "replicated": data-parallel ones kept under no_sync()), as the runtime does when
    an earlier micro-step left gradients in its accumulator (its contents do not matter here)."""
    if plan is None:
        plan = {"fully_shard": {"units": ["model.layers.*", ""], "mixed_precision": mixed_precision}}
    with fake_world(world, 0):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = _model(name, **(config or {}))
        ids = torch.empty(2, 16, dtype=torch.long, device="meta")
        if pending is None:
            pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids}, **options)
        else:
            pmodel = hp.parallelize(model, plan, mesh, materialize=False, **options)
            state = pmodel._hp
            accumulator, layout = ((state.accumulator, "unsharded") if pending == "fsdp"
                                   else (state.replicated_accumulator, "unreduced"))
            accumulator.buffers["kept"], accumulator.layout = torch.zeros(1), layout
            compile_for_inputs(pmodel, (), {"input_ids": ids, "labels": ids})
    return list(pmodel.compiled_programs()[1].graph.nodes)


def _most_in_flight(nodes, targets) -> int:
    """The most reductions issued and not yet waited for at any point of the program."""
    pending: set = set()
    most = 0
    for node in nodes:
        if node.target in targets:
            pending.add(node)
            most = max(most, len(pending))
        elif node.target is c10d.wait_tensor.default:
            pending.discard(node.args[0])
    return most


@pytest.mark.parametrize("mixed_precision", [
    None, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
], ids=["fp32", "bf16-params-fp32-reduce"])
@pytest.mark.slow
@pytest.mark.parametrize("name", ["example", "hf_llama"])
def test_each_units_reduce_scatter_follows_its_backward(name, mixed_precision):
    nodes = _backward(name, mixed_precision)
    position = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    matmuls = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(scatters) == LAYERS + 1, len(scatters)  # one fused reduce-scatter per unit
    # The first layer to finish backward (the last one) is reduced before half of backward has run.
    assert position[scatters[0]] < len(nodes) / 2, (position[scatters[0]], len(nodes))
    # Interleaved: every layer's reduce-scatter is issued before the next layer's last matmul.
    last_mm = position[matmuls[-1]]
    assert sum(position[s] < last_mm for s in scatters) >= LAYERS - 1
    # Under mixed precision the reduction reads fp32 gradients: the casts moved with it.
    if mixed_precision is not None:
        assert all(s.args[0].meta["val"].dtype == torch.float32 for s in scatters)
    # One reduction in flight (prefetch depth 1 here, the fake world's default), as FSDP2.
    assert _most_in_flight(nodes, {c10d.reduce_scatter_tensor.default}) == 1


BF16_FP32 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


@pytest.mark.parametrize("extra", [
    {"recompute": {"model.layers.*": "full"}},
    {"swap": {"model.layers.*": True}},
    {"fully_shard": {"units": ["model.layers.*", ""], "mixed_precision": BF16_FP32, "reshard_after_forward": 2}},
], ids=["recompute-full", "swap", "reshard-to-2-of-4"])
@pytest.mark.slow
def test_reductions_stay_interleaved_with_recompute_swap_and_partial_reshard(extra):
    """Recompute and swap add backward work per layer and reshard_after_forward=2 regathers over
    2 of 4 ranks; each unit's fused reduce-scatter (bf16 parameters, fp32 reduction) still follows
    its own layer's backward, before the next layer's last matmul."""
    plan = {"fully_shard": {"units": ["model.layers.*", ""], "mixed_precision": BF16_FP32}, **extra}
    nodes = _backward("example", None, plan=plan, world=4)
    position = {n: i for i, n in enumerate(nodes)}
    scatters = [position[n] for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    matmuls = [position[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(scatters) == LAYERS + 1, len(scatters)
    assert scatters[0] < len(nodes) / 2, (scatters[0], len(nodes))
    assert sum(s < matmuls[-1] for s in scatters) >= LAYERS - 1, (scatters, matmuls[-1])
    assert _most_in_flight(nodes, {c10d.reduce_scatter_tensor.default}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("name", ["example", "hf_llama"])
def test_data_parallel_buckets_are_issued_during_backward(name, depth):
    """DDP's buckets (a small bucket cap here, so there are several) are issued as soon as their
    last gradient exists, in backward order, the first right after the last layer's backward; each
    is reduced in place; with prefetch depth 1 one is in flight while
    backward goes on, with depth 0 each is waited for at once (never more than the depth)."""
    nodes = _backward(name, None, plan={}, bucket_cap_mb=0.05, prefetch_depth=depth)
    position = {n: i for i, n in enumerate(nodes)}
    reductions = [n for n in nodes if n.target in (c10d.all_reduce_.default, c10d.all_reduce.default)
                  and "gradient bucket" in n.meta.get("hp_bucket", "")]
    labels = [n.meta["hp_bucket"] for n in reductions]
    assert len(reductions) >= 4 and labels[0].startswith("gradient bucket 0 "), labels
    assert [int(label.split()[2]) for label in labels] == sorted(int(label.split()[2]) for label in labels)
    matmuls = [position[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    assert position[reductions[0]] < len(nodes) / 2, (position[reductions[0]], len(nodes))
    assert sum(position[r] < matmuls[-1] for r in reductions) >= len(reductions) - 2
    # Every fused bucket is reduced in place: no all-reduce reads a packed copy out of place.
    assert all(r.target is c10d.all_reduce_.default for r in reductions if "(1 params" not in r.meta["hp_bucket"])
    assert _most_in_flight(nodes, {c10d.all_reduce_.default, c10d.all_reduce.default}) == 1
    waits = [next(iter(r.users)) for r in reductions]
    overlapped = [any(position[r] < m < position[w] for m in matmuls) for r, w in zip(reductions, waits)]
    if depth == 0:  # nothing in flight across compute
        assert all(w is r.next for r, w in zip(reductions, waits))
    else:  # all but the buckets of the last gradients (after the last matmul) overlap matmuls
        assert sum(overlapped) >= len(reductions) - 2, overlapped


@pytest.mark.slow
@pytest.mark.parametrize("mixed_precision", [None, BF16_FP32], ids=["fp32", "bf16-params-fp32-reduce"])
@pytest.mark.parametrize("name", ["example", "hf_llama"])
def test_accumulated_fsdp_gradients_are_reduced_during_backward(name, mixed_precision):
    """The synchronising micro-step of gradient accumulation adds the gradients kept by earlier
    micro-steps before reducing. Lowering emitted those adds at the end of backward, and every
    unit's reduce-scatter waited there for them: no overlap on the step that reduces. Each unit's
    add now follows its gradient, and its reduce-scatter is interleaved as without accumulation."""
    nodes = _backward(name, mixed_precision, pending="fsdp")
    position = {n: i for i, n in enumerate(nodes)}
    scatters = [position[n] for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    matmuls = [position[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    adds = [n for n in nodes if n.meta.get("hp_role") == "accumulate"]
    assert len(scatters) == LAYERS + 1 and len(adds) == LAYERS * 9 + 3, len(adds)  # one per parameter
    assert scatters[0] < len(nodes) / 2, (scatters[0], len(nodes))
    assert sum(s < matmuls[-1] for s in scatters) >= LAYERS - 1, (scatters, matmuls[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["example", "hf_llama"])
def test_accumulated_data_parallel_gradients_are_reduced_during_backward(name):
    """The same for data parallelism's buckets after ``no_sync()`` micro-steps: each bucket is
    issued once its gradients and their kept sums are added, in backward order, overlapping the
    layers before it (as in test_data_parallel_buckets_are_issued_during_backward)."""
    nodes = _backward(name, None, plan={}, bucket_cap_mb=0.05, pending="replicated")
    position = {n: i for i, n in enumerate(nodes)}
    reductions = [n for n in nodes if n.target in (c10d.all_reduce_.default, c10d.all_reduce.default)
                  and "gradient bucket" in n.meta.get("hp_bucket", "")]
    labels = [int(n.meta["hp_bucket"].split()[2]) for n in reductions]
    matmuls = [position[n] for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(reductions) >= 4 and labels == sorted(labels), labels
    assert any(n.meta.get("hp_role") == "accumulate" for n in nodes)
    assert position[reductions[0]] < len(nodes) / 2, (position[reductions[0]], len(nodes))
    assert sum(position[r] < matmuls[-1] for r in reductions) >= len(reductions) - 2


def _bucket_members(nodes) -> list[int]:
    """Gradients per data-parallel bucket, in the order the program issues them."""
    labels = [n.meta["hp_bucket"] for n in nodes if "gradient bucket" in n.meta.get("hp_bucket", "")
              and n.target in (c10d.all_reduce_.default, c10d.all_reduce.default)]
    return [int(label.split("(")[1].split()[0]) for label in labels]


@pytest.mark.slow
def test_bucket_sizes_follow_ddp_rule():
    """DDP's rule for ``bucket_cap_mb``: left at its default, a 1 MiB first bucket (the lm_head's
    gradient, which backward computes first: 1 MiB here) then 25 MB ones; given by the caller, every
    bucket is at most that size, the first one too (DDP uses the cap for its first bucket then),
    so 25 MB holds all 22 MiB of gradients of this 8-layer model in one bucket, and 2 MB cuts them
    into 2 MB buckets from the first on (the lm_head's, the final norm's and the last down
    projection's gradients: 1.5 MiB)."""
    config = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024}
    assert _bucket_members(_backward("example", None, plan={}, config=config)) == [1, LAYERS * 9 + 2]
    assert _bucket_members(_backward("example", None, plan={}, config=config, bucket_cap_mb=25)) == [LAYERS * 9 + 3]
    two_mb = _bucket_members(_backward("example", None, plan={}, config=config, bucket_cap_mb=2))
    assert two_mb[0] == 3 and len(two_mb) >= 11, two_mb


def _backward_gradient_bytes(layers):
    """(most temporaries + communication-buffer bytes live at once in backward, as the memory
    estimator replays it; one layer's fp32 gradient bytes): example Llama with layers far larger
    than their activations (hidden 256, 4 tokens), bf16 parameters and fp32 reduction."""
    from hyper_parallel.analysis import memory

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=1024,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    plan = {"fully_shard": {"units": ["model.layers.*", ""], "mixed_precision": policy}}
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = LlamaForCausalLM(config)
        ids = torch.empty(1, 4, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids}, prefetch_depth=1)
    entry = pmodel._last_entry()
    series: list = []
    memory.estimate_program(entry.program, entry.captured, series=series)
    columns = [memory.CATEGORIES.index(c) for c in ("temporaries", "comm_buffers")]
    most = max(sum(p["live"][c] for c in columns) for p in series if p["phase"] == "backward")
    unit = 4 * sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    return most, unit


@pytest.mark.slow
def test_estimated_unsharded_gradients_stay_within_the_reductions_in_flight():
    """The memory estimator's view of the schedule above: with one reduce-scatter in flight, backward
    holds at most the in-flight unit's packed gradients (a collective's input lives until its wait,
    runtime/collective_inputs.py), the current unit's gradients and their packed copy: 3 units'
    fp32 gradient bytes, plus the in-flight all-gathers' bf16 shards (a quarter unit each at 2
    ranks) and activations, small here; under 4 units, however deep the model. When the casts sat
    at the end of backward, every layer's bf16 gradient stayed alive until then (growing with
    depth)."""
    shallow, unit = _backward_gradient_bytes(4)
    deep, _ = _backward_gradient_bytes(8)
    assert deep == shallow, (deep / unit, shallow / unit)
    assert deep < (1 + 1 + 1 + 1) * unit, deep / unit
