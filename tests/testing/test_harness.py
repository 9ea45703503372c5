"""Tests of the multi-process worker pool (hyper_parallel.testing.distributed) itself."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.testing.distributed import WorkerPool, get_pool, run_on_ranks

pytestmark = pytest.mark.pool  # every test starts or uses a pool


# ----------------------------------------------------------------------------- job functions
# (module level, so the workers can unpickle them by reference)

def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank_payload(scale, offset=0.0):
    r = dist.get_rank()
    return {
        "rank": r,
        "world": dist.get_world_size(),
        "tensor": torch.full((2, 3), float(r)) * scale + offset,
        "value": float(r) * scale,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }


def _pid():
    return os.getpid()


def _raise_on_rank1_others_return():
    if dist.get_rank() == 1:
        raise ValueError("bad input on this rank")
    return "fine"


def _raise_on_rank1_others_blocked():
    if dist.get_rank() == 1:
        raise ValueError("bad input before the collective")
    dist.barrier()  # never completes: rank 1 does not join
    return "unreachable"


def _sleep_on_rank1_others_barrier():
    if dist.get_rank() == 1:
        time.sleep(120)
    dist.barrier()


def _abort_on_rank1_others_barrier():
    if dist.get_rank() == 1:
        os.abort()  # as glibc does on a corrupted heap
    dist.barrier()


def _all_reduce_never_waited():
    group = dist.group.WORLD.group_name
    torch.ops._c10d_functional.all_reduce(torch.ones(4), "sum", group)  # no wait_tensor
    return 1


def _make_subgroups():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return t.item()


def _num_groups():
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("pool_name, expected", [("dist2", 1.0), ("dist4", 6.0)])
def test_all_reduce_sums_rank_ids(request, pool_name, expected):
    pool = request.getfixturevalue(pool_name)
    assert pool.run(_all_reduce_rank) == [expected] * pool.world_size


def test_results_in_rank_order_with_tensors(dist4):
    results = dist4.run(_rank_payload, 2.0, offset=0.5)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r, res in enumerate(results):
        assert res["world"] == 4
        torch.testing.assert_close(res["tensor"], torch.full((2, 3), 2.0 * r + 0.5))
        assert res["value"] == 2.0 * r
        assert res["threads"] == 1 and res["omp"] == "1"


def test_pool_is_persistent_and_cached(dist2):
    assert get_pool(2) is dist2
    first = dist2.run(_pid)
    assert dist2.run(_pid) == first
    assert run_on_ranks(2, _pid) == first
    assert len(set(first)) == 2 and os.getpid() not in first


def test_error_on_one_rank_keeps_pool(dist2):
    pids = dist2.run(_pid)
    with pytest.raises(ValueError, match="rank 1") as info:
        dist2.run(_raise_on_rank1_others_return)
    msg = str(info.value)
    assert "bad input on this rank" in msg
    assert "_raise_on_rank1_others_return" in msg and "Traceback" in msg
    # rank 0 returned normally: no restart was needed
    assert dist2.run(_pid) == pids
    assert dist2.run(_all_reduce_rank) == [1.0, 1.0]


def test_error_while_other_ranks_blocked_restarts_pool(dist2):
    restarts, grace = dist2.restarts, dist2.error_grace_s
    dist2.error_grace_s = 1.0  # how long rank 0 may stay busy after rank 1 failed (keeps it fast)
    try:
        with pytest.raises(ValueError, match="rank 1") as info:
            dist2.run(_raise_on_rank1_others_blocked)
    finally:
        dist2.error_grace_s = grace
    msg = str(info.value)
    assert "bad input before the collective" in msg
    assert "ranks [0] were still running" in msg and "restarts transparently" in msg
    assert dist2.run(_all_reduce_rank) == [1.0, 1.0]
    assert dist2.restarts == restarts + 1


def test_timeout_kills_and_recovers():
    pool = WorkerPool(2, timeout_s=3)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="_sleep_on_rank1_others_barrier"):
            pool.run(_sleep_on_rank1_others_barrier)
        assert time.monotonic() - t0 < 30
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
    finally:
        pool.close()
    assert pool.closed and pool.pids == []


def test_a_native_crash_reports_its_signal_and_cpp_stacks(capfd):
    """A worker killed by a signal (here SIGABRT, as glibc's heap checks abort) is reported with its
    exit code, and its C++ stacks reach stderr (c10's fatal-signal handler, which the worker turns
    on): faulthandler alone shows only the Python stack of the thread that was waiting."""
    pool = WorkerPool(2, timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with code -6.*C\+\+ stacks were printed"):
            pool.run(_abort_on_rank1_others_barrier)
        err = capfd.readouterr().err
        assert "SIGABRT(6)" in err and "frame #" in err, err[-2000:]
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
    finally:
        pool.close()


def test_a_job_that_leaves_a_collective_in_flight_fails_and_the_pool_restarts():
    """A job must wait for every collective it issues: one still in flight would run beside the next
    job's on the same gloo group (several collectives of one group at once corrupt gloo's heap)."""
    pool = WorkerPool(2, timeout_s=60)
    try:
        restarts = pool.restarts
        with pytest.raises(RuntimeError, match=r"_all_reduce_never_waited on rank \d left 1 collective"):
            pool.run(_all_reduce_never_waited)
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
        assert pool.restarts == restarts + 1
    finally:
        pool.close()


def test_unpicklable_function_fails_in_caller(dist2):
    with pytest.raises(TypeError, match="module level"):
        dist2.run(lambda: 1)


def test_groups_created_by_a_job_are_destroyed(dist4):
    base = dist4.run(_num_groups)
    assert dist4.run(_make_subgroups) == [2.0] * 4
    assert dist4.run(_num_groups) == base
