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
