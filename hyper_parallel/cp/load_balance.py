"""Load-balanced sequence order for ring attention with a causal mask.

With a causal mask, the rank holding the last contiguous slice of the sequence attends to every
earlier token and the first rank to almost none. ``hp.ContextParallel(mode="ring",
load_balance=True)`` therefore cuts the sequence into ``2·cp`` chunks and gives rank ``r`` chunks
``r`` and ``2·cp−1−r``: every rank then computes the same number of query-key pairs.

How the compiler keeps that order without a new placement type: inside a compiled program, a value
sharded over the cp axis (``Shard(d)`` or the ``_StridedShard(d, k)`` a ``[batch, sequence]``
flatten gives) holds on rank ``r`` the *balanced* chunks of its sequence, i.e. it is DTensor's
standard shard of ``P(x)``, where ``P`` permutes the chunks of every sequence into the order
``0, 2cp−1, 1, 2cp−2, …``. Every token-wise op commutes with ``P``, so DTensor's kernels compute
the right thing on the shards. Only a layout change on the cp axis between sharded and not sharded
must apply ``P`` (before sharding: :func:`permute`) or its inverse (after gathering:
:func:`unpermute`); :func:`redistribute` wraps lowering's redistribution to do that, and
``cp/ring.py`` knows each rank's chunks when it masks causal attention.

With Ulysses groups (cp/hybrid.py, ``ulysses_degree = u``), the ring has ``m = cp / u`` ranks and
``P`` orders ``2·m`` chunks; cut in ``cp`` pieces, the balanced sequence gives each Ulysses group
its two chunks in ``u`` consecutive pieces, which the group's all-to-all joins back.

The user's side stays in sequence order: each rank passes its contiguous slice of the sequence,
as in the other modes (``testing.parity.local_batch``, :func:`shard_sequence`). Lowering reorders
sequence-sharded inputs (and tangents) into the balanced order at the program's entry and outputs
(and input gradients) back at its exit with one ``all_to_all_single`` each
(:func:`to_balanced`, :func:`from_balanced`): for token ids and labels a few bytes per token.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import Replicate, Shard

from .. import compat
from ..ir import meta
from ..ir.kinds import InputKind
from ..layout import format_placements

c10d = torch.ops._c10d_functional


def chunk_order(n: int) -> list[int]:
    """The sequence's ``2n`` chunks in balanced order: rank r's two are positions 2r and 2r+1."""
    order = []
    for r in range(n):
        order += [r, 2 * n - 1 - r]
    return order


def rank_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two chunks (of ``2n``) rank ``rank`` of ``n`` holds under load balancing."""
    return rank, 2 * n - 1 - rank


def sequence_dim(placement) -> int | None:
    """The tensor dim a placement on the cp axis shards (the sequence's), or None. (DTensor's
    ``_StridedShard`` is no ``Shard`` subclass.)"""
    return placement.dim if isinstance(placement, (Shard, compat.StridedShard)) else None


def _reorder(x: torch.Tensor, dim: int, seq_len: int, order: list[int]) -> torch.Tensor:
    """``x`` with the chunks of every whole sequence along ``dim`` put in ``order``. ``dim`` holds
    one or more whole sequences of ``seq_len`` tokens (several after a ``[batch, sequence]``
    flatten)."""
    size = x.shape[dim]
    pieces = len(order)
    if size % seq_len:
        raise ValueError(
            f"load-balanced context parallelism must reorder a tensor of shape {list(x.shape)} whose "
            f"dim {dim} ({size}) does not hold whole sequences of {seq_len} tokens (it is also sharded "
            "over another mesh axis); use load_balance=False in the hp.ContextParallel entry"
        )
    grouped = x.unflatten(dim, (size // seq_len, pieces, seq_len // pieces))
    return torch.stack([grouped.select(dim + 1, i) for i in order], dim=dim + 1).flatten(dim, dim + 2)


def permute(x: torch.Tensor, dim: int, seq_len: int, n: int) -> torch.Tensor:
    """Sequence order -> balanced order along ``dim`` (``P``)."""
    return _reorder(x, dim, seq_len, chunk_order(n))


def unpermute(x: torch.Tensor, dim: int, seq_len: int, n: int) -> torch.Tensor:
    """Balanced order -> sequence order along ``dim`` (``P⁻¹``)."""
    order = chunk_order(n)
    inverse = [order.index(i) for i in range(2 * n)]
    return _reorder(x, dim, seq_len, inverse)


def balanced_sequence_length(captured, mesh, context) -> int | None:
    """The length of the sequences the balanced order permutes, or None when ring attention does
    not balance one: dim 1 of the user inputs sharded over the cp axis along it (their layouts
    propagated). Propagation (``propagation/balanced_order.py``) and lowering read the same."""
    if context is None or not context.balanced:
        return None
    axis = mesh.mesh_dim_names.index(context.axis)
    lengths = {
        node.meta[meta.LAYOUT].output.tensor_meta.shape[1]
        for node, info in zip(captured.gm.graph.find_nodes(op="placeholder"), captured.inputs)
        if info.kind == InputKind.INPUT and meta.LAYOUT in node.meta
        and isinstance(node.meta[meta.LAYOUT].output, compat.DTensorSpec)
        and node.meta[meta.LAYOUT].output.placements[axis] == Shard(1)
    }
    if not lengths:
        return None
    if len(lengths) > 1:
        raise ValueError(
            f"{context.source}: the inputs sharded over {context.axis!r} have sequences of different "
            f"lengths {sorted(lengths)}; load-balanced ring attention reorders one sequence: give "
            "every sequence input the same length or use load_balance=False")
    return lengths.pop()


class Balancer:
    """What lowering needs to keep the balanced order on one cp axis: the axis's index and size,
    the ring's size (the cp size, or ``cp / ulysses_degree`` for the hybrid of cp/hybrid.py, whose
    balanced order has ``2·ring`` chunks), the sequence length of the program's sequence-sharded
    inputs, and the process group."""

    def __init__(self, mesh, axis: str, seq_len: int, ring: int | None = None):
        self.mesh = mesh
        self.axis = mesh.mesh_dim_names.index(axis)
        self.n = mesh.size(self.axis)
        self.ring = self.n if ring is None else ring
        self.rank = mesh.get_local_rank(self.axis)
        self.seq_len = seq_len
        if seq_len % (2 * self.n):
            raise ValueError(
                f"ring attention with load_balance splits the sequence of {seq_len} tokens into "
                f"2*{axis}={2 * self.n} chunks: use a sequence length divisible by {2 * self.n} "
                f"({seq_len // self.n} tokens per rank, an even number), or load_balance=False"
            )

    def halves(self) -> list[int]:
        """The sequence's ``2·n`` half-pieces (each half of one rank's share), in balanced order:
        the ``2·ring`` chunks in :func:`chunk_order`, each ``n / ring`` half-pieces long. Rank r
        holds positions 2r and 2r+1 of this list."""
        per_chunk = self.n // self.ring
        return [c * per_chunk + i for c in chunk_order(self.ring) for i in range(per_chunk)]

    # --- layout changes inside the program ---------------------------------------------------

    def redistribute(self, local: torch.Tensor, src, dst, plain) -> torch.Tensor:
        """``plain(local, src, dst)`` (lowering's redistribution) with ``P`` applied where a value
        becomes sharded on the cp axis and ``P⁻¹`` where it stops being."""
        a, b = src.placements[self.axis], dst.placements[self.axis]
        if a == b or (sequence_dim(a) is None and sequence_dim(b) is None):
            return plain(local, src, dst)
        if sequence_dim(a) is not None:  # leaves the balanced order: gather (or move), then P⁻¹
            middle = _with(dst, self.axis, Replicate()) if sequence_dim(b) is not None else dst
            local = plain(local, src, middle)
            local = unpermute(local, sequence_dim(a), self.seq_len, self.ring)
            if sequence_dim(b) is None:
                return local
            src = middle
        local = permute(local, sequence_dim(b), self.seq_len, self.ring)
        return plain(local, src, dst)

    # --- the program's entry and exit --------------------------------------------------------

    def _exchange(self, local: torch.Tensor, dim: int, to_balanced: bool) -> torch.Tensor:
        """One ``all_to_all_single`` moving this rank's two half-pieces between the sequence
        order (rank r: half-pieces 2r, 2r+1) and the balanced one (:meth:`halves`; without
        Ulysses groups, rank r: chunks r and 2n-1-r)."""
        n, r = self.n, self.rank
        order = self.halves()
        contiguous = {p: (2 * p, 2 * p + 1) for p in range(n)}
        balanced = {p: (order[2 * p], order[2 * p + 1]) for p in range(n)}
        have, want = (contiguous, balanced) if to_balanced else (balanced, contiguous)
        holder = {c: p for p, chunks in want.items() for c in chunks}  # who must hold chunk c
        source = {c: p for p, chunks in have.items() for c in chunks}  # who holds it now
        half = local.shape[dim] // 2
        pieces = dict(zip(have[r], local.split(half, dim=dim)))
        # all_to_all_single sends consecutive rows to ranks in rank order and receives them in the
        # order of their source ranks (a source's chunks in the order it sends them).
        outgoing = sorted(have[r], key=lambda c: (holder[c], c))
        incoming = sorted(want[r], key=lambda c: (source[c], c))
        rows = torch.cat([pieces[c] for c in outgoing], dim=dim).movedim(dim, 0).contiguous()
        in_splits = [half * sum(holder[c] == p for c in outgoing) for p in range(n)]
        out_splits = [half * sum(source[c] == p for c in incoming) for p in range(n)]
        group = self.mesh.get_group(self.axis).group_name
        got = c10d.wait_tensor(c10d.all_to_all_single(rows, out_splits, in_splits, group)).movedim(0, dim)
        arrived = dict(zip(incoming, got.split(half, dim=dim)))
        return torch.cat([arrived[c] for c in want[r]], dim=dim).contiguous()

    def entry_all(self, values: list[tuple[torch.Tensor, object, str]], stack: bool = True) -> list[torch.Tensor]:
        """User inputs (or tangents) ``(local, spec, name)`` in sequence order -> the program's
        balanced order; with ``stack``, those of one shape and dtype (input ids and labels) travel
        stacked, in one all-to-all."""
        results = [local for local, _, _ in values]
        groups: dict[tuple, list[int]] = {}
        for i, (local, spec, _) in enumerate(values):
            dim = self._boundary_dim(spec)
            if dim is not None:
                groups.setdefault((dim, local.dtype, tuple(local.shape)) if stack else (dim, i), []).append(i)
        for (dim, *_), members in groups.items():
            names = ", ".join(values[i][2] for i in members)
            spec = values[members[0]][1]
            with fx_traceback.annotate({meta.SOURCE: values[members[0]][2], meta.ROLE: meta.ROLE_REDISTRIBUTE,
                                        meta.REDISTRIBUTE: f"{format_placements(spec.placements)} -> balanced "
                                                           f"order ({names})"}):
                if len(members) == 1:
                    results[members[0]] = self._exchange(values[members[0]][0], dim, True)
                    continue
                moved = self._exchange(torch.stack([values[i][0] for i in members]), dim + 1, True)
                for i, part in zip(members, moved.unbind(0)):
                    results[i] = part
        return results

    def exit(self, local: torch.Tensor, spec) -> torch.Tensor:
        """A user output (or input gradient) in the balanced order -> sequence order."""
        return self._boundary(local, spec, to_balanced=False)

    def _boundary_dim(self, spec) -> int | None:
        """The sequence dim of a user-facing value laid out as ``spec``, None if it has none here."""
        dim = sequence_dim(spec.placements[self.axis])
        if dim is None or isinstance(spec.placements[self.axis], compat.StridedShard) or \
                spec.tensor_meta.shape[dim] != self.seq_len:
            return None  # not one of the [batch, sequence, ...] tensors users hand over
        return dim

    def _boundary(self, local, spec, to_balanced: bool):
        dim = self._boundary_dim(spec)
        if dim is None:
            return local
        target = "balanced" if to_balanced else "sequence"
        with fx_traceback.annotate({meta.ROLE: meta.ROLE_REDISTRIBUTE,
                                    meta.REDISTRIBUTE: f"{format_placements(spec.placements)} -> {target} order"}):
            return self._exchange(local, dim, to_balanced)


def _with(spec, axis: int, placement):
    placements = list(spec.placements)
    placements[axis] = placement
    return compat.respec(spec, placements)


def shard_sequence(batch, mesh, *, axis: str = "cp", dim: int = 1):
    """This rank's contiguous slice of the sequence: every tensor of ``batch`` (a tensor, or a
    dict / list / tuple of them) with more than ``dim`` dims, cut in ``mesh.size(axis)`` pieces
    along ``dim``. What each rank passes to a context-parallel model in every mode (the compiled
    program itself reorders the tokens for load-balanced ring attention)."""
    n = mesh.size(mesh.mesh_dim_names.index(axis))
    rank = mesh.get_local_rank(mesh.mesh_dim_names.index(axis))

    def cut(t):
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        if t.shape[dim] % n:
            raise ValueError(f"shard_sequence: dim {dim} of a tensor of shape {list(t.shape)} does not "
                             f"divide over {axis}={n}")
        return t.chunk(n, dim=dim)[rank]

    return compat.pytree.tree_map(cut, batch)
