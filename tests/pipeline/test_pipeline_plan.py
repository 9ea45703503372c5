"""PipelinePlan validation: each bad option is a clear error naming it (no mesh needed)."""

import pytest

import hyper_parallel as hp
from hyper_parallel.pipeline.plan import PipelinePlan


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBH1"])
def test_one_stage_per_rank_schedules_are_accepted(schedule):
    assert PipelinePlan.from_value({"schedule": schedule, "num_microbatches": 4}).schedule == schedule


def test_defaults_and_dict_form():
    plan = PipelinePlan.from_value({"split_points": ["model.layers.2"], "schedule": "GPipe"})
    assert plan == hp.PipelinePlan(split_points=("model.layers.2",), schedule="GPipe")
    assert PipelinePlan().split_points == "auto" and PipelinePlan().axis == "pp"


@pytest.mark.parametrize("kwargs, error, message", [
    ({"axis": ""}, TypeError, "must be a mesh axis name"),
    ({"split_points": "model.layers.2"}, TypeError, "must be 'auto' or a list of module FQNs"),
    ({"split_points": ["a", "a"]}, ValueError, "names a module twice"),
    ({"schedule": "ZB"}, ValueError, "schedule='ZB') is not a schedule; choose one of"),
    ({"num_microbatches": 0}, ValueError, "num_microbatches=0) must be a positive integer"),
    ({"num_microbatches": True}, ValueError, "num_microbatches=True) must be a positive integer"),
    ({"schedule": "Interleaved1F1B"}, ValueError, "needs stages_per_rank >= 2"),
    ({"stages_per_rank": 2}, ValueError, "use schedule='Interleaved1F1B' for stages_per_rank > 1"),
    ({"schedule": "ZBH1", "stages_per_rank": 2}, ValueError, "schedule='ZBH1') runs one stage per rank"),
])
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        PipelinePlan(**kwargs)


def test_unknown_keys_and_types():
    with pytest.raises(ValueError, match=r"ParallelPlan.pipeline has unknown keys \['microbatches'\]"):
        PipelinePlan.from_value({"microbatches": 4})
    with pytest.raises(TypeError, match="must be a PipelinePlan or a dict, got int"):
        PipelinePlan.from_value(4)
