"""Random ops (dropout) on values replicated over a mesh axis draw the same numbers on every rank.

A compiled program's random ops draw from the default generator of the mesh's device on each rank,
as the model's eager code would. A value *replicated* over a mesh axis (GPT-2's residual dropout
under tensor parallelism, after the row-parallel all-reduce) is computed by every rank of that axis
and must come out the same on all of them; when the ranks' generators differ (each rank seeded
with ``torch.manual_seed(seed + rank)``, or a rank drew numbers its peers did not), each rank drops
other elements and the ranks silently train on different activations.

So before a forward whose random ops have a replicated output, the ranks of each such axis compare
a digest of their generator states (one small all-gather per axis), and when they differ every rank
draws from the state of the axis's first rank for that forward, as DTensor's random ops and
Megatron's model-parallel RNG tracker share one seed over the ranks of a replicated region. A rank
that borrowed a state gets its own back afterwards, so its own stream is left as it was (its own
random calls outside the model are the caller's). Ranks whose generators agree (the same seed on
every rank, the usual setup) run as they are: the program draws what one device would draw for
replicated values, exactly.

Random ops whose outputs are sharded on an axis (batch rows on ``dp``, heads on ``tp``) draw per
rank and need no agreement; with equal seeds the shards draw alike, as under DDP with one seed on
every rank. Backward draws nothing: random ops are never recomputed (recompute.RANDOM_OPS)."""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from ..ir import meta
from ..ir.ops import draws_random_numbers


def replicated_random_axes(gm: torch.fx.GraphModule, mesh) -> tuple[str, ...]:
    """The mesh axes (by name, in mesh order) over which some random op of ``gm`` has an output
    that is not sharded. A random node without a layout counts as replicated on every axis."""
    names = tuple(mesh.mesh_dim_names or (str(i) for i in range(mesh.ndim)))
    axes: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not draws_random_numbers(node):
            continue
        layout = node.meta.get(meta.LAYOUT)
        spec = getattr(layout, "output", None)
        if isinstance(spec, (tuple, list)):
            spec = next((s for s in spec if s is not None), None)
        placements = getattr(spec, "placements", None)
        if placements is None:
            axes.update(range(mesh.ndim))
            continue
        axes.update(i for i, p in enumerate(placements) if not p.is_shard())
    return tuple(names[i] for i in sorted(axes) if mesh.size(i) > 1)


def _generator_state(device_type: str) -> torch.Tensor:
    if device_type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device_type).get_rng_state()


def _set_generator_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device_type).set_rng_state(state)


def _digest(state: torch.Tensor) -> int:
    return int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "big") >> 1


def shared_generator_state(mesh, axes: tuple[str, ...]) -> torch.Tensor | None:
    """The generator state every rank of ``axes`` must draw from, or None when this rank's own
    state is it already (the ranks of every axis agree, the usual case). Along each axis in turn the
    ranks all-gather a digest of their states; where they differ, the axis's first rank broadcasts
    its state. Every rank of the mesh calls this with the same ``axes`` (they come from the
    program, which the ranks agreed on)."""
    device_type = mesh.device_type
    own = _generator_state(device_type)
    state = own
    for axis in axes:
        group = mesh.get_group(axis)
        on_device = dist.get_backend(group) != "gloo" and device_type != "cpu"
        mine = torch.tensor([_digest(state)], dtype=torch.int64)
        mine = mine.to(device_type) if on_device else mine
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        if len({int(t) for t in everyone}) == 1:
            continue
        if dist.get_group_rank(group, dist.get_rank()) == 0:  # the source keeps drawing from its own
            dist.broadcast(state.to(device_type) if on_device else state.clone(), group_src=0, group=group)
            continue
        buffer = state.clone().to(device_type) if on_device else state.clone()
        dist.broadcast(buffer, group_src=0, group=group)
        state = buffer.cpu()
    return None if state is own else state


@contextlib.contextmanager
def drawing_from(device_type: str, state: torch.Tensor | None):
    """Run the body drawing from ``state`` (None: from this rank's generator as it is), then give
    this rank its own generator state back."""
    if state is None:
        yield
        return
    own = _generator_state(device_type)
    _set_generator_state(device_type, state)
    try:
        yield
    finally:
        _set_generator_state(device_type, own)
