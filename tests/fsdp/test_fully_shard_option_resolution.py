"""``hp.fully_shard`` / ``FullyShard`` options resolved without a process group: each option is
honoured in the resolved plan (units, storage placements, per-unit policies) or refused with the
reason. Numerics are checked in tests/fsdp/test_fully_shard_options.py."""

import inspect
import types

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hyper_parallel as hp
from hyper_parallel.fsdp.flags import FsdpFlags, program_key
from hyper_parallel.fsdp.fully_shard import FullyShardedModule, collect_recorded_fully_shard
from hyper_parallel.fsdp.resolve import resolve_fully_shard
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, llama_tp_plan
from hyper_parallel.plan import parallelize_module, resolve_plan

DP2 = hp.Layout((2,), ("dp",))
BF16 = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))


def _resolve(model, spec, layout=DP2, plan=None):
    return resolve_fully_shard(spec, model, resolve_plan(plan or {}, model, layout))


def _recorded(model, layout=DP2, **root_options):
    """Resolve the hp.fully_shard calls recorded on ``model`` (the root marked with ``root_options``)."""
    hp.fully_shard(model, **root_options)
    return _resolve(model, collect_recorded_fully_shard(model), layout)


def test_every_fsdp2_option_is_taken_or_refused_with_a_reason():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = inspect.signature(hp.fully_shard).parameters
    for name in inspect.signature(torch_fully_shard).parameters:
        if name in ours:
            continue
        with pytest.raises(TypeError, match=rf"does not take {name}=: "):
            hp.fully_shard(nn.Linear(2, 2), **{name: None})
    with pytest.raises(TypeError, match=r"does not take device=: the device is the mesh's"):
        hp.fully_shard(nn.Linear(2, 2), device="cpu")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_size'"):
        hp.fully_shard(nn.Linear(2, 2), bucket_size=1)


def test_mixed_precision_spelling_is_mp_policy():
    model = _llama()
    hp.fully_shard(model.model.layers[0], mixed_precision=BF16)
    fsdp = _recorded(model).fsdp
    assert fsdp.unit("model.layers.0").mixed_precision == BF16
    assert fsdp.unit("").mixed_precision is None
    with pytest.raises(ValueError, match=r"mp_policy=.* and mixed_precision=.* differ; they are two spellings"):
        hp.fully_shard(nn.Linear(2, 2), mp_policy=BF16, mixed_precision=hp.MixedPrecisionPolicy())
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy.param_dtype must be a torch.dtype"):
        hp.MixedPrecisionPolicy(param_dtype="bf16")


def test_per_unit_policies_and_root_defaults():
    model = _llama()
    fp16 = hp.MixedPrecisionPolicy(param_dtype=torch.float16)
    hp.fully_shard(model.model.layers[0], mp_policy=fp16, offload_policy=hp.CPUOffloadPolicy())
    hp.fully_shard(model.model.layers[1])  # takes the root's
    fsdp = _recorded(model, mp_policy=BF16).fsdp
    assert [fsdp.unit(u).mixed_precision for u in ("model.layers.0", "model.layers.1", "")] == [fp16, BF16, BF16]
    assert fsdp.offloaded("model.layers.0.mlp.up_proj.weight")
    assert not fsdp.offloaded("model.layers.1.mlp.up_proj.weight") and not fsdp.offloaded("lm_head.weight")
    assert fsdp.policy_of("model.layers.0.mlp.up_proj.weight") == fp16


def _host_copies(model, spec):
    """How many FSDP parameters the captured graph copies host -> cuda before their unshard."""
    from hyper_parallel.compile.annotations import UNSHARD
    from hyper_parallel.compile.capture import capture
    from hyper_parallel.propagation.unshard import insert_unshard_nodes

    resolved = _resolve(model, spec)
    ids = torch.zeros(2, 8, dtype=torch.long)
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    insert_unshard_nodes(captured, resolved, {n: p.dtype for n, p in model.named_parameters()}, "cuda")
    unshards = captured.gm.graph.find_nodes(op="call_function", target=UNSHARD)
    return {u.args[1] for u in unshards if u.args[0].target is torch.ops.aten._to_copy.default}


def test_per_unit_cpu_offload_copies_only_that_units_shards():
    model = _llama()
    hp.fully_shard(model.model.layers[1], offload_policy=hp.CPUOffloadPolicy())
    hp.fully_shard(model.model.layers[0])
    hp.fully_shard(model)
    copied = _host_copies(model, collect_recorded_fully_shard(model))
    assert copied == {n for n, _ in model.model.layers[1].named_parameters(prefix="model.layers.1")}


def test_list_of_modules_is_one_unit():
    model = _llama()
    hp.fully_shard([model.model.embed_tokens, model.lm_head, model.model.embed_tokens])
    assert isinstance(model.lm_head, FullyShardedModule)
    fsdp = _recorded(model).fsdp
    unit = fsdp.unit("model.embed_tokens")
    assert unit.members == ("model.embed_tokens", "lm_head")
    assert set(unit.params) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert "model.norm.weight" in fsdp.unit("").params and "lm_head.weight" not in fsdp.unit("").params
    # The plan entry spells it as a list inside units.
    plan_fsdp = _resolve(_llama(), hp.FullyShard(units=(["model.embed_tokens", "lm_head"], "model.layers.*", ""))).fsdp
    assert plan_fsdp.unit_of["lm_head.weight"] == "model.embed_tokens"
    with pytest.raises(ValueError, match=r"does not take a ModuleList, which has no forward"):
        hp.fully_shard(model.model.layers)
    with pytest.raises(ValueError, match=r"module 'lm_head' is in two fully_shard units"):
        _resolve(_llama(), hp.FullyShard(units=(["model.embed_tokens", "lm_head"], "lm_head")))


def test_ignored_params_stay_replicated():
    model = _llama()
    norm = model.model.layers[0].input_layernorm.weight
    hp.fully_shard(model.model.layers[0], ignored_params={norm, model.model.layers[0].mlp.up_proj.weight})
    resolved = _recorded(model)
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.mlp.up_proj.weight"):
        assert resolved.param_placements[name] == (Replicate(),) and name not in resolved.fsdp.unit_of
    assert resolved.param_placements["model.layers.0.mlp.down_proj.weight"] == (Shard(0),)
    # Plan form: parameter-FQN globs; a glob that matches nothing is an error.
    plan = _resolve(_llama(), hp.FullyShard(units=("model.layers.*", ""), ignored_params=("model.layers.*.mlp.*.weight",)))
    assert plan.param_placements["model.layers.1.mlp.gate_proj.weight"] == (Replicate(),)
    with pytest.raises(ValueError, match=r"ignored_params 'model.blocks.\*' matches no parameter"):
        _resolve(_llama(), hp.FullyShard(ignored_params=("model.blocks.*",)))
    # Parameters of mixed dtypes in one unit are fine once the odd one is ignored.
    odd = _llama()
    odd.model.layers[0].mlp.up_proj.to(torch.float64)
    _resolve(odd, hp.FullyShard(units=("model.layers.*", ""), ignored_params=("model.layers.0.mlp.up_proj.weight",)))
    with pytest.raises(TypeError, match=r"ignored_params must be a set of nn.Parameter"):
        hp.fully_shard(nn.Linear(2, 2), ignored_params={"weight"})
    stranger = _llama()
    hp.fully_shard(stranger, ignored_params={nn.Parameter(torch.zeros(3))})
    with pytest.raises(ValueError, match=r"ignored_params holds parameters of shapes \[\(3,\)\] that are not"):
        collect_recorded_fully_shard(stranger)


def _dim1(param):
    return Shard(1) if param.dim() == 2 else None


def test_shard_placement_fn_stores_parameters_on_that_dim():
    model = _llama()
    for layer in model.model.layers:
        hp.fully_shard(layer, shard_placement_fn=_dim1)
    resolved = _recorded(model)
    placements = resolved.param_placements
    assert placements["model.layers.0.mlp.up_proj.weight"] == (Shard(1),)
    assert placements["model.layers.0.input_layernorm.weight"] == (Shard(0),)  # None: the default
    assert placements["lm_head.weight"] == (Shard(0),)  # the root's call gave no fn
    # With tensor parallelism: a colwise weight (TP on dim 0) is stored on dim 1 over dp.
    tp = _resolve(_llama(), hp.FullyShard(shard_placement_fn=_dim1), hp.Layout((2, 2), ("dp", "tp")),
                  {"tensor_parallel": {"model.layers.*.self_attn.q_proj": "colwise"}})
    assert tp.param_placements["model.layers.0.self_attn.q_proj.weight"] == (Shard(1), Shard(0))
    # A rowwise weight already splits dim 1 over tp: refused, naming the parameter.
    with pytest.raises(ValueError, match=r"o_proj.weight' has layout .* which already splits dim 1 over 'tp'"):
        _resolve(_llama(), hp.FullyShard(shard_placement_fn=_dim1), hp.Layout((2, 2), ("dp", "tp")),
                 {"tensor_parallel": {"model.layers.*.self_attn.o_proj": "rowwise"}})
    # Shard(0) is the default placement (strided inside a TP dim-0 shard).
    strided = _resolve(_llama(), hp.FullyShard(shard_placement_fn=lambda p: Shard(0)), hp.Layout((2, 2), ("dp", "tp")),
                       llama_tp_plan())
    assert strided.param_placements["model.layers.0.self_attn.q_proj.weight"] == (_StridedShard(0, split_factor=2), Shard(0))


def test_shard_placement_fn_errors():
    with pytest.raises(TypeError, match=r"shard_placement_fn returned Replicate\(\) for .* it must return Shard\(dim\)"):
        _resolve(_llama(), hp.FullyShard(shard_placement_fn=lambda p: Replicate()))
    with pytest.raises(ValueError, match=r"returned Shard\(dim=1\) for '.*norm.weight', but the parameter has 1 dims"):
        _resolve(_llama(), hp.FullyShard(shard_placement_fn=lambda p: Shard(1)))
    # Not even on dim 1 (64 columns over 3 ranks): FSDP2 requires even shards off dim 0.
    with pytest.raises(ValueError, match=r"64 does not divide over dp=3; as in FSDP2, shards on a dim other than 0 must be even"):
        _resolve(_llama(), hp.FullyShard(shard_placement_fn=_dim1), hp.Layout((3,), ("dp",)))
    negative = _resolve(_llama(), hp.FullyShard(shard_placement_fn=lambda p: Shard(-1) if p.dim() == 2 else None))
    assert negative.param_placements["lm_head.weight"] == (Shard(1),)
    with pytest.raises(TypeError, match=r"shard_placement_fn must be a callable"):
        hp.fully_shard(nn.Linear(2, 2), shard_placement_fn=Shard(1))


def _mesh(*axes):
    """A stand-in for a DeviceMesh (names and shape are all resolution reads)."""
    names = tuple(a for a, _ in axes)
    return types.SimpleNamespace(mesh_dim_names=names or None, mesh=torch.zeros([s for _, s in axes] or [2]))


def test_unit_mesh_maps_to_the_plans_axes():
    layout = hp.Layout((2, 2), ("dp", "fsdp"))
    model = _llama()
    resolved = _recorded(model, layout, mesh=_mesh(("dp", 2)))  # default would shard over fsdp
    assert (resolved.fsdp.replicate_axis, resolved.fsdp.shard_axis) == (None, "dp")
    assert resolved.param_placements["lm_head.weight"] == (Shard(0), Replicate())
    hsdp = _recorded(_llama(), layout, mesh=_mesh(("dp", 2), ("fsdp", 2)))  # 2-D: HSDP as FSDP2
    assert (hsdp.fsdp.replicate_axis, hsdp.fsdp.shard_axis) == ("dp", "fsdp")
    assert hsdp.param_placements["lm_head.weight"] == (Replicate(), Shard(0))
    assert [u for u, _ in hsdp.fsdp.unit_meshes] == [""]


@pytest.mark.parametrize("mesh,layout,error", [
    (_mesh(("tp", 2)), hp.Layout((2, 2), ("dp", "tp")),
     r"shards over 'tp', which is not a data-parallel axis.*mesh= of \['<root>'\]: as in FSDP2, a 2-D"),
    (_mesh(("dp", 2), ("tp", 2)), hp.Layout((2, 2), ("dp", "tp")), r"not a data-parallel axis.*pass the data-parallel sub-mesh"),
    (_mesh(("dp_shard", 2)), DP2, r"axis 'dp_shard' is not an axis of the mesh given to hp.parallelize"),
    (_mesh(("dp", 4)), DP2, r"axis 'dp' has 4 ranks, parallelize's mesh 2"),
    (_mesh(("a", 1), ("b", 1), ("dp", 2)), DP2, r"a 3-D mesh .* 1-D \(FSDP\) or 2-D \(HSDP"),
    (_mesh(), DP2, r"the mesh has no dim names"),
])
def test_unit_mesh_errors(mesh, layout, error):
    with pytest.raises(ValueError, match=error):
        _recorded(_llama(), layout, mesh=mesh)


def test_units_with_different_meshes_or_mesh_axes():
    layout = hp.Layout((2, 2), ("dp", "fsdp"))
    model = _llama()
    hp.fully_shard(model.model.layers[0], mesh=_mesh(("fsdp", 2)))
    with pytest.raises(ValueError, match=r"meshes over different axes \(\['fsdp'\] for \['model.layers.0'\]; \['dp'\]"):
        _recorded(model, layout, mesh=_mesh(("dp", 2)))
    model = _llama()
    hp.fully_shard(model.model.layers[0], mesh=_mesh(("dp", 2)), mesh_axes=("fsdp",))
    with pytest.raises(ValueError, match=r"mesh_axes=\['fsdp'\] and the mesh= of \['model.layers.0'\]"):
        _recorded(model, layout, mesh_axes=("fsdp",))
    model = _llama()
    hp.fully_shard(model.model.layers[0], comm_fusion=False)
    with pytest.raises(ValueError, match=r"different comm_fusion values"):
        _recorded(model)


def test_reshard_after_forward_none_is_fsdp2s_default():
    model = _llama()
    for layer in model.model.layers:
        hp.fully_shard(layer, reshard_after_forward=None)
    fsdp = _recorded(model, reshard_after_forward=None).fsdp
    assert {u.module_fqn: u.reshard_after_forward for u in fsdp.units} == {
        "model.layers.0": True, "model.layers.1": True, "": False}


def test_flags_per_unit_and_uniform_switches():
    model = _llama()
    for layer in model.model.layers:
        hp.fully_shard(layer)
    fsdp = _recorded(model).fsdp
    flags = FsdpFlags().set("divide_factor", 4.0, ["model.layers.1"]).set("reshard_after_forward", False, ["", "model.layers.0"])
    applied = flags.apply(fsdp, accumulated=None, pregathered=())
    assert {u.module_fqn: (u.divide_factor, u.reshard_after_forward) for u in applied.units} == {
        "model.layers.0": (None, False), "model.layers.1": (4.0, True), "": (None, False)}
    assert applied.gradient_scale("model.layers.1.mlp.up_proj.weight", ("dp",), (2,)) == 0.5
    assert applied.gradient_scale("lm_head.weight", ("dp",), (2,)) == 1.0
    assert program_key(applied) != program_key(FsdpFlags().apply(fsdp, accumulated=None, pregathered=()))
    assert flags.changed() == ["set_reshard_after_forward", "set_reduce_scatter_divide_factor"]
    assert FsdpFlags().set("reduce_op", "avg", [""]).values == ()  # back at the default
    mixed = FsdpFlags().set("gradient_sync", False, ["model.layers.0"])
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync differs between FSDP units .*False on \['model.layers.0'\]"):
        mixed.apply(fsdp, accumulated=None, pregathered=())
    uniform = mixed.set("gradient_sync", False, ["model.layers.1", ""]).apply(fsdp, accumulated=None, pregathered=())
    assert uniform.gradient_sync is False


def test_unit_methods_need_the_parallelized_model():
    layer = hp.fully_shard(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"set_reduce_scatter_divide_factor needs the parallelized model"):
        layer.set_reduce_scatter_divide_factor(2.0)
    with pytest.raises(RuntimeError, match=r"set_requires_gradient_sync needs the parallelized model"):
        layer.set_requires_gradient_sync(False, recurse=False)


def test_parallelize_module_src_data_rank():
    model = _llama()
    assert parallelize_module(model, "tp", {"lm_head": "colwise"}, src_data_rank=0) is model  # what parallelize does
    with pytest.raises(ValueError, match=r"src_data_rank=None\) is not supported: hp.parallelize distributes every "
                                         r"parameter from rank 0's values.*hp.init_empty_weights"):
        parallelize_module(model, "tp", {"lm_head": "colwise"}, src_data_rank=None)
    with pytest.raises(ValueError, match=r"src_data_rank=1\) is not supported"):
        parallelize_module(model, "tp", {"lm_head": "colwise"}, src_data_rank=1)
    with pytest.raises(TypeError, match=r"takes an int or None"):
        parallelize_module(model, "tp", {"lm_head": "colwise"}, src_data_rank="0")
    # A 2-D mesh is refused, as torch's parallelize_module does: it takes the 1-D TP sub-mesh.
    with pytest.raises(ValueError, match=r"needs the 1-D tensor-parallel \(sub-\)mesh, got a 2-D mesh"):
        parallelize_module(model, hp.Layout((2, 2), ("dp", "tp")), {"lm_head": "colwise"})


def test_plan_entry_and_fully_shard_calls_together_are_refused():
    """Two sources of FSDP units: taking either would silently drop the other's."""
    from hyper_parallel.tools.explain import fake_world

    model = _llama()
    for layer in model.model.layers:
        hp.fully_shard(layer)
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"fully_shard entry and hp.fully_shard was also called .* use one"):
            hp.parallelize(model, {"fully_shard": hp.FullyShard(units=("model.layers.*", ""))}, mesh)
