"""hp.ParallelDims without a process group: dp_shard inference, every validation rule and its
message, the canonical mesh order, the flattened aliases, the model-config checks and the text
forms. One test builds real meshes on torch's ``fake`` backend in a subprocess (so no process group
leaks into this test session)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hyper_parallel as hp
from hyper_parallel.models import LlamaConfig
from hyper_parallel.distributed.parallel_dims import MESH_AXIS_ORDER, FlattenedAxis, ParallelDims

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ inference
def test_exported_from_package():
    assert hp.ParallelDims is ParallelDims


@pytest.mark.parametrize(
    "kwargs, world, expected",
    [
        (dict(dp_shard=-1), 8, 8),
        (dict(dp_shard=-1, tp=2), 8, 4),
        (dict(dp_shard=-1, dp_replicate=2, cp=2, tp=2), 16, 2),
        (dict(dp_shard=-1, pp=2, tp=2), 8, 2),
        (dict(dp_shard=-1, ep=2, tp=2), 8, 2),  # ep is a peer axis: it takes ranks from the pool
        (dict(dp_shard=-1, tp=8), 8, 1),
    ],
)
def test_dp_shard_minus_one_fills_the_remaining_ranks(kwargs, world, expected):
    pd = ParallelDims(**kwargs, world_size=world)
    assert pd.dp_shard == expected
    assert pd.dp_size == pd.dp_replicate * expected * pd.ep
    assert pd.dp_size * pd.non_data_parallel_size == world


def test_inference_needs_a_divisible_world():
    with pytest.raises(ValueError, match=r"cannot infer dp_shard=-1: world_size=16 is not divisible by "
                       r"dp_replicate\*cp\*tp\*pp\*ep = 1\*1\*3\*1\*1 = 3.*divisors are \[1, 2, 4, 8, 16\]"):
        ParallelDims(dp_shard=-1, tp=3, world_size=16)


@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp", "ep", "etp"])
def test_only_dp_shard_may_be_minus_one(name):
    with pytest.raises(ValueError, match=rf"ParallelDims\.{name}=-1: only dp_shard can be inferred"):
        ParallelDims(**{name: -1}, dp_shard=-1, world_size=8)


# ------------------------------------------------------------------ degree rules
@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp", "ep", "etp"])
@pytest.mark.parametrize("value", [0, -2])
def test_degrees_must_be_positive(name, value):
    with pytest.raises(ValueError, match=rf"ParallelDims\.{name}={value} is invalid: it must be a positive int"):
        ParallelDims(**{name: value}, world_size=1)


@pytest.mark.parametrize("value", [0, -2])
def test_dp_shard_must_be_positive_or_minus_one(value):
    with pytest.raises(ValueError, match=rf"dp_shard={value} is invalid: it must be a positive int, or -1 to infer"):
        ParallelDims(dp_shard=value, world_size=1)


@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_degrees_must_be_ints(value):
    with pytest.raises(TypeError, match=r"ParallelDims\.tp must be an int, got"):
        ParallelDims(tp=value, world_size=2)


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=(
        r"dp_replicate\(1\) \* dp_shard\(3\) \* cp\(1\) \* tp\(4\) \* pp\(1\) \* ep\(1\) = 12, but "
        r"world_size is 16; .*product is 16, or set dp_shard=-1")):
        ParallelDims(dp_shard=3, tp=4, world_size=16)


def test_ep_multiplies_into_the_world_size():
    ParallelDims(dp_shard=2, ep=2, world_size=4)
    with pytest.raises(ValueError, match=r"ep\(2\) = 4, but world_size is 2"):
        ParallelDims(dp_shard=2, ep=2, world_size=2)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match=r"world_size=0 must be a positive"):
        ParallelDims(world_size=0)


def test_world_size_none_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(ValueError, match=r"world_size=None .* not initialised.*pass world_size=N"):
        ParallelDims(tp=2)


@pytest.mark.parametrize("etp", [1, 4])
def test_expert_tp_equal_to_tp_or_off_is_accepted(etp):
    assert ParallelDims(ep=2, tp=4, etp=etp, world_size=8).etp == etp


def test_expert_tp_must_be_tp_or_one_with_ep():
    with pytest.raises(ValueError, match=r"etp=2 is not supported with ep=2: .*\(etp=tp=4\) or is off \(etp=1\)"):
        ParallelDims(ep=2, tp=4, etp=2, world_size=8)


def test_expert_tp_is_unchecked_without_ep():  # as in the reference: etp only matters with experts
    assert not ParallelDims(tp=4, etp=2, world_size=4).etp_enabled


def test_ulysses_must_not_exceed_cp():
    with pytest.raises(ValueError, match=r"ulysses_degree=4 exceeds cp=2: .*divisors of cp \[1, 2\]"):
        ParallelDims(cp=2, ulysses_degree=4, world_size=2)


def test_ulysses_without_cp_is_rejected():  # stricter than the reference, which ignored it
    with pytest.raises(ValueError, match=r"ulysses_degree=2 exceeds cp=1"):
        ParallelDims(ulysses_degree=2, world_size=1)


def test_ulysses_must_divide_cp():
    with pytest.raises(ValueError, match=r"cp=6 is not divisible by ulysses_degree=4: .*divisors of cp \[1, 2, 3, 6\]"):
        ParallelDims(cp=6, ulysses_degree=4, world_size=6)


@pytest.mark.parametrize("value", [0, -1])
def test_ulysses_must_be_positive(value):
    with pytest.raises(ValueError, match=rf"ulysses_degree={value} is invalid"):
        ParallelDims(cp=2, ulysses_degree=value, world_size=2)


def test_ulysses_and_ring_sizes():
    pd = ParallelDims(cp=8, ulysses_degree=2, world_size=8)
    assert (pd.ulysses_size, pd.ring_size) == (2, 4)
    pure = ParallelDims(cp=8, world_size=8)  # None: all of cp is Ulysses
    assert (pure.ulysses_size, pure.ring_size) == (8, 1)


def test_pipeline_parallelism_is_accepted():  # the reference raised NotImplementedError
    pd = ParallelDims(pp=4, dp_shard=-1, tp=2, world_size=16)
    assert pd.pp_enabled and pd.dp_shard == 2
    assert pd.mesh_axes() == {"pp": 4, "dp_shard": 2, "tp": 2}


# ------------------------------------------------------------------ mesh layout
def test_canonical_order_of_enabled_axes():
    assert MESH_AXIS_ORDER == ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
    full = ParallelDims(tp=2, cp=2, ep=2, dp_shard=2, dp_replicate=2, pp=2, world_size=64)
    assert list(full.mesh_axes()) == list(MESH_AXIS_ORDER)
    pd = ParallelDims(tp=4, cp=2, dp_shard=-1, world_size=16)
    assert pd.mesh_axes() == {"dp_shard": 2, "cp": 2, "tp": 4}
    assert (pd.mesh_dim_names, pd.mesh_shape) == (("dp_shard", "cp", "tp"), (2, 2, 4))


def test_single_rank_mesh_is_one_dp_shard_axis():
    pd = ParallelDims(world_size=1)
    assert pd.mesh_axes() == {"dp_shard": 1}
    assert not (pd.fsdp_enabled or pd.tp_enabled or pd.cp_enabled or pd.pp_enabled or pd.ep_enabled)


@pytest.mark.parametrize(
    "kwargs, world, expected",
    [
        # HSDP + CP: fsdp is the shard axis, dp both data axes, loss adds cp.
        (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), 16,
         {"fsdp": (("dp_shard",), 2), "dp": (("dp_replicate", "dp_shard"), 4),
          "loss": (("dp_replicate", "dp_shard", "cp"), 8)}),
        # FSDP only: all three aliases are the shard axis.
        (dict(dp_shard=4), 4,
         {"fsdp": (("dp_shard",), 4), "dp": (("dp_shard",), 4), "loss": (("dp_shard",), 4)}),
        # DDP only: no fsdp alias.
        (dict(dp_replicate=4), 4, {"dp": (("dp_replicate",), 4), "loss": (("dp_replicate",), 4)}),
        (dict(dp_replicate=2, cp=2), 4, {"dp": (("dp_replicate",), 2), "loss": (("dp_replicate", "cp"), 4)}),
        (dict(dp_shard=2, cp=2, tp=2), 8,
         {"fsdp": (("dp_shard",), 2), "dp": (("dp_shard",), 2), "loss": (("dp_shard", "cp"), 4)}),
        # CP without data parallelism: the loss is still reduced over cp.
        (dict(cp=4), 4, {"loss": (("cp",), 4)}),
        # Pure TP / PP: nothing to flatten; pp never joins an alias, ep's ranks take different rows.
        (dict(tp=4), 4, {}),
        (dict(pp=2, dp_shard=2, ep=2), 8,
         {"fsdp": (("dp_shard",), 2), "dp": (("dp_shard", "ep"), 4), "loss": (("dp_shard", "ep"), 4)}),
        (dict(ep=4), 4, {"dp": (("ep",), 4), "loss": (("ep",), 4)}),
        (dict(), 1, {"fsdp": (("dp_shard",), 1), "dp": (("dp_shard",), 1), "loss": (("dp_shard",), 1)}),
    ],
)
def test_flattened_aliases(kwargs, world, expected):
    flat = ParallelDims(**kwargs, world_size=world).flattened_axes()
    assert flat == {k: FlattenedAxis(*v) for k, v in expected.items()}


def test_axis_names_are_what_parallelize_expects():
    from hyper_parallel.distributed.mesh import data_parallel_axes
    from hyper_parallel.layout import Layout

    pd = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, world_size=32)
    layout = Layout(pd.mesh_shape, pd.mesh_dim_names)  # a mesh stand-in with the same names
    assert data_parallel_axes(layout) == ("dp_replicate", "dp_shard")
    assert "tp" in pd.mesh_dim_names


def test_enabled_properties_and_sizes():
    pd = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=2, etp=2, world_size=32)
    assert pd.dp_enabled and pd.dp_replicate_enabled and pd.dp_shard_enabled and pd.fsdp_enabled
    assert pd.cp_enabled and pd.tp_enabled and pd.ep_enabled and pd.etp_enabled and not pd.pp_enabled
    assert (pd.dp_size, pd.non_data_parallel_size, pd.non_dp_size) == (8, 4, 4)
    assert ParallelDims(dp_replicate=2, world_size=2).fsdp_enabled  # as in the reference


def test_is_immutable_and_comparable():
    pd = ParallelDims(dp_shard=-1, tp=2, world_size=8)
    assert pd == ParallelDims(dp_shard=4, tp=2, world_size=8)
    with pytest.raises(AttributeError):
        pd.tp = 4


# ------------------------------------------------------------------ from_config
def test_from_config_dict_and_legacy_dp():
    pd = ParallelDims.from_config({"dp": 2, "tp": 2}, world_size=4)
    assert (pd.dp_shard, pd.tp, pd.etp) == (2, 2, 2)  # legacy dp -> dp_shard; etp defaults to tp
    assert ParallelDims.from_config({"dp_shard": -1, "dp": 9, "tp": 2, "world_size": 8}).dp_shard == 4


def test_from_config_object():
    class Cfg:
        tp = 2
        dp_shard = -1
        ep = 2
        etp = 1

    pd = ParallelDims.from_config(Cfg(), world_size=8)
    assert (pd.dp_shard, pd.ep, pd.etp) == (2, 2, 1)


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['tpp'\]; known keys are"):
        ParallelDims.from_config({"tpp": 2}, world_size=2)


# ------------------------------------------------------------------ model config
def _llama(**kw):
    base = dict(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                max_position_embeddings=8192)
    return {**base, **kw}


def test_fitting_model_config_passes():
    pd = ParallelDims(dp_shard=-1, tp=8, cp=2, ulysses_degree=2, world_size=64)
    assert pd.validate_model(_llama()) is pd
    ParallelDims(tp=2, world_size=2, model_config=LlamaConfig())  # our example: 4 heads, 2 kv heads


def test_tp_must_divide_attention_heads():
    with pytest.raises(ValueError, match=r"tp=8 does not divide num_attention_heads=12 .*divisors of 12: "
                       r"\[1, 2, 3, 4, 6, 12\]"):
        ParallelDims(tp=8, world_size=8).validate_model(_llama(num_attention_heads=12, num_key_value_heads=None))


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2 \(key/value heads .*GQA\)"
                       r"; pick tp from the divisors of 2: \[1, 2\]") as info:
        ParallelDims(tp=4, world_size=4).validate_model(LlamaConfig())
    assert "num_attention_heads" not in str(info.value)  # 4 heads split fine over tp=4


def test_tp_must_divide_ffn_width():
    with pytest.raises(ValueError, match=r"tp=4 does not divide intermediate_size=14338"):
        ParallelDims(tp=4, world_size=4).validate_model(_llama(intermediate_size=14338))


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_ep_must_divide_experts(key):
    with pytest.raises(ValueError, match=rf"ep=4 does not divide {key}=6 .*divisors of 6: \[1, 2, 3, 6\]"):
        ParallelDims(ep=4, world_size=4).validate_model({key: 6})


@pytest.mark.parametrize("key", ["seq_len", "max_seq_len", "max_position_embeddings"])
def test_cp_times_tp_must_divide_the_sequence(key):
    with pytest.raises(ValueError, match=rf"cp\*tp = 2\*4 = 8 does not divide {key}=100 .*multiple of 8.*"
                       r"divisors of 100: \[1, 2, 4, 5, 10, 20, 25, 50, 100\]"):
        ParallelDims(cp=2, tp=4, ulysses_degree=1, world_size=8).validate_model({key: 100})


def test_seq_len_argument_overrides_the_config():
    pd = ParallelDims(cp=4, ulysses_degree=1, world_size=4)
    pd.validate_model({"max_position_embeddings": 4096}, seq_len=4096)
    with pytest.raises(ValueError, match=r"does not divide seq_len=4098"):
        pd.validate_model({"max_position_embeddings": 4096}, seq_len=4098)
    with pytest.raises(ValueError, match=r"does not divide seq_len=30"):
        ParallelDims(cp=4, ulysses_degree=1, world_size=4, seq_len=30)


def test_ulysses_must_divide_heads_per_tp_rank():
    # 12 heads / tp=2 = 6 per rank; ulysses_degree=4 cannot split 6.
    with pytest.raises(ValueError, match=r"ulysses_degree=4 does not divide the 6 heads each tensor-parallel rank "
                       r"keeps \(num_attention_heads=12 / tp=2\).*divisors of 6: \[1, 2, 3, 6\]"):
        ParallelDims(cp=4, ulysses_degree=4, tp=2, world_size=8).validate_model(
            {"num_attention_heads": 12, "num_key_value_heads": 2})
    # Default (None) is all-Ulysses: the whole cp degree must divide the heads.
    with pytest.raises(ValueError, match=r"cp \(all Ulysses\)=8 does not divide the 4 heads"):
        ParallelDims(cp=8, world_size=8).validate_model(LlamaConfig())
    ParallelDims(cp=8, ulysses_degree=4, world_size=8).validate_model(LlamaConfig(max_position_embeddings=128))


def test_every_broken_rule_is_listed_once():
    with pytest.raises(ValueError) as info:
        ParallelDims(tp=8, ep=2, world_size=16).validate_model(
            _llama(num_attention_heads=12, num_key_value_heads=4, num_experts=3, max_position_embeddings=100))
    text = str(info.value)
    assert text.startswith("ParallelDims(") and "does not fit the model config" in text
    for key in ("num_attention_heads=12", "num_key_value_heads=4", "num_experts=3", "max_position_embeddings=100"):
        assert text.count(key) == 1, key


def test_model_config_forms():
    from hyper_parallel.models import LlamaForCausalLM

    pd = ParallelDims(tp=4, world_size=4)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1))
    for form in (model, model.config, {"num_key_value_heads": 2}):
        with pytest.raises(ValueError, match="num_key_value_heads=2"):
            pd.validate_model(form)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        ParallelDims(tp=4, world_size=4, model_config=model)
    pd.validate_model({})  # nothing to check
    pd.validate_model({"num_key_value_heads": None, "num_attention_heads": 8})  # None: absent


def test_model_config_values_must_be_positive_ints():
    with pytest.raises(TypeError, match=r"model config key 'num_attention_heads' must be a positive int"):
        ParallelDims(tp=2, world_size=2).validate_model({"num_attention_heads": "32"})
    from torch import nn

    with pytest.raises(TypeError, match=r"Linear module without a .config"):
        ParallelDims(tp=2, world_size=2).validate_model(nn.Linear(2, 2))


# ------------------------------------------------------------------ text
def test_repr_and_describe():
    pd = ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, tp=2, world_size=16)
    assert repr(pd) == (
        "ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=1, ep=1, etp=1, ulysses_degree=None, "
        "world_size=16; mesh (dp_replicate=2, dp_shard=2, cp=2, tp=2))"
    )
    assert pd.describe().splitlines() == [
        "ParallelDims on 16 ranks",
        "  degrees: dp_replicate=2 dp_shard=2 cp=2 tp=2 pp=1 ep=1 etp=1 ulysses_degree=None",
        "  mesh:    (dp_replicate=2, dp_shard=2, cp=2, tp=2), shape (2, 2, 2, 2)",
        "  aliases: fsdp = dp_shard (2 ranks); dp = dp_replicate x dp_shard (4 ranks); "
        "loss = dp_replicate x dp_shard x cp (8 ranks)",
    ]
    assert "dp=4 world=16" in pd.summary()


def test_mesh_before_build_is_an_error():
    pd = ParallelDims(tp=2, world_size=2)
    with pytest.raises(ValueError, match=r"no mesh yet; call build_mesh"):
        pd.get_mesh("tp")
    with pytest.raises(ValueError, match=r"no mesh yet; call build_mesh"):
        _ = pd.mesh


# ------------------------------------------------------------------ build_mesh on the fake backend
_FAKE_MESH_SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("error")  # no torch deprecation warning from how the aliases are made
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    import hyper_parallel as hp

    pd = hp.ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, tp=2)  # world_size from the group
    mesh = pd.build_mesh("cpu")
    assert mesh is pd.mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp"), mesh
    assert tuple(mesh.shape) == (2, 2, 2, 2)
    for alias, flat in pd.flattened_axes().items():
        sub = pd.get_mesh(alias)
        assert sub.mesh_dim_names == (alias,) and sub.size() == flat.size, (alias, sub)
    for name, size in pd.mesh_axes().items():
        assert pd.get_mesh(name).size() == size
    with warnings.catch_warnings():  # registered on the root mesh too (torch warns on slicing it)
        warnings.simplefilter("ignore")
        assert mesh["loss"].size() == 8

    pp = hp.ParallelDims(pp=2, dp_shard=-1, ep=2, tp=2)
    assert pp.build_mesh("cpu").mesh_dim_names == ("pp", "dp_shard", "ep", "tp")

    try:
        pd.get_mesh("pp")
    except ValueError as e:
        assert "no 'pp' axis because pp=1" in str(e), e
    else:
        raise AssertionError("get_mesh('pp') should fail")
    try:
        hp.ParallelDims(tp=2, dp_shard=4, world_size=8).build_mesh("cpu")
    except ValueError as e:
        assert "plans for world_size=8, but the default process group has 16 ranks" in str(e), e
    else:
        raise AssertionError("a world-size mismatch should fail")
    print("OK")
    """
)


@pytest.mark.slow
def test_build_mesh_on_fake_backend():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _FAKE_MESH_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
