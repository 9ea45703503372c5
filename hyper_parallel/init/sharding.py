"""Turning full tensors into this rank's DTensor shards and installing them in the model.

Splitting is local (``distribute_tensor(..., src_data_rank=None)``, no communication) and the
shard gets its own compact storage, so the full tensor can be dropped; the bytes are counted in
:class:`~hyper_parallel.init.InitStats`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .tensors import InitStats, _Entry, _nbytes


def _shard_locally(placements, full: torch.Tensor, mesh, stats: InitStats) -> DTensor:
    """This rank's shard of ``full`` (a tensor in the arena) as a DTensor with its own compact
    storage, split locally (no communication). Accounts the bytes it allocates."""
    data = full.detach()
    moved = mesh.device_type != data.device.type
    if moved:  # distribute_tensor would make the same copy of the full tensor
        data = data.to(mesh.device_type)
        stats._alloc(_nbytes(data))
    dt = distribute_tensor(data, mesh, placements, src_data_rank=None)
    local = dt.to_local()
    storage = local.untyped_storage()
    if storage.nbytes() > _nbytes(local) or storage.data_ptr() == full.untyped_storage().data_ptr():
        # A view into the arena or into a larger tensor: copy the shard out.
        local = local.clone(memory_format=torch.contiguous_format)
        dt = DTensor.from_local(local, mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())
    if moved and local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():
        return dt  # replicated on the device: the copy made above is the shard
    stats._alloc(local.untyped_storage().nbytes())
    if moved:
        stats._alloc(-_nbytes(data))
    return dt


def _shard_without_data(t: torch.Tensor, placements, mesh, local_shapes: dict | None = None) -> DTensor:
    """This rank's shard of a meta tensor, as a meta DTensor: shapes only (``distribute_tensor``
    would also slice and pad, ~10 ms per tensor, minutes for a 1000-rank 80-layer model).

    ``local_shapes`` remembers the local shape per (shape, placements) across the tensors of one
    mesh: the blocks of a model repeat a few shapes, and DTensor computes a ``_StridedShard``'s size
    by splitting an index per rank of the axis (seconds over an FSDP axis of 2,048 ranks)."""
    if not t.is_meta:
        return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
    from .. import compat

    key = (tuple(t.shape), tuple(placements))
    local_shape = None if local_shapes is None else local_shapes.get(key)
    if local_shape is None:
        local_shape, _ = compat.compute_local_shape_and_global_offset(t.shape, mesh, placements)
        if local_shapes is not None:
            local_shapes[key] = local_shape
    local = torch.empty(local_shape, dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _wrap(entry: _Entry, dt: torch.Tensor) -> torch.Tensor:
    if entry.is_param:
        return nn.Parameter(dt, requires_grad=entry.tensor.requires_grad)
    return dt


def _distribute_real(entry: _Entry, mesh, stats: InitStats) -> torch.Tensor:
    stats.num_real += 1
    dt = distribute_tensor(entry.tensor.detach(), mesh, entry.placements)
    local = dt.to_local()
    if local.untyped_storage().data_ptr() != entry.tensor.untyped_storage().data_ptr():
        stats._alloc(local.untyped_storage().nbytes())
    return _wrap(entry, dt)


def _install(entry: _Entry) -> None:
    for module, name in entry.slots:
        if entry.is_param:
            module.register_parameter(name, entry.result)
        else:
            module.register_buffer(name, entry.result, persistent=name not in module._non_persistent_buffers_set)
