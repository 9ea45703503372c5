"""Alpha-beta time of a collective, with the link chosen by where the group's ranks sit.

A process group is described by an :class:`AxisInfo`: its size and the rank distance between
consecutive members (the product of the sizes of later dims in a row-major ``DeviceMesh``). Ranks
are assumed placed on nodes in order (ranks ``0..d-1`` on node 0 with ``d = devices_per_node``,
as torchrun and SLURM do), so a group whose members are at most ``d - 1`` apart is inside one node
and uses the intra-node link (NVLink, HCCS), any other group the inter-node one (InfiniBand,
RoCE) at the per-device NIC bandwidth. Hierarchical algorithms (NCCL's tree / NVLS, intra-node
reduce then inter-node ring) are not modelled: an inter-node ring is the conservative estimate.

Ring algorithm with ``n`` ranks and a buffer of ``B`` bytes (the full, unsharded size):
all-gather and reduce-scatter each send ``(n-1)/n * B`` per rank in ``n-1`` steps; all-reduce is a
reduce-scatter plus an all-gather, ``2(n-1)/n * B`` in ``2(n-1)`` steps; all-to-all sends
``(n-1)/n * B``; broadcast pipelines ``B`` through the ring in ``n-1`` steps; a send/recv (one
step of ring attention, cp/ring.py) sends ``B`` to one peer in one step. Time = steps x alpha +
bytes / (bandwidth x link efficiency).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Iterable, Mapping

import torch

from .. import compat
from ..distributed import host_reduce
from .hardware import HardwareProfile

__all__ = [
    "AxisInfo", "agreement_time", "axis_infos", "axis_table", "collective_time", "ring_volume", "group_name_of",
    "group_size_of", "unknown_axis",
]

log = logging.getLogger(__name__)

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


@dataclasses.dataclass(frozen=True)
class AxisInfo:
    """One communication group: ``size`` ranks, consecutive members ``stride`` ranks apart.

    ``span`` (default ``(size - 1) * stride``): the largest rank distance inside the group, for
    groups that are not evenly strided (a flattened mesh over non-adjacent axes). ``first``: the
    lowest global rank of the group (0 describes the group of rank 0; real groups from
    :func:`axis_infos` know theirs). ``span=None`` and ``stride=None`` together mean "placement
    unknown": treated as inter-node."""

    name: str
    size: int
    stride: int | None = 1
    span: int | None = None
    first: int = 0

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"axis {self.name!r}: size must be >= 1, got {self.size}")
        if self.span is None and self.stride is not None:
            object.__setattr__(self, "span", (self.size - 1) * self.stride)

    def is_intra_node(self, devices_per_node: int) -> bool:
        """All members on one node (the ranks-in-order placement described in the module doc):
        for the group of rank 0, ``(size - 1) * stride < devices_per_node``."""
        if self.span is None:
            return False
        return self.first // devices_per_node == (self.first + self.span) // devices_per_node


def ring_volume(kind: str, input_bytes: int, n: int) -> tuple[int, float]:
    """(ring steps, bytes each rank sends) for a collective whose LOCAL input is ``input_bytes``
    (as the graph holds it: the shard for all-gather, the full buffer for the others)."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    if n <= 1:
        return 0, 0.0
    full = input_bytes * n if kind == "all_gather" else input_bytes
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * full
    if kind == "broadcast":
        return n - 1, float(full)
    if kind == "send_recv":
        return 1, float(full)
    return n - 1, (n - 1) / n * full


def collective_time(kind: str, input_bytes: int, axis: AxisInfo, profile: HardwareProfile) -> float:
    """Seconds for one collective over ``axis`` on ``profile`` (alpha-beta ring model above)."""
    steps, moved = ring_volume(kind, input_bytes, axis.size)
    if steps == 0:
        return 0.0
    if axis.is_intra_node(profile.devices_per_node):
        bandwidth, latency = profile.intra_node_bandwidth, profile.intra_node_latency
    else:
        bandwidth, latency = profile.inter_node_bandwidth, profile.inter_node_latency
    return steps * latency + moved / (bandwidth * profile.link_efficiency)


def agreement_time(world_size: int, profile: HardwareProfile) -> float:
    """Seconds of the per-call agreement over ``world_size`` ranks (``distributed.spmd.agree``): a
    MAX all-reduce of 24 bytes by recursive doubling between the ranks' host processes, one
    host message latency per round (``host_reduce.rounds``: log2 of the world, 2 more when it is
    not a power of two). The bytes are too few to count."""
    return host_reduce.rounds(world_size) * profile.host_message_latency_s


def group_name_of(group) -> str:
    """A collective's group argument (a name, or a ProcessGroup) as its name."""
    return group if isinstance(group, str) else getattr(group, "group_name", str(group))


def axis_table(mesh_shape: Iterable[int], mesh_dim_names: Iterable[str]) -> dict[str, AxisInfo]:
    """AxisInfo per axis of a row-major mesh of ``mesh_shape`` with no process groups (simulated
    meshes): keyed by axis name. Map a program's group names to them with ``{group: table[axis]}``."""
    shape, names = tuple(mesh_shape), tuple(mesh_dim_names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and names {names} differ in length")
    return {name: AxisInfo(name, size, math.prod(shape[i + 1:])) for i, (size, name) in enumerate(zip(shape, names))}


def _from_ranks(name: str, ranks: list[int]) -> AxisInfo:
    ranks = sorted(ranks)
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    stride = steps.pop() if len(steps) == 1 else (1 if len(ranks) == 1 else None)
    return AxisInfo(name, len(ranks), stride, span=ranks[-1] - ranks[0], first=ranks[0])


def _group_ranks(group) -> list[int] | None:
    import torch.distributed as dist

    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # a group this rank is not in, or a backend that does not record ranks
        return None


def axis_infos(mesh, *extra_meshes, groups: Mapping[str, str] | None = None) -> dict[str, AxisInfo]:
    """``{process-group name: AxisInfo}`` for every dim of ``mesh`` (a ``DeviceMesh``) and of
    ``extra_meshes`` (e.g. an unflattened mesh a pass created), plus the meshes flattened from
    ``mesh``'s root (``DeviceMesh._flatten``: FSDP over ``dp_replicate x dp_shard``; an alias of a
    single axis is the same group and keeps that axis's name), plus
    ``groups`` (``{group name: label}``, e.g. ``debug.group_axis_names``' FSDP ``"<axis>/k<k>"``
    groups). Sizes and spans come from each group's actual global ranks, so any layout is exact.
    A group whose ranks cannot be read gets an AxisInfo of placement unknown (inter-node)."""
    out: dict[str, AxisInfo] = {}

    def add(group, label: str, size: int | None = None) -> None:
        name = group_name_of(group)
        ranks = _group_ranks(group)
        if ranks is not None:
            out[name] = _from_ranks(label, ranks)
        elif size is not None:
            log.debug("cost model: ranks of group %s (%s) unknown; treating it as inter-node", name, label)
            out[name] = AxisInfo(label, size, None)

    meshes = [mesh, *extra_meshes]
    flattened = list(compat.flattened_meshes(mesh).values())
    for k, m in enumerate(meshes + flattened):
        names = m.mesh_dim_names or tuple(str(i) for i in range(m.ndim))
        for i in range(m.ndim):
            group = m.get_group(i)
            if k >= len(meshes) and group_name_of(group) in out:
                continue  # an alias of one axis (ParallelDims' ``loss`` = ``cp``) is that axis's group
            add(group, names[i], m.size(i))
    for name, label in (groups or {}).items():
        group = None if name in out else compat.resolve_process_group(name)
        if group is not None:
            add(group, label, group.size())
        elif name not in out:
            log.debug("cost model: group %s (%s) unknown; treating it as inter-node", name, label)
    return out


def unknown_axis(group: str, size: int) -> AxisInfo:
    """AxisInfo for a group missing from the caller's table: inter-node (the conservative guess)."""
    return AxisInfo(group, size, None)


def group_size_of(node: torch.fx.Node) -> int | None:
    """The group size a collective node states in its arguments (all-gather / reduce-scatter), or None."""
    name = str(node.target)
    if "all_gather_into_tensor" in name:
        return int(node.args[1])
    if "reduce_scatter_tensor" in name:
        return int(node.args[2])
    return None
