"""The per-call agreement's exchange on 4 gloo ranks (``distributed.host_reduce.MaxAllReduce`` and
``spmd.agree`` on it): the maximum arrives on every member of the world and of a 3-rank group that
leaves rank 0 out (not a power of two, not starting at 0), by all-gather (what groups of up to 4
use) and by recursive doubling (larger groups), in at most the rounds each is priced at, blocking and with its later rounds on the agreement thread
while the caller computes; one rank's other
digest or problem is an AgreementError on every rank that names both sides. The schedule alone is
tests/distributed/test_host_reduce.py."""

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.distributed import spmd
from hyper_parallel.distributed import host_reduce
from hyper_parallel.distributed.host_reduce import MaxAllReduce, doubling_rounds, rounds
from hyper_parallel.testing.parity import error_message


def _reductions() -> dict:
    rank = dist.get_rank()
    three = dist.new_group([1, 2, 3])  # every rank takes part in new_group, members or not
    mine = torch.tensor([rank * 7 % 5, -rank, 100 + rank])
    out = {}
    for how, gather_up_to in (("gather", 4), ("doubling", 1)):  # 1: every group by recursive doubling
        host_reduce.GATHER_UP_TO = gather_up_to
        try:
            for background in (False, True):
                world = MaxAllReduce(mine, background=background)
                torch.randn(64, 64) @ torch.randn(64, 64)  # the caller computes while the rounds run
                out[f"world {how} background={background}"] = (world.wait().tolist(), world.sent)
                if rank != 0:
                    sub = MaxAllReduce(mine, three, background=background)
                    out[f"three {how} background={background}"] = (sub.wait().tolist(), sub.sent)
        finally:
            host_reduce.GATHER_UP_TO = 4
    assert mine.tolist() == [rank * 7 % 5, -rank, 100 + rank], "the input is left as it was"
    dist.destroy_process_group(three)
    return out


def test_the_maximum_arrives_on_every_member_in_log_rounds(dist4):
    for rank, got in enumerate(dist4.run(_reductions)):
        for how, rounds_of in (("gather", lambda n: n - 1), ("doubling", doubling_rounds)):
            for background in (False, True):
                values, sent = got[f"world {how} background={background}"]
                assert values == [4, 0, 103] and sent <= rounds_of(4), (how, rank, values, sent)
                if rank == 0:
                    assert f"three {how} background={background}" not in got
                    continue
                # max over ranks 1..3 of [r*7%5, -r, 100+r]: [2, 1, 4] -> 4, -1, 103
                values, sent = got[f"three {how} background={background}"]
                assert values == [4, -1, 103] and sent <= rounds_of(3), (how, rank, values, sent)
    assert rounds(4) == 3 and doubling_rounds(4) == 2


def _disagreements() -> dict:
    rank = dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out = {"same": error_message(spmd.agree, mesh, "call 1", 42, lambda: "signature A")}
    digest = 43 if rank == 2 else 42
    out["digest"] = error_message(spmd.agree, mesh, "call 2", digest, lambda: f"signature {'B' if rank == 2 else 'A'}")
    problem = "labels hold 300, above the vocabulary" if rank == 3 else None
    out["problem"] = error_message(spmd.agree, mesh, "call 3", 42, lambda: "signature A", problem)

    def overlapped():
        pending = spmd.agree(mesh, "call 4", 7 if rank == 1 else 8, lambda: f"rank {rank}", wait=False)
        torch.randn(32, 32).sum()
        pending.wait()

    out["overlapped"] = error_message(overlapped)
    return out


def test_one_rank_differing_is_an_error_on_every_rank_naming_both_sides(dist4):
    for rank, got in enumerate(dist4.run(_disagreements)):
        assert got["same"] == "no error", (rank, got["same"])
        assert got["digest"].startswith("AgreementError: call 2"), (rank, got["digest"])
        assert "signature A" in got["digest"] and "signature B" in got["digest"], (rank, got["digest"])
        assert got["problem"].startswith("AgreementError: call 3"), (rank, got["problem"])
        assert "above the vocabulary" in got["problem"], (rank, got["problem"])
        assert got["overlapped"].startswith("AgreementError: call 4"), (rank, got["overlapped"])
        assert "rank 1" in got["overlapped"] and "rank 0" in got["overlapped"], (rank, got["overlapped"])
