"""Activation memory on a CUDA device (issue 4): parity, the estimator against
``torch.cuda.max_memory_allocated``, and swap copies on a side stream.

Skipped without CUDA (CI has none); run on a lent GPU with ``python -m pytest tests/gpu``. One
process, one rank, NCCL: the compiled program runs the same passes as on a mesh of any size.
"""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.runtime.host_copies import pending_copies
from hyper_parallel.testing.parity import build_model, global_batch
from hyper_parallel.testing.stepper import ParityStepper

pytestmark = pytest.mark.gpu  # skipped without CUDA (conftest)

DEVICE = "cuda"
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
PLANS = {
    "none": {},
    "selective": {"recompute": {"model.layers.*": "selective"}},
    "full": {"recompute": {"model.layers.*": "full"}},
    "swap": {"swap": {"model.layers.*": True}},
    "swap_grouped": {"swap": {"model.layers.*": {"group_swap": True}}},
}
TOLERANCE = 0.10


def _batch(step: int, batch: int = 8, seq_len: int = 128) -> dict:
    return {k: v.to(DEVICE) for k, v in global_batch("llama", batch, seq_len, seed=step + 1).items()}


@pytest.mark.parametrize("name", list(PLANS))
def test_parity_with_eager_on_cuda(mesh, name):
    """3 SGD steps: loss and every gradient equal the eager model's on the same GPU."""
    reference = build_model("llama", **MODEL).to(DEVICE)
    pmodel = hp.parallelize(copy.deepcopy(reference), PLANS[name], mesh)

    def copies_waited(record):
        assert pending_copies() == 0, "every copy back was waited on"

    ParityStepper(reference, pmodel, batch=lambda step: _batch(step, batch=4, seq_len=32), after_backward=copies_waited,
                  what=name).run(3)


def _measure(mesh, plan: dict) -> dict:
    """The last of two steps: measured forward+backward and optimizer peaks (CUDA allocator), minus
    what the allocator holds that is not the model's (cuBLAS workspaces), next to the estimate."""
    pmodel = hp.parallelize(build_model("llama", **MODEL).to(DEVICE), plan, mesh)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    for step in range(2):
        batch = _batch(step)
        gc.collect()
        torch.cuda.synchronize()
        held = [t.to_local() for t in [*pmodel.parameters(), *pmodel.buffers()]] + list(batch.values())
        held += [v.to_local() if hasattr(v, "to_local") else v
                 for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        known = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())
        other = torch.cuda.memory_allocated() - known  # cuBLAS workspaces and the like
        torch.cuda.reset_peak_memory_stats()
        out = pmodel(**batch)
        out["loss"].backward()
        del out
        torch.cuda.synchronize()
        forward_backward = torch.cuda.max_memory_allocated() - other
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        optimizer_step = torch.cuda.max_memory_allocated() - other
        opt.zero_grad()
    est = pmodel.memory_report(opt)
    return {
        "measured": {"forward_backward": forward_backward, "optimizer_step": optimizer_step,
                     "peak": max(forward_backward, optimizer_step)},
        "estimated": {"forward_backward": max(est["peak_forward"], est["peak_backward"]),
                      "optimizer_step": est["peak_optimizer"], "peak": est["peak"]},
        "other_allocations": other,
        "peak_site": est["peak_site"]["where"],
    }


def test_estimator_matches_max_memory_allocated(mesh, record_property):
    results = {name: _measure(mesh, plan) for name, plan in PLANS.items()}
    record_property("memory", json.dumps(results))
    print(json.dumps(results, indent=1))
    for name, r in results.items():
        for what, actual in r["measured"].items():
            estimated = r["estimated"][what]
            error = (estimated - actual) / actual
            assert abs(error) <= TOLERANCE, (
                f"{name}: estimated {what} {estimated:,} B vs max_memory_allocated {actual:,} B ({error:+.1%}); "
                f"estimate peaks at {r['peak_site']}"
            )
    fb = {name: r["measured"]["forward_backward"] for name, r in results.items()}
    assert fb["full"] < fb["selective"] < fb["none"], fb
    assert fb["swap"] < fb["none"], fb


def test_swap_copies_run_on_a_side_stream(mesh, tmp_path, profiled_step_events):
    """The profiler sees every device<->host copy of the swap plan on a stream other than the one
    the compute kernels run on, and backward leaves no copy un-waited."""
    pmodel = hp.parallelize(build_model("llama", **MODEL).to(DEVICE), PLANS["swap"], mesh)
    batch = _batch(0)
    pmodel(**batch)["loss"].backward()  # compile outside the profile
    events = profiled_step_events(pmodel, batch, tmp_path / "trace.json")
    kernels: dict = {}
    for e in events:
        if e.get("cat") == "kernel" and not e["name"].startswith("nccl"):
            kernels.setdefault(e["tid"], []).append(e["name"])
    compute_stream = max(kernels, key=lambda tid: len(kernels[tid]))
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and ("DtoH" in e["name"] or "HtoD" in e["name"])]
    assert copies, "the swap plan copied nothing between device and host"
    copy_streams = {e["tid"] for e in copies}
    assert compute_stream not in copy_streams, (
        f"swap copies ran on the compute stream {compute_stream}: "
        f"{sorted({e['name'] for e in copies if e['tid'] == compute_stream})}"
    )
    # Off the compute stream only copies run (a non-contiguous activation is packed on the swap
    # stream before its transfer): what the model computes stays on its own stream.
    other = {name for tid, names in kernels.items() if tid != compute_stream for name in names}
    assert all("copy" in name for name in other), f"kernels off the compute stream: {other}"
    assert pending_copies() == 0
