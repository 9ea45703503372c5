"""The ``pool`` marker (tests/conftest.py) splits the suite: ``bash scripts/test.sh --fast`` runs
``-m "not pool and not slow"``, the tests that start no worker process (and take at most 5 s).

Checked here, without starting any pool: collecting the suite with ``-m "not pool"`` (in a
subprocess, so this session's own pools and conftest hooks are left alone) keeps no test that
requests a pool fixture or starts one in its body, deselects the tests that do, and keeps a real
number of tests; and the conftest guard fails a test that is not marked yet creates a pool.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from hyper_parallel.testing import distributed as _distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Measured when this was written, on tests/distributed + tests/passes (then the only folders with pool
# tests; the fixture below now collects all of tests/, whose folders follow the packages): 134 tests
# in the fast tier, 428 in the pool tier; the bounds leave room for tests to come and go.
MIN_FAST, MIN_POOL = 120, 380

# Collects ARGS with -m "not pool" and prints, for the kept and for the deselected tests, their node
# id, fixture closure, markers and whether the test function's source starts processes itself.
COLLECT = r"""
import inspect, json, re, sys
import pytest

STARTS = re.compile(r"\b(get_pool|run_on_ranks|WorkerPool)\(|getfixturevalue\(\s*f?[\"']dist"
                    r"|torch\.distributed\.run|[\"']torchrun[\"']")

def describe(item):
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        source = ""
    return {"id": item.nodeid, "fixtures": list(getattr(item, "fixturenames", ())),
            "markers": sorted({m.name for m in item.iter_markers()}),
            "starts": sorted(set(m.group(0) for m in STARTS.finditer(source)))}

class Recorder:
    deselected = []
    kept = []
    def pytest_deselected(self, items):
        self.deselected += [describe(i) for i in items]
    def pytest_collection_finish(self, session):
        self.kept = [describe(i) for i in session.items]

rec = Recorder()
rc = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", "-m", "not pool", *sys.argv[1:]],
                 plugins=[rec])
print("@@" + json.dumps({"rc": int(rc), "kept": rec.kept, "deselected": rec.deselected}))
"""


@pytest.fixture(scope="module")
def tiers():
    proc = subprocess.run([sys.executable, "-c", COLLECT, "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][2:])
    assert out["rc"] == 0, proc.stdout[-3000:]
    return out


def _pool_fixtures(test):
    return [name for name in test["fixtures"] if re.fullmatch(r"dist\d+", name)]



@pytest.mark.slow
def test_the_fast_tier_requests_and_starts_no_pool(tiers):
    with_fixture = {t["id"]: _pool_fixtures(t) for t in tiers["kept"] if _pool_fixtures(t)}
    assert not with_fixture, f"tests requesting a pool fixture kept by -m 'not pool': {with_fixture}"
    starting = {t["id"]: t["starts"] for t in tiers["kept"] if t["starts"]}
    assert not starting, f"tests starting processes kept by -m 'not pool' (mark them pool): {starting}"
    assert all("pool" not in t["markers"] for t in tiers["kept"])


def test_the_pool_tier_is_what_was_deselected(tiers):
    assert all("pool" in t["markers"] for t in tiers["deselected"])
    ids = {t["id"] for t in tiers["deselected"]}
    # one of each way of using a pool: a session fixture, a fixture over it, a module's dist1,
    # getfixturevalue, a WorkerPool of its own, get_pool in the body, torchrun, a module pytestmark
    for expected in [
        "tests/pipeline/test_pipeline.py::test_loss_fn_and_targets",
        "tests/distributed/test_eager_dtensor.py::test_distribute_from_local_redistribute_give_the_manual_slices",
        "tests/passes/test_pipeline_split.py::",
        "tests/checkpoints/test_state_dict.py::test_get_model_state_dict_matrix[",
        "tests/runtime/test_faults.py::test_stuck_peer_times_out_naming_program_collective_and_call",
        "tests/pipeline/test_pipeline.py::test_interleaved_two_stages_on_one_rank",
        "tests/end_to_end/test_readme_example.py::test_readme_example_trains_at_one_device_parity",
        "tests/testing/test_harness.py::test_timeout_kills_and_recovers",
    ]:
        assert any(i == expected or (expected.endswith(("::", "[")) and i.startswith(expected)) for i in ids), expected
    assert len(tiers["deselected"]) >= MIN_POOL, len(tiers["deselected"])


def test_the_fast_tier_keeps_the_tests_without_processes(tiers):
    ids = {t["id"] for t in tiers["kept"]}
    # tests next to pool tests in their module stay (test_faults.py, test_backend.py hold both)
    assert "tests/runtime/test_faults.py::test_dump_dir_must_be_writable" in ids
    assert any(i.startswith("tests/backend/test_backend.py::test_bad_options[") for i in ids)
    assert len(ids) >= MIN_FAST, len(ids)


def _conftest(config):
    """tests/conftest.py as loaded by this session (its path may be a link to ROOT's)."""
    (module,) = [p for p in config.pluginmanager.get_plugins() if getattr(p, "__file__", None)
                 and pathlib.Path(p.__file__).resolve() == ROOT / "tests" / "conftest.py"]
    return module


class _Item:
    def __init__(self, marked):
        self.nodeid = "tests/x.py::test_x"
        self.stash = pytest.Stash()
        self._marked = marked

    def get_closest_marker(self, name):
        return pytest.mark.pool.mark if self._marked and name == "pool" else None


def _run(conftest, item, create):
    """Drives the conftest's setup and call wrappers around a test that ``create``s a pool (a
    stand-in object in get_pool's cache, no process); the cache is restored before returning."""
    setup = conftest.pytest_runtest_setup(item)
    next(setup)
    with pytest.raises(StopIteration):
        setup.send(None)
    call = conftest.pytest_runtest_call(item)
    next(call)
    key = ("fast-tier-test", "stand-in")
    if create:
        _distributed._POOLS[key] = object()
    try:
        call.send("result")
    except StopIteration as stop:
        return stop.value
    finally:
        _distributed._POOLS.pop(key, None)


def test_an_unmarked_test_that_creates_a_pool_fails(request):
    conftest = _conftest(request.config)
    with pytest.raises(pytest.fail.Exception, match=r"tests/x.py::test_x created a process pool but is not "
                                                    r"marked `pool`: add @pytest.mark.pool"):
        _run(conftest, _Item(marked=False), create=True)
    assert _run(conftest, _Item(marked=True), create=True) == "result"
    assert _run(conftest, _Item(marked=False), create=False) == "result"
