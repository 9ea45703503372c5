"""transformers' Phi-3 under FSDP x TP with mixed precision, as it trains: bf16 parameters, fp32
reduction, padded labels (the dp ranks count different tokens), on a 2 x 2 mesh.

Phi-3 fuses q, k and v in ``qkv_proj`` and gate and up in ``gate_up_proj``; hf_zoo's plan splits
each part over tp (``ColwiseParallel(parts=3)`` / ``parts=2``: ``_StridedShard(0)``), and FSDP
shards those weights on dim 1 over dp (dim 0 is tp's). Against one device computing in bf16 from
the same fp32 weights, two SGD steps; the program adds no collective beyond the plan's."""

import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.compat import StridedShard
from hyper_parallel.testing.parity import build_model, mixed_precision_steps

pytest.importorskip("transformers")

ARCH = "Phi3ForCausalLM"


def _mixed_precision_steps() -> dict:
    from hyper_parallel.models.hf_zoo import hf_fsdp_plan, hf_tp_plan

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {**hf_tp_plan(ARCH), "fully_shard": {**hf_fsdp_plan(ARCH)["fully_shard"], "mixed_precision": policy}}
    master = build_model(f"hf:{ARCH}")
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    mixed_precision_steps(master, model, mesh, steps=2, ignore_fraction=0.3)
    qkv = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    return {"summary": model.compile_summary(), "qkv_placements": [repr(p) for p in qkv.placements]}


def test_phi3_fsdp_tp_mixed_precision(dist4):
    result = dist4.run(_mixed_precision_steps)[0]
    assert result["summary"]["unplanned_collectives"] == []
    assert result["qkv_placements"] == [repr(p) for p in (torch.distributed.tensor.Shard(1), StridedShard(0, split_factor=3))]
