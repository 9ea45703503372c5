"""``codegen="inductor"`` on a CUDA device (issue 20): Triton kernels for the compute regions,
numbers as the eager model's.

Skipped without CUDA (CI has none; the CPU path, with the collective-order checks on two ranks, is
tests/codegen/test_codegen.py); run on a lent GPU with ``python -m pytest tests/gpu``. One
process, one rank, NCCL: on a mesh of one the FSDP plan compiles to programs without collectives
(a degree-1 axis needs none), so what these tests show is the GPU code generation and its numbers.

Tolerances: fp32 loss within 1e-5 relative and gradients within rtol 1e-4 / atol 1e-5, because
Inductor's Triton reductions sum in another order than cuBLAS and aten's kernels (the CPU test
passes at assert_close's fp32 defaults); bf16 parameters with fp32 reduction against one device
doing the same casts, at the bf16 tolerances the eager FSDP tests use.
"""

from __future__ import annotations

import copy
import glob

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.codegen.inductor import InductorRegion
from hyper_parallel.testing.parity import build_model, global_batch
from hyper_parallel.testing.stepper import ParityStepper

pytestmark = pytest.mark.gpu  # skipped without CUDA (conftest)

DEVICE = "cuda"
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}


def _batch(model_name: str, step: int) -> dict:
    full = global_batch(model_name, 4, 64, seed=step + 1, ignore_fraction=0.3)
    return {k: v.to(DEVICE) for k, v in full.items()}


def _fsdp(master, mesh, mixed_precision: bool, dump_dir: str):
    policy = (hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else None)
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    return hp.parallelize(copy.deepcopy(master), plan, mesh, codegen="inductor", dump_dir=dump_dir)


@pytest.mark.parametrize("model_name", ["llama", "hf_llama"])
def test_fsdp_fp32_parity_and_triton_kernels(mesh, tmp_path, model_name):
    if model_name == "hf_llama":
        pytest.importorskip("transformers")
        if torch.__version__ < "2.13":  # see tests/propagation/test_attention_rules.py
            pytest.skip("torch < 2.13: DTensor cannot shard the efficient-attention backward with a mask")
    master = build_model(model_name, **MODEL).to(DEVICE)
    model = _fsdp(master, mesh, False, str(tmp_path))
    # One rank: both models get the whole batch. Tolerances: the module docstring.
    ParityStepper(master, model, batch=lambda step: _batch(model_name, step), loss_rtol=1e-5, loss_atol=0.0,
                  rtol=1e-4, atol=1e-5).run(3)
    for generated in model.generated_programs():
        assert any(isinstance(m, InductorRegion) for m in generated.gm.children())
    # Inductor generated Triton kernels (not C++, not a replay of aten ops).
    sources = [open(f).read() for f in glob.glob(str(tmp_path / "**" / "inductor.*.region*.py"), recursive=True)]
    assert sources and any("@triton.jit" in s for s in sources), f"{len(sources)} region dumps, none with Triton"


def test_fsdp_bf16_mixed_precision_tracks_eager(mesh, tmp_path):
    """bf16 params / fp32 reduce on padded labels, against one device doing the same casts."""
    master = build_model("llama", **MODEL).to(DEVICE)
    model = _fsdp(master, mesh, True, str(tmp_path))
    # assert_matches_bf16_reference each step; the fp32 master steps with its bf16 copy's gradients.
    ParityStepper(master, model, batch=lambda step: _batch("llama", step), bf16_reference=True).run(3)


def test_generated_kernels_run_in_the_step(mesh, tmp_path, profiled_step_events):
    """A profiled step runs Triton kernels (Inductor's), not only aten's."""
    master = build_model("llama", **MODEL).to(DEVICE)
    model = _fsdp(master, mesh, False, "")
    batch = _batch("llama", 0)
    model(**batch)["loss"].backward()  # compiles outside the profile
    events = profiled_step_events(model, batch, tmp_path / "trace.json")
    names = [e["name"] for e in events if e.get("cat") == "kernel"]
    triton = [n for n in names if n.startswith("triton_")]
    assert triton, f"no Triton kernel ran; kernels: {sorted(set(names))[:20]}"
