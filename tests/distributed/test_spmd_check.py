"""The compile-time SPMD check's comparison (distributed/spmd.py), on collective sequences built by hand for
four ranks on a ("dp", "tp") mesh of (2, 2): ranks (0, 1) and (2, 3) are the tp groups, (0, 2) and
(1, 3) the dp groups. What must agree is compared, and only that: each group's sequence, sizes
included, among its members; the whole sequence without sizes among all ranks. Every mismatch
names the node of each side and what it serves, for every collective kind. The multi-process path
(the exchange itself) runs in tests/compile/test_compile.py (a rank-dependent program) and
tests/moe/test_moe_fsdp_tp.py (sizes that differ between data-parallel groups)."""

import pytest

from hyper_parallel.ir.collectives import Collective
from hyper_parallel.distributed.spmd import _differs, _Sequences, first_difference

GROUPS = {"tp0": (0, 1), "tp1": (2, 3), "dp0": (0, 2), "dp1": (1, 3)}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv")


def _coll(kind, axis, group, shape, node, source="", why=""):
    return Collective(kind=kind, axis=axis, dtype="float32", shape=shape, nbytes=4, node=node,
                      source=source, group=group, why=why)


def _program(rank: int, bucket_rows: int = None, kind: str = "all_reduce") -> dict:
    """A forward all-gather over dp and a backward over tp whose size differs between the tp
    groups, as an FSDP x TP program's all-reduce of gradient shards where a parameter has fewer
    rows than dp has ranks (Qwen2-MoE's shared_expert_gate: [1, 64])."""
    tp, dp = f"tp{rank // 2}", f"dp{rank % 2}"
    rows = bucket_rows if bucket_rows is not None else (224 if rank < 2 else 160)
    return {
        "forward": [_coll("all_gather", "dp", dp, (16, 64), "all_gather_into_tensor_3", "unshard_2",
                          "FSDP unit model.layers.0: gather model.layers.0.mlp.gate.weight")],
        "backward": [_coll(kind, "tp", tp, (rows,), "all_reduce__default",
                           why="FSDP unit model.layers.0: all-reduce of its gradient shards over the HSDP replicas")],
    }


def _exchange(programs_of_rank: dict) -> tuple[list[bool], str | None]:
    """What each rank concludes from the first exchange, and the message from the full one."""
    seqs = {r: _Sequences.of(p, group_ranks=GROUPS.__getitem__) for r, p in programs_of_rank.items()}
    digests = {r: s.digests() for r, s in seqs.items()}
    verdicts = [_differs(seqs[r], digests) for r in sorted(seqs)]
    return verdicts, first_difference([seqs[r].details(r) for r in sorted(seqs)])


def test_sizes_differing_between_groups_that_never_meet_agree():
    verdicts, message = _exchange({r: _program(r) for r in range(4)})
    assert verdicts == [False] * 4 and message is None


def test_a_size_differing_within_a_group_is_named_with_its_node_and_group():
    programs = {r: _program(r) for r in range(4)}
    programs[1] = _program(1, bucket_rows=160)  # rank 1 disagrees with rank 0, its tp peer
    verdicts, message = _exchange(programs)
    assert verdicts == [True, True, False, False]  # the ranks of that group see it ...
    assert message == (  # ... and the verdict exchange makes every rank raise this
        "SPMD check failed: collective #0 of the backward program (collective #0 on the tp group of "
        "ranks [0, 1]) differs between rank 0 (all_reduce[tp] float32[224] for node "
        "'all_reduce__default' (FSDP unit model.layers.0: all-reduce of its gradient shards over the "
        "HSDP replicas)) and rank 1 (all_reduce[tp] float32[160] for node 'all_reduce__default' (FSDP "
        "unit model.layers.0: all-reduce of its gradient shards over the HSDP replicas)). All ranks must "
        "compile the same program: pass inputs with the same shapes and dtypes on every rank and the "
        "same plan; running it would hang.")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_named_by_its_node(kind):
    """A program that differs structurally (another kind on one tp group) is found by ranks of
    the other group too, and the message names both sides' nodes."""
    programs = {r: _program(r) for r in range(4)}
    other = "all_gather" if kind != "all_gather" else "all_reduce"
    programs[2], programs[3] = _program(2, kind=kind), _program(3, kind=kind)
    programs[0], programs[1] = _program(0, kind=other), _program(1, kind=other)
    verdicts, message = _exchange(programs)
    assert verdicts == [True] * 4
    assert f"rank 0 ({other}[tp] float32[224] for node 'all_reduce__default' (FSDP unit" in message
    assert f"rank 2 ({kind}[tp] float32[160] for node 'all_reduce__default' (FSDP unit" in message


def test_a_member_issuing_nothing_on_a_group_disagrees():
    programs = {r: _program(r) for r in range(4)}
    programs[3]["backward"] = []
    verdicts, message = _exchange(programs)
    assert all(verdicts)
    assert "differs between rank 0 (all_reduce[tp] float32[224] for node 'all_reduce__default'" in message
    assert "and rank 3 (no collective)" in message


def test_a_collective_serving_a_joint_graph_node_names_it():
    programs = {r: _program(r) for r in range(4)}
    programs[2]["forward"][0] = _coll("all_gather", "dp", "dp0", (8, 64), "all_gather_into_tensor_3", "unshard_2")
    _, message = _exchange(programs)
    assert "rank 2 (all_gather[dp] float32[8, 64] for node 'all_gather_into_tensor_3' for 'unshard_2')" in message
    assert "(collective #0 on the dp group of ranks [0, 2])" in message
