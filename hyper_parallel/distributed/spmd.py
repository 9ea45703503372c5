"""SPMD consistency: every rank must run the same collectives in the same order.

Two checks, both a ValueError on every rank instead of a hang:

* at compile time (:func:`check_spmd_on_mesh`) the ranks compare their collective sequences (kind,
  mesh axis, dtype, local shape, per program) as far as they must agree: the ranks of each
  process group the same sequence on that group, sizes included; the ranks of the whole mesh the
  same sequence without sizes (kind, axis, dtype, rank). A size may differ between the groups of
  one axis: a parameter with fewer rows than its FSDP axis has ranks is stored empty on some, so
  the tensor-parallel all-reduce of its gradient shard has another size in each data-parallel
  group, and those all-reduces never meet. A size that depends on the data (expert-parallel
  dispatch) is an unbacked symbol and is compared by its name. A mismatch names the first
  collective that differs on both ranks, with its node and what it serves;
* before ``parallelize`` distributes parameters and before every call, :func:`agree` exchanges a
  digest of the resolved plan / the call's input signature and flags, and whether this rank found a
  problem with its inputs (see the section below).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import torch
import torch.distributed as dist

from .. import compat
from ..ir.collectives import Collective
from .host_reduce import MaxAllReduce


def sequence_hash(programs: dict[str, list[Collective]]) -> str:
    """This rank's collective sequence (with sizes), as ``compile_summary()["spmd_hash"]``."""
    text = "\n".join(f"{name}: {c.signature()}" for name, colls in programs.items() for c in colls)
    return hashlib.sha256(text.encode()).hexdigest()


def _text_hash(lines) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class _Sequences:
    """This rank's collectives as the check compares them: the whole sequence without sizes, and
    for each process group the sequence on that group with sizes. A group is keyed by its axis
    label and its ranks (a gloo reduction lane has its axis's label and ranks: its reductions are
    checked in one sequence with the axis's own collectives, an order every rank of it shares)."""

    structure: list  # (program, index in program, Collective)
    groups: dict  # group key -> (ranks, [(program, index in program, Collective)])

    @classmethod
    def of(cls, programs: dict[str, list[Collective]], group_ranks=None) -> "_Sequences":
        """``group_ranks``: group name -> its global ranks (default: the registered groups')."""
        group_ranks = group_ranks or _group_ranks
        structure, groups, ranks_of = [], {}, {}
        for name, colls in programs.items():
            for i, c in enumerate(colls):
                structure.append((name, i, c))
                if c.group not in ranks_of:
                    ranks_of[c.group] = tuple(group_ranks(c.group))
                ranks = ranks_of[c.group]
                key = f"{c.axis} {_text_hash(map(str, ranks))}"
                groups.setdefault(key, (ranks, []))[1].append((name, i, c))
        return cls(structure, groups)

    def digests(self) -> tuple:
        """What is exchanged first: a digest of the structure and one per group."""
        structure = _text_hash(f"{name}: {c.structure()}" for name, _, c in self.structure)
        return structure, {key: _text_hash(f"{name}: {c.signature()}" for name, _, c in seq)
                           for key, (_, seq) in self.groups.items()}

    def details(self, rank: int) -> dict:
        """What is exchanged after a mismatch, for the message (plain data: it is pickled)."""
        entry = lambda name, i, c: (name, i, c.signature(), c.structure(), c.describe())  # noqa: E731
        return {"rank": rank, "structure": [entry(*e) for e in self.structure],
                "groups": {key: (ranks, [entry(*e) for e in seq]) for key, (ranks, seq) in self.groups.items()}}


def _group_ranks(name: str) -> tuple:
    """The global ranks of the process group registered as ``name`` (a collective's group
    argument); ``(name,)`` when none is registered (then only ranks naming it alike agree)."""
    group = compat.resolve_process_group(name) if name else None
    return tuple(dist.get_process_group_ranks(group)) if group is not None else (name,)


def check_spmd_on_mesh(programs: dict[str, list[Collective]], mesh) -> str:
    """Raise ValueError on every rank of ``mesh`` unless its ranks' collective sequences agree
    (module docstring); returns this rank's :func:`sequence_hash`.

    The ranks exchange over the world when ``mesh`` spans it, else along each mesh axis in turn
    (``mesh`` may be a pipeline stage's sub-mesh; ranks that agree along every axis line agree
    everywhere on the mesh, and every group a program uses lies within one line or, FSDP's joint
    group over several axes, is connected by lines within it)."""
    digest = sequence_hash(programs)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return digest
    mine = _Sequences.of(programs)
    exchanges = [None] if mesh.size() == dist.get_world_size() else [mesh.get_group(a) for a in range(mesh.ndim)]
    for group in exchanges:
        _check_among(mine, group)
    return digest


def _check_among(mine: _Sequences, group) -> None:
    """One exchange over ``group`` (None: the world). First each rank's digests; each rank checks
    the groups it belongs to against their members, then all learn whether any rank found a
    difference (so no rank goes on to a collective its peers will not join); only then, on the
    rare path, the full sequences, so every rank can name what differs."""
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    everyone = [None] * len(members)
    dist.all_gather_object(everyone, mine.digests(), group=group)
    found = _differs(mine, dict(zip(members, everyone)))
    verdicts = [None] * len(members)
    dist.all_gather_object(verdicts, found, group=group)
    if not any(verdicts):
        return
    details = [None] * len(members)
    dist.all_gather_object(details, mine.details(dist.get_rank()), group=group)
    raise ValueError(first_difference(details) or "SPMD check failed: collective sequences differ between ranks")


def _differs(mine: "_Sequences", digests_of: dict) -> bool:
    """Whether a rank of this exchange disagrees with this one: on the structure, or, for a group
    this rank belongs to, on that group's sequence (a member issuing nothing on it disagrees)."""
    structure, groups = mine.digests()
    if any(theirs[0] != structure for theirs in digests_of.values() if theirs is not None):
        return True
    for key, (ranks, _) in mine.groups.items():
        for rank in ranks:
            theirs = digests_of.get(rank)
            if theirs is not None and theirs[1].get(key) != groups[key]:
                return True
    return False


_AFTER = ("All ranks must compile the same program: pass inputs with the same shapes and dtypes on "
          "every rank and the same plan; running it would hang.")


def first_difference(details: list[dict]) -> str | None:
    """The message for the first difference among ``details`` (one :meth:`_Sequences.details` per
    rank of the exchange), or None: first in the sequence without sizes, then, group by group, in
    the sequence of each group among its members. The same text on every rank."""
    ref = details[0]
    for other in details[1:]:
        found = _first_in(ref["structure"], other["structure"], field=3)
        if found is not None:
            return _message(found, ref["rank"], other["rank"], "")
    by_rank = {d["rank"]: d for d in details}
    for key in sorted({k for d in details for k in d["groups"]}):
        holders = [d for d in details if key in d["groups"]]
        ranks = holders[0]["groups"][key][0]
        first = holders[0]
        for rank in ranks:
            other = by_rank.get(rank)
            if other is None or other is first:
                continue
            theirs = other["groups"].get(key, (ranks, []))[1]
            found = _first_in(first["groups"][key][1], theirs, field=2)
            if found is not None:
                axis = key.split(" ")[0]
                where = f" (collective #{found[2]} on the {axis} group of ranks {list(ranks)})"
                return _message(found, first["rank"], rank, where)
    return None


def _first_in(a: list, b: list, field: int):
    """The first index at which entries of ``a`` and ``b`` differ in ``field`` (2: signature, 3:
    structure), as ``(entry of a or None, entry of b or None, index)``, or None."""
    for i, (x, y) in enumerate(itertools.zip_longest(a, b)):
        if x is None or y is None or x[field] != y[field]:
            return x, y, i
    return None


def _message(found, rank_a: int, rank_b: int, where: str) -> str:
    x, y, _ = found
    entry = x if x is not None else y
    name, index = entry[0], entry[1]

    def side(e) -> str:
        return "no collective" if e is None else f"{e[2]} for {e[4]}"

    return (f"SPMD check failed: collective #{index} of the {name} program{where} differs between rank "
            f"{rank_a} ({side(x)}) and rank {rank_b} ({side(y)}). {_AFTER}")


# --- agreement before anything can hang -----------------------------------------------------------
# The compile-time check above runs only where a rank compiles. A rank that reuses a cached program
# while its peer compiles a new input signature would wait in the peer's compile while the peer
# waits in the cached program: a hang. So every call (and parallelize, before it distributes the
# parameters) first exchanges a digest of what it is about to run, plus whether this rank found a
# problem with its inputs; a difference or a problem is a ValueError on every rank. The exchange is
# a MAX all-reduce of [digest, -digest, problem] (3 int64 per rank): every rank then holds the
# largest digest and minus the smallest, which differ exactly when some rank's digest differs, and
# the largest problem flag, so all ranks reach the same verdict from the same 24 bytes. Only then,
# on a disagreement, are the ranks' descriptions gathered to name both sides. Over a gloo group
# (host memory: no device synchronisation) the all-reduce is host_reduce's recursive doubling,
# log2(world) message rounds, where gloo's own all-reduce and all-gather are rings (2(n-1) and n-1
# rounds: tens of ms at 1,024 ranks); over a device group (a sub-mesh's axes) the backend's
# all-reduce, whose small-message algorithm is a tree (NCCL).

_CONTROL_GROUPS: dict = {}  # (backend of the default group, timeout seconds) -> gloo group over the world


def digest_of(text: str) -> int:
    """A stable 63-bit digest of ``text`` (Python's hash() differs between processes)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _exchange_groups(mesh, timeout) -> list:
    """Where agreement is exchanged: one gloo group over the world when ``mesh`` spans it (the
    default group when it is gloo already), else each axis of the mesh in turn (a sub-mesh, such
    as a pipeline stage's: ranks that agree along every axis line agree on the whole mesh)."""
    if mesh.size() != dist.get_world_size():
        return [mesh.get_group(axis) for axis in range(mesh.ndim)]
    if dist.get_backend() in ("gloo", "fake") and timeout is None:
        return [None]
    key = (dist.get_backend(), None if timeout is None else timeout.total_seconds())
    if key not in _CONTROL_GROUPS:
        # Every rank creates it at the same call (the first parallelize or call after a change
        # of timeout), as new_group requires.
        kwargs = {} if timeout is None else {"timeout": timeout}
        _CONTROL_GROUPS[key] = dist.new_group(backend="gloo", **kwargs)
    return [_CONTROL_GROUPS[key]]


class AgreementError(ValueError):
    """Ranks disagree on what to run, or one rank found a problem with its inputs."""


def agree(mesh, what: str, digest: int, describe, problem: str | None = None, *, timeout=None,
          wait: bool = True) -> "PendingAgreement | None":
    """Raise :class:`AgreementError` (a ValueError) on every rank of ``mesh`` unless all of them
    pass the same ``digest`` and none a ``problem``.

    ``what`` names the moment ("parallelize", "call 3 of LlamaForCausalLM"); ``describe()`` gives
    this rank's human-readable version of what the digest covers, gathered only when digests differ
    so the error can show both sides. ``timeout``: a timedelta for the exchange, or None for the
    group's own. ``wait=False``: where the exchange is over one group (a mesh over the whole
    world), start it (its rounds after the first run on a thread of their own) and return a
    :class:`PendingAgreement` whose ``wait()`` checks it; the caller must wait before it issues
    any other collective (runtime/agreement_gate.py). Otherwise (and always when ``wait``) the
    check is done on return, and None is returned."""
    if not dist.is_initialized() or mesh.size() == 1:
        if problem:
            raise AgreementError(f"{what}: {problem}")
        return None
    groups = _exchange_groups(mesh, timeout)
    for group in groups:
        later = not wait and len(groups) == 1
        pending = PendingAgreement(mesh, group, what, digest, describe, problem, background=later)
        if later:
            return pending
        pending.wait()
    return None


class PendingAgreement:
    """One agreement exchange in flight: the MAX all-reduce of [digest, -digest, problem] over
    ``group`` (see the section comment). ``background``: a host exchange's later rounds run on a
    thread (host_reduce.MaxAllReduce), so the caller computes while they complete."""

    def __init__(self, mesh, group, what: str, digest: int, describe, problem: str | None, *,
                 background: bool = False):
        self.group, self.what, self.describe, self.problem = group, what, describe, problem
        mine = torch.tensor([digest, -digest, 1 if problem else 0], dtype=torch.int64)
        backend = dist.get_backend(group)
        try:
            if backend == "gloo":
                self.host, self.work = True, MaxAllReduce(mine, group, background=background)
            else:  # a device mesh axis group (sub-mesh case), or the fake backend (one process: a no-op)
                if group is not None and mesh.device_type != "cpu" and backend != "fake":
                    mine = mine.to(mesh.device_type)
                self.host, self.reduced = False, mine
                self.work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def wait(self) -> None:
        """Raise :class:`AgreementError` on every rank unless all digests match and none has a problem."""
        try:
            if self.host:
                reduced = self.work.wait()
            else:
                self.work.wait()
                reduced = self.reduced
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        high, minus_low, flagged = (int(v) for v in reduced.tolist())
        if high == -minus_low and not flagged:
            return
        # Every rank holds the same maximum, so all of them take this path: the gather cannot hang.
        size = dist.get_world_size(self.group)
        details = [None] * size
        dist.all_gather_object(details, (dist.get_rank(), self.describe(), self.problem), group=self.group)
        raise AgreementError(_disagreement(self.what, details))

    def _lost(self, exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"{self.what}: rank {dist.get_rank()} timed out or lost a peer while checking that every "
            f"rank runs the same step ({exc}). A peer is not running this step: it raised an "
            "error, exited, or is stuck elsewhere; see that rank's output."
        )


def _disagreement(what: str, details: list) -> str:
    problems = [(rank, p) for rank, _, p in details if p]
    if problems:
        lines = [f"rank {rank}: {p}" for rank, p in problems]
        return f"{what}: " + "; ".join(lines) + " (raised on every rank, so none is left waiting)"
    first_rank, first, _ = details[0]
    for rank, text, _ in details[1:]:
        lines = itertools.zip_longest(first.splitlines(), text.splitlines(), fillvalue="<nothing>")
        diff = next(((a, b) for a, b in lines if a != b), None)
        if diff is not None:
            return (
                f"{what}: ranks disagree on what to run, which would hang: rank {first_rank} has "
                f"{diff[0]!r} where rank {rank} has {diff[1]!r}. Every rank must use the same plan "
                "and options and pass inputs with the same shapes and dtypes (pad variable-length "
                "batches to one length on all ranks)."
            )
    return f"{what}: ranks disagree on what to run (digests differ but descriptions match)"
