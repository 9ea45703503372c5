"""Process-group helpers of the reference API, as thin wrappers over ``torch.distributed``.

Each function is the ``torch.distributed`` call its docstring names, plus argument checks with the
fix in the message. What is added: :func:`init_process_group` picks the backend from
:func:`hyper_parallel.distributed.platform.get_platform` and checks that a launcher started the process;
:func:`split_group` builds subgroups with ``torch.distributed.new_group`` and keeps them in a cache
keyed by their ranks, so that it hands back a group that already exists (one it created, or one
registered with :func:`mark_created_groups`) instead of creating a duplicate;
:func:`destroy_process_group` drops destroyed groups from that cache.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .platform import get_platform

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "get_process_group_ranks",
    "get_backend",
    "split_group",
    "get_group_local_rank",
    "mark_created_groups",
]

# Sorted global ranks -> the group over exactly those ranks (this process is a member of each).
_CREATED_GROUPS: dict[tuple[int, ...], Any] = {}


def _launch_hint(world_size: int) -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    n = world_size if world_size > 0 else os.environ.get("WORLD_SIZE", "N")
    return f"torchrun --nproc-per-node {n} {script}"


def init_process_group(
    backend: str | None = None,
    *,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    device_id: Any = None,
    **kwargs: Any,
) -> None:
    """``torch.distributed.init_process_group`` with the backend defaulted from the platform.

    ``backend=None`` uses ``get_platform().backend`` (gloo on CPU, nccl on CUDA, hccl on NPU);
    on an accelerator the process first moves to the device of its ``LOCAL_RANK``. Without
    ``init_method``/``store`` the rank and world size come from the launcher's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun sets them); when
    they are missing this raises ValueError with the torchrun command line instead of torch's
    error. Calling it when the default group already exists is a RuntimeError.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend must be a string such as 'gloo', 'nccl' or 'hccl' (or None to use the "
            f"platform's), got {type(backend).__name__} {backend!r}"
        )
    if dist.is_initialized():
        raise RuntimeError(
            f"the default process group already exists (backend {dist.get_backend()}, world size "
            f"{dist.get_world_size()}): call hp.init_process_group() once per process, or "
            "hp.destroy_process_group() first"
        )
    if init_method in (None, "env://") and store is None:
        missing = [name for name, given in (("RANK", rank), ("WORLD_SIZE", world_size))
                   if given < 0 and name not in os.environ]
        if missing:
            raise ValueError(
                f"hp.init_process_group() starts one process per rank, but this process was not "
                f"started by a launcher ({' and '.join(missing)} not set: run with plain "
                f"python?). Launch it as `{_launch_hint(world_size)}`, or pass rank=, "
                "world_size= and init_method= (or store=)"
            )
    platform = get_platform()
    if backend is None:
        backend = platform.backend
    if platform.is_accelerator and device_id is None:
        platform.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank,
        store=store, device_id=device_id, **kwargs,
    )


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group(group)``: ``None`` destroys every group, the
    default one included. The destroyed groups are also forgotten by :func:`split_group`."""
    if group is None:
        _CREATED_GROUPS.clear()
    else:
        for key in [k for k, g in _CREATED_GROUPS.items() if g is group]:
            del _CREATED_GROUPS[key]
    dist.destroy_process_group(group)


def get_process_group_ranks(group: Any = None) -> list[int]:
    """``torch.distributed.get_process_group_ranks``: the global ranks of ``group`` (default: the
    world), in group-rank order."""
    return dist.get_process_group_ranks(group)


def get_backend(group: Any = None) -> str:
    """``torch.distributed.get_backend`` as a plain string (``"gloo"``, ``"nccl"`` ...) for
    ``group`` (default: the world)."""
    return str(dist.get_backend(group))


def get_group_local_rank(group: Any = None) -> int:
    """``torch.distributed.get_rank(group)``: this process's rank inside ``group`` (default: the
    world). Where torch returns -1 for a process outside the group, this raises ValueError."""
    local = dist.get_rank(group)
    if local < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the group; ask "
            "get_group_local_rank only for a group this process belongs to (split_group returns "
            "None on the ranks outside every split)"
        )
    return local


def _is_live(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def mark_created_groups(groups: Any) -> None:
    """Register groups created elsewhere (``dist.new_group``, a ``DeviceMesh``'s dimension groups
    ...) so that :func:`split_group` returns them instead of creating a group over the same ranks.

    ``groups`` is a ``ProcessGroup`` or a list of them, each one this process belongs to. Local (no
    communication): split_group reuses a group only when every member registered it, and creates
    it anew otherwise, so call this on every member of each group.
    """
    items = groups if isinstance(groups, (list, tuple)) else [groups]
    for group in items:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"mark_created_groups takes a ProcessGroup or a list of them, got "
                f"{type(group).__name__} {group!r} (on ranks outside a group, new_group returns "
                "a placeholder that cannot be registered: register only your own groups)"
            )
        if not _is_live(group):
            raise ValueError(
                f"mark_created_groups: {group!r} is not a live process group (it was destroyed); "
                "register groups right after creating them"
            )
        _CREATED_GROUPS[tuple(sorted(dist.get_process_group_ranks(group)))] = group


def _split_ranks(split_size: Any, split_ranks: Any, parent: Sequence[int]) -> list[list[int]]:
    """Check the split arguments against ``parent`` (its global ranks) and return the splits as
    lists of parent-group ranks."""
    parent_size = len(parent)
    if (split_size is None) == (split_ranks is None):
        raise ValueError(
            "split_group needs exactly one of split_size (ranks per subgroup, e.g. 2) or "
            "split_ranks (parent-group ranks per subgroup, e.g. [[0, 1], [2, 3]]), got "
            f"split_size={split_size!r}, split_ranks={split_ranks!r}"
        )
    if split_size is not None:
        if isinstance(split_size, bool) or not isinstance(split_size, int):
            raise TypeError(f"split_size must be an int, got {type(split_size).__name__}")
        if split_size < 1 or parent_size % split_size:
            raise ValueError(
                f"split_size={split_size} must be a positive divisor of the size of the parent "
                f"group {list(parent)} ({parent_size}); use split_ranks for uneven subgroups"
            )
        return [list(range(s, s + split_size)) for s in range(0, parent_size, split_size)]
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks or not all(
        isinstance(s, (list, tuple)) and s for s in split_ranks
    ):
        raise TypeError(
            "split_ranks must be a non-empty list of non-empty lists of parent-group ranks, "
            f"e.g. [[0, 1], [2, 3]], got {split_ranks!r}"
        )
    seen: set[int] = set()
    for split in split_ranks:
        for r in split:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"split_ranks holds {r!r}; ranks must be ints")
            if not 0 <= r < parent_size:
                raise ValueError(
                    f"split_ranks rank {r} is outside the parent group {list(parent)} (group ranks "
                    f"0..{parent_size - 1}); split_ranks are ranks within the parent group, not "
                    "global ranks"
                )
            if r in seen:
                raise ValueError(f"split_ranks {split_ranks!r} lists rank {r} twice: splits must "
                                 "not overlap")
            seen.add(r)
    return [list(s) for s in split_ranks]


def _exchange_device() -> torch.device:
    # gloo (alone or as "cpu:gloo,...") all-gathers CPU tensors; nccl/hccl need their device.
    if "gloo" in get_backend():
        return torch.device("cpu")
    return get_platform().current_device()


def _gather_parents(group: Any, split_size: Any, split_ranks: Any) -> list[list[int]]:
    """All-gather over the world one row per rank: [flag, parent's global ranks, -1 padding].

    flag is 1 when this rank's own subgroup is registered and live, 0 when not, -1 when ``group``
    is unusable here (destroyed, or this rank is not in it); checked after the exchange so that all
    ranks raise together instead of leaving the others waiting."""
    world, me = dist.get_world_size(), dist.get_rank()
    try:
        parent = dist.get_process_group_ranks(group)
    except KeyError:
        parent = []
    flag = -1
    if me in parent:
        flag = 0
        try:
            splits = _split_ranks(split_size, split_ranks, parent)
        except (TypeError, ValueError):
            splits = []  # raised on every rank after the exchange
        for split in splits:
            key = tuple(sorted(parent[r] for r in split))
            if me in key and key in _CREATED_GROUPS and _is_live(_CREATED_GROUPS[key]):
                flag = 1
    row = torch.full((world + 1,), -1, dtype=torch.int64, device=_exchange_device())
    row[0] = flag
    if flag >= 0:
        row[1 : len(parent) + 1] = torch.tensor(parent, dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return [r.tolist() for r in rows]


def split_group(
    group: Any = None,
    split_size: int | Sequence[Sequence[int]] | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    *,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> Any:
    """Split ``group`` (default: the world) into subgroups and return the one this rank is in.

    Give ``split_size`` (consecutive subgroups of that many ranks) or ``split_ranks`` (the ranks of
    each subgroup, numbered within the parent group as in ``torch.distributed.split_group``); a
    list passed as ``split_size`` is taken as ``split_ranks``. Returns None on a rank that no
    split lists. A subgroup over the same ranks as one this function created before, or one
    registered with :func:`mark_created_groups` on all its members, is returned again rather than
    re-created.

    Collective over the whole job, like ``torch.distributed.new_group``: every rank calls it with
    the same split arguments, each passing the group it belongs to. Disjoint parents are split
    side by side: ``split_group(dp_group, 1)`` on every rank splits each data-parallel group.
    One all-gather of the parents' ranks comes first; then every rank makes the same
    ``torch.distributed.new_group`` calls for the subgroups that do not exist yet. Not
    ``dist.split_group``: in torch 2.13 it supports only NCCL (it raises on gloo) and names its
    groups in a way that can collide once a group is destroyed and split again.
    """
    if isinstance(split_size, (list, tuple)) and split_ranks is None:
        split_size, split_ranks = None, split_size
    me = dist.get_rank()
    rows = _gather_parents(group, split_size, split_ranks)
    bad = [r for r, row in enumerate(rows) if row[0] < 0]
    if bad:
        raise ValueError(
            f"split_group: on global ranks {bad} the parent group is not a live group the rank "
            "belongs to (destroyed, or torch's non-member placeholder); every rank must pass a "
            "group it is a member of (or None for the world)"
        )
    parents: list[tuple[int, ...]] = []
    for row in rows:
        parent = tuple(r for r in row[1:] if r >= 0)
        if parent not in parents:
            parents.append(parent)
    seen = [r for parent in parents for r in parent]
    if len(seen) != len(set(seen)):
        raise ValueError(
            f"split_group: the ranks passed overlapping parent groups {[list(p) for p in parents]}"
            "; the parents split side by side must be disjoint (each rank passes its own group "
            "of one partition, e.g. its data-parallel group)"
        )
    mine = None
    for parent in parents:
        for split in _split_ranks(split_size, split_ranks, parent):
            ranks = tuple(sorted(parent[r] for r in split))
            if all(rows[r][0] == 1 for r in ranks):
                new = _CREATED_GROUPS.get(ranks)  # every member has it: nobody creates it
            else:
                new = dist.new_group(
                    list(ranks), timeout=timeout, pg_options=pg_options, group_desc=group_desc
                )
                if me in ranks:
                    _CREATED_GROUPS[ranks] = new
            if me in ranks:
                mine = new
    return mine
