"""Eager DTensor calls that take a hyper_parallel layout: inspect and move values by hand.

``parallelize`` compiles collectives into the program; outside a compiled program a user still
wants to build a distributed value from a local shard, look at it, gather it or move it to
another layout. These functions do that. They are a thin layer over torch's own
``torch.distributed.tensor.DTensor``: each one turns a layout (a :class:`~hyper_parallel.layout.
TensorLayout` such as ``Layout((2, 2), ("dp", "tp"))("dp", "None")``, or anything
:func:`~hyper_parallel.layout.to_placements` reads, e.g. ``(Shard(0), Replicate())``) into
torch placements and calls torch. Every result is a plain torch ``DTensor``, so the rest of
torch keeps working on it.

A partial value is spelled ``layout.with_partial("tp")`` (torch ``Partial("sum")`` on ``tp``).

The *current mesh* is torch's own: the innermost ``with mesh:`` block (a ``DeviceMesh`` is a
context manager). It is what ``mesh=None`` means here and in ``torch.distributed.tensor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from .. import compat
from ..layout import to_placements
from .mesh import axis_size, mesh_axis_names, mesh_shape

__all__ = [
    "from_local",
    "to_local",
    "distribute_tensor",
    "redistribute",
    "full_tensor",
    "is_partial",
    "reduce_partial",
    "get_current_mesh",
    "get_device_num_along_axis",
]


def get_current_mesh() -> DeviceMesh:
    """Return the mesh of the innermost ``with mesh:`` block (torch's current mesh).

    Raises RuntimeError when no mesh is active.
    """
    mesh = compat.current_mesh()
    if mesh is None:
        raise RuntimeError(
            "no device mesh is active: enter one with `with mesh:` (mesh = hp.init_device_mesh("
            "'cpu', (2, 2), mesh_dim_names=('dp', 'tp'))), or pass mesh=... explicitly"
        )
    return mesh


def get_device_num_along_axis(dim_name: str, mesh: DeviceMesh | None = None) -> int:
    """Return the number of devices along mesh axis ``dim_name`` (of ``mesh``, else the current
    mesh). ValueError names the mesh's axes if ``dim_name`` is not one of them."""
    return axis_size(get_current_mesh() if mesh is None else mesh, dim_name)


def _placements(layout: Any, mesh: DeviceMesh, ndim: int, what: str) -> tuple:
    """``layout`` as one torch placement per axis of ``mesh`` (ValueError if it fits another)."""
    return to_placements(
        layout, mesh_axis_names(mesh), ndim, mesh_shape=mesh_shape(mesh), where=what
    )


def from_local(
    local_tensor: torch.Tensor,
    layout: Any,
    mesh: DeviceMesh | None = None,
    *,
    run_check: bool = False,
    shape: torch.Size | None = None,
    stride: tuple[int, ...] | None = None,
) -> DTensor:
    """Return the DTensor whose shard on this rank is ``local_tensor``, laid out as ``layout``.

    ``mesh`` defaults to the current mesh. The torch order ``from_local(t, mesh, placements)`` is
    accepted too. ``run_check``, ``shape`` and ``stride`` are passed to ``DTensor.from_local``
    (give ``shape``/``stride`` when the shards are uneven).
    """
    if isinstance(layout, DeviceMesh):
        layout, mesh = mesh, layout
    mesh = get_current_mesh() if mesh is None else mesh
    placements = _placements(layout, mesh, local_tensor.ndim, "from_local")
    return DTensor.from_local(
        local_tensor, mesh, placements, run_check=run_check, shape=shape, stride=stride
    )


def distribute_tensor(
    tensor: torch.Tensor,
    layout: Any,
    mesh: DeviceMesh | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split the full ``tensor`` (taken from rank ``src_data_rank``) into a DTensor laid out as
    ``layout`` on ``mesh`` (default: the current mesh)."""
    mesh = get_current_mesh() if mesh is None else mesh
    placements = _placements(layout, mesh, tensor.ndim, "distribute_tensor")
    return _torch_distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)


def _check_dtensor(value: Any, what: str) -> DTensor:
    if not isinstance(value, DTensor):
        raise TypeError(
            f"{what} needs a torch DTensor, got {type(value).__name__}; build one with "
            "hp.from_local(local, layout) or hp.distribute_tensor(tensor, layout)"
        )
    return value


def redistribute(dtensor: DTensor, layout: Any, *, async_op: bool = False) -> DTensor:
    """Return ``dtensor`` moved (by collectives) to ``layout`` on its own mesh."""
    _check_dtensor(dtensor, "redistribute")
    placements = _placements(layout, dtensor.device_mesh, dtensor.ndim, "redistribute")
    return dtensor.redistribute(dtensor.device_mesh, placements, async_op=async_op)


def to_local(dtensor: DTensor | torch.Tensor) -> torch.Tensor:
    """Return this rank's shard of ``dtensor`` (a plain tensor is returned as it is)."""
    return dtensor.to_local() if isinstance(dtensor, DTensor) else dtensor


def full_tensor(dtensor: DTensor | torch.Tensor) -> torch.Tensor:
    """Return the whole value of ``dtensor`` on every rank: gathers shards and reduces partial
    values (a plain tensor is returned as it is)."""
    return dtensor.full_tensor() if isinstance(dtensor, DTensor) else dtensor


def is_partial(dtensor: DTensor) -> bool:
    """True if ``dtensor`` holds partial (not yet reduced) values along some mesh axis."""
    return any(isinstance(p, Partial) for p in _check_dtensor(dtensor, "is_partial").placements)


def reduce_partial(dtensor: DTensor) -> DTensor:
    """Return ``dtensor`` with its partial axes reduced (``Partial`` -> ``Replicate``); its
    sharded and replicated axes are kept. A value that is not partial is returned as it is."""
    placements = _check_dtensor(dtensor, "reduce_partial").placements
    if not any(isinstance(p, Partial) for p in placements):
        return dtensor
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    return redistribute(dtensor, target)

