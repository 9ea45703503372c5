"""Expert-parallel plan entries (hp.ExpertParallel) and the unused-mesh-axis check, without
process groups: meshes are hp.Layout stand-ins with the same axis names and sizes."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.layout import Layout, format_placements
from hyper_parallel.models.moe import MoEConfig, MoEForCausalLM
from hyper_parallel.plan import ParallelPlan, merge_plans, resolve_plan
from hyper_parallel.plan.resolver import check_mesh_axes_used

EXPERTS = "model.layers.*.mlp.experts"


def _moe(**overrides):
    torch.manual_seed(0)
    return MoEForCausalLM(MoEConfig(num_hidden_layers=2, **overrides))


def _ep_plan(**style):
    return ParallelPlan(expert_parallel={EXPERTS: hp.ExpertParallel(**style)})


def test_expert_weights_shard_over_ep_and_ep_is_data_parallel():
    resolved = resolve_plan(_ep_plan(), _moe(), Layout((2, 2), ("dp", "ep")))
    assert resolved.data_parallel_axes == ("dp", "ep")
    assert resolved.param_placements["model.layers.0.mlp.experts.gate_proj"] == (Replicate(), Shard(0))
    assert resolved.param_placements["model.layers.1.mlp.experts.down_proj"] == (Replicate(), Shard(0))
    assert resolved.param_placements["model.layers.0.mlp.router.gate.weight"] == (Replicate(), Replicate())
    region = resolved.experts["model.layers.1.mlp.experts"]
    assert (region.axis, region.degree, region.num_experts, region.local_experts) == ("ep", 2, 4, 2)
    assert region.param_names == ("gate_proj", "up_proj", "down_proj")
    assert resolved.input_placements("input_ids", 2) == (Shard(0), Shard(0))


def test_named_axis_and_yaml_forms():
    plan = ParallelPlan.from_dict({"expert_parallel": {EXPERTS: {"style": "expert_parallel", "axis": "moe"}}})
    assert plan.expert_parallel[EXPERTS] == hp.ExpertParallel(axis="moe")
    assert ParallelPlan(expert_parallel={EXPERTS: "expert_parallel"}).expert_parallel[EXPERTS] == hp.ExpertParallel()
    resolved = resolve_plan(plan, _moe(), Layout((2,), ("moe",)))
    assert resolved.data_parallel_axes == ("moe",)
    merged = merge_plans(plan, {"expert_parallel": {EXPERTS: hp.ExpertParallel(axis="moe")}})
    assert merged.expert_parallel == plan.expert_parallel
    with pytest.raises(ValueError, match=r"expert_parallel\['model.layers.\*.mlp.experts'\] is given twice with different styles"):
        merge_plans(plan, _ep_plan())
    with pytest.raises(TypeError, match=r"expert_parallel\['x'\]: expected hp.ExpertParallel\(\)"):
        ParallelPlan(expert_parallel={"x": "colwise"})


def test_without_the_axis_experts_stay_whole():
    resolved = resolve_plan(_ep_plan(), _moe(), Layout((2,), ("dp",)))
    region = resolved.experts["model.layers.0.mlp.experts"]
    assert (region.axis, region.degree, region.local_experts) == (None, 1, 4)
    assert resolved.param_placements["model.layers.0.mlp.experts.up_proj"] == (Replicate(),)


def test_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match=r"module 'model.layers.0.mlp.experts' has 4 experts, which mesh axis 'ep' "
                                         r"of size 3 does not divide .* from \[1, 2, 4\]"):
        resolve_plan(_ep_plan(), _moe(), Layout((3,), ("ep",)))


def test_module_without_stacked_expert_weights():
    plan = ParallelPlan(expert_parallel={"model.layers.*.mlp": hp.ExpertParallel()})
    with pytest.raises(TypeError, match=r"ExpertParallel on module 'model.layers.0.mlp' \(MoEBlock\) needs a module "
                                        r"that holds the stacked expert weights itself.*\['experts', 'router'\]"):
        resolve_plan(plan, _moe(), Layout((2,), ("ep",)))
    plan = ParallelPlan(expert_parallel={"model.layers.*.mlp.router.gate": hp.ExpertParallel()})
    with pytest.raises(TypeError, match=r"needs stacked expert weight matrices \[num_experts, in, out\], but its "
                                        r"parameters are \{'weight': \(4, 64\)\}"):
        resolve_plan(plan, _moe(), Layout((2,), ("ep",)))


def test_glob_matching_no_module():
    plan = ParallelPlan(expert_parallel={"model.layers.*.moe.experts": hp.ExpertParallel()})
    with pytest.raises(ValueError, match=r"expert_parallel.*model.layers.\*.moe.experts.*matches no module"):
        resolve_plan(plan, _moe(), Layout((2,), ("ep",)))


@pytest.mark.parametrize("axis, plan, fix", [
    ("ep", {}, r"add expert_parallel=\{'model.layers.\*.mlp.experts': hp.ExpertParallel\(\)\}"),
    ("cp", {}, r"add context_parallel=\{.model.layers.\*.self_attn.: hp.ContextParallel\(\)\} to shard the sequence"),
    ("tp", {}, r"add tensor_parallel entries"),
    ("moe", {"expert_parallel": {EXPERTS: hp.ExpertParallel(axis="moe")}}, None),
    ("stuff", {}, r"shard on it in a plan entry, or name it 'dp_shard' / 'dp_replicate'"),
])
def test_an_axis_no_entry_uses_is_an_error(axis, plan, fix):
    """A mesh axis that no plan entry uses and that is not data-parallel would only repeat the
    same computation on its ranks: a ValueError naming the axis and the entry that would use it."""
    plan = ParallelPlan.from_dict(plan)
    resolved = resolve_plan(plan, _moe(), Layout((2, 2), ("dp", axis)))
    if fix is None:
        check_mesh_axes_used(resolved, plan)
        return
    with pytest.raises(ValueError, match=rf"mesh axis '{axis}' \(size 2\) is used by no plan entry .*; {fix}"):
        check_mesh_axes_used(resolved, plan)


def test_size_one_axes_and_used_axes_pass():
    model = _moe()
    plan = ParallelPlan.from_dict({"expert_parallel": {EXPERTS: hp.ExpertParallel()},
                                   "tensor_parallel": {"model.layers.*.self_attn.q_proj": "colwise"}})
    check_mesh_axes_used(resolve_plan(plan, model, Layout((2, 2, 1), ("ep", "tp", "cp"))), plan)


def test_ep_times_other_degrees_must_equal_the_world():
    with pytest.raises(ValueError, match=r"ep\(2\) = 8, but world_size is 4"):
        hp.ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4)


def test_expert_tensor_parallel_splits_each_expert():
    plan = ParallelPlan(expert_parallel={EXPERTS: hp.ExpertTensorParallel()})
    resolved = resolve_plan(plan, _moe(), Layout((2, 2), ("ep", "tp")))
    assert resolved.data_parallel_axes == ("ep",)
    p = resolved.param_placements
    assert p["model.layers.0.mlp.experts.gate_proj"] == (Shard(0), Shard(2))
    assert p["model.layers.0.mlp.experts.up_proj"] == (Shard(0), Shard(2))
    assert p["model.layers.0.mlp.experts.down_proj"] == (Shard(0), Shard(1))
    region = resolved.experts["model.layers.0.mlp.experts"]
    assert (region.tp_axis, region.tp_degree, dict(region.tp_dims)) == ("tp", 2, {"gate_proj": 2, "up_proj": 2, "down_proj": 1})
    # Without expert parallelism (the reference's TensorParallel on expert weights).
    plan = ParallelPlan(expert_parallel={EXPERTS: hp.ExpertWeightTensorParallel()})
    resolved = resolve_plan(plan, _moe(), Layout((2,), ("tp",)))
    assert resolved.param_placements["model.layers.1.mlp.experts.down_proj"] == (Shard(1),)
    assert resolved.data_parallel_axes == ()
    assert repr(hp.ExpertWeightTensorParallel()) == "ExpertWeightTensorParallel()"
    assert ParallelPlan.from_dict({"expert_parallel": {EXPERTS: {"style": "expert_tensor_parallel", "tp_axis": "etp"}}}
                                  ).expert_parallel[EXPERTS] == hp.ExpertTensorParallel(tp_axis="etp")


def test_expert_tensor_parallel_splits_a_fused_gate_up_weight_as_two_halves():
    """HF keeps gate and up in one [E, 2I, H] weight that its forward splits with chunk(2): a
    contiguous split over tp would hand one rank all of gate and the other all of up (a silently
    wrong result), so the dim is split as two halves, each over tp (a strided shard). Interleaved
    gate/up (``is_concatenated=False``) is split plainly, in whole pairs; other size ratios are refused."""
    from hyper_parallel.models.hf_zoo import tiny_hf_model

    model = tiny_hf_model("MixtralForCausalLM")
    mesh = Layout((2, 2), ("ep", "tp"))
    style = hp.ExpertTensorParallel(shard_dims={"gate_up_proj": 1, "down_proj": 2})
    region = resolve_plan(ParallelPlan(expert_parallel={EXPERTS: style}), model, mesh).experts["model.layers.0.mlp.experts"]
    assert format_placements(region.weight_placements("gate_up_proj")) == format_placements(
        (Shard(0), compat.StridedShard(1, split_factor=2)))
    assert region.weight_placements("down_proj") == (Shard(0), Shard(2))
    experts = model.model.layers[0].mlp.experts
    experts.is_concatenated = False
    try:
        region = resolve_plan(ParallelPlan(expert_parallel={EXPERTS: style}), model, mesh).experts["model.layers.0.mlp.experts"]
        assert region.weight_placements("gate_up_proj") == (Shard(0), Shard(1))
    finally:
        experts.is_concatenated = True
    # gate_proj's dim 1 is the hidden size (64), four times the intermediate size (16).
    bad = hp.ExpertTensorParallel(shard_dims={"gate_proj": 1, "up_proj": 2, "down_proj": 1})
    with pytest.raises(ValueError, match=r"must all be the expert's intermediate size, or twice it .* check shard_dims"):
        resolve_plan(ParallelPlan(expert_parallel={EXPERTS: bad}), _moe(moe_intermediate_size=16), mesh)
    with pytest.raises(TypeError, match=r"needs to know which dim of each stacked weight .* pass shard_dims="):
        resolve_plan(ParallelPlan(expert_parallel={EXPERTS: hp.ExpertTensorParallel()}), model, mesh)


def test_expert_tensor_parallel_refuses_a_weight_left_whole():
    """A weight not split over tp would enter every rank's partial output and be summed tp times."""
    plan = ParallelPlan(expert_parallel={EXPERTS: hp.ExpertTensorParallel(shard_dims={"gate_proj": 2, "up_proj": 2})})
    with pytest.raises(ValueError, match=r"shard_dims gives no split dim for \['down_proj'\] .* summed once per tp rank"):
        resolve_plan(plan, _moe(), Layout((2, 2), ("ep", "tp")))
    plan = ParallelPlan(expert_parallel={EXPERTS: hp.ExpertTensorParallel(tp_axis="etp")})
    with pytest.raises(ValueError, match=r"mesh axis 'etp', which the mesh does not have .* tp_axis="):
        resolve_plan(plan, _moe(), Layout((2, 2), ("ep", "tp")))
