"""The caching-allocator model (hyper_parallel/analysis/allocator_model.py): its placement rules on small
hand-checked traces, and its prediction of the reserved peak against what one H200 measured for
the same program (bench/bench_memory_cuda.py, docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from hyper_parallel.analysis.allocator_model import CachingAllocatorModel, round_size

MiB = 1 << 20
GiB = 1 << 30


def test_requests_round_up_to_512_bytes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    a = CachingAllocatorModel()
    a.malloc("empty", 0)  # malloc(0) allocates nothing
    a.free("empty")
    assert a.reserved == a.allocated == 0


def test_default_segments_by_request_size():
    a = CachingAllocatorModel()
    a.malloc("small", 100)
    assert a.reserved == 2 * MiB  # the small pool's 2 MiB segment
    a.malloc("medium", 3 * MiB)
    assert a.reserved == 22 * MiB  # a request under 10 MiB takes a 20 MiB segment
    a.malloc("large", 17 * MiB + 1)  # over the 17 MiB left in that segment: a segment of its own,
    assert a.reserved == 22 * MiB + 18 * MiB  # its size rounded up to 2 MiB
    a.malloc("rest", 17 * MiB)  # the medium segment's remainder holds it exactly
    assert a.reserved == 40 * MiB and a.allocated == 512 + 20 * MiB + 18 * MiB


def test_default_hands_out_a_whole_block_when_the_rest_is_under_1_mib():
    a = CachingAllocatorModel()
    a.malloc("x", 20 * MiB - MiB // 2)
    assert a.allocated == 20 * MiB  # the 0.5 MiB remainder is not split off: counted as allocated
    a.free("x")
    assert a.allocated == 0


def test_best_fit_and_merging_of_free_neighbours():
    a = CachingAllocatorModel()
    for name in "abcd":
        a.malloc(name, 5 * MiB)  # one 20 MiB segment, four blocks
    a.malloc("other", 12 * MiB)  # its own 12 MiB segment
    assert a.reserved == 32 * MiB
    a.free("other")
    a.free("b")
    a.free("c")  # merges with b: a free 10 MiB block between a and d
    a.malloc("fits_merged", 9 * MiB)  # best fit: the 10 MiB block, not the 12 MiB segment
    a.malloc("fits_12", 11 * MiB)
    assert a.reserved == 32 * MiB
    a.malloc("new", 3 * MiB)  # nothing free holds 3 MiB any more: a new 20 MiB segment
    assert a.reserved == 52 * MiB


def test_expandable_segment_grows_in_20_mib_pages_and_reuses_its_free_end():
    a = CachingAllocatorModel(expandable_segments=True)
    a.malloc("x", 3 * MiB)
    assert a.reserved == 20 * MiB
    a.malloc("y", 30 * MiB)  # the 17 MiB free at the end + one more page
    assert a.reserved == 40 * MiB
    a.free("y")  # the end is free again: 37 MiB
    a.malloc("z", 40 * MiB)  # the free end grows by one page, instead of 40 MiB more
    assert a.reserved == 60 * MiB
    a.malloc("tiny", 4 * MiB)  # split off the 17 MiB end: no new page
    assert a.reserved == 60 * MiB


def test_expandable_best_fit_ranks_the_growable_end_last():
    a = CachingAllocatorModel(expandable_segments=True)
    a.malloc("a", 10 * MiB)
    a.malloc("b", 8 * MiB)
    a.malloc("c", 2 * MiB)  # fills the first page exactly
    a.malloc("d", 32 * MiB + MiB // 2)  # two more pages; 7.5 MiB left free at the end
    a.free("b")  # an 8 MiB hole
    assert a.reserved == 60 * MiB
    # 7 MiB fits both; the end is the smaller, but it can grow, so the hole is taken ...
    a.malloc("e", 7 * MiB)
    # ... and 8 MiB then fits neither the hole's remaining 1 MiB nor the 7.5 MiB end: one more page
    # (had the end been taken, the 8 MiB hole would have held it).
    a.malloc("f", 8 * MiB)
    assert a.reserved == 80 * MiB


def test_fragmentation_costs_the_default_allocator_more_than_expandable_segments():
    """Blocks that each take a segment of their own in the default allocator pack one after
    another in an expandable segment, and its free end grows for what the holes do not hold."""
    trace = [("malloc", i, 11 * MiB) for i in range(8)] + [("free", i) for i in range(0, 8, 2)]
    trace += [("malloc", f"big{i}", 13 * MiB) for i in range(4)]
    default = CachingAllocatorModel(False).replay(trace)
    expandable = CachingAllocatorModel(True).replay(trace)
    # Default: 12 MiB segments (11 MiB rounded up to 2 MiB, the 1 MiB rest not split off: counted
    # as allocated), then four 14 MiB ones, as no freed 12 MiB segment holds 13 MiB.
    assert default.peak_allocated == 4 * 12 * MiB + 4 * 14 * MiB
    assert default.peak_reserved == 8 * 12 * MiB + 4 * 14 * MiB
    # Expandable: 88 MiB in five pages, then the free end grows twice by a page for the 52 MiB.
    assert expandable.peak_allocated == 4 * 11 * MiB + 4 * 13 * MiB
    assert expandable.peak_reserved == 140 * MiB


def test_allocating_a_live_key_twice_is_an_error():
    a = CachingAllocatorModel()
    a.malloc("x", 10)
    with pytest.raises(ValueError, match="already allocated"):
        a.malloc("x", 10)


# What one H200 measured (2026-11-28, torch 2.11, bench/bench_memory_cuda.py: four Llama 3 8B-shaped
# layers, 8192 tokens, FSDP bf16 / fp32 reduce on one rank, AdamW, the step drops the logits):
# (recompute, expandable segments) -> (max_memory_allocated, max_memory_reserved) in GiB.
H200_MEASURED = {
    ("full", True): (35.88, 40.51),
    ("full", False): (35.88, 47.66),
    ("none", True): (40.06, 43.42),
}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_predicted_reserved_peak_matches_the_h200_measurement(recompute, monkeypatch):
    """The same program compiled here (explain: simulated rank, meta tensors) predicts the reserved
    peaks the H200 measured to 1% (it measured 40.51 / 47.66 / 43.42 GiB; the prediction was 40.51
    / 47.60 / 43.48). The allocated peak is 64 MiB under the measured one: memory outside the
    program (cuBLAS's workspaces)."""
    import hyper_parallel.analysis.memory as memory
    from hyper_parallel.tools.explain import explain, format_report

    estimate = memory.estimate
    # The bench's step drops the returned logits: the estimate without them, as it compared.
    monkeypatch.setattr(memory, "estimate", lambda *a, **k: estimate(*a, **{**k, "keep_outputs": False}))
    report = explain("example", "llama3-8b", "dp_shard=1", 1, "fsdp", "h100", num_layers=4,
                     recompute=recompute, local_batch=1, seq_len=8192)
    mem = report["memory"]
    allocated, reserved = H200_MEASURED[(recompute, True)]
    assert mem["peak"] / GiB == pytest.approx(allocated - 1 / 16, rel=0.002)
    assert mem["reserved_expandable"] / GiB == pytest.approx(reserved, rel=0.01)
    if (recompute, False) in H200_MEASURED:
        assert mem["reserved_default"] / GiB == pytest.approx(H200_MEASURED[(recompute, False)][1], rel=0.01)
    assert mem["reserved_default"] > mem["reserved_expandable"] > mem["peak"]
    # explain's verdict on a device between the two: the tensors fit, the allocator's cache does not.
    between = (mem["peak"] + mem["reserved_expandable"]) // 2
    report["device"] = {**report["device"], "memory_bytes": between, "fits": True,
                        "peak_fraction": mem["peak"] / between}
    assert "fits, but not the allocator's cache" in format_report(report)
