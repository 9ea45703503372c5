"""Checkpoint layouts DCP can write: each rank's shard of a tensor must be one box of it.

``torch.distributed.checkpoint`` records each rank's part of a DTensor as one chunk (an offset and a
size per dim). A fused projection split per part (``ColwiseParallel(parts=n)``, GPT-2's ``c_attn``:
``_StridedShard(d, split_factor=n)`` with no other mesh axis sharding ``d``) gives a rank ``n``
pieces of dim ``d``, not one box: DCP computed overlapping chunks and refused the save. (A strided
shard that FSDP nests inside another axis's ``Shard(d)`` is a box, and DCP reads it as one.)

Such tensors travel through DCP in the same placements with ``Shard(d)`` instead: on save a
redistributed copy is written, on load DCP reads into a temporary in that layout, which is then
redistributed back and copied into the live tensor. The checkpoint holds the whole tensor's shape
and values either way, so it loads under any plan (a plain ``Shard(d)`` is one box)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from .. import compat
from ..layout import split_per_part




def _walk(state: Any, visit: Callable[[dict, Any, DTensor], None]) -> None:
    """``visit(container, key, value)`` for every DTensor in the nested dicts / lists of ``state``."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in list(items):
        if isinstance(value, DTensor):
            visit(state, key, value)
        elif isinstance(value, (dict, list)):
            _walk(value, visit)


def _boxed(value: DTensor) -> DTensor:
    """``value`` itself when its shard is one box, else its redistribution with each placement
    that splits a dim per part made a plain ``Shard``."""
    axes = split_per_part(value.placements)
    if not axes:
        return value
    boxed = tuple(Shard(p.dim) if i in axes else p for i, p in enumerate(value.placements))
    return value.redistribute(value.device_mesh, boxed)


def for_save(state: dict) -> dict:
    """``state`` (nested dicts of the model and optimizer state) with every DTensor DCP cannot write
    replaced, in a copy of the dicts, by its redistribution to box placements."""
    return compat.pytree.tree_map_only(DTensor, _boxed, state)


def for_load(request: dict) -> Callable[[], None]:
    """Swap, in ``request`` (the state DCP is to read into), every DTensor DCP cannot read into for
    a temporary in box placements; returns the function that, after the read, copies each
    temporary back into the tensor it stands for (redistributed to that tensor's placements) and
    puts that tensor back in ``request``."""
    swapped: list[tuple[Any, Any, DTensor, DTensor]] = []

    def visit(container, key, value):
        read = _boxed(value)
        if read is not value:
            container[key] = read
            swapped.append((container, key, value, read))

    _walk(request, visit)

    def restore() -> None:
        with torch.no_grad():
            for container, key, live, read in swapped:
                live.copy_(read.redistribute(live.device_mesh, live.placements))
                container[key] = live

    return restore
