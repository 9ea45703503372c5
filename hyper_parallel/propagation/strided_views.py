"""Our rule for un-flattening a dim that two mesh axes shard (batch over dp, sequence over cp).

Context parallelism flattens ``[batch, sequence, hidden]`` to ``[batch * sequence, hidden]`` around
every linear layer (and back). DTensor's view rule describes the flattened dim as ``Shard(0)`` over
the data-parallel axis and ``_StridedShard(0, split_factor=b)`` over cp, ``b`` the batch rows left
after the data-parallel split. Going back to ``[batch, sequence, ...]`` it refuses some of these
(torch 2.13): with one row per data-parallel rank and more cp ranks than rows in the whole batch
(``dp=2, cp=4``, local batch 1), "This operation would remove or reshape sharded dimension 0". That
is the common long-context configuration, so this module decides such views itself:

Reading the mesh axes left to right (DTensor's order), with ``b`` batch rows and ``s`` sequence
positions still whole at each step, an axis of ``n`` ranks that shards the flattened dim with

* ``Shard``: splits the batch rows when ``n`` divides ``b`` (then ``Shard(batch dim)``), or the
  sequence when one row is left (``Shard(sequence dim)``);
* ``_StridedShard(split_factor=b)``: splits every row's sequence (``Shard(sequence dim)``).

Anything else is left to DTensor's error. Lowering computes such a view on the local shard
(:func:`local_kernel`): the local result is the local input viewed to the output's local shape.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import Shard

from .. import compat

aten = torch.ops.aten

VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _split_dims(in_shape: tuple, out_shape: tuple) -> tuple[int, int] | None:
    """``(d, k)`` when the view turns input dim ``d`` into output dims ``k`` and ``k + 1`` and keeps
    every other dim; else None."""
    if len(out_shape) != len(in_shape) + 1:
        return None
    for d in range(len(in_shape)):
        if (in_shape[:d] == out_shape[:d] and in_shape[d + 1:] == out_shape[d + 2:]
                and out_shape[d] * out_shape[d + 1] == in_shape[d]):
            return d, d
    return None


def unflatten_placements(spec, out_shape: tuple):
    """The output placements of viewing ``spec`` (a DTensorSpec) to ``out_shape`` when it splits
    one dim into (rows, positions) as described in the module docstring, else None."""
    in_shape = tuple(spec.tensor_meta.shape)
    found = _split_dims(in_shape, tuple(out_shape))
    if found is None:
        return None
    d, k = found
    rows, positions = out_shape[k], out_shape[k + 1]
    placements = []
    for axis, p in enumerate(spec.placements):
        n = spec.mesh.size(axis)
        if isinstance(p, compat.StridedShard) and p.dim == d:
            if p.split_factor != rows or positions % n:
                return None
            placements.append(Shard(k + 1))
            positions //= n
        elif isinstance(p, Shard) and p.dim == d:
            if rows % n == 0 and rows > 1:
                placements.append(Shard(k))
                rows //= n
            elif rows == 1 and positions % n == 0:
                placements.append(Shard(k + 1))
                positions //= n
            else:
                return None
        elif isinstance(p, (Shard, compat.StridedShard)):
            if isinstance(p, compat.StridedShard):
                return None
            placements.append(Shard(p.dim + (1 if p.dim > d else 0)))
        else:
            placements.append(p)
    return tuple(placements)


def _out_shape(args_schema) -> tuple | None:
    spec, shape = args_schema[0], args_schema[1]
    shape = list(shape)
    if any(not isinstance(s, int) for s in shape):
        return None
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = math.prod(spec.tensor_meta.shape) // known
    return tuple(shape)


def unflatten_rule(op, args_schema: tuple):
    """``(output_spec, None)`` for a view this module decides, else None."""
    if op not in VIEW_OPS or len(args_schema) != 2 or not isinstance(args_schema[0], compat.DTensorSpec):
        return None
    spec = args_schema[0]
    if not any(isinstance(p, compat.StridedShard) for p in spec.placements):
        return None
    out_shape = _out_shape(args_schema)
    placements = unflatten_placements(spec, out_shape) if out_shape is not None else None
    if placements is None:
        return None
    meta = spec.tensor_meta
    stride = tuple(math.prod(out_shape[i + 1:]) for i in range(len(out_shape)))
    out = compat.respec(spec, placements, tensor_meta=compat.TensorMeta(torch.Size(out_shape), stride, meta.dtype))
    return out, None


def _dtensor_refuses(op, spec, shape) -> bool:
    schema = compat.OpSchema(op, (spec, shape), {})
    try:
        compat.sharding_propagator().propagate_op_sharding(schema)
    except (RuntimeError, AssertionError, ValueError):
        return True
    return False


def local_kernel(op, layout):
    """For lowering: the local view for a node :func:`unflatten_rule` decided, else None."""
    if op not in VIEW_OPS or not layout.inputs or not isinstance(layout.output, compat.DTensorSpec):
        return None
    spec = layout.inputs[0]
    if not any(isinstance(p, compat.StridedShard) for p in spec.placements):
        return None
    out = layout.output
    if unflatten_placements(spec, tuple(out.tensor_meta.shape)) != tuple(out.placements):
        return None
    if not _dtensor_refuses(op, spec, list(out.tensor_meta.shape)):
        return None
    return functools.partial(_local_view, op, out)


def _local_view(op, out_spec, x, shape):
    # The local input keeps every other dim; the split dim becomes its two local sizes (integers
    # from the placements: DTensor's own helper would trace the mesh coordinate into the graph).
    local = compat.local_of(x)
    d, k = _split_dims(tuple(compat.spec_of(x).tensor_meta.shape), tuple(out_spec.tensor_meta.shape))
    sizes = [out_spec.tensor_meta.shape[k], out_spec.tensor_meta.shape[k + 1]]
    for axis, p in enumerate(out_spec.placements):
        if isinstance(p, Shard) and p.dim in (k, k + 1):
            sizes[p.dim - k] //= out_spec.mesh.size(axis)
    local_shape = [*local.shape[:d], *sizes, *local.shape[d + 1:]]
    return compat.dtensor_from_spec(op(local, local_shape), out_spec)
