"""Where FSDP's gradient reductions sit in the compiled backward program (issue: reductions as soon
as possible). The example Llama and transformers' ``LlamaForCausalLM``, 8 layers, one FSDP unit per
layer plus the root, compiled on one simulated rank of 2 (torch's ``fake`` backend): each unit's fused reduce-scatter must follow that
unit's backward, interleaved with the other layers' backward compute, also under mixed precision
(bf16 parameters, fp32 reduction), where the gradient casts to the reduce dtype once all sat at the
end of backward and held every reduce-scatter (and every layer's unsharded fp32 gradient) there."""

from __future__ import annotations

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.explain import compile_for_explain, fake_world
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

c10d = torch.ops._c10d_functional
LAYERS = 8


def _model(name):
    if name == "hf_llama":
        pytest.importorskip("transformers")
        from hyper_parallel.models import tiny_hf_llama

        return tiny_hf_llama(num_hidden_layers=LAYERS, use_cache=False)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=LAYERS))


def _backward(name, mixed_precision):
    plan = {"fully_shard": {"units": ["model.layers.*", ""], "mixed_precision": mixed_precision}}
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = _model(name)
        ids = torch.empty(2, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids})
    return list(pmodel.compiled_programs()[1].graph.nodes)


@pytest.mark.parametrize("mixed_precision", [
    None, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
], ids=["fp32", "bf16-params-fp32-reduce"])
@pytest.mark.parametrize("name", ["example", "hf_llama"])
def test_each_units_reduce_scatter_follows_its_backward(name, mixed_precision):
    nodes = _backward(name, mixed_precision)
    position = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    matmuls = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(scatters) == LAYERS + 1, len(scatters)  # one fused reduce-scatter per unit
    # The first layer to finish backward (the last one) is reduced before half of backward has run.
    assert position[scatters[0]] < len(nodes) / 2, (position[scatters[0]], len(nodes))
    # Interleaved: every layer's reduce-scatter is issued before the next layer's last matmul.
    last_mm = position[matmuls[-1]]
    assert sum(position[s] < last_mm for s in scatters) >= LAYERS - 1
    # Under mixed precision the reduction reads fp32 gradients: the casts moved with it.
    if mixed_precision is not None:
        assert all(s.args[0].meta["val"].dtype == torch.float32 for s in scatters)
