"""The one-rank CUDA mesh the GPU tests share (tests/conftest.py skips them without CUDA)."""

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp


@pytest.fixture(scope="module")
def mesh():
    """A ("dp",) mesh of one rank on GPU 0, NCCL; the process group lives for one test module."""
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    yield hp.init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    dist.destroy_process_group()


@pytest.fixture
def profiled_step_events():
    """``events(model, batch, trace_path)``: see :func:`_profiled_step_events`."""
    return _profiled_step_events


def _profiled_step_events(model, batch: dict, trace_path) -> list[dict]:
    """One forward + backward of ``model`` (already compiled) under the CUDA profiler: the Chrome
    trace's events, written to ``trace_path`` first (and to ``HP_GPU_TRACE_OUT`` when set, so a
    device script can bring the trace back)."""
    import json
    import os
    import shutil

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(**batch)["loss"].backward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))  # Kineto saves a profile once: copy it for the script
    if os.environ.get("HP_GPU_TRACE_OUT"):
        shutil.copyfile(trace_path, os.environ["HP_GPU_TRACE_OUT"])
    with open(trace_path) as f:
        return json.load(f)["traceEvents"]
