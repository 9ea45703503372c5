"""SPMD consistency check: every rank must run the same collectives in the same order.

At compile time the ranks exchange a hash of their collective sequence (kind, mesh axis, dtype,
local shape, per program). A mismatch would hang or corrupt a real run; here it is a ValueError on
every rank that names the first collective that differs, with the joint-graph node it serves.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from .debug import Collective


def sequence_hash(programs: dict[str, list[Collective]]) -> str:
    text = "\n".join(f"{name}: {c.signature()}" for name, colls in programs.items() for c in colls)
    return hashlib.sha256(text.encode()).hexdigest()


def check_spmd(programs: dict[str, list[Collective]], group=None) -> str:
    """Exchange hashes over ``group`` (default: world); raise ValueError on any difference."""
    digest = sequence_hash(programs)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return digest
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return digest
    # Rare path: gather the full sequences so every rank can say exactly what differs.
    mine = {name: [(c.signature(), c.source) for c in colls] for name, colls in programs.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    raise ValueError(_first_difference(everyone))


def _first_difference(everyone: list[dict]) -> str:
    ref = everyone[0]
    for rank, seqs in enumerate(everyone[1:], start=1):
        for name in ref:
            a, b = ref[name], seqs.get(name, [])
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else ("<none>", "")
                y = b[i] if i < len(b) else ("<none>", "")
                if x[0] != y[0]:
                    return (
                        f"SPMD check failed: collective #{i} of the {name} program differs between "
                        f"rank 0 ({x[0]} for node '{x[1]}') and rank {rank} ({y[0]} for node '{y[1]}'). "
                        "All ranks must compile the same program: pass inputs with the same shapes and "
                        "dtypes on every rank and the same plan; running it would hang."
                    )
    return "SPMD check failed: collective sequences differ between ranks"


def check_spmd_on_mesh(programs: dict[str, list[Collective]], mesh) -> str:
    """:func:`check_spmd` among the ranks of ``mesh``, which may be a sub-mesh of the world (a
    pipeline stage's): over the world when the mesh spans it, else along each mesh axis in turn
    (ranks that agree along every axis line agree everywhere on the mesh)."""
    if not dist.is_initialized() or mesh.size() == dist.get_world_size():
        return check_spmd(programs)
    digest = sequence_hash(programs)
    for axis in range(mesh.ndim):
        check_spmd(programs, group=mesh.get_group(axis))
    return digest

