"""Shared pytest fixtures: persistent gloo worker pools and the ``gpu`` marker."""

import pytest
import torch

from hyper_parallel.testing.distributed import close_all_pools, get_pool


@pytest.fixture(scope="session")
def dist2():
    """A 2-rank gloo WorkerPool shared by the whole session: ``dist2.run(fn, *args)``."""
    return get_pool(2)


@pytest.fixture(scope="session")
def dist4():
    """A 4-rank gloo WorkerPool shared by the whole session: ``dist4.run(fn, *args)``."""
    return get_pool(4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    close_all_pools()
