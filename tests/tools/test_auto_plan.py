"""``hp.auto_plan`` / ``hyper-parallel plan`` (hyper_parallel/tools/planner): the search space, what
is rejected without compiling and why, that those rejections are sound, and that the choice is what
``explain`` predicts for it, through ``choice.mesh()`` + ``choice.plan`` and through its plan file.

The model is the example Llama with a tiny shape (2 layers, 2 KV heads: tp is 1 or 2), so each
compile takes seconds; the 64- and 1,024-rank searches leave one configuration to compile by
their global batch (the others do not split it or do not divide the heads).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.analysis.memory import optimizer_model
from hyper_parallel.tools.cli import main, parse_include_spec, parse_search_spec
from hyper_parallel.tools.explain import build_model, compile_for_explain, explain, fake_world
from hyper_parallel.tools.planner import Candidate, auto_plan, predicted_of
from hyper_parallel.tools.planner.prune import (
    activation_lower_bound, batch_problem, dims_problem, memory_lower_bound, memory_problem, plan_problem,
    state_lower_bound,
)
from hyper_parallel.cost import get_profile
from hyper_parallel.tools.planner.estimate import analytic_step_s
from hyper_parallel.tools.planner.result import NOT_COMPILED_BUDGET
from hyper_parallel.tools.planner.space import LONG_SEQUENCE, degree_choices, parse_search, pipeline_choices

pytestmark = pytest.mark.usefixtures("no_process_group_leak")

TINY = {"base": "llama3-8b", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
FIELDS = {**{k: v for k, v in TINY.items() if k != "base"}}
SEQ = 64


def _factorisations(world, fields=FIELDS, seq_len=SEQ, per_node=8, search=None):
    return [tuple(d.values()) for d in degree_choices(world, fields, seq_len, per_node, parse_search(search))]


def test_every_factorisation_of_the_world_within_the_defaults():
    """(dp_replicate, dp_shard, cp, tp, pp, ep): products equal the world; tp within a node; pp at
    most the layers; cp only for long sequences, ep only for experts, dp_replicate only when asked."""
    got = _factorisations(8)
    assert got == [(1, 8, 1, 1, 1, 1), (1, 4, 1, 1, 2, 1), (1, 4, 1, 2, 1, 1), (1, 2, 1, 2, 2, 1),
                   (1, 2, 1, 4, 1, 1), (1, 1, 1, 4, 2, 1), (1, 1, 1, 8, 1, 1)]
    assert all(d[0] * d[1] * d[2] * d[3] * d[4] * d[5] == 8 for d in got)
    assert max(d[3] for d in _factorisations(64, per_node=4)) == 4  # tp within a 4-device node
    long = _factorisations(8, seq_len=LONG_SEQUENCE)
    assert {d[2] for d in long} == {1, 2, 4, 8}
    moe = _factorisations(8, fields={**FIELDS, "num_experts": 4})
    assert {d[5] for d in moe} == {1, 2, 4}  # ep up to the number of experts
    assert {d[0] for d in _factorisations(8, search={"dp_replicate": [1, 2]})} == {1, 2}
    # Restrictions: only these degrees, tp beyond a node when named.
    assert _factorisations(16, search={"pp": 1, "tp": [2, 16]}, per_node=8) == [(1, 8, 1, 2, 1, 1), (1, 1, 1, 16, 1, 1)]
    assert Candidate(dp_shard=8).plan_name == "fsdp" and Candidate(dp_shard=2, tp=4).plan_name == "fsdp+tp+sp"
    assert Candidate(tp=8).plan_name == "tp+sp" and Candidate(pp=8).plan_name is None


def test_pipeline_choices_fit_layers_and_the_local_batch():
    space = parse_search(None)
    assert pipeline_choices(2, 4, 4, space) == [("1F1B", 1, 2), ("1F1B", 1, 4), ("Interleaved1F1B", 2, 2),
                                                ("Interleaved1F1B", 2, 4)]
    assert pipeline_choices(2, 4, 2, space) == [("1F1B", 1, 2), ("1F1B", 1, 4)]  # 4 stages need 4 layers
    assert pipeline_choices(4, 2, 8, space) == []  # 4 micro-batches do not come from 2 sequences


def test_each_rejection_without_compiling_says_why():
    degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 4, "pp": 1, "ep": 1}
    assert "tp=4 does not divide num_key_value_heads=2" in dims_problem(degrees, 4, FIELDS, SEQ)
    assert dims_problem({**degrees, "tp": 2, "dp_shard": 2}, 4, FIELDS, SEQ) is None
    assert batch_problem({**degrees, "tp": 1, "dp_shard": 4}, 6) == "global batch 6 does not split over 4 data-parallel ranks"
    assert batch_problem({**degrees, "tp": 1, "dp_shard": 4}, 8) is None
    assert plan_problem(Candidate(pp=8)).startswith("no preset for these axes")
    # 10^9 parameters x (fp32 master, fp32 gradient, two AdamW states) over 8 ranks: 1.86 GiB.
    assert memory_problem(10**9, Candidate(dp_shard=8), "bf16", "adamw", budget=2**30) == \
        "OOM: parameters, gradients and adamw state alone need at least 1.86 GiB per rank (budget 1.00 GiB)"
    assert memory_problem(10**9, Candidate(dp_shard=8), "bf16", "adamw", budget=2 * 2**30) is None
    assert state_lower_bound(10**9, Candidate(dp_shard=8), "bf16", "adamw") == 16 * 10**9 // 8
    assert state_lower_bound(10**9, Candidate(tp=8), "bf16", "sgd") == 4 * 10**9 // 8  # bf16 parameters, no state
    for bad, key in (({"tq": 2}, "'tq'"), ({"tp": 0}, "'tp'"), ({"recompute": "most"}, "most"), ({"pp": "2"}, "'pp'")):
        with pytest.raises(ValueError, match=key):
            parse_search(bad)
    assert parse_search_spec("pp=1,tp=1:2:4,recompute=full") == {"pp": [1], "tp": [1, 2, 4], "recompute": ["full"]}
    with pytest.raises(ValueError, match="tp takes integers"):
        parse_search_spec("tp=two")


@pytest.mark.slow
def test_a_candidate_pruned_for_memory_does_not_fit_when_compiled():
    """The lower bound is below the compiled estimate: a budget just under it prunes the candidate,
    and the compiled peak is above that budget (so no fitting candidate is ever pruned)."""
    net, _ = build_model("example", FIELDS)
    params = sum(p.numel() for p in net.parameters())
    candidate = Candidate(dp_shard=4, local_batch=2)
    bound = state_lower_bound(params, candidate, "bf16", "adamw")
    assert memory_problem(params, candidate, "bf16", "adamw", bound - 1) is not None
    report = explain(config=dict(FIELDS), parallel=candidate.degrees, world_size=4, plan="fsdp", local_batch=2,
                     seq_len=SEQ, optimizer="adamw")
    assert report["memory"]["peak"] > bound - 1
    assert report["memory"]["params"] + report["memory"]["grads"] + report["memory"]["optimizer_state"] >= bound


DEEP = {**FIELDS, "num_hidden_layers": 4}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_memory_lower_bound_is_below_every_compiled_peak(recompute):
    """Activations dominate here (256 tokens per sequence, 4 per rank): the bound, which adds the
    saved activations of every layer (or of a pipeline's first stage's in-flight micro-batches) to
    the parameters and optimizer state, stays below the compiled peak under FSDP, FSDP x TP and
    1F1B / interleaved pipelines; without recompute the activations dominate it and are at least a
    third of what the compile saves."""
    net, _ = build_model("example", DEEP)
    params = sum(p.numel() for p in net.parameters())
    seq, batch = 256, 4
    cases = [Candidate(dp_shard=8, local_batch=batch), Candidate(dp_shard=4, tp=2, local_batch=batch),
             Candidate(dp_shard=4, pp=2, local_batch=batch, pp_schedule="1F1B", num_microbatches=2, stages_per_rank=1),
             Candidate(dp_shard=4, pp=2, local_batch=batch, pp_schedule="Interleaved1F1B", num_microbatches=4,
                       stages_per_rank=2)]
    for shape in cases:
        candidate = dataclasses.replace(shape, recompute=recompute)
        bound, what = memory_lower_bound(params, DEEP, candidate, seq, "bf16", "adamw")
        report = explain(config=dict(DEEP), parallel=candidate.degrees, world_size=8, plan=candidate.plan_name,
                         local_batch=batch, seq_len=seq, optimizer="adamw", recompute=recompute,
                         pp_schedule=candidate.pp_schedule or "1F1B", num_microbatches=candidate.num_microbatches,
                         stages_per_rank=candidate.stages_per_rank)
        assert bound <= report["memory"]["peak"], (candidate.describe(), bound, report["memory"]["peak"])
        activations = activation_lower_bound(DEEP, candidate, seq, "bf16")
        assert activations <= report["memory"]["saved_activations"], candidate.describe()
        if recompute == "none":  # the bound is not vacuous: at least a third of what the compile holds
            assert "activations" in what, candidate.describe()
            assert 3 * activations >= report["memory"]["saved_activations"], candidate.describe()


def test_the_analytic_estimate_orders_as_the_costs_it_models():
    """What the search orders candidates by: more recompute, a larger bubble (fewer micro-batches,
    no interleaving) or tensor parallelism's exposed transfers each cost time."""
    from hyper_parallel.tools import presets

    _, fields = presets.load_model_config("llama3-8b")
    h100 = get_profile("h100")

    def est(**kw):
        return analytic_step_s(Candidate(**kw), fields, h100, seq_len=8192, dtype="bf16")

    assert est(dp_shard=8, local_batch=2) < est(dp_shard=8, local_batch=2, recompute="selective") \
        < est(dp_shard=8, local_batch=2, recompute="full")
    pipe = dict(dp_shard=4, pp=2, local_batch=4, pp_schedule="1F1B", stages_per_rank=1)
    assert est(**pipe, num_microbatches=4) < est(**pipe, num_microbatches=2)
    assert est(**{**pipe, "pp_schedule": "Interleaved1F1B", "stages_per_rank": 2}, num_microbatches=2) \
        < est(**pipe, num_microbatches=2)
    assert est(dp_shard=8, local_batch=2) < est(dp_shard=4, tp=2, local_batch=4)  # the same compute, plus tp's
    # Close to a compiled prediction's scale: Llama 3 8B on 8 H100, local batch 2 x 8192, selective
    # recompute, predicted 1.88 s by the compiled programs (2026-12-03): estimated 1.27 s.
    assert 1.0 < est(dp_shard=8, local_batch=2, recompute="selective") < 1.9


def test_attention_scores_are_priced_at_the_attention_rate():
    """The analytic estimate prices causal attention's scores and values (and their recompute) at
    the profile's attention efficiency, everything else at its matmul efficiency: halving the
    attention rate adds exactly the scores' time at the old rate, and selective recompute costs one
    more forward of the scores whatever the rate."""
    from hyper_parallel.tools import presets

    _, fields = presets.load_model_config("llama3-8b")
    h100 = get_profile("h100")
    slow = dataclasses.replace(h100, attention_efficiency=h100.compute_efficiency(attention=True) / 2)
    seq, layers, q_width = 8192, int(fields["num_hidden_layers"]), int(fields["num_attention_heads"]) * int(
        fields.get("head_dim") or int(fields["hidden_size"]) // int(fields["num_attention_heads"]))

    def est(profile, **kw):
        return analytic_step_s(Candidate(dp_shard=8, local_batch=1, **kw), fields, profile, seq_len=seq, dtype="bf16")

    rate = h100.flops_per_s("bf16") * h100.compute_efficiency(attention=True)
    scores_forward = seq * layers * 2 * q_width * seq  # FLOPs of one forward of the scores, this rank
    assert est(slow) - est(h100) == pytest.approx(3 * scores_forward / rate, rel=1e-9)
    assert est(h100, recompute="selective") - est(h100) == pytest.approx(scores_forward / rate, rel=1e-9)
    assert est(slow, recompute="selective") - est(slow) == pytest.approx(2 * scores_forward / rate, rel=1e-9)


def test_include_entries_are_checked():
    for spec, error in (({"tq": 2}, "unknown keys \\['tq'\\]"), ({"tp": 3}, "multiply to 6, not the world size 8"),
                        ({"dp_shard": 8, "tp": 2}, "multiply to 16"), ({"recompute": "most"}, "recompute is one of"),
                        ({"pp": 2, "pp_schedule": "Zig"}, "pp_schedule is one of")):
        with pytest.raises(ValueError, match=error):
            auto_plan(TINY, world_size=8, global_batch=8, seq_len=SEQ, include=[spec], max_compiles=1, progress=False)
    with pytest.raises(ValueError, match="does not split over 8 data-parallel ranks"):
        auto_plan(TINY, world_size=8, global_batch=4, seq_len=SEQ, include=[{"dp_shard": 8}], search={"tp": 2},
                  progress=False)
    with pytest.raises(ValueError, match="max_compiles must be a positive integer"):
        auto_plan(TINY, world_size=8, global_batch=8, seq_len=SEQ, max_compiles=0, progress=False)
    assert parse_include_spec("dp_shard=32,tp=8,recompute=full") == {"dp_shard": 32, "tp": 8, "recompute": "full"}
    with pytest.raises(ValueError, match="tp takes an integer"):
        parse_include_spec("tp=eight")


@pytest.mark.slow
def test_the_compile_budget_goes_to_the_best_estimated_and_included_plans_are_always_compiled():
    search = {"pp": [1, 2], "pp_schedule": "1F1B", "recompute": ["none", "full"]}
    hand = {"dp_shard": 2, "tp": 2, "pp": 2, "recompute": "full", "num_microbatches": 4}
    choice = auto_plan(TINY, world_size=8, global_batch=8, seq_len=SEQ, search=search, max_compiles=2,
                       include=[hand], progress=False)
    compiled = [r for r in choice.ranked if r.compiled]
    skipped = [r for r in choice.ranked if (r.rejected or "").startswith(NOT_COMPILED_BUDGET + "max_compiles=2")]
    assert len([r for r in compiled if not r.included]) == 2 and skipped, choice.table()
    included = [r for r in choice.ranked if r.included]
    assert len(included) == 1 and included[0].compiled and included[0].predicted is not None
    assert included[0].candidate.describe() == "dp_shard=2 tp=2 pp=2 | recompute full | local batch 4 | 1F1B x1, 4 micro-batches"
    # The first compiled is the best estimated of all; what was skipped is estimated no better than it.
    first = next(r for r in compiled if not r.included)
    assert all(first.estimate_s <= r.estimate_s for r in skipped)
    table = choice.table()
    assert "not compiled: the compile budget went to candidates estimated faster" in table
    assert "* included" in table


def _assert_explain_equals(choice, path, fields=FIELDS) -> None:
    """The plan file's configuration, explained again, predicts exactly what the search did; and
    ``choice.mesh()`` + ``choice.plan`` compile to the same memory estimate."""
    best = choice.ranked[0]
    choice.write(str(path))
    report = explain(config=dict(fields), parallel=choice.dims, world_size=choice.context.world_size, plan=str(path),
                     local_batch=choice.local_batch, seq_len=SEQ, optimizer="adamw",
                     num_microbatches=best.candidate.num_microbatches, pp_schedule=best.candidate.pp_schedule or "1F1B")
    assert predicted_of(report) == choice.predicted
    if choice.dims["pp"] == 1:
        net, _ = build_model("example", fields)
        with fake_world(choice.context.world_size):
            ids = torch.zeros(choice.local_batch, SEQ, dtype=torch.long, device="meta")
            pmodel = compile_for_explain(net, choice.plan, choice.mesh("cpu"), (), {"input_ids": ids, "labels": ids})
            priced = dataclasses.replace(optimizer_model("adamw"), foreach=True)
            assert pmodel.memory_report(priced)["peak"] == choice.predicted["peak_bytes"]


@pytest.mark.slow
def test_eight_ranks_with_a_budget_that_rules_some_out(tmp_path):
    """FSDP, TP and 1F1B pipelines on 8 ranks: candidates over the budget are rejected "OOM by ..."
    with their compiled peak above it, the rest ranked by predicted step time, the best's plan file
    and mesh give explain's prediction again."""
    search = {"pp": [1, 2], "pp_schedule": "1F1B", "recompute": ["none", "full"]}
    # Just under plain FSDP's peak: it does not fit, pipelines (half the layers per rank) do.
    budget = explain(config=dict(FIELDS), parallel={"dp_shard": 8}, world_size=8, plan="fsdp", local_batch=1,
                     seq_len=SEQ, optimizer="adamw")["memory"]["peak"] - 1
    choice = auto_plan(TINY, world_size=8, global_batch=8, seq_len=SEQ, search=search, memory_per_device=budget,
                       progress=False)
    fits = [r for r in choice.ranked if r.rejected is None]
    ooms = [r for r in choice.ranked if (r.rejected or "").startswith("OOM by")]
    assert fits and ooms, choice.table()
    assert all(r.predicted["peak_bytes"] <= budget for r in fits)
    assert all(r.predicted["peak_bytes"] > budget for r in ooms)
    assert [r.predicted["step_s"] for r in fits] == sorted(r.predicted["step_s"] for r in fits)
    assert choice.ranked[: len(fits)] == fits  # the rejected ones come after
    # A configuration compiled with full recompute is one that does not fit without (over the
    # budget compiled or by the lower bound, not compiling, or expected over it and so passed
    # over); one that fits without recompute is not compiled again.
    none_of = {r.candidate.degrees_and_pipeline: r for r in choice.ranked if r.candidate.recompute == "none"}
    retried = [r for r in choice.ranked if r.compiled and r.candidate.recompute == "full"]
    assert retried, choice.table()
    for r in retried:
        assert none_of[r.candidate.degrees_and_pipeline].rejected.startswith(
            ("OOM", "does not compile", "not compiled: expected peak")), r.candidate.describe()
    assert any(r.rejected.startswith("not compiled: recompute=none fits") for r in choice.ranked if r.rejected)
    _assert_explain_equals(choice, tmp_path / "plan8.py")
    assert "OOM by" in choice.table()


@pytest.mark.slow
def test_sixty_four_ranks_plan_and_explain_agree_and_search_again_alike(tmp_path):
    """Only tp=2 splits the global batch (tp=1 leaves more data-parallel ranks than sequences, tp=4
    does not divide the KV heads), so one configuration is compiled; a second search ranks the same."""
    choice = auto_plan(TINY, world_size=64, global_batch=32, seq_len=SEQ, search={"pp": 1}, progress=False)
    assert choice.dims == {"dp_replicate": 1, "dp_shard": 32, "cp": 1, "tp": 2, "pp": 1, "ep": 1}
    assert choice.local_batch == 1 and choice.compiled == 1
    reasons = {r.candidate.tp: r.rejected for r in choice.ranked if r.candidate.recompute == "none"}
    assert reasons[1] == "global batch 32 does not split over 64 data-parallel ranks"
    assert "does not divide num_key_value_heads=2" in reasons[4]
    again = auto_plan(TINY, world_size=64, global_batch=32, seq_len=SEQ, search={"pp": 1}, progress=False)
    assert [(r.candidate, r.predicted, r.rejected) for r in again.ranked] == \
        [(r.candidate, r.predicted, r.rejected) for r in choice.ranked]
    _assert_explain_equals(choice, tmp_path / "plan64.py")


WIDE = {**TINY, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 8}


@pytest.mark.slow
def test_a_thousand_ranks_plan_and_explain_agree(tmp_path):
    """1,024 simulated ranks, global batch 512: tp = 2, 4 and 8 split it (each shard of the
    projections divides over the FSDP axis left), tp = 1 does not; the fastest is explained again."""
    choice = auto_plan(WIDE, world_size=1024, global_batch=512, seq_len=SEQ, search={"pp": 1, "recompute": "none"},
                       progress=False)
    assert choice.compiled == 3 and choice.dims["tp"] in (2, 4, 8)
    assert sorted(r.dims["tp"] for r in choice.ranked if r.rejected is None) == [2, 4, 8]
    _assert_explain_equals(choice, tmp_path / "plan1024.py", fields={k: v for k, v in WIDE.items() if k != "base"})


@pytest.mark.slow
def test_cli_prints_the_table_and_writes_the_plan(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "chosen.py"
    assert main(["plan", "--config", str(config), "--world-size", "64", "--global-batch", "32", "--seq-len", str(SEQ),
                 "--search", "pp=1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 compiled, 1 fit" in printed and "dp_shard=32 tp=2" in printed and "does not split" in printed
    namespace = {}
    exec(compile(out.read_text(), str(out), "exec"), namespace)
    assert namespace["parallel"]["tp"] == 2 and namespace["local_batch"] == 1
    assert "fully_shard" in namespace["plan"]({"dp_shard": 32, "tp": 2}, FIELDS)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(config), "--world-size", "64", "--global-batch", "32", "--seq-len", str(SEQ),
              "--search", "pp=1", "--memory-gib", "0.0001"])
    assert exit_.value.code == 2 and "no configuration of 64 ranks fits" in capsys.readouterr().err


def test_auto_plan_is_public_and_checks_its_arguments():
    assert hp.auto_plan is auto_plan
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        auto_plan(TINY, world_size=8, global_batch=0, seq_len=SEQ)
    with pytest.raises(TypeError, match="model_or_config is a config preset name"):
        auto_plan(3, world_size=8, global_batch=8, seq_len=SEQ)
    with pytest.raises(TypeError, match="has no transformers config"):
        auto_plan(torch.nn.Linear(2, 2), world_size=8, global_batch=8, seq_len=SEQ)
