"""Fixtures of the unit tests that simulate a mesh in this process (torch's ``fake`` backend)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def no_process_group_leak():
    """The test starts without a default process group and leaves none behind: ``explain`` and
    ``fake_world`` create one for the simulated mesh and must destroy it, else later tests of this
    process would run on it."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in this process: an earlier test leaked it")
    yield
    assert not dist.is_initialized(), "the test left its fake process group behind"
