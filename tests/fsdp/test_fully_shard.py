"""FSDP plan resolution (no process group): units, storage layouts, and the errors a user gets."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hyper_parallel as hp
from hyper_parallel.fsdp.resolve import resolve_fully_shard
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, llama_tp_plan
from hyper_parallel.plan import resolve_plan


def _resolve(model, fully_shard, layout, plan=None):
    return resolve_fully_shard(fully_shard, model, resolve_plan(plan or {}, model, layout))


def _llama():
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))


def test_units_own_their_parameters_innermost_first():
    fsdp = _resolve(_llama(), hp.FullyShard(units=("model.layers.*", "")), hp.Layout((2,), ("dp",))).fsdp
    assert {u.module_fqn for u in fsdp.units} == {"", "model.layers.0", "model.layers.1"}
    assert len(fsdp.units) == 3
    assert fsdp.unit_of["model.layers.1.mlp.up_proj.weight"] == "model.layers.1"
    assert fsdp.unit_of["lm_head.weight"] == ""
    assert (fsdp.shard_axis, fsdp.replicate_axis) == ("dp", None)


def test_storage_layouts_fsdp_hsdp_and_with_tensor_parallel():
    resolved = _resolve(_llama(), {"units": [""]}, hp.Layout((2,), ("dp",)))
    assert resolved.param_placements["model.layers.0.mlp.up_proj.weight"] == (Shard(0),)
    assert resolved.fsdp.compute_placements["model.layers.0.mlp.up_proj.weight"] == (Replicate(),)

    hsdp = _resolve(_llama(), {"units": [""]}, hp.Layout((2, 2), ("dp_replicate", "dp_shard")))
    assert hsdp.param_placements["lm_head.weight"] == (Replicate(), Shard(0))
    assert (hsdp.fsdp.replicate_axis, hsdp.fsdp.shard_axis) == ("dp_replicate", "dp_shard")

    tp = _resolve(_llama(), {"units": [""]}, hp.Layout((2, 2), ("dp", "tp")), llama_tp_plan())
    # colwise (dim 0 already split by tp): FSDP splits each TP shard further, as FSDP2 does
    assert tp.param_placements["model.layers.0.self_attn.q_proj.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    # rowwise (dim 1 split by tp): plain dim-0 sharding over dp
    assert tp.param_placements["model.layers.0.self_attn.o_proj.weight"] == (Shard(0), Shard(1))


def test_dict_form_and_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['unit'\]"):
        hp.FullyShard.from_value({"unit": [""]})
    assert hp.FullyShard.from_value({"units": "model.layers.*"}).units == ("model.layers.*",)


def test_unit_matching_no_module():
    with pytest.raises(ValueError, match=r"unit 'model.blocks\.\*' matches no module"):
        _resolve(_llama(), {"units": ["model.blocks.*"]}, hp.Layout((2,), ("dp",)))


def test_mesh_without_data_parallel_axis():
    with pytest.raises(ValueError, match=r"needs a data-parallel mesh axis.*\['tp'\]"):
        _resolve(_llama(), {"units": [""]}, hp.Layout((2,), ("tp",)))


def test_wrong_number_of_mesh_axes():
    layout = hp.Layout((2, 2, 1), ("dp_replicate", "dp_shard", "dp"))
    with pytest.raises(ValueError, match=r"must name 1 axis \(FSDP\) or 2 \(HSDP"):
        _resolve(_llama(), {"units": [""], "mesh_axes": ("dp_replicate", "dp_shard", "dp")}, layout)


def test_int_reshard_after_forward_must_divide_the_shard_axis():
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide the shard axis dp=4"):
        _resolve(_llama(), {"units": [""], "reshard_after_forward": 3}, hp.Layout((4,), ("dp",)))
    fsdp = _resolve(_llama(), {"units": [""], "reshard_after_forward": 2}, hp.Layout((4,), ("dp",))).fsdp
    assert [u.reshard_after_forward for u in fsdp.units] == [2]


def test_mixed_dtypes_in_one_unit_need_a_policy():
    model = _llama()
    model.model.layers[0].mlp.up_proj.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"unit 'model.layers.0' mixes parameter dtypes.*MixedPrecisionPolicy"):
        _resolve(model, {"units": ["model.layers.*", ""]}, hp.Layout((2,), ("dp",)))
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _resolve(model, hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy), hp.Layout((2,), ("dp",)))


class _Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight  # one tensor, two sibling units


def test_shared_tensor_in_units_that_do_not_nest():
    with pytest.raises(ValueError, match=r"shared tensor owned by units \['a', 'b'\], which do not nest"):
        _resolve(_Siblings(), {"units": ["a", "b"]}, hp.Layout((2,), ("dp",)))
    # With the root as a unit that contains both, the root owns it.
    fsdp = _resolve(_Siblings(), {"units": ["a", "b", ""]}, hp.Layout((2,), ("dp",))).fsdp
    assert fsdp.unit_of["a.weight"] == fsdp.unit_of["b.weight"] == ""


def test_uneven_dim_zero_is_padded_like_fsdp2_except_inside_tp_shards():
    # 256-row embedding over 3 ranks: an uneven Shard(0) (padded inside the collectives).
    resolved = _resolve(_llama(), {"units": [""]}, hp.Layout((3,), ("dp",)))
    assert resolved.param_placements["model.embed_tokens.weight"] == (Shard(0),)
    # Nested inside a tensor-parallel dim-0 shard (strided), uneven is refused with the reason.
    with pytest.raises(ValueError, match=r"uneven FSDP shards nested inside tensor-parallel shards"):
        _resolve(_llama(), {"units": [""]}, hp.Layout((3, 2), ("dp", "tp")), llama_tp_plan())


def _captured_with_unshards(offload, compute_device):
    from hyper_parallel.compile.annotations import UNSHARD
    from hyper_parallel.compile.capture import capture
    from hyper_parallel.propagation.unshard import insert_unshard_nodes

    model = _llama()
    spec = hp.FullyShard(units=("model.layers.*", ""), offload_policy=hp.CPUOffloadPolicy() if offload else None)
    resolved = _resolve(model, spec, hp.Layout((2,), ("dp",)))
    ids = torch.zeros(2, 8, dtype=torch.long)
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    storage = {n: p.dtype for n, p in model.named_parameters()}
    insert_unshard_nodes(captured, resolved, storage, compute_device)
    unshards = captured.gm.graph.find_nodes(op="call_function", target=UNSHARD)
    copies = [u.args[0] for u in unshards if u.args[0].target is torch.ops.aten._to_copy.default
              and u.args[0].kwargs.get("device") == torch.device(compute_device)]
    return len(unshards), len(copies)


@pytest.mark.slow
def test_cpu_offload_copies_shards_to_the_compute_device_before_unsharding():
    num_unshards, num_copies = _captured_with_unshards(offload=True, compute_device="cuda")
    assert num_unshards == 2 * 9 + 3 and num_copies == num_unshards
    # On a CPU mesh (this machine) the shards already are where compute happens: no copies.
    assert _captured_with_unshards(offload=True, compute_device="cpu")[1] == 0
    assert _captured_with_unshards(offload=False, compute_device="cuda")[1] == 0


def test_int_reshard_after_forward_normalised_like_fsdp2():
    # k == shard-axis size is True, k == 1 is False; 1 < k < size stays an int (HSDP: the shard axis).
    layout = hp.Layout((2, 4), ("dp_replicate", "dp_shard"))
    for k, expected in ((4, True), (1, False), (2, 2)):
        fsdp = _resolve(_llama(), {"units": ["model.layers.*", ""], "reshard_after_forward": k}, layout).fsdp
        assert {u.reshard_after_forward for u in fsdp.units} == {expected}
        assert all(type(u.reshard_after_forward) is type(expected) for u in fsdp.units)
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 must divide the shard axis dp_shard=3"):
        _resolve(_llama(), {"units": [""], "reshard_after_forward": 2}, hp.Layout((2, 3), ("dp_replicate", "dp_shard")))


def test_per_unit_int_reshard_after_forward_from_fully_shard_calls():
    from hyper_parallel.fsdp.fully_shard import collect_recorded_fully_shard

    def recorded(layer_value, root_value=True):
        model = _llama()
        for layer in model.model.layers:
            hp.fully_shard(layer, reshard_after_forward=layer_value)
        hp.fully_shard(model, reshard_after_forward=root_value)
        return model, collect_recorded_fully_shard(model)

    model, spec = recorded(2, root_value=4)
    fsdp = _resolve(model, spec, hp.Layout((4,), ("dp",))).fsdp
    assert {u.module_fqn: u.reshard_after_forward for u in fsdp.units} == {
        "model.layers.0": 2, "model.layers.1": 2, "": True,
    }
    model, spec = recorded(3)
    with pytest.raises(ValueError, match=r"unit 'model.layers.0': reshard_after_forward=3 must divide the shard axis dp=4"):
        _resolve(model, spec, hp.Layout((4,), ("dp",)))
    model, spec = recorded(True, root_value=0)
    with pytest.raises(ValueError, match=r"unit '<root>': reshard_after_forward=0 must divide"):
        _resolve(model, spec, hp.Layout((4,), ("dp",)))
    model, spec = recorded("yes")
    with pytest.raises(TypeError, match=r"unit 'model.layers.0': reshard_after_forward must be True, False or an int"):
        _resolve(model, spec, hp.Layout((4,), ("dp",)))


def test_shards_over_several_axes_stay_even():
    """FSDP over dp_shard x cp: a parameter whose dim 0 does not divide over both axes is stored
    sharded on dim 1 when that divides, else over dp_shard alone. DTensor gathers a nested uneven
    Shard(0) wrongly over the mesh flattened from the two axes (ParallelDims meshes have one, and
    parallelize creates one), so no such layout may exist."""
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=258))
    model.model.register_parameter("odd", nn.Parameter(torch.zeros(3, 5)))
    plan = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel(mode="ring")}}
    layout = hp.Layout((2, 2), ("dp_shard", "cp"))
    resolved = _resolve(model, {"units": ["model.layers.*", ""]}, layout, plan)
    assert resolved.fsdp.extra_shard_axes == ("cp",)
    placements = resolved.param_placements
    assert placements["model.layers.0.self_attn.q_proj.weight"] == (Shard(0), Shard(0))  # 64 rows: even
    assert placements["model.embed_tokens.weight"] == (Shard(1), Shard(1))  # 258 rows, 64 columns
    assert placements["model.odd"] == (Shard(0), Replicate())  # neither 3 nor 5 divides over 4
