"""SPMD consistency: every rank must run the same collectives in the same order.

Two checks, both a ValueError on every rank instead of a hang:

* at compile time the ranks exchange a hash of their collective sequence (kind, mesh axis, dtype,
  local shape, per program); a mismatch names the first collective that differs, with the
  joint-graph node it serves;
* before ``parallelize`` distributes parameters and before every call, :func:`agree` exchanges a
  digest of the resolved plan / the call's input signature and flags, and whether this rank found a
  problem with its inputs (see the section below).
"""

from __future__ import annotations

import hashlib
import itertools

import torch
import torch.distributed as dist

from .debug import Collective


def sequence_hash(programs: dict[str, list[Collective]]) -> str:
    text = "\n".join(f"{name}: {c.signature()}" for name, colls in programs.items() for c in colls)
    return hashlib.sha256(text.encode()).hexdigest()


def check_spmd(programs: dict[str, list[Collective]], group=None) -> str:
    """Exchange hashes over ``group`` (default: world); raise ValueError on any difference."""
    digest = sequence_hash(programs)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return digest
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return digest
    # Rare path: gather the full sequences so every rank can say exactly what differs.
    mine = {name: [(c.signature(), c.source) for c in colls] for name, colls in programs.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    raise ValueError(_first_difference(everyone))


def _first_difference(everyone: list[dict]) -> str:
    ref = everyone[0]
    for rank, seqs in enumerate(everyone[1:], start=1):
        for name in ref:
            a, b = ref[name], seqs.get(name, [])
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else ("<none>", "")
                y = b[i] if i < len(b) else ("<none>", "")
                if x[0] != y[0]:
                    return (
                        f"SPMD check failed: collective #{i} of the {name} program differs between "
                        f"rank 0 ({x[0]} for node '{x[1]}') and rank {rank} ({y[0]} for node '{y[1]}'). "
                        "All ranks must compile the same program: pass inputs with the same shapes and "
                        "dtypes on every rank and the same plan; running it would hang."
                    )
    return "SPMD check failed: collective sequences differ between ranks"


def check_spmd_on_mesh(programs: dict[str, list[Collective]], mesh) -> str:
    """:func:`check_spmd` among the ranks of ``mesh``, which may be a sub-mesh of the world (a
    pipeline stage's): over the world when the mesh spans it, else along each mesh axis in turn
    (ranks that agree along every axis line agree everywhere on the mesh)."""
    if not dist.is_initialized() or mesh.size() == dist.get_world_size():
        return check_spmd(programs)
    digest = sequence_hash(programs)
    for axis in range(mesh.ndim):
        check_spmd(programs, group=mesh.get_group(axis))
    return digest



# --- agreement before anything can hang -----------------------------------------------------------
# The compile-time check above runs only where a rank compiles. A rank that reuses a cached program
# while its peer compiles a new input signature would wait in the peer's compile while the peer
# waits in the cached program: a hang. So every call (and parallelize, before it distributes the
# parameters) first exchanges a digest of what it is about to run, plus whether this rank found a
# problem with its inputs; a difference or a problem is a ValueError on every rank. The exchange is
# one all-gather of two int64 per rank over a gloo group (host memory: no device synchronisation).

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
    group's own. ``wait=False``: where the exchange is one collective (a mesh over the whole
    world), issue it and return a :class:`PendingAgreement` whose ``wait()`` checks it; the caller
    must wait before it issues any other collective (runtime/agreement_gate.py). Otherwise (and
    always when ``wait``) the check is done on return, and None is returned."""
    if not dist.is_initialized() or mesh.size() == 1:
        if problem:
            raise AgreementError(f"{what}: {problem}")
        return None
    groups = _exchange_groups(mesh, timeout)
    for group in groups:
        pending = PendingAgreement(mesh, group, what, digest, describe, problem)
        if not wait and len(groups) == 1:
            return pending
        pending.wait()
    return None


class PendingAgreement:
    """One agreement exchange in flight (an all-gather of two int64 per rank over ``group``)."""

    def __init__(self, mesh, group, what: str, digest: int, describe, problem: str | None):
        self.group, self.what, self.describe, self.problem = group, what, describe, problem
        mine = torch.tensor([digest, 1 if problem else 0], dtype=torch.int64)
        if group is not None and mesh.device_type != "cpu" and dist.get_backend(group) != "gloo":
            mine = mine.to(mesh.device_type)  # a device mesh axis group (sub-mesh case)
        self.everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        try:
            self.work = dist.all_gather(self.everyone, mine, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def wait(self) -> None:
        """Raise :class:`AgreementError` on every rank unless all digests match and none has a problem."""
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        digests = {int(t[0]) for t in self.everyone}
        if len(digests) == 1 and not any(int(t[1]) for t in self.everyone):
            return
        details = [None] * len(self.everyone)
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
