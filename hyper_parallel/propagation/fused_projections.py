"""Our rules for a fused projection split into its parts, and the parts' gradients joined again.

GPT-2's ``c_attn`` computes q, k and v with one weight ``[hidden, 3 * hidden]`` and splits its
output with ``.split(hidden, dim=2)``; Phi-3's ``qkv_proj`` and ``gate_up_proj`` do the same. A
plain column split of such a weight gives rank 0 all of q and half of k, which the split cannot
keep sharded: the output was all-gathered and the attention ran replicated on every rank. Planned
as ``_StridedShard(1, split_factor=3)`` (each rank holds its columns of q, of k and of v, in that
order), the projection's output is ``_StridedShard(dim, split_factor=3)``, and:

* ``split`` / ``split_with_sizes`` of such a dim into ``split_factor`` equal parts gives each part
  ``Shard(dim)``: this rank's part of it is its local third (DTensor's rule gathers instead);
* ``cat`` of equal parts each ``Shard(dim)`` along ``dim`` (the split's backward) gives
  ``_StridedShard(dim, split_factor=parts)``: this rank's parts side by side (DTensor's rule gathers
  every part).

Both compute on the local shards (:func:`local_kernel`) with no communication. Every other
placement must leave ``dim`` alone (it is kept as it is); anything else is left to DTensor.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Shard

from .. import compat

aten = torch.ops.aten

SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
CAT_OPS = (aten.cat.default,)
SLICE_OPS = (aten.slice.Tensor,)
SLICE_BACKWARD_OPS = (aten.slice_backward.default,)


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _part_sizes(op, args_schema: tuple, size: int) -> list[int] | None:
    if op is aten.split.Tensor:
        step = args_schema[1]
        if not isinstance(step, int) or step <= 0:
            return None
        return [min(step, size - start) for start in range(0, size, step)]
    sizes = args_schema[1]
    return list(sizes) if all(isinstance(s, int) for s in sizes) else None


def _strided_axis(placements, dim: int) -> int | None:
    """The one mesh axis whose placement is a strided shard of ``dim``; None if none, or if any
    other axis shards ``dim`` too."""
    strided = [i for i, p in enumerate(placements) if isinstance(p, compat.StridedShard) and p.dim == dim]
    others = [i for i, p in enumerate(placements)
              if p.is_shard() and p.dim == dim and not isinstance(p, compat.StridedShard)]
    return strided[0] if len(strided) == 1 and not others else None


def _split_rule(op, args_schema: tuple):
    x = args_schema[0]
    if not isinstance(x, compat.DTensorSpec) or x.tensor_meta is None:
        return None
    shape = tuple(x.tensor_meta.shape)
    dim = _dim(args_schema[2] if len(args_schema) > 2 else 0, len(shape))
    axis = _strided_axis(x.placements, dim)
    if axis is None:
        return None
    sizes = _part_sizes(op, args_schema, shape[dim])
    factor = x.placements[axis].split_factor
    if sizes is None or len(sizes) != factor or len(set(sizes)) != 1 or sizes[0] % x.mesh.size(axis):
        return None
    placements = list(x.placements)
    placements[axis] = Shard(dim)
    part_shape = shape[:dim] + (sizes[0],) + shape[dim + 1:]
    meta = compat.TensorMeta(torch.Size(part_shape), tuple(x.tensor_meta.stride), x.tensor_meta.dtype)
    part = compat.DTensorSpec(x.mesh, tuple(placements), tensor_meta=meta)
    return tuple(part for _ in sizes), None


def _contiguous_stride(shape) -> tuple[int, ...]:
    return tuple(int(torch.Size(shape[i + 1:]).numel()) for i in range(len(shape)))


def _slice_part(args_schema: tuple) -> tuple[int, int, int, int] | None:
    """(mesh axis, dim, part index, parts) when the slice takes exactly one of the ``split_factor`` equal
    parts of a strided-sharded dim (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + k]``, ``qkv[..., q + k:]``),
    else None."""
    x = args_schema[0]
    if not isinstance(x, compat.DTensorSpec) or x.tensor_meta is None:
        return None
    shape = tuple(x.tensor_meta.shape)
    dim = _dim(args_schema[1] if len(args_schema) > 1 else 0, len(shape))
    start = args_schema[2] if len(args_schema) > 2 else None
    end = args_schema[3] if len(args_schema) > 3 else None
    step = args_schema[4] if len(args_schema) > 4 else 1
    axis = _strided_axis(x.placements, dim)
    if axis is None or step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
        return None
    size, factor = shape[dim], x.placements[axis].split_factor
    start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    end = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    part = size // factor
    if size % factor or part % x.mesh.size(axis) or start % part or end - start != part:
        return None
    return axis, dim, start // part, factor


def _slice_spec(x, found: tuple[int, int, int, int]):
    """The layout of the part :func:`_slice_part` found: ``Shard(dim)`` where the dim was strided."""
    axis, dim, _, parts = found
    placements = list(x.placements)
    placements[axis] = Shard(dim)
    shape = list(x.tensor_meta.shape)
    shape[dim] //= parts
    meta = compat.TensorMeta(torch.Size(shape), tuple(x.tensor_meta.stride), x.tensor_meta.dtype)
    return compat.DTensorSpec(x.mesh, tuple(placements), tensor_meta=meta)


def _slice_backward_part(args_schema: tuple) -> tuple[int, int, int, int] | None:
    """(mesh axis, dim, part index, parts) when a slice's gradient, ``Shard(dim)`` over one axis,
    goes back into one of the equal parts of a ``dim`` of ``parts`` times its size (the backward of
    :func:`_slice_part`), else None."""
    grad = args_schema[0]
    if len(args_schema) != 6 or not isinstance(grad, compat.DTensorSpec) or grad.tensor_meta is None:
        return None
    _, sizes, dim, start, end, step = args_schema
    if not all(isinstance(v, int) for v in (*sizes, dim, start, end, step)) or step != 1:
        return None
    dim = _dim(dim, len(sizes))
    axes = [i for i, p in enumerate(grad.placements) if p.is_shard() and p.dim == dim]
    if len(axes) != 1 or isinstance(grad.placements[axes[0]], compat.StridedShard):
        return None
    part, size = grad.tensor_meta.shape[dim], sizes[dim]
    start = start + size if start < 0 else start
    if part == 0 or size % part or size == part or start % part or min(end, size) - start != part:
        return None
    return axes[0], dim, start // part, size // part


def _slice_backward_spec(grad, sizes, found: tuple[int, int, int, int]):
    """The layout of the gradient :func:`_slice_backward_part` found: strided over its parts."""
    axis, dim, _, parts = found
    placements = list(grad.placements)
    placements[axis] = compat.StridedShard(dim, split_factor=parts)
    meta = compat.TensorMeta(torch.Size(sizes), _contiguous_stride(tuple(sizes)), grad.tensor_meta.dtype)
    return compat.DTensorSpec(grad.mesh, tuple(placements), tensor_meta=meta)


def _cat_rule(op, args_schema: tuple):
    parts = args_schema[0]
    if not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    if not all(isinstance(p, compat.DTensorSpec) and p.tensor_meta is not None for p in parts):
        return None
    first = parts[0]
    shape = tuple(first.tensor_meta.shape)
    dim = _dim(args_schema[1] if len(args_schema) > 1 else 0, len(shape))
    if any(tuple(p.tensor_meta.shape) != shape or p.placements != first.placements for p in parts):
        return None
    axes = [i for i, p in enumerate(first.placements) if p.is_shard() and p.dim == dim]
    if len(axes) != 1 or isinstance(first.placements[axes[0]], compat.StridedShard):
        return None
    axis = axes[0]
    if shape[dim] % first.mesh.size(axis):
        return None
    placements = list(first.placements)
    placements[axis] = compat.StridedShard(dim, split_factor=len(parts))
    out_shape = shape[:dim] + (shape[dim] * len(parts),) + shape[dim + 1:]
    meta = compat.TensorMeta(torch.Size(out_shape), _contiguous_stride(out_shape), first.tensor_meta.dtype)
    return compat.DTensorSpec(first.mesh, tuple(placements), tensor_meta=meta), None


def rule(op, args_schema: tuple, kwargs_schema: dict):
    """``(output_spec, None)`` for a split or cat this module decides (module docstring), else None."""
    if kwargs_schema:
        return None
    if op in SPLIT_OPS:
        return _split_rule(op, args_schema)
    if op in CAT_OPS:
        return _cat_rule(op, args_schema)
    if op in SLICE_OPS:
        found = _slice_part(args_schema)
        return None if found is None else (_slice_spec(args_schema[0], found), None)
    if op in SLICE_BACKWARD_OPS:
        found = _slice_backward_part(args_schema)
        return None if found is None else (_slice_backward_spec(args_schema[0], args_schema[1], found), None)
    return None


def local_kernel(op, args: tuple, layout):
    """For lowering: the local split or cat of a node :func:`rule` decided, else None. ``args`` are
    the node's arguments (the dim is read from them)."""
    if op in SPLIT_OPS and layout.inputs and isinstance(layout.output, tuple):
        if not all(isinstance(o, compat.DTensorSpec) for o in layout.output):
            return None
        decided = _split_rule(op, (layout.inputs[0], *args[1:]))
        if decided is None or any(d.placements != o.placements for d, o in zip(decided[0], layout.output)):
            return None
        dim = _dim(args[2] if len(args) > 2 else 0, len(layout.inputs[0].tensor_meta.shape))
        return functools.partial(_local_split, layout.output, dim)
    if op in CAT_OPS and isinstance(layout.output, compat.DTensorSpec) and layout.inputs:
        decided = _cat_rule(op, (list(layout.inputs), *args[1:]))
        if decided is None or decided[0].placements != layout.output.placements:
            return None
        dim = _dim(args[1] if len(args) > 1 else 0, len(layout.output.tensor_meta.shape))
        return functools.partial(_local_cat, layout.output, dim)
    if op in SLICE_OPS + SLICE_BACKWARD_OPS and isinstance(layout.output, compat.DTensorSpec) and layout.inputs:
        backward = op in SLICE_BACKWARD_OPS
        found = (_slice_backward_part if backward else _slice_part)((layout.inputs[0], *args[1:]))
        if found is None:
            return None
        spec = _slice_backward_spec(layout.inputs[0], args[1], found) if backward else _slice_spec(layout.inputs[0], found)
        if spec.placements != layout.output.placements:
            return None
        _, dim, index, parts = found
        return functools.partial(_local_part_backward if backward else _local_part, layout.output, dim, index, parts)
    return None


def _local_split(out_specs, dim: int, x, *_args, **_kwargs):
    local = compat.local_of(x)
    pieces = torch.chunk(local, len(out_specs), dim=dim)
    return tuple(compat.dtensor_from_spec(p, s) for p, s in zip(pieces, out_specs))


def _local_part(out_spec, dim: int, index: int, factor: int, x, *_args, **_kwargs):
    local = compat.local_of(x)
    return compat.dtensor_from_spec(torch.chunk(local, factor, dim=dim)[index], out_spec)


def _local_part_backward(out_spec, dim: int, index: int, parts: int, grad, *_args, **_kwargs):
    """This rank's gradient of its local parts: zeros, but ``grad``'s local shard in part ``index``."""
    local = compat.local_of(grad)
    pieces = [local if i == index else torch.zeros_like(local) for i in range(parts)]
    return compat.dtensor_from_spec(torch.cat(pieces, dim=dim), out_spec)


def _local_cat(out_spec, dim: int, parts, *_args, **_kwargs):
    local = torch.cat([compat.local_of(p) for p in parts], dim=dim)
    return compat.dtensor_from_spec(local, out_spec)
