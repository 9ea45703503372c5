"""Schedule objects without processes: CustomSchedule (hand-written MetaStep lists) and its checks,
MetaStep.from_str, BatchDimSpec and the micro-batch split along another dim.

The end-to-end runs (parity with one device) are in tests/pipeline/test_pipeline_custom_schedule.py.
"""

import itertools
import types

import pytest
import torch

from hyper_parallel.pipeline import BatchDimSpec, CustomSchedule, MetaStep, MetaStepType, PipelinePlan
from hyper_parallel.pipeline.micro_batches import input_names, leaf_specs, micro_batches
from hyper_parallel.pipeline.plan import resolve_pipeline
from hyper_parallel.pipeline.schedules import (
    SCHEDULES, analytic_bubble, build_schedule, equal_stage_bubble, peak_in_flight, split_backward_stages,
)

T = MetaStepType
COMPUTE = (T.FORWARD, T.BACKWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT)
ONE_F_ONE_B = {0: "F0@s0 F1@s0 B0@s0 F2@s0 B1@s0 F3@s0 B2@s0 B3@s0",
               1: "F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1"}


def built_cases():
    for name, p, m, v in itertools.product(SCHEDULES, (1, 2, 3), (1, 2, 4), (1, 2)):
        if (name == "Interleaved1F1B") == (v == 2) and not (name == "Interleaved1F1B" and m % p):
            yield name, p, m, v


def compute_only(schedule):
    return {r: [s for s in steps if s.step_type in COMPUTE] for r, steps in schedule.items()}


def build_error(steps, num_stages=2, num_microbatches=4, **kwargs):
    with pytest.raises(ValueError) as err:
        CustomSchedule(steps).build(num_stages, num_microbatches, **kwargs)
    return str(err.value)


# --- CustomSchedule: the built-in schedules written by hand -------------------------------------

@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_every_built_schedule_written_by_hand_builds_the_same(overlap_p2p):
    """The compute steps of each built schedule, as a CustomSchedule, get the same sends and receives;
    written in full (sends and receives too) they are taken as they are."""
    for name, p, m, v in built_cases():
        built = build_schedule(name, p, m, v, overlap_p2p=overlap_p2p)
        assert CustomSchedule(compute_only(built)).build(p * v, m, overlap_p2p) == built, (name, p, m, v)
        assert CustomSchedule(built).build(p * v, m) == built, (name, p, m, v)


def test_written_forms_strings_lists_and_dicts():
    as_strings = CustomSchedule(ONE_F_ONE_B)
    as_tokens = CustomSchedule([ONE_F_ONE_B[0].split(), ONE_F_ONE_B[1].split()])
    as_steps = CustomSchedule({r: [MetaStep.from_str(t) for t in text.split()] for r, text in ONE_F_ONE_B.items()})
    assert as_strings == as_tokens == as_steps and hash(as_strings) == hash(as_steps)
    assert as_strings.num_ranks == 2 and not as_strings.writes_p2p
    assert as_strings.as_dict()[1][1] == MetaStep(T.BACKWARD, 1, 0)
    assert eval(repr(as_strings), {"CustomSchedule": CustomSchedule}) == as_strings
    assert as_strings.build(2, 4) == build_schedule("1F1B", 2, 4)


def test_meta_step_from_str_inverts_repr():
    for name, p, m, v in built_cases():
        for steps in build_schedule(name, p, m, v).values():
            assert [MetaStep.from_str(repr(s)) for s in steps] == steps
    for bad, message in [("F0s1", "expected <type><micro-batch>@s<stage>"), ("OFB0@s0", "expected"),
                         ("FS0@s0<s1", "a FWD_SEND names its peer with '>s<peer>'"), (3, "expected")]:
        with pytest.raises(ValueError, match=message):
            MetaStep.from_str(bad)
    with pytest.raises(TypeError, match="stage must be an int"):
        MetaStep(T.FORWARD, "0", 0)
    with pytest.raises(TypeError, match="must be a MetaStepType"):
        MetaStep("F", 0, 0)


# --- CustomSchedule: invalid lists name the rank, the step and the MetaStep ----------------------

def test_missing_backward_names_rank_and_its_forward():
    message = build_error({0: ONE_F_ONE_B[0], 1: "F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1"})
    assert message.startswith("CustomSchedule 'custom': rank 1 has no BACKWARD of micro-batch 3 for stage 1; "
                              "expected B3@s1 after its FORWARD at rank 1 step 6 (F3@s1)"), message


def test_duplicate_forward_names_both_steps():
    message = build_error({0: "F0@s0 F1@s0 B0@s0 F2@s0 F1@s0 B1@s0 F3@s0 B2@s0 B3@s0", 1: ONE_F_ONE_B[1]})
    assert message == "CustomSchedule 'custom': rank 0 step 4 (F1@s0) duplicates rank 0 step 1 (F1@s0)"


def test_deadlocking_order_names_each_blocked_step():
    # Rank 0 waits for B0's gradient before it runs F1; rank 1 wants F1 before it runs B0.
    message = build_error({0: "F0@s0 B0@s0 F1@s0 B1@s0 F2@s0 B2@s0 F3@s0 B3@s0",
                           1: "F0@s1 F1@s1 B0@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1"})
    first = message.splitlines()[0]
    assert first == ("CustomSchedule 'custom': schedule deadlocks: rank 0 step 1 (B0@s0) waits for BS0@s1 (rank 1); "
                     "rank 1 step 1 (F1@s1) waits for FS1@s0 (rank 0)"), first
    assert "rank 0" in message.splitlines()[1]  # the schedule's grid follows


def test_deadlock_in_a_schedule_with_its_own_sends_and_receives():
    full = {0: "F0@s0 FS0@s0>s1 BR0@s0<s1 B0@s0 F1@s0 FS1@s0>s1 BR1@s0<s1 B1@s0",
            1: "FR0@s1<s0 F0@s1 FR1@s1<s0 F1@s1 B0@s1 BS0@s1>s0 B1@s1 BS1@s1>s0"}
    assert CustomSchedule(full).writes_p2p
    message = build_error(full, num_microbatches=2)
    assert "rank 0 step 3 (B0@s0) waits for BS0@s1 (rank 1)" in message
    assert "rank 1 step 3 (F1@s1) waits for FS1@s0 (rank 0)" in message
    with pytest.raises(ValueError, match="overlap_p2p=True moves the sends and receives it adds"):
        CustomSchedule(full).build(2, 2, overlap_p2p=True)


@pytest.mark.parametrize("steps, expected", [
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "B0@s1 F0@s1 F1@s1 B1@s1"},
     "rank 1 step 0 (B0@s1) comes before its forward at step 1"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 F1@s1 B0@s1"},
     "rank 1 has no BACKWARD of micro-batch 1 for stage 1; expected B1@s1 after its FORWARD at rank 1 step 1"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 B0@s1 B1@s1"},
     "rank 1 has no FORWARD of micro-batch 1 for stage 1; expected F1@s1 before its BACKWARD at rank 1 step 2"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0 F0@s1", 1: "F0@s1 F1@s1 B0@s1 B1@s1"},
     "rank 0 step 4 (F0@s1): stage 1 lives on rank 1"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 F1@s1 B0@s1 B1@s1 F2@s1"},
     "rank 1 step 4 (F2@s1): stage or micro-batch out of range"),
    # Rank 1 takes the forwards in another order than rank 0 sends them: wrong on NCCL / HCCL.
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F1@s1 F0@s1 B0@s1 B1@s1"},
     "rank 1 step 0 (FR1@s1<s0) is receive 0 of rank 1 from rank 0, but send 0 of rank 0 to rank 1 is "
     "rank 0 step 0 (FS0@s0>s1)"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 F1@s1 I0@s1 B1@s1 W0@s1"},
     "rank 1 step 3 (B1@s1): stage 1 already runs BACKWARD_INPUT at step 2; a stage's backward is whole"),
    ({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 F1@s1 I0@s1 W1@s1 I1@s1 W0@s1"},
     "rank 1 step 3 (W1@s1) comes before its BACKWARD_INPUT at step 4"),
    ({0: [MetaStep(T.FORWARD, 0, 0), MetaStep(T.FORWARD, 0, 1), MetaStep(T.BACKWARD, 0, 0), MetaStep(T.BACKWARD, 0, 1)],
      1: [MetaStep(T.FORWARD, 1, 0), MetaStep(T.OVERLAP_F_B, 1, 0, sub_steps=(MetaStep(T.FORWARD, 1, 1),
                                                                            MetaStep(T.BACKWARD, 1, 0))),
          MetaStep(T.BACKWARD, 1, 1)]},
     "does not run OVERLAP_F_B steps"),
])
def test_invalid_schedules_name_rank_and_step(steps, expected):
    message = build_error(steps, num_microbatches=2)
    assert message.startswith("CustomSchedule 'custom': ") and expected in message, message


def test_custom_p2p_errors_name_the_written_steps():
    full = build_schedule("1F1B", 2, 2)
    full[1] = [s for s in full[1] if repr(s) != "FR1@s1<s0"]
    assert "rank 0 step 3 (FS1@s0>s1) has no matching FWD_RECV FR1@s1<s0 on rank 1" in build_error(full, 2, 2)


def test_bad_step_lists_are_refused_when_written():
    with pytest.raises(ValueError, match=r"CustomSchedule rank 1 step 2: MetaStep.from_str\('X0@s1'\)"):
        CustomSchedule({0: "F0@s0", 1: "F0@s1 B0@s1 X0@s1"})
    with pytest.raises(TypeError, match="CustomSchedule rank 0 step 1 is 7, not a MetaStep"):
        CustomSchedule([[MetaStep(T.FORWARD, 0, 0), 7]])
    with pytest.raises(ValueError, match="needs the pp ranks 0..N-1 as keys, got \\[1, 2\\]"):
        CustomSchedule({1: "F0@s0", 2: "F0@s1"})
    with pytest.raises(TypeError, match="takes {pp_rank: \\[MetaStep, ...\\]}"):
        CustomSchedule("F0@s0 B0@s0")


# --- PipelinePlan(schedule=CustomSchedule / dict) ------------------------------------------------

def test_plan_takes_a_custom_schedule_and_checks_it_without_a_mesh():
    plan = PipelinePlan(split_points=["layers.1"], schedule=ONE_F_ONE_B, num_microbatches=4)
    assert isinstance(plan.schedule, CustomSchedule) and plan.schedule_name == "custom"
    assert plan == PipelinePlan.from_value({"split_points": ["layers.1"], "schedule": CustomSchedule(ONE_F_ONE_B),
                                            "num_microbatches": 4})
    assert hash(plan) == hash(PipelinePlan(split_points=["layers.1"], schedule=ONE_F_ONE_B, num_microbatches=4))
    assert plan.rank_schedules(2) == build_schedule("1F1B", 2, 4)
    assert PipelinePlan(schedule="GPipe").schedule_name == "GPipe"
    with pytest.raises(ValueError, match="CustomSchedule 'custom': schedule deadlocks: rank 0 step 1 \\(B0@s0\\)"):
        PipelinePlan(schedule={0: "F0@s0 B0@s0 F1@s0 B1@s0", 1: "F0@s1 F1@s1 B0@s1 B1@s1"})
    with pytest.raises(ValueError, match=r"PipelinePlan\(num_microbatches=2\): the schedule 'custom' runs "
                                         r"micro-batches 0..3; set num_microbatches=4"):
        PipelinePlan(schedule=ONE_F_ONE_B)
    interleaved = compute_only(build_schedule("Interleaved1F1B", 2, 2, 2))
    with pytest.raises(ValueError, match=r"stages 0..3 on its 2 ranks; set stages_per_rank=2"):
        PipelinePlan(schedule=interleaved)
    assert PipelinePlan(schedule=interleaved, stages_per_rank=2).rank_schedules(2) == build_schedule(
        "Interleaved1F1B", 2, 2, 2)
    with pytest.raises(ValueError, match="is not a schedule; choose one of .* hp.CustomSchedule"):
        PipelinePlan(schedule=3)


def test_resolve_refuses_a_schedule_for_another_pp_degree():
    mesh = types.SimpleNamespace(mesh_dim_names=("pp",), size=lambda i: 4, get_local_rank=lambda axis: 0)
    plan = PipelinePlan(split_points=["0", "1", "2"], schedule=ONE_F_ONE_B, num_microbatches=4)
    with pytest.raises(ValueError, match="has steps for 2 pp ranks, but the 'pp' axis has 4"):
        resolve_pipeline(plan, torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)]), mesh)


def test_schedule_measures():
    for name, p, m, v in built_cases():
        built = build_schedule(name, p, m, v)
        assert equal_stage_bubble(built) == pytest.approx(analytic_bubble(p, m, v, name)), (name, p, m, v)
    assert peak_in_flight(build_schedule("GPipe", 2, 4)) == 4
    assert peak_in_flight(build_schedule("1F1B", 2, 4)) == 2
    mixed = CustomSchedule({0: "F0@s0 F1@s0 B0@s0 B1@s0", 1: "F0@s1 I0@s1 F1@s1 I1@s1 W1@s1 W0@s1"}).build(2, 2)
    assert split_backward_stages(mixed) == {1}
    assert 0 < equal_stage_bubble(mixed) < 1


# --- BatchDimSpec and the micro-batch split ------------------------------------------------------

def test_batch_dim_spec():
    assert BatchDimSpec(1).batch_dim == 1 and repr(BatchDimSpec(1)) == "BatchDimSpec(1)"
    assert BatchDimSpec(None).batch_dim is None
    assert BatchDimSpec.from_tuple((0, 1, None)) == (BatchDimSpec(0), BatchDimSpec(1), BatchDimSpec(None))
    assert BatchDimSpec.from_dict({"x": 1}) == {"x": BatchDimSpec(1)}
    with pytest.raises(ValueError, match="counted from the front"):
        BatchDimSpec(-1)
    with pytest.raises(TypeError, match="must be an int >= 0 or None"):
        BatchDimSpec(1.0)
    with pytest.raises(TypeError, match="takes a tuple"):
        BatchDimSpec.from_tuple([1])


def test_plan_batch_dims_forms():
    expected = {"x": BatchDimSpec(1), "mask": BatchDimSpec(None)}
    assert PipelinePlan(batch_dims={"x": 1, "mask": None}).batch_dims == expected
    every = {"*": BatchDimSpec(1)}
    assert PipelinePlan(batch_dims=1).batch_dims == PipelinePlan(batch_dims=BatchDimSpec(1)).batch_dims == every
    assert PipelinePlan().batch_dims == {} and PipelinePlan(batch_dims=None).batch_dims == {}
    assert PipelinePlan.from_value({"batch_dims": {"x": 1}}) == PipelinePlan(batch_dims={"x": BatchDimSpec(1)})
    with pytest.raises(ValueError, match=r"PipelinePlan\(batch_dims\)\['x'\]: BatchDimSpec\(batch_dim=-1\)"):
        PipelinePlan(batch_dims={"x": -1})
    with pytest.raises(TypeError, match="must map input names to BatchDimSpec"):
        PipelinePlan(batch_dims=[1])


def test_micro_batches_cut_each_input_on_its_dim():
    x = torch.arange(24.0).reshape(3, 8)  # [seq, batch]
    y = torch.arange(8.0)
    table = torch.ones(5)
    mbs = micro_batches([x, y, table, "note"], 4, ["x", "y", "table", "note"],
                        [BatchDimSpec(1), BatchDimSpec(0), BatchDimSpec(None), BatchDimSpec(0)])
    assert len(mbs) == 4
    for mb, (xm, ym, tm, note) in enumerate(mbs):
        assert torch.equal(xm, x[:, 2 * mb:2 * mb + 2]) and xm.is_contiguous()
        assert torch.equal(ym, y[2 * mb:2 * mb + 2])
        assert tm is table and note == "note"
    with pytest.raises(ValueError, match=r"input 'x' has batch size 8 on dim 1 \(BatchDimSpec\(1\), shape \[3, 8\]\), "
                                         r"which num_microbatches=3 does not divide"):
        micro_batches([x], 3, ["x"], [BatchDimSpec(1)])
    with pytest.raises(ValueError, match=r"input 'y' has shape \[8\], with no batch dim 1"):
        micro_batches([y], 2, ["y"], [BatchDimSpec(1)])


def test_inputs_are_named_by_forward_arguments():
    def forward(input_ids, labels=None, *, mask=None):
        pass

    assert input_names(forward, 2, {"mask": 0}, with_targets=False) == ["input_ids", "labels", "mask"]
    assert input_names(forward, 2, {}, with_targets=True) == ["input_ids", "targets"]
    args, kwargs = (torch.zeros(4, 2), {"a": torch.zeros(4, 2), "b": torch.zeros(2)}), {"mask": torch.zeros(4, 2)}
    names = input_names(forward, 2, kwargs, with_targets=False)
    labels, specs = leaf_specs(args, kwargs, names, {"input_ids": BatchDimSpec(1), "*": BatchDimSpec(None)}, forward)
    assert labels == ["input_ids", "labels['a']", "labels['b']", "mask"]
    assert specs == [BatchDimSpec(1), BatchDimSpec(None), BatchDimSpec(None), BatchDimSpec(None)]
    with pytest.raises(ValueError, match=r"names \['input_idz'\], which are neither inputs of this step nor arguments"):
        leaf_specs(args, kwargs, names, {"input_idz": BatchDimSpec(1)}, forward)
