"""Reduction lanes: a second gloo process group over the ranks of each data-parallel mesh axis,
on which the program's gradient reductions run (``passes/reduction_lanes.py``).

Why. ProcessGroupGloo executes a group's queued collectives on two worker threads, and two of them
executing at once on one group corrupt memory now and then, so a compiled program keeps one
collective in flight per gloo group: the main thread waits for a group's previous collective before
it issues the next (``passes/serialize_collectives.py``). FSDP's backward wants two in flight at
once, the next unit's all-gather (prefetch) and the last unit's reduce-scatter: on one group the
main thread then waits for one of them at every unit. A lane is another group over the same ranks;
gradient reductions move there and gathers stay on the axis's own group, each group still one
collective at a time, so the gather and the reduction overlap each other and the compute. NCCL and
HCCL order a group's collectives on its stream (nothing to do), and simulated meshes (the ``fake``
backend: ``explain``, the pass tests) get none.

Creating a process group is collective, so :func:`attach_reduction_lanes` runs in plan resolution,
which every rank runs. A lane is made once per process for each layout of ranks (the groups of an
axis over the whole world, gathered from every rank, so every rank decides alike) and reused by
later meshes with that layout, as long as it is still registered (a process group torn down and
initialised again gets new lanes).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .. import compat

log = logging.getLogger(__name__)

_LANED_BACKENDS = ("gloo",)

# (backend, the axis's groups as tuples of global ranks) -> (lane ProcessGroup, its name) for this rank
_LANES: dict[tuple, tuple] = {}


def attach_reduction_lanes(mesh, axes) -> dict[str, str]:
    """``{name of this rank's group of axis: name of its lane}`` for each axis of ``axes`` (mesh axis
    names) whose group runs on gloo and has more than one rank; creates lanes not made yet.
    Collective over the world (as parallelize is): every rank calls it with the same ``axes``."""
    if not dist.is_initialized() or mesh is None:
        return {}
    names = tuple(mesh.mesh_dim_names or ())
    out: dict[str, str] = {}
    for axis in dict.fromkeys(axes):  # in order, once each
        if axis not in names:
            continue
        i = names.index(axis)
        n = mesh.size(i)
        group = mesh.get_group(i)
        backend = dist.get_backend(group)
        if n == 1 or backend not in _LANED_BACKENDS:
            continue
        rows = _axis_groups(group)
        key = (backend, rows)
        cached = _LANES.get(key)
        if cached is None or compat.resolve_process_group(cached[1]) is not cached[0]:
            cached = _LANES[key] = _new_lane(rows, backend)
            log.debug("reduction lane for %s (ranks %s): process group %s", axis, rows, cached[1])
        out[group.group_name] = cached[1]
    return out


def _axis_groups(group) -> tuple:
    """The ranks of every group of an axis over the whole world, sorted: each rank contributes its
    own group's (a pipeline stage's mesh, a sliced or flattened mesh knows only its own part), so
    every rank gets the same tuple and creates the same groups in the same order."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(dist.get_process_group_ranks(group)))
    return tuple(sorted(set(everyone)))


def _new_lane(rows: tuple, backend: str) -> tuple:
    """A new group for each of ``rows`` (every rank creates all of them, in order, as
    ``new_group`` requires); this rank's with its name. A fresh group, never the axis's own: a
    mesh's group spanning the world is the default group, which ``DeviceMesh`` reuses."""
    mine = None
    for ranks in rows:
        group = dist.new_group(list(ranks), backend=backend)
        if dist.get_rank() in ranks:
            mine = (group, group.group_name)
    return mine


def known_lanes(mesh) -> dict[str, str]:
    """The lanes made so far for ``mesh``'s axes, ``{group name: lane name}``, without creating any
    (not collective): what labels a lane's collectives with its axis in summaries and errors."""
    if not dist.is_initialized() or mesh is None or not mesh.mesh_dim_names:
        return {}
    out = {}
    for i in range(mesh.ndim):
        group = mesh.get_group(i)
        backend, mine = dist.get_backend(group), tuple(dist.get_process_group_ranks(group))
        # the axis's layout is not known here without a collective: any made for this rank's group
        for (lane_backend, rows), cached in _LANES.items():
            if (lane_backend == backend and mine in rows
                    and compat.resolve_process_group(cached[1]) is cached[0]):
                out[group.group_name] = cached[1]
    return out
