"""Shared pytest fixtures: persistent gloo worker pools, the ``gpu`` and ``pool`` markers.

``pool`` marks every test that starts worker processes (a gloo pool, a ``WorkerPool``, torchrun),
``slow`` (by hand) a test without a pool that takes over 5 s on 2 cores; ``bash scripts/test.sh
--fast`` runs the rest (``-m "not pool and not slow"``).  A test is marked ``pool``

* automatically, when its fixtures (transitively) include a pool fixture: a fixture named ``distN``
  (``dist2``, ``dist4`` below, the module-level ``dist1`` fixtures), see :data:`POOL_FIXTURE`;
* explicitly (``@pytest.mark.pool`` or a module's ``pytestmark``) when it starts processes itself:
  ``get_pool()`` / ``run_on_ranks()`` / ``WorkerPool(...)`` / ``request.getfixturevalue("distN")``
  in its body, or a torchrun launch.

A test that is not marked yet creates a pool (through ``get_pool`` or a ``WorkerPool`` left open)
fails, naming the marker to add: the fast tier never starts a pool unnoticed.
tests/testing/test_fast_tier.py checks the marking.

Also ``no_process_group_leak``, for tests that simulate a mesh in this process (torch's ``fake``
backend): they must start without a default process group and leave none behind.
"""

import re

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.testing import distributed as _distributed
from hyper_parallel.testing import worker_pool as _worker_pool
from hyper_parallel.testing.distributed import close_all_pools, get_pool

POOL_FIXTURE = re.compile(r"dist\d+")
"""Fixture names that stand for a process pool (``re.fullmatch``): a test requesting one, directly
or through another fixture, gets the ``pool`` marker."""


@pytest.fixture(scope="session")
def dist2():
    """A 2-rank gloo WorkerPool shared by the whole session: ``dist2.run(fn, *args)``."""
    return get_pool(2)


@pytest.fixture(scope="session")
def dist4():
    """A 4-rank gloo WorkerPool shared by the whole session: ``dist4.run(fn, *args)``."""
    return get_pool(4)


@pytest.fixture
def no_process_group_leak():
    """The test starts without a default process group and leaves none behind: ``explain`` and
    ``fake_world`` create one for the simulated mesh and must destroy it, else later tests of this
    process would run on it."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in this process: an earlier test leaked it")
    yield
    assert not dist.is_initialized(), "the test left its fake process group behind"


def uses_pool_fixture(item) -> bool:
    """Whether ``item`` requests a pool fixture (its fixture closure, so transitively)."""
    return any(POOL_FIXTURE.fullmatch(name) for name in getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if uses_pool_fixture(item) and item.get_closest_marker("pool") is None:
            item.add_marker(pytest.mark.pool)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --- a test not marked ``pool`` must not create a pool ---------------------------------------------

_POOLS_BEFORE = pytest.StashKey[set]()


def _pool_ids() -> set:
    return {id(p) for p in _distributed._POOLS.values()} | {id(p) for p in list(_worker_pool._LIVE_POOLS)}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_POOLS_BEFORE] = _pool_ids()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if item.get_closest_marker("pool") is None and _pool_ids() - item.stash.get(_POOLS_BEFORE, set()):
        pytest.fail(f"{item.nodeid} created a process pool but is not marked `pool`: add "
                    "@pytest.mark.pool (or request the pool through a distN fixture), so that "
                    "`scripts/test.sh --fast` leaves it out", pytrace=False)
    return result


def pytest_sessionfinish(session, exitstatus):
    close_all_pools()
