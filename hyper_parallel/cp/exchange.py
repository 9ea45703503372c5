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
    annotation = {meta.ROLE: meta.ROLE_REDISTRIBUTE, meta.REDISTRIBUTE: description}
    with fx_traceback.annotate(annotation):
        pieces = local.unflatten(dst_dim, (n, local.shape[dst_dim] // n)).movedim(dst_dim, 0).contiguous()
        received = c10d.wait_tensor(c10d.all_to_all_single(pieces, [1] * n, [1] * n, group))
        # What rank i sent is its piece of the dim that becomes whole: the i-th along it.
        return received.movedim(0, src_dim).flatten(src_dim, src_dim + 1)
