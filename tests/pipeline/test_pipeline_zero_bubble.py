"""Zero-bubble pipeline schedule ZB-H1 end to end: parity with one device, order, reductions per step.

``PipelinePlan(schedule="ZBH1")`` splits every stage's backward (both the no-sync and the sync
variant) into an input-gradient program I and a weight-gradient program W
(``runtime/partition.py:split_backward``) and the executor runs them as the schedule's
BACKWARD_INPUT / BACKWARD_WEIGHT steps (``pipeline/runtime.py``). Every parity case trains 3 SGD
steps and checks the loss and every gradient of this rank's stages against the single-device model
on the whole batch: pp=2 (without, and with ``overlap_p2p`` and padded labels), pp=2 x dp=2 with
DP and with FSDP (padded labels; gradients reduced once per step, in the stage's last W), and a
stage without parameters (its W computes nothing).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.pipeline.schedules import MetaStepType, analytic_bubble, build_schedule
from hyper_parallel.testing.parity import build_model, run_pipeline_parity
from hyper_parallel.testing.stepper import ParityStepper
# The PP x DP / PP x FSDP parity job of the 1F1B / GPipe / interleaved cases (4 ranks, padded labels,
# measured gradient-reduction bytes), run here with schedule="ZBH1".
from test_pipeline_grad_sync import LAYERS, NUM_MICROBATCHES, FSDP, _summary_reduction_bytes, pipeline_parity

COMPUTE = (MetaStepType.FORWARD, MetaStepType.BACKWARD_INPUT, MetaStepType.BACKWARD_WEIGHT)


def _zbh1(split_points, **extra):
    return {"pipeline": {"split_points": split_points, "schedule": "ZBH1", "num_microbatches": NUM_MICROBATCHES,
                         **extra}}


def _executed_order_is_the_schedules(results, num_ranks):
    """Each rank ran its compute steps exactly in the schedule's order (I before its W, W delayed)."""
    schedule = build_schedule("ZBH1", num_ranks, NUM_MICROBATCHES)
    for rank in range(num_ranks):
        ran = [name for name, *_ in results[0]["report"]["timeline"][rank]]
        assert ran == [repr(s) for s in schedule[rank] if s.step_type in COMPUTE], (rank, ran)
    # On the last stage each W waits one I: W0 runs after I1 (rank 0 of two runs W right after I).
    last = [name for name, *_ in results[0]["report"]["timeline"][num_ranks - 1]]
    assert last.index("I0@s1") < last.index("I1@s1") < last.index("W0@s1"), last


# Each case compiles for ~10 s here, so overlap_p2p shares a run with padded labels (which the
# pp x dp cases below also use without overlap_p2p).
@pytest.mark.parametrize("overlap_p2p, ignore_fraction", [(False, 0.0), (True, 0.3)],
                         ids=["plain", "overlap_p2p-padded_labels"])
def test_two_stages_match_single_device(dist2, overlap_p2p, ignore_fraction):
    plan = _zbh1(["model.layers.1"], overlap_p2p=overlap_p2p)
    # Padded labels: the last row is all -100 and a third of the rest, so the micro-batches count
    # different numbers of tokens; the loss is still the mean over the step's tokens.
    results = dist2.run(run_pipeline_parity, plan, (2,), ("pp",), num_layers=LAYERS, ignore_fraction=ignore_fraction)
    assert results[0]["losses"] == results[1]["losses"], "every pp rank returns the loss"
    assert not set(results[0]["params"]) & set(results[1]["params"])
    assert set(results[0]["params"]) | set(results[1]["params"]) == set(results[0]["all_params"])
    _executed_order_is_the_schedules(results, 2)
    for rank, r in enumerate(results):
        # A one-rank stage mesh reduces nothing: the stage's first micro-batch runs the variant
        # without gradient sums, the others the one adding into them; each backward split in two,
        # the split programs replace the whole backward in the summary.
        names = ("backward input", "backward weight", "forward")
        assert r["summary"]["runs_per_step"] == {**{f"stage{rank} {name}": NUM_MICROBATCHES - 1 for name in names},
                                                 **{f"stage{rank} {name} (first micro-batch)": 1 for name in names}}
        assert f"stage{rank} backward" not in r["summary"]["collectives"]
    report = results[0]["report"]
    assert report["analytic_bubble"] == analytic_bubble(2, NUM_MICROBATCHES, schedule="ZBH1") == pytest.approx(1 / 13)
    assert 0 <= report["simulated_bubble"] < 1


@pytest.mark.parametrize("family", ["dp", "fsdp"])
def test_pp_by_dp_reduces_gradients_once_per_step_in_the_last_w(dist4, family):
    """pp=2 x dp=2, padded labels (ranks and micro-batches count different tokens). Parity is asserted
    on every rank inside the job; per step, the pp ranks of one dp coordinate reduce each parameter's
    gradient once (the model's fp32 bytes: what the plan without a pipeline reduces, see
    test_pipeline_grad_sync.py), measured while the steps run and in the compile summary."""
    plan = {"dp": {}, "fsdp": FSDP}[family]
    results = dist4.run(pipeline_parity, plan, ["model.layers.1"], "ZBH1")
    assert len({tuple(r["losses"]) for r in results}) == 1, "every rank returns the step's loss"
    model = build_model("llama", num_hidden_layers=LAYERS)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for dp in (0, 1):
        ranks = [r for r in results if r["rank"] % 2 == dp]
        for step in range(2):
            assert sum(r["measured"][step] for r in ranks) == param_bytes, (family, step)
        assert sum(_summary_reduction_bytes(r["summary"]["gradient_reductions_per_step"]) for r in ranks) == param_bytes
    assert set(results[0]["params"]) | set(results[2]["params"]) == {n for n, _ in model.named_parameters()}
    for r in results:
        summary, (s,) = r["summary"], r["summary"]["local_stages"]
        runs = summary["runs_per_step"]
        # Every variant is split; the sync one runs the stage's last micro-batch (I and W), the
        # first one its first micro-batch, the no-sync one the others.
        for name in ("forward", "backward input", "backward weight"):
            assert runs[f"stage{s} {name}"] == 1 and runs[f"stage{s} {name} (first micro-batch)"] == 1, runs
            assert runs[f"stage{s} {name} (no sync)"] == NUM_MICROBATCHES - 2, runs
        colls = summary["collectives"]
        # The reductions are in the sync variant's W only: I (whose outputs the previous stage waits
        # for) and every other variant's programs reduce nothing over dp.
        assert _summary_reduction_bytes(colls[f"stage{s} backward weight"]) > 0
        for name in ("backward input", "backward input (no sync)", "backward weight (no sync)",
                     "backward input (first micro-batch)", "backward weight (first micro-batch)"):
            assert _summary_reduction_bytes(colls[f"stage{s} {name}"]) == 0, (name, colls[f"stage{s} {name}"])
        pp_rank = r["rank"] // 2
        assert r["report"]["gradient_reductions_per_step"][pp_rank] == summary["gradient_reductions_per_step"]
        ran = [name for name, *_ in r["report"]["timeline"][pp_rank]]
        assert ran == [repr(x) for x in build_schedule("ZBH1", 2, NUM_MICROBATCHES)[pp_rank] if x.step_type in COMPUTE]


class Squash(nn.Module):
    """Parameter-free."""

    def forward(self, h):
        return torch.tanh(h) * 2.0


class FreeEnds(nn.Module):
    """A parameter-free module on each side of an MLP, the loss computed in forward."""

    def __init__(self):
        super().__init__()
        self.pre = Squash()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.post = Squash()

    def forward(self, x, target):
        return nn.functional.mse_loss(self.post(self.body(self.pre(x))), target)


def free_stage_parity(split_point: str, steps: int = 3) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    reference = FreeEnds()
    plan = {"pipeline": hp.PipelinePlan(split_points=[split_point], schedule="ZBH1", num_microbatches=NUM_MICROBATCHES)}
    pmodel = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    g = torch.Generator().manual_seed(1)
    ParityStepper(reference, pmodel, batch=lambda step: {"x": torch.randn(8, 16, generator=g),
                                                         "target": torch.randn(8, 16, generator=g)},
                  forward=lambda m, b: m.step(b), backward_in_forward=True).run(steps)
    entry = pmodel._hp.pipeline.last
    (program,) = entry.programs.values()
    ops = {name: sum(1 for n in gm.graph.nodes if n.op == "call_function")
           for name, gm in (("input", program.split.input_gm), ("weight", program.split.weight_gm))}
    # The end-of-step check covers the I -> W hand-offs: a schedule that drops this rank's last W
    # (W steps never communicate, so the ranks stay matched) ends with an error, not a silent gap.
    executor = copy.copy(entry.executor)
    executor.schedule = [x for x in executor.schedule if repr(x) != f"W{NUM_MICROBATCHES - 1}@s{program.stage}"]
    x, target = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    try:
        executor.run(pmodel, [list(mb) for mb in zip(x.chunk(NUM_MICROBATCHES), target.chunk(NUM_MICROBATCHES))])
        leak = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        leak = str(exc)
    return {"rank": dist.get_rank(), "params": sorted(n for n, _ in pmodel.named_parameters()), "ops": ops,
            "runs": pmodel.compile_summary()["runs_per_step"], "leak": leak}


@pytest.mark.parametrize("split_point, free_stage", [("body", 0), ("post", 1)])
def test_stage_without_parameters(dist2, split_point, free_stage):
    """Stage 0 without parameters has no backward at all (its input needs no gradient); a last stage
    without parameters has input gradients (sent back) but no weight gradients: either way its W
    computes nothing, still runs once per micro-batch, and the other stage matches one device."""
    results = dist2.run(free_stage_parity, split_point)
    free, other = results[free_stage], results[1 - free_stage]
    assert free["params"] == [] and other["params"] == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"]
    assert free["ops"]["weight"] == 0 and other["ops"]["weight"] > 0
    assert (free["ops"]["input"] > 0) == (free_stage == 1)  # the last stage's loss gradient, sent back
    assert free["runs"][f"stage{free_stage} backward weight"] == NUM_MICROBATCHES
    for rank, r in enumerate(results):
        assert f"input-gradient hand-offs of (stage, micro-batch) [({rank}, 3)], whose BACKWARD_WEIGHT did not " \
               "run" in r["leak"], r["leak"]
