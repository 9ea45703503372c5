"""The memory estimator against the measured peak of the same run (issue 4 item 4).

Each case trains the example Llama (wider than the default and on 8 x 128 tokens, so activations
dominate) for two steps on gloo and compares ``memory_report(opt)`` with what
:class:`~hyper_parallel.testing.memory_tracker.MemoryTracker` measured in the last step: the
forward+backward peak, the optimizer step's peak and the overall peak, each within 10%. The
plans cover no recompute, selective and full recompute, swap, FSDP and FSDP with full recompute,
on 2 ranks and on 1.
"""

import pytest

import hyper_parallel as hp
from hyper_parallel.testing.distributed import get_pool
from hyper_parallel.testing.memory_tracker import measure_training_memory

MODEL = {"hidden_size": 128, "intermediate_size": 256}
FSDP = {"fully_shard": {"units": ["model.layers.*", ""]}}
PLANS = {
    "none": {},
    "selective": {"recompute": {"model.layers.*": "selective"}},
    "full": {"recompute": {"model.layers.*": "full"}},
    "swap": {"swap": {"model.layers.*": True}},
    "fsdp": FSDP,
    "fsdp_full": {**FSDP, "recompute": {"model.layers.*": "full"}},
}
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def dist1():
    return get_pool(1)


def _check(result: dict, label: str) -> dict:
    est, measured = result["estimate"], result["measured"]
    pairs = {
        "forward_backward": (max(est["peak_forward"], est["peak_backward"]), measured["forward_backward"]),
        "optimizer_step": (est["peak_optimizer"], measured["optimizer_step"]),
        "peak": (est["peak"], measured["peak"]),
    }
    for what, (estimated, actual) in pairs.items():
        error = (estimated - actual) / actual
        assert abs(error) <= TOLERANCE, (
            f"{label}: estimated {what} {estimated} B vs measured {actual} B ({error:+.1%}); estimate "
            f"at {est['peak_site']['where']}: {est['at_peak']}; tracker at its peak: {result['tracked_at_peak']}"
        )
    # The peak is located: a phase, and for forward/backward a node of a named program.
    site = est["peak_site"]
    assert site["phase"] in ("forward", "backward", "optimizer")
    assert site["phase"] == "optimizer" or site["node"], site
    return pairs


def test_estimate_matches_measured_peak_two_ranks(dist2):
    peaks = {}
    for name, plan in PLANS.items():
        results = dist2.run(measure_training_memory, "llama", plan, (2,), ("dp",), model_overrides=MODEL)
        for rank, result in enumerate(results):
            pairs = _check(result, f"{name} / rank {rank}")
        peaks[name] = pairs["forward_backward"]
        # SGD keeps no state: the compile summary's estimate (no optimizer) is the same.
        assert results[0]["summary_memory"]["peak"] == results[0]["estimate"]["peak"]
    # What recompute is for, estimated and measured alike: full < selective < none; FSDP shards
    # parameters and gradients, so it needs less than plain data parallelism. The last is checked on
    # the estimate only: FSDP's margin here is 0.6 MB, and its measured peak is 13.21 MB in most runs
    # and 14.03 MB in a few (3 of 66 back to back, the estimate always 13.21 MB; within TOLERANCE):
    # the tracker then holds two units' all-gathered parameters at its peak (1.18 MB of all-gather
    # output and their cat, against 0.59 MB), one unit's buffer living past the program's last use
    # of it, as when a finished gloo work releases its output late.
    for i in (0, 1):
        assert peaks["full"][i] < peaks["selective"][i] < peaks["none"][i], peaks
        assert peaks["fsdp_full"][i] < peaks["fsdp"][i], peaks
    assert peaks["fsdp"][0] < peaks["none"][0], peaks


@pytest.mark.parametrize("name", ["none", "fsdp_full"])
def test_estimate_with_adamw_state_and_step(dist2, name):
    """AdamW: two moments per parameter shard, and the step's temporaries (CPU runs the
    per-parameter loop), estimated against the measured optimizer step."""
    results = dist2.run(
        measure_training_memory, "llama", PLANS[name], (2,), ("dp",), optimizer="adamw", model_overrides=MODEL,
    )
    for rank, result in enumerate(results):
        _check(result, f"{name} / adamw / rank {rank}")
        est = result["estimate"]
        # The optimizer's real state after a step: 2 fp32 moments per shard plus scalar step counters.
        assert 2 * est["params"] < est["optimizer_state"] <= 2 * est["params"] + 4 * 64
        assert est["peak_optimizer"] > est["params"] + est["grads"] + est["optimizer_state"]


def test_estimate_matches_measured_peak_one_rank(dist1):
    for name in ("none", "selective", "full", "swap"):
        result = dist1.run(measure_training_memory, "llama", PLANS[name], (1,), ("dp",), model_overrides=MODEL)[0]
        _check(result, f"{name} / 1 rank")


def test_context_parallel_divides_saved_activations(dist1, dist4):
    """Ring context parallelism (load-balanced) over cp=4 against one device on the same global
    batch and sequence: the estimate matches the measured peaks on every rank as for the plans
    above, and each rank saves at most 0.3 of one device's activations for backward (its quarter
    of the tokens; ring attention sends K/V around again in backward instead of keeping them)."""
    ring = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel(mode="ring")}}
    one = dist1.run(measure_training_memory, "llama", {}, (1,), ("dp",), model_overrides=MODEL)[0]
    results = dist4.run(measure_training_memory, "llama", ring, (4,), ("cp",), model_overrides=MODEL)
    for rank, result in enumerate(results):
        _check(result, f"ring cp=4 / rank {rank}")
    saved = [r["estimate"]["saved_activations"] for r in results]
    assert max(saved) <= 0.3 * one["estimate"]["saved_activations"], (saved, one["estimate"]["saved_activations"])


def _fsdp_one_rank_mixed_precision() -> dict:
    """FSDP with bf16 parameters on a shard axis of one rank (no all-gather: the cast is the whole
    "gather") next to FSDP2 on the same model and batch: two steps at parity with one device
    computing in bf16, then one measured step of each, and what hp's programs keep for backward."""
    import copy
    import gc

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hyper_parallel.ir import meta
    from hyper_parallel.testing.memory_tracker import MemoryTracker, unique_storage_bytes
    from hyper_parallel.testing.parity import (
        assert_matches_bf16_reference, bf16_reference_step, build_model, global_batch,
    )

    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    master = build_model("llama", **MODEL)
    mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""),
                                        mixed_precision=hp.MixedPrecisionPolicy(**policy))}
    pmodel = hp.parallelize(copy.deepcopy(master), plan, mesh)
    peer = copy.deepcopy(master)
    torch_mesh = init_device_mesh("cpu", (1,))
    for layer in peer.model.layers:
        fully_shard(layer, mesh=torch_mesh, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(peer, mesh=torch_mesh, mp_policy=MixedPrecisionPolicy(**policy))
    for step in range(2):
        batch = global_batch("llama", 8, 128, seed=step + 1, ignore_fraction=0.3)
        loss = pmodel(**batch)["loss"]
        loss.backward()
        compute, ref_loss = bf16_reference_step(master, batch)
        assert_matches_bf16_reference(pmodel, loss, compute, ref_loss, batch, f"step {step}: ")
        pmodel.zero_grad()
    peaks = {}
    for name, model in (("hp", pmodel), ("fsdp2", peer)):
        model(**batch)["loss"].backward()  # FSDP2's lazy init; hp's program is compiled already
        model.zero_grad()
        gc.collect()
        with MemoryTracker([*model.parameters(), *batch.values()]) as tracker:
            model(**batch)["loss"].backward()
        peaks[name] = tracker.peak
        model.zero_grad()
    forward, backward = pmodel.compiled_programs()
    saved = next(n for n in forward.graph.nodes if n.op == "output").args[0]

    def cast_behind(node):  # the parameter a saved value is a cast of, through views (t(w), ...)
        while isinstance(node, torch.fx.Node) and meta.FSDP_CAST not in node.meta and len(node.all_input_nodes) == 1:
            node = node.all_input_nodes[0]
        return node.meta.get(meta.FSDP_CAST) if isinstance(node, torch.fx.Node) else None

    return {
        "peaks": peaks,
        "estimate": max(pmodel.memory_report(keep_outputs=False)[k] for k in ("peak_forward", "peak_backward")),
        "params": unique_storage_bytes(pmodel.parameters()),
        "saved_casts": sorted(fqn for fqn in map(cast_behind, saved) if fqn),
        "backward_casts": sorted({n.meta[meta.FSDP_CAST] for n in backward.graph.nodes if meta.FSDP_CAST in n.meta}),
    }


def test_fsdp_on_one_rank_frees_param_dtype_copies_after_forward(dist1):
    """A shard axis of one rank has no all-gather, but under mixed precision the cast to bf16 is
    the unsharded parameter: a unit that reshards after forward casts again in backward (as FSDP2
    frees and re-gathers) instead of keeping every layer's bf16 copy from forward to backward.
    Measured here with FSDP2 beside it: the same peak or less (one H200 with Llama 3 8B layers
    showed hp at 1.015x FSDP2's allocated peak before)."""
    r = dist1.run(_fsdp_one_rank_mixed_precision)[0]
    layer_casts = [fqn for fqn in r["saved_casts"] if fqn.startswith("model.layers.")]
    assert not layer_casts, f"bf16 copies of layer parameters kept for backward: {layer_casts}"
    assert any(fqn.startswith("model.layers.") and fqn.endswith("mlp.down_proj.weight") for fqn in r["backward_casts"]), (
        r["backward_casts"]
    )
    assert r["peaks"]["hp"] <= r["peaks"]["fsdp2"], r["peaks"]
    error = (r["estimate"] - r["peaks"]["hp"]) / r["peaks"]["hp"]
    assert abs(error) <= TOLERANCE, (r["estimate"], r["peaks"])
