"""A plan that adds collectives beyond its own boundaries is warned about, naming the module, its plan
entries and an example node (compile/unplanned.py); the same plan on a model it fits warns nothing.

One key/value head over tp=2: ``k_proj``/``v_proj`` are column-parallel, so their one head's dims are
split across the two ranks; attention needs whole heads, so propagation gathers them inside the
attention module (exact, but 3 all-gathers per layer the plan never asked for). Compiled for rank 0 of
a simulated 4-rank mesh (torch's fake process-group backend): nothing runs."""

import warnings

import pytest
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.api import compile_for_inputs
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import build_model, global_batch

pytestmark = pytest.mark.timeout(300)


def _compile(kv_heads: int):
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process (leaked by another test)")
    with fake_world(4, 0):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_model("llama", num_hidden_layers=1, num_key_value_heads=kv_heads)
        pmodel = hp.parallelize(model, llama_tp_plan(), mesh)
        batch = {k: v[:2] for k, v in global_batch("llama", 4, 16).items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compile_for_inputs(pmodel, (), batch)
        return pmodel.compile_summary(), [str(w.message) for w in caught if "beyond its own" in str(w.message)]


@pytest.mark.slow
def test_one_kv_head_over_tp2_is_warned_with_the_module_and_its_entries_two_fit_quietly():
    summary, messages = _compile(kv_heads=1)
    [finding] = summary["unplanned_collectives"]
    assert finding["module"] == "model.layers.0.self_attn"
    assert finding["axes"] == ["tp"] and finding["kinds"] == ["all_gather"] and finding["count"] == 3
    assert "tensor_parallel['model.layers.*.self_attn.k_proj'] ColwiseParallel" in finding["entries"]
    assert "tensor_parallel['model.layers.*.mlp.down_proj'] RowwiseParallel" not in finding["entries"]
    assert finding["example"].startswith("all_gather_into_tensor") and "op rule: aten." in finding["example"]
    assert "llama.py" in finding["example"]  # the user's source line
    [message] = messages
    assert "3 collective(s) per step beyond its own boundaries" in message
    assert "'model.layers.0.self_attn'" in message and "k_proj" in message and "heads" in message
    # The same 3 are in the per-step counts: the warning explains them, it does not invent them.
    fitting, quiet = _compile(kv_heads=2)
    assert fitting["unplanned_collectives"] == [] and quiet == []  # the plan fits: nothing to say
    extra = summary["collectives_per_step"]["all_gather"]["tp"]["count"]
    assert extra - fitting["collectives_per_step"].get("all_gather", {}).get("tp", {"count": 0})["count"] >= 3



def _compile_hf(arch: str, plan: dict | None = None) -> dict:
    from hyper_parallel.models.hf_zoo import hf_tp_plan, tiny_hf_model
    from hyper_parallel.testing.parity import local_batch

    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pmodel = hp.parallelize(tiny_hf_model(arch), plan or hf_tp_plan(arch), mesh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_for_inputs(pmodel, (), local_batch(global_batch(arch, 4, 16), mesh))
        forward = pmodel.compiled_programs()[0]
        return {**pmodel.compile_summary(), "forward_all_reduce_sources": [
            _source_module(n.args[0]) for n in forward.graph.nodes if "all_reduce" in str(n.target)]}


def _source_module(node) -> str:
    """The module that computed ``node``, looking through the reshapes lowering adds (no module)."""
    from hyper_parallel.ir.graph import module_fqn_of

    for _ in range(4):
        if module_fqn_of(node):
            return module_fqn_of(node)
        node = next((a for a in node.args if hasattr(a, "meta")), None)
        if node is None:
            break
    return ""


def _gpt2_contiguous_column_split() -> dict:
    """GPT-2's plan with c_attn split by contiguous columns (``Shard(1)``), as a Linear would be."""
    from torch.distributed.tensor import Shard

    from hyper_parallel.models.hf_zoo import gpt2_tp_layouts

    layouts = gpt2_tp_layouts()
    layouts["transformer.h.*.attn.c_attn"] = {"parameter": {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}}
    return {"layouts": layouts}


@pytest.mark.slow
def test_transformers_models_gpt2_fused_qkv_warned_llama_quiet():
    """GPT-2's fused ``c_attn`` (q, k, v in one [in, 3 * hidden] weight) split by contiguous columns
    puts each rank's columns across q, k and v: splitting them gathers per layer. Split per third
    (``_StridedShard(1, split_factor=3)``, hf_zoo's GPT-2 plan: propagation/fused_projections.py)
    each rank holds its heads' q, k and v and nothing is gathered; HF Llama's separate projections
    fit the plan."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process (leaked by another test)")
    findings = _compile_hf("GPT2LMHeadModel", _gpt2_contiguous_column_split())["unplanned_collectives"]
    for layer in ("transformer.h.0.attn", "transformer.h.1.attn"):
        mine = [f for f in findings if f["module"] == layer or f["module"].startswith(layer + ".")]
        assert sum(f["count"] for f in mine) >= 3, findings
    assert all(f["kinds"] == ["all_gather"] and f["axes"] == ["tp"] for f in findings)
    assert any("aten.split" in f["example"] for f in findings)
    strided = _compile_hf("GPT2LMHeadModel")
    assert strided["unplanned_collectives"] == []
    # Megatron's count: one all-reduce per row-parallel layer forward (c_proj of attention and MLP).
    assert strided["collectives"]["forward"] == {"all_reduce": {"tp": strided["collectives"]["forward"]["all_reduce"]["tp"]}}
    assert strided["collectives"]["forward"]["all_reduce"]["tp"]["count"] == 4
    # ... and where Megatron has them: each reduces the output of a row-parallel c_proj, in order.
    assert strided["forward_all_reduce_sources"] == [
        f"transformer.h.{i}.{part}.c_proj" for i in range(2) for part in ("attn", "mlp")], strided["forward_all_reduce_sources"]
    assert _compile_hf("LlamaForCausalLM")["unplanned_collectives"] == []


def _phi3_contiguous_column_split() -> dict:
    """Phi-3's plan with the fused projections split by contiguous columns (plain ``colwise``)."""
    from hyper_parallel.models.hf_zoo import hf_tp_plan

    plan = hf_tp_plan("Phi3ForCausalLM")
    for glob in ("model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"):
        plan["tensor_parallel"][glob] = "colwise"
    return plan


@pytest.mark.slow
def test_transformers_models_phi3_fused_projections_split_per_part():
    """Phi-3 keeps q, k and v in one ``qkv_proj`` and slices them apart (``qkv[..., :q]``), gate and
    up in one ``gate_up_proj`` (``.chunk(2)``). Split by contiguous columns, rank 0 holds all of q:
    the slices gather. With ``ColwiseParallel(parts=3)`` / ``parts=2`` (hf_zoo's plan) each part is
    split, the slices and chunks (and their gradients) stay local, and the program has Megatron's
    collectives: the same as transformers' Llama under its plan, forward and backward."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process (leaked by another test)")
    findings = _compile_hf("Phi3ForCausalLM", _phi3_contiguous_column_split())["unplanned_collectives"]
    assert {f["module"] for f in findings} >= {"model.layers.0.self_attn", "model.layers.1.self_attn"}, findings
    assert any("aten.slice" in f["example"] for f in findings), findings
    fused = _compile_hf("Phi3ForCausalLM")
    assert fused["unplanned_collectives"] == []
    sources = fused["forward_all_reduce_sources"]
    assert sources[0] == "model.embed_tokens", sources  # the vocab-parallel embedding's partial sums
    assert [s for s in sources if s.startswith("model.layers.")] == [
        f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn.o_proj", "mlp.down_proj")], sources
    assert fused["collectives"] == _compile_hf("LlamaForCausalLM")["collectives"]
