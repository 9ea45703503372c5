"""Compiles inside ``reusing_lowerings`` share one capture, propagation and lowering where only the
passes differ (compile/lowering_reuse.py): what the auto-planner does for a configuration's
recompute modes. The reports must be the ones each compile gives on its own, and a compile that
differs before the passes (another batch, another plan) must lower afresh."""

import json

import pytest

from hyper_parallel.compile.lowering_reuse import active_reuse, reusing_lowerings
from hyper_parallel.tools.explain import explain

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}
SETTING = dict(model="example", config=TINY, parallel={"dp_shard": 4, "tp": 2}, world_size=8, plan="fsdp+tp",
               hardware="h100", local_batch=2, seq_len=64)
MODES = ("none", "selective", "full")


def _report(**overrides) -> dict:
    """explain's report without its wall-clock seconds, as comparable text per entry."""
    report = explain(**{**SETTING, **overrides})
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in report.items() if k not in ("wall_s", "compile_s")}


@pytest.mark.slow
def test_recompute_modes_share_a_lowering_and_report_as_compiled_alone():
    alone = {mode: _report(recompute=mode) for mode in MODES}
    assert active_reuse() is None
    with reusing_lowerings() as reuse:
        shared = {mode: _report(recompute=mode) for mode in MODES}
        assert (reuse.lowered_count, reuse.reused) == (1, 2)
        # Another local batch is another capture; the same setting again reuses the first.
        _report(recompute="none", local_batch=4)
        assert (reuse.lowered_count, reuse.reused) == (2, 2)
        _report(recompute="selective", plan="fsdp+tp+sp")  # another plan: other layouts
        assert (reuse.lowered_count, reuse.reused) == (3, 2)
        _report(recompute="full", local_batch=4)
        assert (reuse.lowered_count, reuse.reused) == (3, 3)
    assert active_reuse() is None  # nothing kept after the scope
    for mode in MODES:
        assert shared[mode] == alone[mode], mode
    # The modes differ where recompute acts: what is saved for backward.
    assert alone["none"]["memory"] != alone["full"]["memory"]


def test_nested_scopes_share_the_outer_one():
    with reusing_lowerings() as outer:
        with reusing_lowerings() as inner:
            assert inner is outer and active_reuse() is outer
        assert active_reuse() is outer
    assert active_reuse() is None
