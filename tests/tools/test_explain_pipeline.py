"""``explain`` with a pipeline (issue 55, item 1): every stage compiled on the fake mesh, the step
priced in the order the executor runs (pipeline/step_cost.py, tools/explain_pipeline.py).

The oracle: the replay must run each pp rank's compute steps in the order of the schedule the
compiled entry's executor holds, its bubble must be that of the schedule with the stage times it
measured, the first stage of 1F1B must hold pp micro-batches in flight (GPipe: all), and each pp
rank's peak must be the sum the module docstring states.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.cost import get_profile
from hyper_parallel.distributed.host_reduce import rounds
from hyper_parallel.pipeline.runtime import flat_steps
from hyper_parallel.pipeline.schedules import simulate
from hyper_parallel.pipeline.schedules.steps import T
from hyper_parallel.pipeline.step_cost import rank_memory
from hyper_parallel.tools import presets
from hyper_parallel.tools.explain import explain, format_report

TINY = {"base": "llama3-8b", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 256}


pytestmark = pytest.mark.usefixtures("no_process_group_leak")


def test_equal_stages_and_their_errors():
    plan = presets.pipeline_entry(2, {"num_hidden_layers": 5})
    assert plan.split_points == ("model.layers.3",) and plan.num_microbatches == 2 and plan.schedule == "1F1B"
    plan = presets.pipeline_entry(2, {"num_hidden_layers": 8}, "Interleaved1F1B", 4)
    assert plan.stages_per_rank == 2 and plan.split_points == ("model.layers.2", "model.layers.4", "model.layers.6")
    with pytest.raises(ValueError, match="need at least 8 decoder layers; the model has 4"):
        presets.pipeline_entry(4, {"num_hidden_layers": 4}, "Interleaved1F1B")
    with pytest.raises(ValueError, match="--pp-schedule 'Zero'"):
        presets.pipeline_entry(2, {"num_hidden_layers": 4}, "Zero")
    with pytest.raises(ValueError, match="--local-batch 3 does not split into 2 micro-batches"):
        explain(config=dict(TINY), parallel="dp_shard=2,pp=2", world_size=4, local_batch=3, seq_len=16)


@pytest.mark.slow
@pytest.mark.parametrize("pp,schedule", [(2, "1F1B"), (4, "GPipe"), (2, "ZBH1")])
def test_step_is_the_schedule_replayed_with_each_stage_program(pp, schedule):
    from hyper_parallel.testing.explained import explain_pipelined_kept

    microbatches = 4
    report, seen = explain_pipelined_kept(config=dict(TINY), parallel=f"dp_shard=2,pp={pp}", world_size=2 * pp,
                                          local_batch=4, seq_len=16, plan="fsdp", pp_schedule=schedule,
                                          num_microbatches=microbatches, repeated_blocks="auto")
    section = report["pipeline"]
    entry = seen["pmodel"]._hp.pipeline.last
    assert section["num_stages"] == pp and len(entry.programs) == pp  # every stage compiled

    # The replay ran every rank's compute steps in its schedule's order.
    cost = seen["cost"]
    for rank, steps in entry.schedule.items():
        compute = [(s.step_type, s.stage, s.micro_batch) for s in flat_steps(steps)
                   if s.step_type in (T.FORWARD, T.BACKWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT)]
        replayed = [(sub.step_type, sub.stage, sub.micro_batch) for r, step, _, _ in cost.events if r == rank
                    for sub in (step.sub_steps or (step,))]
        assert replayed == compute, rank

    # The bubble is the schedule's with the per-stage times (equal micro-batches: the middle variant's).
    stages = {s["stage"]: s for s in section["stages"]}
    assert section["bubble_fraction"] > 0
    if schedule == "1F1B":
        expect = simulate(entry.schedule, {s: v["forward_s"] for s, v in stages.items()},
                          {s: v["backward_s"] for s, v in stages.items()}, p2p_time=section["p2p_s"])
        assert section["bubble_fraction"] == pytest.approx(expect.bubble_fraction(), rel=0.05)

    # In flight: GPipe holds every micro-batch; 1F1B / ZB-H1's first stage one per pp rank, the most.
    assert stages[0]["in_flight"] == (microbatches if schedule == "GPipe" else pp)
    for s, row in stages.items():
        assert 1 <= row["in_flight"] <= stages[0]["in_flight"], (s, row)
        assert row["rank"] == s % pp and row["forward_s"] > 0 and row["backward_s"] > 0

    # Each pp rank's peak is its stages' persistent bytes, their in-flight held bytes, the temporaries.
    for r in section["ranks"]:
        own = [c for c in cost.stages if c.rank == r["rank"]]
        held = max(c.in_flight for c in own) * sum(c.saved_bytes for c in own)  # one stage per rank here
        assert r["peak_bytes"] == rank_memory(own, held)
    assert report["memory"]["peak"] == max(r["peak_bytes"] for r in section["ranks"])
    assert report["step"]["step_s"] == pytest.approx(max(r["end_s"] for r in section["ranks"]))
    assert report["step"]["step_s"] >= section["makespan_s"]
    # The step's agreement (once per step, log2(2 pp) rounds) delays it by what stage 0's first forward waits.
    assert section["agreement_s"] == pytest.approx(rounds(2 * pp) * get_profile(report["step"]["profile"]).host_message_latency_s)
    assert 0 <= section["agreement_exposed_s"] <= section["agreement_s"]
    text = format_report(report)
    assert f"pipeline  {pp} stages over pp={pp}, schedule {schedule}" in text and "pp rank" in text


def test_vocab_parallel_loss_of_a_fsdp_tp_pipeline_stays_in_the_last_stage():
    """PP x FSDP x TP with the vocab-parallel loss on a 2-layer Llama (regression): the pipeline
    split put the loss's backward in stage 0, reading the log-probabilities stage 1 computes. The
    fill value the vocab-parallel ``nll_loss_backward`` makes for its masked targets (a constant,
    no inputs) was placed by its autograd ``seq_nr``, which FSDP's embedding all-gather in stage 0
    carried too (nodes added after capture get the last forward op's, the loss's), and the
    backward's earliest-input rule pulled the rest of the loss's backward after it (on 4 layers the
    numbers do not collide)."""
    from hyper_parallel.ir.graph import source_line
    from hyper_parallel.testing.explained import explain_pipelined_kept

    report, seen = explain_pipelined_kept(config={**TINY, "num_hidden_layers": 2},
                                          parallel={"dp_shard": 2, "tp": 2, "pp": 2}, world_size=8,
                                          plan="fsdp+tp+sp", local_batch=4, seq_len=16, num_microbatches=2)
    assert report["pipeline"]["split_points"] == ["model.layers.1"] and report["step"]["step_s"] > 0
    first, last = seen["pmodel"]._hp.pipeline.last.stages

    def ops(graph):
        return [n for n in graph.gm.graph.nodes if n.op == "call_function"]

    # Every node of the loss, forward and backward, and its per-token max / exp-sum all-reduces
    # over tp, in the last stage.
    assert not [n.name for n in ops(first) if "causal_lm_loss" in (source_line(n) or "")]
    targets = {n.target for n in ops(last)}
    assert {torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss_backward.default} <= targets
    token_reductions = ("[S(0), P(max)] -> [S(0), R]", "[S(0), P(sum)] -> [S(0), R]")
    for graph, expect in ((first, set()), (last, set(token_reductions))):
        found = {n.meta.get("hp_redistribute") for n in ops(graph) if "all_reduce" in str(n.target)}
        assert found & set(token_reductions) == expect, (graph.stage, found)
    # Only the hidden state crosses the cut: a micro-batch of 2 rows, its sequence-parallel half of
    # the 16 positions, in the bf16 of FSDP's mixed precision; and its gradient back.
    crossing = [(t.phase, t.src, t.dst, t.shape, t.dtype) for t in first.sends + last.sends]
    assert crossing == [("forward", 0, 1, (2, 8, 64), torch.bfloat16),
                        ("backward", 1, 0, (2, 8, 64), torch.bfloat16)], crossing
