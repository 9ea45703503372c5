"""Unit tests for hyper_parallel.plan (and the mesh helpers it uses).

Meshes come from torch's ``fake`` process-group backend (4 ranks in this one process), so no real
communication happens; a module-scoped fixture creates the group and destroys it afterwards.
"""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.layout import Layout, Partial, Replicate, Shard
from hyper_parallel.distributed.mesh import (
    axis_size,
    data_parallel_axes,
    init_device_mesh,
    is_data_parallel_axis,
    mesh_axis_names,
)
from hyper_parallel.plan import (
    PLAN_KEYS,
    ActivationConstraint,
    ModuleConstraints,
    ParallelPlan,
    ResolvedPlan,
    collect_recorded_plan,
    default_input_placements,
    fqn_matches,
    match_module_fqns,
    merge_plans,
    parallelize_module,
    resolve_plan,
    shard_module,
)
from hyper_parallel.tp.styles import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

R = Replicate()


# -- a small transformer-ish model ------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.o_proj(torch.relu(self.q_proj(x)))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(x)


class Backbone(nn.Module):
    def __init__(self, vocab, dim, num_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim) for _ in range(num_layers))
        self.norm = RMSNorm(dim)
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32), persistent=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLM(nn.Module):
    def __init__(self, vocab=16, dim=8, num_layers=2, tie=False):
        super().__init__()
        self.model = Backbone(vocab, dim, num_layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None):
        return self.lm_head(self.model(input_ids))


TP_PLAN = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_world():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield dist.get_world_size()
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh_2d(fake_world):
    return DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))


@pytest.fixture(scope="module")
def mesh_1d(fake_world):
    return DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyLM()


# -- mesh helpers -------------------------------------------------------------------------------


def test_is_data_parallel_axis():
    for name in ("dp", "dp_replicate", "dp_shard", "fsdp"):
        assert is_data_parallel_axis(name)
    for name in ("tp", "cp", "ep", "pp", "fsdp2", "sdp"):
        assert not is_data_parallel_axis(name)


def test_mesh_queries(mesh_2d):
    assert mesh_axis_names(mesh_2d) == ("dp", "tp")
    assert data_parallel_axes(mesh_2d) == ("dp",)
    assert axis_size(mesh_2d, "tp") == 2
    with pytest.raises(ValueError, match=r"mesh axis 'cp' does not exist; the mesh has axes \['dp', 'tp'\]"):
        axis_size(mesh_2d, "cp")
    layout = Layout((2, 2, 2, 1), ("dp_replicate", "dp_shard", "tp", "fsdp"))
    assert data_parallel_axes(layout) == ("dp_replicate", "dp_shard", "fsdp")
    assert axis_size(layout, "dp_shard") == 2


def test_unnamed_mesh_is_rejected(fake_world):
    unnamed = DeviceMesh("cpu", torch.arange(4))
    with pytest.raises(ValueError, match="has no axis names.*mesh_dim_names="):
        data_parallel_axes(unnamed)


def test_init_device_mesh(fake_world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (2, 2)
    with pytest.raises(ValueError, match=r"mesh \(2, 4\) has 8 ranks but the world size is 4: .*product is 4"):
        init_device_mesh("cpu", (2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"has 1 names but mesh_shape \(2, 2\) has 2 axes"):
        init_device_mesh("cpu", (2, 2), ("dp",))
    with pytest.raises(ValueError, match=r"repeats \['dp'\]"):
        init_device_mesh("cpu", (2, 2), ("dp", "dp"))


def test_init_device_mesh_npu_imports_torch_npu_lazily(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(ImportError, match="needs the torch_npu package"):
        init_device_mesh("npu", (2,), ("dp",))


@pytest.mark.slow
def test_import_creates_no_process_group():
    code = (
        "import sys, torch.distributed as d\n"
        "import hyper_parallel.distributed.mesh, hyper_parallel.layout, hyper_parallel.tp.styles, hyper_parallel.plan\n"
        "assert not d.is_initialized()\n"
        "assert 'torch_npu' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))


# -- glob matching ------------------------------------------------------------------------------


def test_glob_matches_segment_by_segment():
    assert fqn_matches("model.layers.*", "model.layers.0")
    assert not fqn_matches("model.layers.*", "model.layers.0.mlp")
    assert not fqn_matches("model.layers.*", "model.layers")
    assert fqn_matches("model.layers.*.mlp", "model.layers.11.mlp")
    assert fqn_matches("model.layers.[01].mlp", "model.layers.1.mlp")
    assert not fqn_matches("model.layers.[01].mlp", "model.layers.2.mlp")
    assert fqn_matches("*_proj", "q_proj") and not fqn_matches("*", "model.norm")
    assert fqn_matches("", "") and not fqn_matches("", "model") and not fqn_matches("*", "")
    assert not fqn_matches("Model", "model")  # case-sensitive on every platform


def test_match_module_fqns(model):
    fqns = [name for name, _ in model.named_modules()]
    assert match_module_fqns("model.layers.*", fqns) == ["model.layers.0", "model.layers.1"]
    assert match_module_fqns("model.layers.*.*_proj", fqns) == []
    assert match_module_fqns("model.layers.*.self_attn.*_proj", fqns) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
    ]
    assert match_module_fqns("", fqns) == [""]
    assert match_module_fqns("*", fqns) == ["model", "lm_head"]


# -- ParallelPlan -------------------------------------------------------------------------------


def test_plan_defaults():
    plan = ParallelPlan()
    assert plan.tensor_parallel == {} and plan.layouts == {} and plan.inputs == {}
    assert plan.fully_shard is None and plan.tp_axis == "tp"
    assert plan.is_empty()
    assert repr(plan) == "ParallelPlan()"
    assert PLAN_KEYS == (
        "tensor_parallel", "layouts", "inputs", "outputs", "fully_shard", "recompute", "swap", "pipeline",
        "expert_parallel", "context_parallel", "tp_axis",
    )


def test_plan_from_dict_equals_constructor():
    from_dict = ParallelPlan.from_dict(
        {
            "tensor_parallel": {"model.layers.*.self_attn.q_proj": "colwise", "lm_head": {"style": "colwise", "output_layouts": "R"}},
            "layouts": {"model.norm": {"parameter": {"weight": ["tp"]}, "forward": {"output": [["dp", None, None]]}}},
            "inputs": {"input_ids": ["dp", None]},
            "fully_shard": {"units": ["model.layers.*"]},
        }
    )
    direct = ParallelPlan(
        tensor_parallel={"model.layers.*.self_attn.q_proj": ColwiseParallel(), "lm_head": ColwiseParallel(output_layouts=R)},
        layouts={"model.norm": {"parameter": {"weight": ("tp",)}, "forward": {"output": (("dp", None, None),)}}},
        inputs={"input_ids": ("dp", None)},
        fully_shard={"units": ["model.layers.*"]},
    )
    assert from_dict == direct
    assert ParallelPlan.from_dict(direct) is direct
    assert not direct.is_empty()
    assert "tensor_parallel={'model.layers.*.self_attn.q_proj': ColwiseParallel()" in repr(direct)


def test_plan_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown plan key 'tensor_paralel' \(did you mean 'tensor_parallel'\?\); valid keys are \['tensor_parallel', 'layouts'"):
        ParallelPlan.from_dict({"tensor_paralel": {}})
    with pytest.raises(TypeError, match="a plan must be a ParallelPlan or a dict"):
        ParallelPlan.from_dict([("tensor_parallel", {})])
    with pytest.raises(ValueError, match=r"tensor_parallel\['lm_head'\]: unknown parallel style 'col'"):
        ParallelPlan.from_dict({"tensor_parallel": {"lm_head": "col"}})
    with pytest.raises(TypeError, match=r"ParallelPlan\(layouts=...\) must be a dict"):
        ParallelPlan(layouts=["x"])
    with pytest.raises(TypeError, match="tp_axis=...\\) must be a mesh axis name"):
        ParallelPlan(tp_axis=None)


def test_plan_layout_entry_errors():
    with pytest.raises(ValueError, match=r"layouts\['model.norm'\]: unknown key 'parameters'; a layouts entry has keys \['parameter', 'forward'\]"):
        ParallelPlan(layouts={"model.norm": {"parameters": {}}})
    with pytest.raises(ValueError, match=r"\['forward'\]: unknown key 'inputs'; valid keys are \['input', 'output'\]"):
        ParallelPlan(layouts={"model.norm": {"forward": {"inputs": ()}}})
    with pytest.raises(TypeError, match=r"\['forward'\]\['input'\]: expected a tuple with one layout \(or None\) per forward input"):
        ParallelPlan(layouts={"model.norm": {"forward": {"input": Shard(0)}}})
    with pytest.raises(TypeError, match=r"\['parameter'\]: expected a dict parameter name -> layout"):
        ParallelPlan(layouts={"model.norm": {"parameter": ["weight"]}})
    with pytest.raises(TypeError, match=r"layouts\['x'\]: expected a dict with keys"):
        ParallelPlan(layouts={"x": "colwise"})


# -- resolve_plan: the happy path ---------------------------------------------------------------


def test_resolve_tp_plan_on_2d_mesh(model, mesh_2d):
    resolved = resolve_plan(ParallelPlan(tensor_parallel=TP_PLAN), model, mesh_2d)
    assert isinstance(resolved, ResolvedPlan)
    assert resolved.tp_axis == "tp" and resolved.data_parallel_axes == ("dp",)
    assert resolved.mesh_dim_names == ("dp", "tp") and resolved.mesh_shape == (2, 2)
    pp = resolved.param_placements
    # Every parameter and buffer is present, one placement per mesh axis.
    expected_names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert list(pp) == expected_names
    assert all(len(p) == 2 for p in pp.values())
    assert pp["model.embed_tokens.weight"] == (R, Shard(0))
    assert pp["model.layers.0.self_attn.q_proj.weight"] == (R, Shard(0))
    assert pp["model.layers.1.self_attn.q_proj.bias"] == (R, Shard(0))
    assert pp["model.layers.0.self_attn.o_proj.weight"] == (R, Shard(1))
    assert pp["model.layers.1.mlp.gate_proj.weight"] == (R, Shard(0))
    assert pp["model.layers.1.mlp.down_proj.weight"] == (R, Shard(1))
    assert pp["lm_head.weight"] == (R, Shard(0))
    assert pp["model.layers.0.input_layernorm.weight"] == (R, R)
    assert pp["model.inv_freq"] == (R, R)
    src = resolved.param_sources
    assert src["model.layers.1.self_attn.q_proj.weight"] == "tensor_parallel['model.layers.*.self_attn.q_proj'] ColwiseParallel"
    assert "model.norm.weight" not in src and "model.inv_freq" not in src

    mods = resolved.modules
    assert list(mods) == [
        "model.embed_tokens",
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj",
        "lm_head",
    ]
    q = mods["model.layers.0.self_attn.q_proj"]
    assert isinstance(q, ModuleConstraints) and q.module_fqn == "model.layers.0.self_attn.q_proj"
    assert q.inputs == (ActivationConstraint({"tp": R}, "tensor_parallel['model.layers.*.self_attn.q_proj'] ColwiseParallel input 0"),)
    assert q.outputs[0].placements == {"tp": Shard(-1)}
    assert q.kwarg_inputs == {}
    o = mods["model.layers.1.self_attn.o_proj"]
    assert o.inputs[0].placements == {"tp": Shard(-1)} and o.outputs[0].placements == {"tp": R}
    assert o.outputs[0].source == "tensor_parallel['model.layers.*.self_attn.o_proj'] RowwiseParallel output 0"
    assert mods["model.embed_tokens"].inputs[0].placements == {"tp": R}
    assert mods["lm_head"].outputs[0].placements == {"tp": R}
    assert resolved.inputs == {}
    assert repr(q.inputs[0]) == "ActivationConstraint(tp=R)"


def test_resolve_on_1d_mesh(model, mesh_1d):
    resolved = resolve_plan({"tensor_parallel": TP_PLAN}, model, mesh_1d)
    assert resolved.tp_axis == "tp" and resolved.data_parallel_axes == ()
    assert resolved.param_placements["model.layers.0.self_attn.q_proj.weight"] == (Shard(0),)
    assert resolved.param_placements["model.norm.weight"] == (R,)
    assert resolved.input_placements("input_ids", 2) == (R, R)[:1]


def test_resolve_accepts_a_layout_as_mesh(model):
    resolved = resolve_plan({"tensor_parallel": TP_PLAN}, model, Layout((2, 2), ("dp", "tp")))
    assert resolved.param_placements["model.layers.0.self_attn.o_proj.weight"] == (R, Shard(1))


def test_resolve_empty_plan(model, mesh_2d):
    for plan in (None, {}, ParallelPlan()):
        resolved = resolve_plan(plan, model, mesh_2d)
        assert set(resolved.param_placements.values()) == {(R, R)}
        assert resolved.param_sources == {} and resolved.modules == {} and resolved.inputs == {}
        assert resolved.tp_axis == "tp"  # the mesh has one, even if no style uses it


def test_tp_axis_selection(model):
    one_axis = Layout((2,), ("mp",))
    assert resolve_plan({"tensor_parallel": TP_PLAN}, model, one_axis).tp_axis == "mp"
    assert resolve_plan({}, model, one_axis).tp_axis is None
    custom = resolve_plan({"tensor_parallel": TP_PLAN, "tp_axis": "mp"}, model, Layout((2, 2), ("dp", "mp")))
    assert custom.param_placements["lm_head.weight"] == (R, Shard(0))
    with pytest.raises(ValueError, match=r"apply on mesh axis 'tp', which the mesh does not have \(axes \['dp', 'cp'\]\).*tp_axis"):
        resolve_plan({"tensor_parallel": TP_PLAN}, model, Layout((2, 2), ("dp", "cp")))
    with pytest.raises(ValueError, match=r"the mesh's only axis is the data-parallel axis 'dp'.*tp_axis='dp'"):
        resolve_plan({"tensor_parallel": TP_PLAN}, model, Layout((2,), ("dp",)))
    explicit = resolve_plan({"tensor_parallel": TP_PLAN, "tp_axis": "dp"}, model, Layout((2,), ("dp",)))
    assert explicit.tp_axis == "dp"


def test_resolve_layouts_entries(model, mesh_2d):
    plan = {
        "layouts": {
            "model.layers.*.input_layernorm": {"parameter": {"weight": ["tp"]}},
            "model.embed_tokens": {
                "parameter": {"weight": (Replicate(), Shard(-1))},
                "forward": {"input": (["dp", None],), "output": (Layout((2, 2), ("dp", "tp"))("dp", None, "tp"),)},
            },
            "model.norm": {"forward": {"input": (None, ["dp"])}},
        }
    }
    resolved = resolve_plan(plan, model, mesh_2d)
    pp = resolved.param_placements
    assert pp["model.layers.1.input_layernorm.weight"] == (R, Shard(0))
    assert pp["model.embed_tokens.weight"] == (R, Shard(1))  # Shard(-1) made non-negative
    assert resolved.param_sources["model.embed_tokens.weight"] == "layouts['model.embed_tokens']['parameter']['weight']"
    embed = resolved.modules["model.embed_tokens"]
    assert embed.inputs[0].placements == {"dp": Shard(0), "tp": R}  # full-mesh: every axis pinned
    assert embed.outputs[0].placements == {"dp": Shard(0), "tp": Shard(2)}
    assert embed.inputs[0].source == "layouts['model.embed_tokens']['forward']['input'][0]"
    assert resolved.modules["model.norm"].inputs[0] is None
    assert resolved.modules["model.norm"].inputs[1].placements == {"dp": Shard(0), "tp": R}
    assert resolved.modules["model.norm"].inputs[1].source == "layouts['model.norm']['forward']['input'][1]"


def test_tp_and_layouts_on_one_module_merge(model, mesh_2d):
    plan = ParallelPlan(
        tensor_parallel={"model.layers.*.self_attn.q_proj": ColwiseParallel()},
        layouts={
            # Agrees with the style on the weight; adds a dp constraint on the output.
            "model.layers.0.self_attn.q_proj": {
                "parameter": {"weight": ["tp", None]},
                "forward": {"output": ({"dp": Shard(0)},)},
            }
        },
    )
    resolved = resolve_plan(plan, model, mesh_2d)
    out = resolved.modules["model.layers.0.self_attn.q_proj"].outputs[0]
    assert out.placements == {"dp": Shard(0), "tp": Shard(-1)}
    assert list(out.placements) == ["dp", "tp"]  # mesh order
    assert out.source == (
        "tensor_parallel['model.layers.*.self_attn.q_proj'] ColwiseParallel output 0 + "
        "layouts['model.layers.0.self_attn.q_proj']['forward']['output'][0]"
    )
    assert resolved.modules["model.layers.1.self_attn.q_proj"].outputs[0].placements == {"tp": Shard(-1)}


def test_sequence_parallel_and_prepare_styles(model, mesh_2d):
    plan = ParallelPlan(
        tensor_parallel={
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.self_attn": PrepareModuleInput(desired_input_layouts=(Replicate(),)),
            "model.layers.*.mlp": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Shard(1)),
            "": PrepareModuleInput(desired_input_kwarg_layouts={"labels": Replicate()}),
        }
    )
    resolved = resolve_plan(plan, model, mesh_2d)
    assert resolved.param_placements["model.layers.0.input_layernorm.weight"] == (R, R)
    assert resolved.param_sources["model.layers.0.input_layernorm.weight"].endswith("SequenceParallel")
    norm = resolved.modules["model.layers.0.input_layernorm"]
    assert norm.inputs[0].placements == {"tp": Shard(1)} and norm.outputs[0].placements == {"tp": Shard(1)}
    assert resolved.modules["model.layers.1.self_attn"].inputs[0].placements == {"tp": R}
    assert resolved.modules["model.layers.1.self_attn"].outputs == ()
    assert resolved.modules["model.layers.0.mlp"].outputs[0].placements == {"tp": Shard(1)}
    root = resolved.modules[""]
    assert root.kwarg_inputs["labels"].placements == {"tp": R}
    assert root.kwarg_inputs["labels"].source == "tensor_parallel[''] PrepareModuleInput kwarg input 'labels'"
    assert list(resolved.modules)[0] == ""  # model order: root first


def test_input_overrides(model, mesh_2d):
    resolved = resolve_plan({"inputs": {"input_ids": ["dp", "tp"], "labels": (Shard(0), Shard(-1))}}, model, mesh_2d)
    assert resolved.inputs == {"input_ids": (Shard(0), Shard(1)), "labels": (Shard(0), Shard(-1))}
    assert resolved.input_placements("input_ids", 2) == (Shard(0), Shard(1))
    assert resolved.input_placements("labels", 2) == (Shard(0), Shard(1))  # normalised for the rank
    # Defaults: Shard(0) on data-parallel axes, Replicate elsewhere; 0-d tensors replicated.
    assert resolved.input_placements("other", 3) == (Shard(0), R)
    assert resolved.input_placements("other", 0) == (R, R)
    assert default_input_placements(("dp_replicate", "dp_shard", "tp"), 2) == (Shard(0), Shard(0), R)
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\]: TinyLM.forward has no argument 'attention_mask'; its arguments are \['input_ids', 'labels'\]"):
        resolve_plan({"inputs": {"attention_mask": ["dp"]}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"inputs\['input_ids'\] Layout\[sp\]: mesh axis 'sp'"):
        resolve_plan({"inputs": {"input_ids": ["sp"]}}, model, mesh_2d)


def test_output_overrides(model, mesh_2d):
    """``outputs`` name the non-data-parallel axes only: one Placement for all of them or a dict."""
    resolved = resolve_plan({"outputs": {"logits": Replicate(), "hidden.*": {"tp": "S(1)"}}}, model, mesh_2d)
    assert resolved.outputs == {"logits": {"tp": R}, "hidden.*": {"tp": Shard(1)}}
    assert resolved.output_override("logits") == {"tp": R}
    assert resolved.output_override("hidden.0") == {"tp": Shard(1)}
    assert resolved.output_override("loss") == {}
    with pytest.raises(ValueError, match=r"outputs\['logits'\]: 'dp' is a data-parallel axis; outputs are always this rank's part of the batch there \(as inputs\). Name only the other axes \['tp'\]"):
        resolve_plan({"outputs": {"logits": {"dp": Replicate()}}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"outputs\['logits'\]: a returned value cannot be Partial on 'tp'"):
        resolve_plan({"outputs": {"logits": Partial()}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"outputs\['logits'\] is given twice with different layouts"):
        merge_plans({"outputs": {"logits": Replicate()}}, {"outputs": {"logits": Shard(2)}})
    assert merge_plans({"outputs": {"logits": R}}, {"outputs": {"loss": R}}).outputs == {"logits": R, "loss": R}


def test_tied_parameters_share_placements(mesh_2d):
    model = TinyLM(tie=True)
    resolved = resolve_plan({"tensor_parallel": {"lm_head": "colwise"}}, model, mesh_2d)
    assert resolved.param_placements["lm_head.weight"] == (R, Shard(0))
    assert resolved.param_placements["model.embed_tokens.weight"] == (R, Shard(0))
    assert resolved.param_sources["model.embed_tokens.weight"] == (
        "tensor_parallel['lm_head'] ColwiseParallel (tied with 'lm_head.weight')"
    )
    # Embedding colwise shards dim 1, lm_head colwise dim 0: one tensor cannot be both.
    plan = {"tensor_parallel": {"lm_head": "colwise", "model.embed_tokens": "colwise"}}
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' and 'lm_head.weight' are the same tied tensor but get different layouts: \[R, S\(1\)\].*\[R, S\(0\)\]"):
        resolve_plan(plan, model, mesh_2d)


def test_describe(model, mesh_2d):
    text = resolve_plan({"tensor_parallel": TP_PLAN, "inputs": {"input_ids": ["dp"]}}, model, mesh_2d).describe()
    assert "mesh {'dp': 2, 'tp': 2}, tp_axis='tp'" in text
    assert "model.layers.0.self_attn.q_proj.weight: [R, S(0)]  <- tensor_parallel['model.layers.*.self_attn.q_proj'] ColwiseParallel" in text
    assert "model.norm.weight: [R, R]  <- default" in text
    assert "input_ids: [S(0), R]" in text


# -- resolve_plan: errors -----------------------------------------------------------------------


def test_unmatched_tensor_parallel_glob(model, mesh_2d):
    with pytest.raises(ValueError, match=r"tensor_parallel\['model.layer.\*.self_attn.q_proj'\] matches no module of TinyLM; .*segment by segment.*did you mean 'model.layers.\*.self_attn.q_proj'"):
        resolve_plan({"tensor_parallel": {"model.layer.*.self_attn.q_proj": "colwise"}}, model, mesh_2d)


def test_unmatched_layouts_glob_suggests_concrete_names(model, mesh_2d):
    with pytest.raises(ValueError, match=r"layouts\['model.layers.0.self_attn.q_prj'\] matches no module.*did you mean 'model.layers.0.self_attn.q_proj'"):
        resolve_plan({"layouts": {"model.layers.0.self_attn.q_prj": {"parameter": {}}}}, model, mesh_2d)


def test_unmatched_glob_without_close_names(model, mesh_2d):
    with pytest.raises(ValueError, match=r"matches no module.*the top-level modules are \['model', 'lm_head'\]"):
        resolve_plan({"tensor_parallel": {"zzzzzz": "colwise"}}, model, mesh_2d)


def test_style_on_wrong_module(model, mesh_2d):
    with pytest.raises(TypeError, match=r"tensor_parallel\['model.layers.\*.mlp'\]: ColwiseParallel cannot be applied to module 'model.layers.0.mlp' \(MLP\).*'model.layers.0.mlp.gate_proj'"):
        resolve_plan({"tensor_parallel": {"model.layers.*.mlp": "colwise"}}, model, mesh_2d)


def test_layout_names_unknown_mesh_axis(model, mesh_2d):
    with pytest.raises(ValueError, match=r"layouts\['model.norm'\]\['parameter'\]\['weight'\] \('model.norm.weight'\).*mesh axis 'sp' .*does not exist; available axes are \['dp', 'tp'\]"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": ["sp"]}}}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"layouts\['model.norm'\]\['forward'\]\['output'\]\[0\].*mesh axis 'cp'"):
        resolve_plan({"layouts": {"model.norm": {"forward": {"output": ({"cp": Shard(0)},)}}}}, model, mesh_2d)
    other = Layout((2, 2), ("dp", "cp"))("cp")
    with pytest.raises(ValueError, match=r"Layout\[cp\] was built for mesh \('dp', 'cp'\).*but the mesh is \('dp', 'tp'\)"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": other}}}}, model, mesh_2d)


def test_layout_for_another_mesh_shape(model, mesh_2d):
    wrong_shape = Layout((1, 4), ("dp", "tp"))("tp")
    with pytest.raises(ValueError, match=r"shape \(1, 4\) but the mesh is \('dp', 'tp'\) of shape \(2, 2\)"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": wrong_shape}}}}, model, mesh_2d)


def test_parameter_not_divisible(mesh_2d):
    model = TinyLM(vocab=15)
    with pytest.raises(ValueError, match=r"parameter 'lm_head.weight' with shape \(15, 8\) cannot be sharded on dim 0 over mesh axes \['tp'\] \(sizes \[2\], 2 shards\): 15 is not divisible by 2 \(set by tensor_parallel\['lm_head'\] ColwiseParallel\); use a parallel degree that divides 15"):
        resolve_plan({"tensor_parallel": {"lm_head": "colwise"}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' with shape \(15, 8\) cannot be sharded on dim 0 over mesh axes \['dp', 'tp'\] \(sizes \[2, 2\], 4 shards\)"):
        resolve_plan({"layouts": {"model.embed_tokens": {"parameter": {"weight": [("dp", "tp")]}}}}, model, mesh_2d)


def test_fused_parts_not_divisible(mesh_2d):
    """Each of ColwiseParallel(parts=n)'s parts is split over the axis: 18 features are 2 parts of 9,
    which 2 ranks cannot split (it was a bare AssertionError inside DTensor)."""
    with pytest.raises(ValueError, match=r"'lm_head.weight' with shape \(18, 8\) cannot be sharded on dim 0 over mesh axes "
                                         r"\['tp'\] \(sizes \[2\], each of its 2 parts split, 4 shards\): 18 is not divisible by 4"):
        resolve_plan({"tensor_parallel": {"lm_head": ColwiseParallel(parts=2)}}, TinyLM(vocab=18), mesh_2d)
    resolve_plan({"tensor_parallel": {"lm_head": ColwiseParallel(parts=2)}}, TinyLM(vocab=20), mesh_2d)


def test_parameter_layout_rank_errors(model, mesh_2d):
    with pytest.raises(ValueError, match=r"\('model.norm.weight'\).*names 2 tensor dims but the tensor has 1 dims"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": [None, "tp"]}}}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"placement S\(3\).*shards dim 3 but the tensor has 1 dims"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": (R, Shard(3))}}}}, model, mesh_2d)


def test_partial_parameter_rejected(model, mesh_2d):
    with pytest.raises(ValueError, match=r"\('model.norm.weight'\): a parameter cannot be partial \(\[R, P\(sum\)\]\)"):
        resolve_plan({"layouts": {"model.norm": {"parameter": {"weight": (R, Partial())}}}}, model, mesh_2d)


def test_conflicting_parameter_layouts(model, mesh_2d):
    plan = ParallelPlan(
        tensor_parallel={"model.layers.*.self_attn.q_proj": ColwiseParallel()},
        layouts={"model.layers.1.self_attn.q_proj": {"parameter": {"weight": [None, "tp"]}}},
    )
    with pytest.raises(
        ValueError,
        match=r"parameter 'model.layers.1.self_attn.q_proj.weight' gets two different layouts: \[R, S\(0\)\] from "
        r"tensor_parallel\['model.layers.\*.self_attn.q_proj'\] ColwiseParallel and \[R, S\(1\)\] from "
        r"layouts\['model.layers.1.self_attn.q_proj'\]\['parameter'\]\['weight'\]",
    ):
        resolve_plan(plan, model, mesh_2d)
    two_styles = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.0.self_attn.*": "rowwise"}
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' gets two different layouts.*tensor_parallel\['model.layers.0.self_attn.\*'\] RowwiseParallel"):
        resolve_plan({"tensor_parallel": two_styles}, model, mesh_2d)


def test_conflicting_activation_constraints(model, mesh_2d):
    plan = ParallelPlan(
        tensor_parallel={"model.norm": SequenceParallel()},
        layouts={"model.norm": {"forward": {"output": (["dp", None, "tp"],)}}},
    )
    with pytest.raises(ValueError, match=r"module 'model.norm' output 0 is constrained twice on mesh axis 'tp': S\(1\) by tensor_parallel\['model.norm'\] SequenceParallel output 0 and S\(2\) by layouts\['model.norm'\]\['forward'\]\['output'\]\[0\]"):
        resolve_plan(plan, model, mesh_2d)


def test_layouts_parameter_the_module_does_not_have(model, mesh_2d):
    with pytest.raises(ValueError, match=r"layouts\['model.layers.\*.self_attn.o_proj'\]\['parameter'\]\['bias'\]: module 'model.layers.0.self_attn.o_proj' \(Linear\) has no parameter or buffer 'bias'; its own parameters/buffers are \['weight'\]"):
        resolve_plan({"layouts": {"model.layers.*.self_attn.o_proj": {"parameter": {"bias": ["tp"]}}}}, model, mesh_2d)
    with pytest.raises(ValueError, match=r"module 'model.layers.0' \(DecoderLayer\) has no parameter or buffer 'self_attn.q_proj.weight'; its own parameters/buffers are \[\]"):
        resolve_plan({"layouts": {"model.layers.0": {"parameter": {"self_attn.q_proj.weight": ["tp"]}}}}, model, mesh_2d)


def test_plan_options_are_stored_and_ignored_by_resolution(model, mesh_2d):
    plan = ParallelPlan(fully_shard={"units": [""]}, recompute=True, swap="x", pipeline=2)
    assert (plan.fully_shard, plan.recompute, plan.swap, plan.pipeline) == ({"units": [""]}, True, "x", 2)
    assert set(resolve_plan(plan, model, mesh_2d).param_placements.values()) == {(R, R)}


# -- recorded entries: shard_module / parallelize_module ----------------------------------------


def test_shard_module_records_without_touching_the_module(model, mesh_2d):
    x = torch.randint(0, 16, (2, 3))
    before = model(x)
    layout = Layout((2, 2), ("dp", "tp"))
    norm = model.model.layers[1].input_layernorm
    returned = shard_module(norm, {"parameter": {"weight": layout("tp")}, "forward": {"input": (layout("dp"),)}})
    assert returned is norm
    assert not norm._forward_hooks and not norm._forward_pre_hooks
    assert isinstance(norm.weight, nn.Parameter) and norm.weight.shape == (8,)
    torch.testing.assert_close(model(x), before)
    plan = collect_recorded_plan(model)
    assert plan.layouts == {
        "model.layers.1.input_layernorm": {"parameter": {"weight": layout("tp")}, "forward": {"input": (layout("dp"),)}}
    }
    resolved = resolve_plan(plan, model, mesh_2d)
    assert resolved.param_placements["model.layers.1.input_layernorm.weight"] == (R, Shard(0))
    assert resolved.modules["model.layers.1.input_layernorm"].inputs[0].placements == {"dp": Shard(0), "tp": R}


def test_shard_module_errors(model):
    with pytest.raises(ValueError, match=r"shard_module\(sharding_plan\)\['parameter'\]: module '<root>' \(Linear\) has no parameter or buffer 'wieght'; its own parameters/buffers are \['weight'\]"):
        shard_module(model.lm_head, {"parameter": {"wieght": ["tp"]}})
    with pytest.raises(ValueError, match=r"unknown key 'model.norm'; a layouts entry has keys"):
        shard_module(model, {"model.norm": {"parameter": {}}})
    with pytest.raises(TypeError, match="shard_module expects an nn.Module"):
        shard_module("lm_head", {})


def test_parallelize_module_records_relative_globs(model, mesh_1d):
    layer = model.model.layers[0]
    returned = parallelize_module(layer, mesh_1d, {"self_attn.q_proj": ColwiseParallel(), "self_attn.o_proj": "rowwise"})
    assert returned is layer and not layer._forward_hooks
    assert isinstance(layer.self_attn.q_proj.weight, nn.Parameter)
    parallelize_module(model.lm_head, mesh_1d, ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(model, "tp", {"model.layers.1.mlp.gate_proj": "colwise"})
    plan = collect_recorded_plan(model)
    assert plan.tensor_parallel == {
        "model.layers.1.mlp.gate_proj": ColwiseParallel(),
        "model.layers.0.self_attn.q_proj": ColwiseParallel(),
        "model.layers.0.self_attn.o_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    assert plan.tp_axis == "tp"
    resolved = resolve_plan(plan, model, mesh_1d)
    assert resolved.param_placements["model.layers.0.self_attn.o_proj.weight"] == (Shard(1),)
    assert resolved.param_placements["model.layers.1.self_attn.o_proj.weight"] == (R,)


def test_parallelize_module_takes_axis_from_mesh(model, mesh_2d):
    parallelize_module(model, mesh_2d["tp"], {"lm_head": "colwise"})
    assert collect_recorded_plan(model).tp_axis == "tp"
    other = TinyLM()
    parallelize_module(other, Layout((2,), ("mp",)), {"lm_head": "colwise"})
    assert collect_recorded_plan(other).tp_axis == "mp"
    parallelize_module(other.model, "tp", {"norm": SequenceParallel()})
    with pytest.raises(ValueError, match=r"parallelize_module was called with meshes on different axes: 'mp' .*'tp'"):
        collect_recorded_plan(other)


def test_parallelize_module_errors(model, mesh_2d):
    with pytest.raises(ValueError, match=r"needs the 1-D tensor-parallel \(sub-\)mesh, got a 2-D mesh with axes \('dp', 'tp'\); pass mesh\['tp'\]"):
        parallelize_module(model, mesh_2d, {"lm_head": "colwise"})
    with pytest.raises(ValueError, match=r"parallelize_plan\['layers.\*.q_proj'\] matches no module of Backbone.*did you mean 'layers.\*.self_attn.q_proj'"):
        parallelize_module(model.model, "tp", {"layers.*.q_proj": "colwise"})
    with pytest.raises(ValueError, match=r"parallelize_plan\['lm_head'\]: unknown parallel style"):
        parallelize_module(model, "tp", {"lm_head": "col"})
    with pytest.raises(TypeError, match="parallelize_plan must be a ParallelStyle, a style name, or a dict"):
        parallelize_module(model, "tp", [ColwiseParallel()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parallelize_module(model, "tp", None) is model
    assert any("records nothing" in str(w.message) for w in caught)
    assert collect_recorded_plan(model).is_empty()


def test_recorded_conflicts(model):
    parallelize_module(model, "tp", {"lm_head": "colwise"})
    parallelize_module(model.lm_head, "tp", RowwiseParallel())
    with pytest.raises(ValueError, match=r"tensor_parallel\['lm_head'\] is recorded twice with different styles: ColwiseParallel\(\) \(parallelize_module on '<root>'\) and RowwiseParallel\(\) \(parallelize_module on 'lm_head'\)"):
        collect_recorded_plan(model)
    other = TinyLM()
    shard_module(other.lm_head, {"parameter": {"weight": ["tp"]}})
    shard_module(other.lm_head, {"parameter": {"weight": [None, "tp"]}})
    with pytest.raises(ValueError, match=r"layouts\['lm_head'\]\['parameter'\]\['weight'\] is given twice with different layouts: \('tp',\) \(shard_module on 'lm_head'\) and \(None, 'tp'\)"):
        collect_recorded_plan(other)


# -- merge_plans --------------------------------------------------------------------------------


def test_merge_plans():
    a = ParallelPlan(
        tensor_parallel={"lm_head": "colwise"},
        layouts={"model.norm": {"parameter": {"weight": ["tp"]}}},
        inputs={"input_ids": ["dp"]},
        fully_shard={"units": [""]},
    )
    b = {
        "tensor_parallel": {"lm_head": ColwiseParallel(), "model.embed_tokens": "rowwise"},
        "layouts": {"model.norm": {"forward": {"output": (["dp"],)}}},
        "inputs": {"labels": ["dp"], "input_ids": ("dp",)},
        "recompute": True,
    }
    merged = merge_plans(a, b)
    assert merged.tensor_parallel == {"lm_head": ColwiseParallel(), "model.embed_tokens": RowwiseParallel()}
    assert merged.layouts == {"model.norm": {"parameter": {"weight": ("tp",)}, "forward": {"output": (("dp",),)}}}
    assert merged.inputs == {"input_ids": ("dp",), "labels": ("dp",)}
    assert merged.fully_shard == {"units": [""]} and merged.recompute is True
    assert merge_plans(None, a) == a and merge_plans(a, None) == a and merge_plans(None, None) == ParallelPlan()


def test_merge_plans_conflicts():
    with pytest.raises(ValueError, match=r"tensor_parallel\['lm_head'\] is given twice with different styles: ColwiseParallel\(\) and RowwiseParallel\(\)"):
        merge_plans({"tensor_parallel": {"lm_head": "colwise"}}, {"tensor_parallel": {"lm_head": "rowwise"}})
    with pytest.raises(ValueError, match=r"layouts\['n'\]\['forward'\]\['input'\] is given twice with different layouts"):
        merge_plans({"layouts": {"n": {"forward": {"input": (["dp"],)}}}}, {"layouts": {"n": {"forward": {"input": (["tp"],)}}}})
    with pytest.raises(ValueError, match=r"inputs\['input_ids'\] is given twice with different layouts: \('dp',\) and \('tp',\)"):
        merge_plans({"inputs": {"input_ids": ["dp"]}}, {"inputs": {"input_ids": ["tp"]}})
    with pytest.raises(ValueError, match="fully_shard is given twice with different values"):
        merge_plans({"fully_shard": 1}, {"fully_shard": 2})
    with pytest.raises(ValueError, match=r"different mesh axes, 'tp' and 'mp'; use one tp_axis"):
        merge_plans({"tensor_parallel": {"a": "colwise"}}, {"tensor_parallel": {"b": "colwise"}, "tp_axis": "mp"})


def test_merge_plans_tp_axis():
    assert merge_plans({"tensor_parallel": {"a": "colwise"}, "tp_axis": "mp"}, {}).tp_axis == "mp"
    assert merge_plans({}, {"tensor_parallel": {"a": "colwise"}, "tp_axis": "mp"}).tp_axis == "mp"
    assert merge_plans({"tp_axis": "mp"}, {}).tp_axis == "mp"
    assert merge_plans({"tensor_parallel": {"a": "colwise"}}, {"tp_axis": "mp"}).tp_axis == "tp"


def test_recorded_and_explicit_plans_combine(model, mesh_2d):
    parallelize_module(model.model.layers[0].self_attn, mesh_2d["tp"], {"q_proj": "colwise", "o_proj": "rowwise"})
    explicit = ParallelPlan(tensor_parallel={"model.layers.1.self_attn.q_proj": "colwise"}, inputs={"input_ids": ["dp"]})
    resolved = resolve_plan(merge_plans(collect_recorded_plan(model), explicit), model, mesh_2d)
    pp = resolved.param_placements
    assert pp["model.layers.0.self_attn.q_proj.weight"] == (R, Shard(0))
    assert pp["model.layers.0.self_attn.o_proj.weight"] == (R, Shard(1))
    assert pp["model.layers.1.self_attn.q_proj.weight"] == (R, Shard(0))
    assert pp["model.layers.1.self_attn.o_proj.weight"] == (R, R)
    assert resolved.inputs == {"input_ids": (Shard(0), R)}


def test_glob_naming_a_parameter(model, mesh_2d):
    with pytest.raises(ValueError, match=r"\['model.layers.\*.self_attn.q_proj.weight'\] matches no module.*the key names a parameter, but plan keys are module FQNs: use 'model.layers.\*.self_attn.q_proj'"):
        resolve_plan({"tensor_parallel": {"model.layers.*.self_attn.q_proj.weight": "colwise"}}, model, mesh_2d)


def test_forward_entry_that_is_one_layout_not_a_tuple():
    with pytest.raises(TypeError, match=r"\['forward'\]\['input'\] = \['dp', None\] looks like a single layout.*write \(\['dp', None\],\)"):
        ParallelPlan(layouts={"model.norm": {"forward": {"input": ["dp", None]}}})
