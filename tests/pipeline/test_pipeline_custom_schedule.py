"""Hand-written pipeline schedules and micro-batches cut on a dim other than 0, end to end.

``PipelinePlan(schedule=CustomSchedule({pp_rank: [MetaStep, ...]}))`` runs through the same
executor as the built-in schedules; ``PipelinePlan(batch_dims={name: BatchDimSpec(d)})`` cuts
an input's micro-batches along dim ``d``. On the example Llama with 2 stages (2 layers, the cut at
the second), 2 pp ranks: every case trains SGD steps and checks the loss and every gradient of this
rank's stages against one device on the whole batch. The plans' validation errors are unit tests
(tests/pipeline/test_pipeline_schedule_objects.py).
"""

import copy

import torch
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.pipeline import BatchDimSpec, CustomSchedule
from hyper_parallel.pipeline.schedules import MetaStepType, build_schedule
from hyper_parallel.testing.parity import build_model, error_message, global_batch, run_pipeline_parity
from hyper_parallel.testing.stepper import ParityStepper, batches

LAYERS = 2
SPLIT = ["model.layers.1"]
NUM_MICROBATCHES = 4
COMPUTE = {t.value for t in (MetaStepType.FORWARD, MetaStepType.BACKWARD, MetaStepType.BACKWARD_INPUT,
                             MetaStepType.BACKWARD_WEIGHT)}

# 1F1B on 2 ranks and 4 micro-batches, written by hand: rank 0 warms up with one extra forward.
HAND_1F1B = {
    0: "F0@s0 F1@s0 B0@s0 F2@s0 B1@s0 F3@s0 B2@s0 B3@s0",
    1: "F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1",
}
# Another valid order: GPipe on rank 0; rank 1 splits its backward (input gradients sent at once,
# weight gradients later, the last two swapped) so rank 0's backwards start early.
HAND_MIXED = {
    0: "F0@s0 F1@s0 F2@s0 F3@s0 B0@s0 B1@s0 B2@s0 B3@s0",
    1: "F0@s1 I0@s1 F1@s1 I1@s1 W0@s1 F2@s1 I2@s1 W1@s1 F3@s1 I3@s1 W3@s1 W2@s1",
}


def _written_compute(schedule):
    return {r: [repr(s) for s in steps if s.step_type.value in COMPUTE] for r, steps in schedule.items()}


def _ran(report, rank):
    return [name for name, *_ in report["timeline"][rank]]


def _custom_next_to_builtin(steps: int = 2) -> dict:
    """The hand-written 1F1B and the built-in one side by side with one device: same losses and
    gradients (bitwise between the two pipelines, assert_close defaults against one device)."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    reference = build_model("llama", num_hidden_layers=LAYERS)
    plans = {
        "builtin": hp.PipelinePlan(split_points=SPLIT, schedule="1F1B", num_microbatches=NUM_MICROBATCHES),
        "custom": hp.PipelinePlan(split_points=SPLIT, schedule=CustomSchedule(HAND_1F1B, name="hand-1F1B"),
                                  num_microbatches=NUM_MICROBATCHES),
    }
    models = {k: hp.parallelize(copy.deepcopy(reference), {"pipeline": plan}, mesh) for k, plan in plans.items()}
    builtin, builtin_opt, builtin_losses = models["builtin"], torch.optim.SGD(models["builtin"].parameters(), lr=0.1), []

    def bitwise_equal_to_builtin(record):  # the built-in 1F1B stepped first, on the same batch
        assert torch.equal(record.loss, builtin_losses[-1]), (record.step, record.loss, builtin_losses[-1])
        others = dict(builtin.named_parameters())
        for name, p in models["custom"].named_parameters():
            assert torch.equal(p.grad.full_tensor(), others[name].grad.full_tensor()), (record.step, name)

    def step_builtin(record):
        builtin_opt.step()
        builtin_opt.zero_grad()

    # The hand-written 1F1B against one device on the whole batch (every pp rank gets it).
    stepper = ParityStepper(reference, models["custom"], batch=batches(batch=8), forward=lambda m, b: m.step(b),
                            backward_in_forward=True,
                            before_step=lambda r: builtin_losses.append(builtin.step(r.batch)),
                            after_backward=bitwise_equal_to_builtin, before_optimizer=step_builtin)
    stepper.run(steps)
    return {"losses": stepper.losses, "params": sorted(n for n, _ in models["custom"].named_parameters()),
            "report": models["custom"].pipeline_report(), "summary": models["custom"].compile_summary(),
            "builtin_schedule": models["builtin"]._hp.pipeline.last.schedule,
            "custom_schedule": models["custom"]._hp.pipeline.last.schedule}


def test_hand_written_1f1b_matches_builtin_1f1b_and_one_device(dist2):
    results = dist2.run(_custom_next_to_builtin)
    assert results[0]["losses"] == results[1]["losses"], "every pp rank returns the loss"
    assert not set(results[0]["params"]) & set(results[1]["params"])
    r = results[0]
    # The compute steps as written, with the sends and receives the built-in 1F1B has.
    assert r["custom_schedule"] == r["builtin_schedule"] == build_schedule("1F1B", 2, NUM_MICROBATCHES)
    for rank in (0, 1):
        assert _ran(r["report"], rank) == HAND_1F1B[rank].split(), rank
    assert r["summary"]["schedule"] == r["report"]["schedule"] == "hand-1F1B"
    assert r["report"]["analytic_bubble"] == 1 / (NUM_MICROBATCHES + 1)  # (p-1)/(m+p-1), as 1F1B


def test_hand_written_different_order_matches_one_device(dist2):
    """GPipe order on rank 0, a split backward in its own order on rank 1: at parity, run as written."""
    plan = {"pipeline": {"split_points": SPLIT, "schedule": HAND_MIXED, "num_microbatches": NUM_MICROBATCHES}}
    results = dist2.run(run_pipeline_parity, plan, (2,), ("pp",), num_layers=LAYERS, steps=2)
    assert results[0]["losses"] == results[1]["losses"]
    report = results[0]["report"]
    for rank in (0, 1):
        assert _ran(report, rank) == HAND_MIXED[rank].split(), rank
    # Stage 1's backward is compiled split (I and W programs), stage 0's whole (each in the variant
    # of the stage's first micro-batch, without gradient sums, and the one of the others).
    programs = {1: ("forward", "backward input", "backward weight"), 0: ("forward", "backward")}
    for rank, names in programs.items():
        assert set(results[rank]["summary"]["runs_per_step"]) == {
            f"stage{rank} {name}{variant}" for name in names for variant in ("", " (first micro-batch)")}
    assert results[0]["summary"]["schedule"] == "custom"
    assert 0 <= report["simulated_bubble"] < 1


class SeqFirstLlama(nn.Module):
    """The example Llama taking its inputs laid out [seq, batch] (batch on dim 1)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels):
        return self.inner(input_ids.t(), labels=labels.t())


def _batch_on_dim_1(batch_dims, steps: int = 2) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    reference = SeqFirstLlama(build_model("llama", num_hidden_layers=LAYERS))
    plan = hp.PipelinePlan(split_points=["inner.model.layers.1"], schedule="1F1B", num_microbatches=2,
                           batch_dims=batch_dims)
    parallel = hp.parallelize(copy.deepcopy(reference), {"pipeline": plan}, mesh)

    def seq_first(step):  # [seq=16, batch=4]: micro-batches of 2 sequences each (dim 0 would cut the sequence)
        return {k: v.t().contiguous() for k, v in global_batch("llama", 4, 16, seed=step + 1).items()}

    stepper = ParityStepper(reference, parallel, batch=seq_first, forward=lambda m, b: m.step(b),
                            backward_in_forward=True)
    stepper.run(steps)
    losses = stepper.losses
    # 3 sequences: dim 1 does not divide into 2 micro-batches (raised before anything runs).
    odd = {k: v.t().contiguous() for k, v in global_batch("llama", 3, 16).items()}
    return {"losses": losses, "odd_batch": error_message(parallel.step, odd)}


def test_micro_batches_split_on_dim_1_match_one_device(dist2):
    results = dist2.run(_batch_on_dim_1, {"input_ids": BatchDimSpec(1), "labels": BatchDimSpec(1)})
    assert results[0]["losses"] == results[1]["losses"]
    for r in results:
        assert r["odd_batch"] == (
            "ValueError: pipeline: input 'input_ids' has batch size 3 on dim 1 (BatchDimSpec(1), shape [16, 3]), "
            "which num_microbatches=2 does not divide; use a local batch that is a multiple of num_microbatches"
        ), r["odd_batch"]
