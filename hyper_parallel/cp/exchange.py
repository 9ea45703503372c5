"""The all-to-all that swaps which dim of an attention tensor is split over a group of ranks.

All-to-all (Ulysses) context parallelism and the ring × all-to-all hybrid both move query, key,
value and output ``[B, H, S, D]`` (and log-sum-exp ``[B, H, S]``) between sequence-sharded and
head-sharded: :func:`swap_sharded_dim` does it on the local tensor with one
``all_to_all_single`` of equal chunks over the group, functional and traceable. (DTensor's own
shard-to-shard redistribution on a CPU mesh all-gathers the whole tensor and slices it: ``n``
times the bytes.)
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from ..ir import meta

c10d = torch.ops._c10d_functional


def swap_sharded_dim(local: torch.Tensor, group: str, n: int, src_dim: int, dst_dim: int,
                     description: str) -> torch.Tensor:
    """``local``, this rank's piece of a tensor split along ``src_dim`` over the ``n`` ranks of
    ``group`` (in rank order), as its piece split along ``dst_dim`` instead: ``dst_dim`` is cut
    in ``n`` chunks, chunk ``j`` goes to the group's rank ``j``, and what arrives is concatenated
    along ``src_dim`` in rank order. The nodes are annotated as a redistribution described by
    ``description`` (dumps and summaries show it)."""
    with _annotated(description):
        return _joined(_exchanged(local, group, n, dst_dim), src_dim)


def _annotated(description: str):
    return fx_traceback.annotate({meta.ROLE: meta.ROLE_REDISTRIBUTE, meta.REDISTRIBUTE: description})


def _exchanged(local: torch.Tensor, group: str, n: int, dst_dim: int) -> torch.Tensor:
    """The all-to-all: ``dst_dim`` cut in ``n`` chunks, chunk ``j`` to rank ``j``; returns the
    ``n`` pieces received, stacked in front in rank order."""
    pieces = local.unflatten(dst_dim, (n, local.shape[dst_dim] // n)).movedim(dst_dim, 0).contiguous()
    return c10d.wait_tensor(c10d.all_to_all_single(pieces, [1] * n, [1] * n, group))


def _joined(received: torch.Tensor, src_dim: int) -> torch.Tensor:
    """What rank i sent is its piece of the dim that becomes whole: the i-th along it."""
    return received.movedim(0, src_dim).flatten(src_dim, src_dim + 1)


def swap_sharded_dims(tensors: list[torch.Tensor], group: str, n: int, src_dim: int, dst_dim: int,
                      description: str) -> list[torch.Tensor]:
    """:func:`swap_sharded_dim` of several attention tensors ``[B, H, S, D]`` / ``[B, H, S]`` in as
    few all-to-alls as their ``[B, H, S]`` allow: those that share it travel concatenated along
    their last dim (a ``[B, H, S]`` one as one more column), one all-to-all each group. A member of
    another dtype travels as the bytes of its values, reinterpreted (a bit cast, never a
    conversion) as columns of the group's dtype, so a bf16 output and its fp32 log-sum-exp move
    together, exactly. Each collective is a fixed latency before it is bandwidth; query, key and
    value (or the three gradients) moving at once cost one."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(tensors):
        groups.setdefault(tuple(x.shape[:3]), []).append(i)
    moved: list = [None] * len(tensors)
    for members in groups.values():
        carrier = min((tensors[i].dtype for i in members), key=lambda d: d.itemsize)
        riding = [i for i in members if tensors[i].dtype.itemsize % carrier.itemsize == 0]
        for i in members:
            if i not in riding or len(riding) == 1:
                moved[i] = swap_sharded_dim(tensors[i], group, n, src_dim, dst_dim, description)
        if len(riding) < 2:
            continue
        with _annotated(description):
            columns = [_as_columns(tensors[i], carrier) for i in riding]
            received = _exchanged(torch.cat(columns, dim=-1), group, n, dst_dim)
            # Split before joining: each join copies its piece whole and contiguous, as the kernels
            # (and the GPU ones' alignment rules) want it.
            for i, piece in zip(riding, received.split([c.shape[-1] for c in columns], dim=-1)):
                moved[i] = _from_columns(_joined(piece, src_dim).contiguous(), tensors[i])
    return moved


def _as_columns(x: torch.Tensor, carrier: torch.dtype) -> torch.Tensor:
    """``x`` as ``[B, H, S, columns]`` of dtype ``carrier`` (its values' bytes when it is another)."""
    x = x if x.dim() == 4 else x.unsqueeze(-1)
    return x if x.dtype == carrier else x.contiguous().view(carrier)


def _from_columns(columns: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_as_columns` for a tensor shaped and typed as ``like``."""
    x = columns if columns.dtype == like.dtype else columns.view(like.dtype)
    return x if like.dim() == 4 else x.squeeze(-1)
