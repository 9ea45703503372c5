"""A function of whole matrices applied to sharded DTensors: each matrix on one owner rank.

Muon orthogonalises every weight matrix's update with Newton–Schulz iterations, which multiply the
*whole* matrix by its transpose: a shard alone is not enough. A parallelized model's parameters are
DTensors split over the mesh (FSDP ``Shard(0)``, tensor-parallel ``Shard(0)``/``Shard(1)``, FSDP x TP
``_StridedShard(0)`` + ``Shard(0)``, replicated over HSDP's replicate axis ...). This module applies a
function ``fn`` to each full matrix and hands every rank back its own shard of the result.

The scheme, per step and per mesh:

1. Every sharded matrix gets an *owner*: a rank of the group that holds its shards (the ranks that
   differ only on the axes it is sharded over). Owners are assigned greedily, least-loaded first,
   by Newton–Schulz cost, so the work is spread evenly over the group. Every rank computes the same
   assignment from the shapes and placements alone: no communication.
2. One ``all_to_all_single`` over the mesh's ranks sends each rank's shards to their owners (uneven
   split sizes: any matrix shapes, uneven shards). Each owner places them into full matrices
   and runs ``fn`` on each whole matrix, once.
3. A second ``all_to_all_single`` sends each rank its slice of every result.

Why it is exact: the owner sees exactly the matrix one device would see and runs the same ``fn`` on
it; slicing and placing are copies. Why it is cheap: compared with every rank gathering every matrix
(``full_tensor()``, then computing redundantly), each matrix is computed once instead of N times, and
the bytes moved are N/2 times fewer: a matrix of B bytes sharded N ways costs (N-1)/N * B in each of
the two exchanges (together 2(N-1)/N * B, summed over ranks), where an all-gather costs (N-1) * B;
and it is two collectives per step for all matrices, not one or two per matrix. Replicated axes
(HSDP's replicate axis, a TP-replicated matrix) form separate groups that compute the same result
side by side, which needs no further communication.

Where every shard lives in the full matrix comes from the placements, applied left to right over the
mesh axes exactly as ``distribute_tensor`` slices a full tensor (each placement's own split,
``compat.split_by_placement``), for every rank of the group (not only this one), so the owner
needs no index messages; each rank checks that the shape this gives its own shard is its shard's.

Memory: an owner holds its matrices whole while it computes (about 1/N of the matrices, input and
result), and the send/receive buffers are the size of the rank's shards. All matrices of a mesh go
in one exchange; a model whose matrices do not fit that way would need buckets (not done here).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .. import compat

__all__ = ["Collective", "apply_to_whole_matrices", "shard_indices"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective this rank issued: ``kind`` (``"all_to_all_single"``), ``phase`` (``"gather"``:
    shards to their owners; ``"scatter"``: results back), the global ``ranks`` of its group, the
    payload ``dtype``, and the bytes this rank sent to / received from *other* ranks (its own part
    is a local copy)."""

    kind: str
    phase: str
    ranks: tuple[int, ...]
    dtype: torch.dtype
    send_bytes: int
    recv_bytes: int


def _is_shard(placement) -> bool:
    return isinstance(placement, (Shard, compat.StridedShard))


def shard_indices(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                  placements: Sequence) -> tuple[torch.Tensor, ...]:
    """For each tensor dim, the indices into the full tensor of the rank at ``coordinate``'s shard.

    Sharding splits each tensor dim independently, so a shard is the outer product of one index
    vector per dim. Each placement's own split (``torch.chunk`` semantics, ``_StridedShard``'s
    interleaving, through ``compat.split_by_placement``) is applied to the index vectors, mesh axis
    by mesh axis, as ``distribute_tensor`` applies it to the data."""
    indices = [torch.arange(size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(f"a parameter with placement {placement} has no whole matrix to orthogonalise")
        if not _is_shard(placement):
            continue
        dim = placement.dim % len(shape)
        as_dim = indices[dim].view([1] * dim + [-1])  # the vector along tensor dim ``dim``
        pieces = compat.split_by_placement(placement, as_dim, mesh_shape[mesh_dim])
        position = coordinate[mesh_dim]
        indices[dim] = pieces[position].reshape(-1) if position < len(pieces) else indices[dim][:0]
    return tuple(indices)


def _as_slice(index: torch.Tensor):
    """A contiguous index vector as a slice (plain slicing then), else the vector itself."""
    n = index.numel()
    if n == 0:
        return slice(0, 0)
    start = int(index[0])
    if int(index[-1]) - start == n - 1 and (n < 3 or bool((index.diff() == 1).all())):
        return slice(start, start + n)
    return index


def _take(full: torch.Tensor, rows, cols) -> torch.Tensor:
    out = full[rows] if isinstance(rows, slice) else full.index_select(0, rows)
    return out[:, cols] if isinstance(cols, slice) else out.index_select(1, cols)


def _put(full: torch.Tensor, rows, cols, value: torch.Tensor) -> None:
    if not isinstance(rows, slice) and not isinstance(cols, slice):
        rows, cols = rows[:, None], cols[None, :]
    full[rows, cols] = value


@dataclasses.dataclass
class _Matrix:
    """This rank's view of one sharded matrix: its group's ranks, owner, and (on the owner) where
    every member's shard lies in the full matrix."""

    shape: tuple[int, ...]
    members: tuple[int, ...]
    owner: int
    local_shape: tuple[int, ...]  # this rank's shard as the placements give it
    where: dict[int, tuple] = dataclasses.field(default_factory=dict)  # member -> (rows, cols)

    def numel_of(self, member: int) -> int:
        rows, cols = self.where[member]
        return _length(rows, self.shape[0]) * _length(cols, self.shape[1])


def _length(index, size: int) -> int:
    return len(range(size)[index]) if isinstance(index, slice) else index.numel()


def _on(index, device: torch.device):
    return index if isinstance(index, slice) else index.to(device)


def _ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton–Schulz step on a matrix of ``shape``: 2 m^2 n + m^3, m <= n."""
    m, n = sorted(shape)
    return 2 * m * m * n + m ** 3


def _assign(mesh, layouts: Sequence[tuple[tuple[int, ...], tuple]], device: torch.device) -> list[_Matrix]:
    """Groups and owners of every matrix, as every rank of the mesh computes them (same inputs,
    same greedy order, so the same answer everywhere); on the owner, where each member's shard
    lies (slices, or index vectors on ``device``)."""
    ranks = mesh.mesh
    me, my_coord = dist.get_rank(), mesh.get_coordinate()
    coord_of = {int(ranks[c]): c for c in itertools.product(*(range(s) for s in ranks.shape))}
    load = {r: 0 for r in coord_of}
    plan = []
    for shape, placements in layouts:
        sharded = [d for d, p in enumerate(placements) if _is_shard(p)]
        others = [d for d in range(ranks.ndim) if d not in sharded]
        mine = None
        for fixed in itertools.product(*(range(ranks.shape[d]) for d in others)):
            index = [slice(None)] * ranks.ndim
            for d, c in zip(others, fixed):
                index[d] = c
            members = tuple(int(r) for r in ranks[tuple(index)].reshape(-1).tolist())
            owner = min(members, key=lambda r: load[r])  # ties: the first in group order
            load[owner] += _ns_cost(shape)
            if me in members:
                local = shard_indices(shape, ranks.shape, my_coord, placements)
                mine = _Matrix(shape, members, owner, tuple(i.numel() for i in local))
        if mine.owner == me:
            for member in mine.members:
                rows, cols = shard_indices(shape, ranks.shape, coord_of[member], placements)
                mine.where[member] = tuple(_on(_as_slice(i), device) for i in (rows, cols))
        plan.append(mine)
    return plan


class WholeMatrixExchange:
    """Runs :func:`apply_to_whole_matrices`, caching per mesh its process group and per parameter
    layout list the owner assignment (both depend on shapes and placements only)."""

    def __init__(self) -> None:
        self._groups: dict = {}
        self._plans: dict = {}

    def group_of(self, mesh) -> tuple[object, tuple[int, ...]]:
        """A process group over all of ``mesh``'s ranks and its global ranks in group order."""
        if mesh not in self._groups:
            ranks = sorted(int(r) for r in mesh.mesh.reshape(-1).tolist())
            if mesh.ndim == 1:
                group = mesh.get_group(0)
            elif ranks == list(range(dist.get_world_size())):
                group = dist.group.WORLD
            else:  # a sub-mesh (e.g. one pipeline stage's): its axes flattened into one group
                names = tuple(mesh.mesh_dim_names)
                group = compat.flatten_mesh(mesh, names, "_".join(names)).get_group(0)
            self._groups[mesh] = (group, tuple(dist.get_process_group_ranks(group)))
        return self._groups[mesh]

    def plan(self, mesh, layouts, device: torch.device) -> list[_Matrix]:
        key = (mesh, tuple(layouts), device)
        if key not in self._plans:
            self._plans[key] = _assign(mesh, layouts, device)
        return self._plans[key]

    def __call__(self, params: Sequence[torch.Tensor], local_values: Sequence[torch.Tensor],
                 dtypes: Sequence[torch.dtype], fn: Callable[[int, torch.Tensor], torch.Tensor],
                 ) -> tuple[list[torch.Tensor], list[Collective]]:
        return apply_to_whole_matrices(params, local_values, dtypes, fn, exchange=self)


def apply_to_whole_matrices(
    params: Sequence[torch.Tensor],
    local_values: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    exchange: WholeMatrixExchange | None = None,
) -> tuple[list[torch.Tensor], list[Collective]]:
    """``fn(i, full_i)`` for every 2-D matrix ``i``, returned as this rank's shards.

    ``params[i]`` gives the layout (a DTensor's global shape, mesh and placements, or a plain
    tensor); ``local_values[i]`` is this rank's local shard of the input matrix, cast to
    ``dtypes[i]`` before it travels (``fn`` sees it in that dtype and must return that dtype and
    the full shape). All ranks of every mesh involved must call this with the same matrices in the
    same order. Returns the local result shards (in ``dtypes[i]``) and the collectives issued:
    two per (mesh, dtype) with a sharded matrix, none for plain or fully replicated ones.
    """
    exchange = exchange or WholeMatrixExchange()
    results: list[torch.Tensor | None] = [None] * len(params)
    buckets: dict[tuple, list[int]] = {}
    for i, (param, value) in enumerate(zip(params, local_values)):
        if param.dim() != 2:
            raise ValueError(f"whole-matrix functions take 2-D parameters, got shape {tuple(param.shape)}")
        if isinstance(param, DTensor) and any(_is_shard(p) for p in param.placements):
            buckets.setdefault((param.device_mesh, dtypes[i]), []).append(i)
            continue
        if isinstance(param, DTensor) and any(p.is_partial() for p in param.placements):
            raise ValueError(f"a parameter with placements {tuple(param.placements)} has no whole matrix")
        results[i] = fn(i, value.to(dtypes[i]))  # whole on this rank already
    records: list[Collective] = []
    for (mesh, dtype), members in buckets.items():
        records += _exchange(exchange, mesh, dtype, [params[i] for i in members],
                             [local_values[i] for i in members], members, fn, results)
    return results, records  # type: ignore[return-value]


def _exchange(exchange, mesh, dtype, params, values, positions, fn, results) -> list[Collective]:
    group, group_ranks = exchange.group_of(mesh)
    slot = {r: k for k, r in enumerate(group_ranks)}
    me = dist.get_rank()
    device = values[0].device
    plan = exchange.plan(mesh, [(tuple(p.shape), tuple(p.placements)) for p in params], device)
    for matrix, param, value in zip(plan, params, values):
        if tuple(value.shape) != matrix.local_shape:
            raise RuntimeError(
                f"a shard of shape {tuple(value.shape)} where placements {tuple(param.placements)} of a "
                f"{matrix.shape} matrix give {matrix.local_shape}: this torch slices DTensors differently"
            )

    # Gather: every local shard to its matrix's owner; owners receive their matrices' shards.
    send = [[] for _ in group_ranks]
    for matrix, value in zip(plan, values):
        send[slot[matrix.owner]].append(value.reshape(-1).to(dtype))
    owned = [(k, m) for k, m in enumerate(plan) if m.owner == me]
    recv_sizes = [sum(m.numel_of(src) for _, m in owned if src in m.members) for src in group_ranks]
    received = _all_to_all(send, recv_sizes, dtype, device, group)
    records = [_record("gather", group_ranks, dtype, send, recv_sizes, slot[me])]

    full = {k: torch.empty(m.shape, dtype=dtype, device=device) for k, m in owned}
    for src, chunk in zip(group_ranks, received):
        offset = 0
        for k, m in owned:
            if src in m.members:
                rows, cols = m.where[src]
                n = m.numel_of(src)
                shape = (_length(rows, m.shape[0]), _length(cols, m.shape[1]))
                _put(full[k], rows, cols, chunk[offset:offset + n].view(shape))
                offset += n
    done = {k: fn(positions[k], full[k]) for k, _ in owned}

    # Scatter: each member's slice of every result back from the owner.
    send = [[] for _ in group_ranks]
    for k, m in owned:
        for member in m.members:
            rows, cols = m.where[member]
            send[slot[member]].append(_take(done[k], rows, cols).reshape(-1))
    recv_sizes = [0] * len(group_ranks)
    for m, value in zip(plan, values):
        recv_sizes[slot[m.owner]] += value.numel()
    received = _all_to_all(send, recv_sizes, dtype, device, group)
    records.append(_record("scatter", group_ranks, dtype, send, recv_sizes, slot[me]))

    offsets = [0] * len(group_ranks)
    for k, (m, value) in enumerate(zip(plan, values)):
        src = slot[m.owner]
        n = value.numel()
        results[positions[k]] = received[src][offsets[src]:offsets[src] + n].view(value.shape)
        offsets[src] += n
    return records


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], dtype, device, group) -> list[torch.Tensor]:
    pieces = [t for chunks in send for t in chunks]
    flat_in = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    in_sizes = [sum(t.numel() for t in chunks) for chunks in send]
    flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, recv_sizes, in_sizes, group=group)
    return list(flat_out.split(recv_sizes))


def _record(phase, group_ranks, dtype, send, recv_sizes, mine) -> Collective:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sent = sum(t.numel() for k, chunks in enumerate(send) if k != mine for t in chunks)
    got = sum(n for k, n in enumerate(recv_sizes) if k != mine)
    return Collective("all_to_all_single", phase, tuple(group_ranks), dtype, sent * itemsize, got * itemsize)
