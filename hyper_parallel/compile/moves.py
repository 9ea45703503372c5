"""How the lowering traces one tensor's layout change (a ``DTensorSpec`` to another).

DTensor's ``redistribute_local_tensor`` is the reference and lowers most steps. Three steps it
traces with one graph node per rank of the mesh axis, because its eager code chunks the tensor
into one piece per rank: over an FSDP axis of thousands of ranks that is thousands of nodes per
parameter, which every later stage of a large compile walks (issue 55: Llama 3 405B on 16,384
ranks spent most of a 20-minute compile in them). Those three are traced here as a few ops, with
exactly DTensor's values, sizes and collectives:

* Replicate -> Shard (:func:`take_own_parts`): DTensor chunks and keeps one piece; here one
  ``narrow`` of this rank's part, then a clone (a shard owns its storage).
* Partial -> Shard(d) on one axis (:func:`reduce_scatter`): when the dim does not divide, DTensor
  pads each of the N chunks and concatenates them, and for d != 0 the functional collective
  chunks again to put the parts first. The padded chunks, side by side, are the whole tensor
  padded at its end (torch.chunk's parts are full but the last ones), so here: one pad, one
  unflatten + movedim + flatten, the reduce-scatter, one narrow.
* Shard(d) -> Replicate on one axis with d != 0 (:func:`all_gather`): the functional collective
  gathers on dim 0 and re-concatenates N chunks on d; here unflatten + movedim + flatten.

A mesh axis of one rank changes nothing (DTensor skips it too: its part is the whole tensor, its
partial sum the sum): :func:`move` drops such changes first. Without that a one-rank FSDP axis
cloned every gradient, 7 GB more at the reserved peak of tests/analysis/test_allocator_model.py's
Llama 3 8B shape, whose H200 measurement caught it. A step that changes several axes, nests shards
on one dim or uses ``_StridedShard`` goes to DTensor unchanged. Partial(avg) was made a sum by the caller (compile/lower.py)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard

from .. import compat

__all__ = ["move", "reduction_steps", "local_splits", "take_own_parts", "reduce_scatter", "all_gather"]


def move(local: torch.Tensor, src, dst) -> torch.Tensor:
    """``local`` (this rank's piece under ``src``) as this rank's piece under ``dst``, traced."""
    src = _one_rank_axes_as(src, dst)
    for step in reduction_steps(src, dst):
        local = _one_step(local, src, step)
        src = step
    return local


def _one_step(local: torch.Tensor, src, dst) -> torch.Tensor:
    splits = local_splits(src, dst)
    if splits is not None:
        return take_own_parts(local, src.mesh, splits)
    change = _one_axis_change(src, dst)
    if change is not None:
        axis, before, after = change
        if type(before) is Partial and type(after) is Shard:
            return reduce_scatter(local, src.mesh, axis, after.dim, before.reduce_op)
        if type(before) is Shard and after.is_replicate() and before.dim != 0:
            return all_gather(local, src.mesh, axis, before.dim, src.tensor_meta.shape[before.dim])
    return compat.redistribute_local_tensor(local, src, dst)


def _one_rank_axes_as(src, dst):
    """``src`` with ``dst``'s placements on the mesh axes of one rank (where every placement holds
    the same local tensor)."""
    placements = [b if src.mesh.size(axis) == 1 else a
                  for axis, (a, b) in enumerate(zip(src.placements, dst.placements))]
    return src if tuple(placements) == tuple(src.placements) else compat.respec(src, placements)


def reduction_steps(src, dst) -> list:
    """The specs to pass through from ``src`` to ``dst``: partial axes that end sharded are
    reduce-scattered first, so partial axes that end replicated all-reduce the smaller shard
    (HSDP's reduce-scatter then all-reduce; DTensor alone may all-reduce the full tensor first)."""
    to_shard = [
        i for i, (a, b) in enumerate(zip(src.placements, dst.placements))
        if a.is_partial() and b.is_shard()
    ]
    also_replicate = any(
        a.is_partial() and not b.is_shard() for a, b in zip(src.placements, dst.placements)
    )
    steps = []
    if to_shard and also_replicate:
        middle = list(src.placements)
        for i in to_shard:
            middle[i] = dst.placements[i]
        steps.append(compat.respec(src, middle))
    if dst.placements != src.placements:
        steps.append(dst)
    return steps


def local_splits(src, dst) -> list[tuple[int, int]] | None:
    """(mesh axis, tensor dim) of each Replicate -> Shard of ``src`` -> ``dst`` when that is all
    it does, on distinct tensor dims; else None."""
    splits = []
    for axis, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if a == b:
            continue
        if not (a.is_replicate() and type(b) is Shard):
            return None
        splits.append((axis, b.dim))
    if not splits or len({dim for _, dim in splits}) < len(splits):
        return None
    return splits


def take_own_parts(local: torch.Tensor, mesh, splits) -> torch.Tensor:
    """This rank's part of ``local`` along each (mesh axis, tensor dim) of ``splits``: DTensor's
    chunking (sizes rounded up, the last parts shorter or empty), as a narrow, then a clone (a
    shard owns its storage, as DTensor's does)."""
    coordinate = mesh.get_coordinate()
    for axis, dim in splits:
        size, offset = Shard.local_shard_size_and_offset(local.size(dim), mesh.size(axis), coordinate[axis])
        local = local.narrow(dim, offset, size)
    return local.clone()


def _one_axis_change(src, dst):
    """(axis, before, after) when ``src`` -> ``dst`` changes one mesh axis and no other axis shards
    the tensor dim it involves (the dim's size on this axis is then the whole tensor's); else None."""
    changed = [i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(changed) != 1:
        return None
    axis = changed[0]
    before, after = src.placements[axis], dst.placements[axis]
    dim = next((p.dim for p in (before, after) if p.is_shard()), None)
    if dim is None:
        return None
    for other, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if other != axis and any(p.is_shard() and p.dim == dim for p in (a, b)):
            return None
    return axis, before, after


def _parts_first(x: torch.Tensor, parts: int, dim: int) -> torch.Tensor:
    """``torch.cat(torch.chunk(x, parts, dim), 0)`` for a ``dim`` that divides: the parts stacked
    along dim 0, as one view + permute + copy instead of a node per part."""
    if dim == 0:
        return x
    return x.unflatten(dim, (parts, x.size(dim) // parts)).movedim(dim, 0).flatten(0, 1)


def _parts_back(x: torch.Tensor, parts: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`_parts_first`: ``torch.cat(torch.chunk(x, parts, 0), dim)``."""
    if dim == 0:
        return x
    return x.unflatten(0, (parts, x.size(0) // parts)).movedim(0, dim).flatten(dim, dim + 1)


def _pad_end(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``size`` (itself when it already has it)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, missing])


def reduce_scatter(local: torch.Tensor, mesh, axis: int, dim: int, reduce_op: str) -> torch.Tensor:
    """Partial -> Shard(``dim``) over mesh axis ``axis``: reduce ``local`` over the axis and keep
    this rank's part (DTensor's chunk sizes: rounded up, the last parts shorter or empty)."""
    parts = mesh.size(axis)
    length = local.size(dim)
    chunk = -(-length // parts)
    x = _pad_end(local, dim, chunk * parts)
    if not x.is_contiguous():
        x = x.contiguous()
    x = _parts_first(x, parts, dim)
    out = compat.reduce_scatter_single(x, reduce_op, (mesh, axis))
    size, _ = Shard.local_shard_size_and_offset(length, parts, mesh.get_coordinate()[axis])
    return out if size == chunk else out.narrow(dim, 0, size)


def all_gather(local: torch.Tensor, mesh, axis: int, dim: int, length: int) -> torch.Tensor:
    """Shard(``dim``) -> Replicate over mesh axis ``axis`` of a tensor ``length`` long on ``dim``:
    every rank's part, padded to the rounded-up chunk size, gathered and put side by side."""
    parts = mesh.size(axis)
    chunk = -(-length // parts)
    x = _pad_end(local, dim, chunk)
    if not x.is_contiguous():
        x = x.contiguous()
    out = _parts_back(compat.all_gather_single(x, (mesh, axis)), parts, dim)
    return out if chunk * parts == length else out.narrow(dim, 0, length)
