"""Process-group helpers (``hyper_parallel.distributed.process_group``) on 4 gloo ranks, checked against
torch.distributed and against sums the test computes itself; ``init_process_group``'s checks run
in this process with torch's own init replaced (the pool's workers already have their group)."""

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.distributed import process_group as pg
from hyper_parallel.distributed.platform import get_platform


def _sum_over(group, rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    return t.item()


def _describe(group, rank: int) -> dict:
    if group is None:
        return None
    return {"ranks": pg.get_process_group_ranks(group), "local": pg.get_group_local_rank(group),
            "backend": pg.get_backend(group), "sum": _sum_over(group, rank)}


def _world_and_splits() -> dict:
    rank = dist.get_rank()
    halves = pg.split_group(None, 2)
    strided = pg.split_group(dist.group.WORLD, split_ranks=[[0, 2], [1, 3]])
    return {
        "world": {"ranks": pg.get_process_group_ranks(None), "local": pg.get_group_local_rank(),
                  "backend": pg.get_backend(), "sum": _sum_over(None, rank)},
        "halves": _describe(halves, rank),
        "strided": _describe(strided, rank),
        "reused": pg.split_group(None, [[1, 0], [3, 2]]) is halves,  # a list as split_size
        "partial": _describe(pg.split_group(None, split_ranks=[[3, 1]]), rank),
        # each rank splits its own strided group; split_ranks count within the parent
        "nested": _describe(pg.split_group(strided, split_ranks=[[1]]), rank),
        "platform_backend": get_platform().backend,
    }


def test_ranks_backend_and_splits(dist4):
    for _ in range(2):  # the pool destroys the job's groups: the second run must not reuse them
        for rank, got in enumerate(dist4.run(_world_and_splits)):
            assert got["world"] == {"ranks": [0, 1, 2, 3], "local": rank, "backend": "gloo",
                                    "sum": 10.0}
            assert got["platform_backend"] == "gloo"
            lo = rank - rank % 2
            assert got["halves"] == {"ranks": [lo, lo + 1], "local": rank % 2, "backend": "gloo",
                                     "sum": float(2 * lo + 3)}
            assert got["strided"] == {"ranks": [rank % 2, rank % 2 + 2], "local": rank // 2,
                                      "backend": "gloo", "sum": float(2 * (rank % 2) + 4)}
            assert got["reused"] is True
            if rank in (1, 3):
                assert got["partial"] == {"ranks": [1, 3], "local": rank // 2, "backend": "gloo",
                                          "sum": 6.0}
            else:
                assert got["partial"] is None
            if rank >= 2:  # group rank 1 of [0, 2] is 2, of [1, 3] is 3
                assert got["nested"] == {"ranks": [rank], "local": 0, "backend": "gloo",
                                         "sum": float(rank + 1)}
            else:
                assert got["nested"] is None


def _marked_destroyed_and_errors() -> dict:
    rank = dist.get_rank()
    out = {}
    outer, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
    pg.mark_created_groups(outer)
    out["marked_reused"] = pg.split_group(None, [[0, 3], [1, 2]]) is outer
    pairs, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    if rank != 3:  # [2, 3] is registered on rank 2 only: it must be created again, on both
        pg.mark_created_groups([pairs])
    again = pg.split_group(None, 2)
    out["pairs_reused"] = again is pairs
    out["pairs_sum"] = _sum_over(again, rank)
    pg.destroy_process_group(again)
    fresh = pg.split_group(None, 2)
    out["after_destroy_new"] = fresh is not again
    out["after_destroy_sum"] = _sum_over(fresh, rank)
    errors = {}
    cases = {
        "indivisible": lambda: pg.split_group(None, 3),
        "both": lambda: pg.split_group(None, 2, [[0, 1]]),
        "neither": lambda: pg.split_group(None),
        "overlap": lambda: pg.split_group(None, [[0, 1], [1, 2]]),
        "out_of_range": lambda: pg.split_group(None, [[0, 4]]),
        "bool_size": lambda: pg.split_group(None, True),
        "flat_ranks": lambda: pg.split_group(None, split_ranks=[0, 1]),
        # ranks 0 and 1 pass the world, 2 and 3 their pair: overlapping parents, all ranks raise
        "overlapping_parents": lambda: pg.split_group(None if rank < 2 else fresh, 1),
        "destroyed_parent": lambda: pg.split_group(again, 1),
        "mark_type": lambda: pg.mark_created_groups("tp"),
        "mark_destroyed": lambda: pg.mark_created_groups(again),
        "not_member": lambda: pg.get_group_local_rank(dist.GroupMember.NON_GROUP_MEMBER),
        "init_twice": lambda: pg.init_process_group(),
    }
    for name, call in cases.items():
        with pytest.raises(Exception) as info:
            call()
        errors[name] = (type(info.value).__name__, str(info.value))
    out["errors"] = errors
    out["still_aligned"] = _sum_over(pg.split_group(None, 2), rank)  # no rank left waiting
    out["world_size"] = dist.get_world_size()
    return out


def test_mark_created_groups_destroy_and_errors(dist4):
    results = dist4.run(_marked_destroyed_and_errors)
    expected = {
        "indivisible": ("ValueError", "split_size=3 must be a positive divisor"),
        "both": ("ValueError", "exactly one of split_size"),
        "neither": ("ValueError", "exactly one of split_size"),
        "overlap": ("ValueError", "lists rank 1 twice"),
        "out_of_range": ("ValueError", "rank 4 is outside the parent group"),
        "bool_size": ("TypeError", "split_size must be an int"),
        "flat_ranks": ("TypeError", "list of non-empty lists"),
        "overlapping_parents": ("ValueError", "overlapping parent groups"),
        "destroyed_parent": ("ValueError", "not a live group"),
        "mark_type": ("TypeError", "takes a ProcessGroup"),
        "mark_destroyed": ("ValueError", "not a live process group"),
        "not_member": ("ValueError", "is not a member of the group"),
        "init_twice": ("RuntimeError", "already exists"),
    }
    for rank, got in enumerate(results):
        assert got["marked_reused"] is True
        assert got["pairs_reused"] is (rank < 2)  # [0, 1] registered on both members, [2, 3] not
        assert got["pairs_sum"] == got["after_destroy_sum"] == got["still_aligned"] == (
            3.0 if rank < 2 else 7.0)
        assert got["after_destroy_new"] is True
        assert got["world_size"] == 4
        for name, (kind, text) in expected.items():
            assert got["errors"][name][0] == kind, (name, got["errors"][name])
            assert text in got["errors"][name][1], (name, got["errors"][name])


# init_process_group's own logic, in this process: torch's init is replaced by a recorder.


@pytest.fixture
def recorded_init(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    return calls


def test_init_without_launcher_names_torchrun(monkeypatch, recorded_init):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr("sys.argv", ["train.py"])
    with pytest.raises(ValueError, match=r"RANK not set.*`torchrun --nproc-per-node 4 train\.py`"):
        pg.init_process_group()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"RANK and WORLD_SIZE not set.*nproc-per-node N train"):
        pg.init_process_group()
    with pytest.raises(TypeError, match="backend must be a string"):
        pg.init_process_group(backend=2)
    assert recorded_init == []  # nothing reached torch


def test_init_defaults_backend_from_platform(monkeypatch, recorded_init):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    pg.init_process_group()
    pg.init_process_group("gloo", timeout=None, group_name="x")
    (args, kwargs), (args2, kwargs2) = recorded_init
    assert args == (get_platform().backend,) and kwargs["init_method"] is None
    assert args2 == ("gloo",) and kwargs2["group_name"] == "x"
    # rank/world_size/init_method given explicitly: no launcher environment needed
    monkeypatch.delenv("RANK")
    pg.init_process_group(init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert recorded_init[-1][1]["init_method"] == "tcp://127.0.0.1:1"
