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
