"""``distribute_parameters``: every parameter and buffer of a model replaced by a DTensor shard.

Real tensors are split as ``distribute_tensor`` does; meta tensors are materialised by the replay
(:mod:`.replay`) after checking that every meta module can be initialised and that the ranks'
generator states agree.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .arena import _arena_bytes
from .replay import _Replay
from .schedule import _check_initialisable, _schedule
from .sharding import _distribute_real, _install, _shard_without_data, _wrap
from .tensors import InitStats, _collect, _direct_tensors, _nbytes, _resolve_placements

log = logging.getLogger("hyper_parallel.init")  # the package's logger, as before the split


def _check_rng_consistent(mesh) -> None:
    if not (dist.is_available() and dist.is_initialized()) or mesh is None:
        return
    state = torch.get_rng_state()
    digest = hashlib.sha1(bytes(state.tolist())).hexdigest()[:16]
    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        if dist.get_world_size(group) == 1:
            continue
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digest, group=group)
        if len(set(gathered)) > 1:
            names = mesh.mesh_dim_names or ()
            axis_name = names[axis] if axis < len(names) else axis
            raise ValueError(
                "distribute_parameters: the model has parameters on the meta device, which every "
                "rank initialises by replaying the constructor's random draws, but the ranks' CPU "
                f"generator states differ along mesh axis {axis_name!r} ({gathered}); call "
                "hp.manual_seed(seed) with the same seed on every rank right before building or "
                "parallelizing the model (and draw nothing rank-dependent from the global RNG in "
                "between)."
            )


def distribute_parameters(
    model: nn.Module,
    param_placements: dict[str, tuple],
    mesh,
    *,
    stats: Optional[InitStats] = None,
    materialize: bool = True,
) -> None:
    """Replace every parameter and buffer of ``model`` (in place) by a DTensor on ``mesh``.

    ``param_placements`` maps each parameter/buffer FQN (tied aliases may be listed or not) to one
    torch placement per mesh axis (``Replicate()``, ``Shard(d)``, ``_StridedShard(d, split_factor=k)``).
    Parameters stay ``nn.Parameter`` (same ``requires_grad``); buffers keep their persistence. A
    tensor registered under several FQNs (tied weights) becomes one DTensor Parameter object under
    all of them.

    * Real tensors are distributed as ``distribute_tensor(t, mesh, placements)`` (rank 0's values
      are the source, as in torch).
    * Meta tensors (a model built under :func:`init_empty_weights`) are initialised by replaying
      the model's construction module by module and split locally, so each rank only ever holds its
      shards plus one module's full tensors; the values equal the single-device model built from
      the same generator state (see the module docstring for the replay and its assumptions).

    Raises ``ValueError`` naming the parameter/module and a fix when a FQN has no placements, tied
    aliases disagree, a meta module cannot be initialised (no ``reset_parameters()`` and no init
    hook, or an initialiser leaves a tensor unset), or the ranks' generator states differ. On error
    the model is left as it was. ``stats``, if given, is filled with the bytes this call held.

    ``materialize=False`` (planning, ``hyper_parallel.tools.explain``): meta tensors stay on the meta
    device; each becomes a DTensor whose local tensor is its meta shard (right shapes, dtypes and
    placements, no memory, no initialisation, no communication). Real tensors are split locally.
    """
    stats = stats if stats is not None else InitStats()
    entries, modules = _collect(model)
    for entry in entries:
        entry.placements = _resolve_placements(entry, param_placements)
    if not materialize:
        local_shapes: dict = {}
        for entry in entries:
            entry.result = _wrap(entry, _shard_without_data(entry.tensor, entry.placements, mesh, local_shapes))
            _install(entry)
        return
    stats.total_bytes = sum(_nbytes(e.tensor) for e in entries)
    stats.largest_tensor_bytes = max((_nbytes(e.tensor) for e in entries), default=0)
    stats.largest_module_bytes = max((_arena_bytes(_direct_tensors(m)) for _, m in modules), default=0)
    if not any(e.tensor.is_meta for e in entries):
        for entry in entries:
            entry.result = _distribute_real(entry, mesh, stats)
            _install(entry)
        stats.final_bytes = stats.current_bytes
        return
    schedule = _schedule(model, modules)
    stats.init_hook = schedule.hook_name
    _check_initialisable(schedule)
    _check_rng_consistent(mesh)
    replay = _Replay(entries, schedule, mesh, stats)
    done = False
    try:
        replay.run()
        done = True
    finally:
        if not done:
            for entry in entries:
                entry.set_slots(entry.tensor)
    for entry in entries:
        _install(entry)
    stats.final_bytes = stats.current_bytes
    log.debug(
        "distribute_parameters: %d materialised, %d replayed, %d real, peak %.1f MB, final %.1f MB",
        stats.num_materialised, stats.num_replayed, stats.num_real,
        stats.peak_bytes / 2**20, stats.final_bytes / 2**20,
    )
