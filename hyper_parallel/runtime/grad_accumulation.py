"""Gradient accumulation without communication, for FSDP/HSDP (``set_requires_gradient_sync``).

While gradient sync is off, the compiled program leaves every FSDP parameter's gradient as the
unsharded partial sum of this rank's data (no reduce-scatter); :class:`GradientAccumulator` adds
those into per-parameter buffers and hands autograd nothing for them. On the next step with sync on,
the program again returns unsharded partial gradients; the accumulator adds them to the buffers and
reduces each unit's buffers once, through one flat buffer (reduce-scatter over the shard axis, then
all-reduce over the HSDP replicate axis), and hands autograd the resulting shards. The numbers equal
one large batch: the reduction is linear, so reducing the accumulated sum once equals summing the
per-step reductions.

These collectives run from the runtime, not from a graph: a known gap (see the issue note).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradientAccumulator:
    def __init__(self, fsdp, mesh, primal_params: list[str | None]):
        self.fsdp = fsdp
        self.mesh = mesh
        self.primal_params = primal_params  # per primal index: FSDP parameter FQN or None
        self.buffers: dict[str, torch.Tensor] = {}
        names = mesh.mesh_dim_names
        self.shard_group = mesh.get_group(names.index(fsdp.shard_axis))
        self.shard_size = mesh.size(names.index(fsdp.shard_axis))
        self.replicate_group = (
            mesh.get_group(names.index(fsdp.replicate_axis)) if fsdp.replicate_axis else None
        )

    @property
    def pending(self) -> bool:
        return bool(self.buffers)

    def accumulate(self, grads: list) -> list:
        """No-sync step: keep the unsharded gradients, give autograd None for them."""
        out = list(grads)
        for i, fqn in enumerate(self.primal_params):
            if fqn is None or grads[i] is None:
                continue
            g = grads[i]
            self.buffers[fqn] = self.buffers[fqn] + g if fqn in self.buffers else g.clone()
            out[i] = None
        return out

    def reduce(self, grads: list, shard_shapes: dict[str, torch.Size]) -> list:
        """Sync step: add this step's unsharded gradients, reduce each unit once, return shards."""
        self.accumulate(grads)
        out = list(grads)
        index_of = {fqn: i for i, fqn in enumerate(self.primal_params) if fqn is not None}
        for unit in self.fsdp.units:
            members = [f for f in unit.params if f in self.buffers]
            if not members:
                continue
            rows = [self.buffers[f].reshape(self.shard_size, -1) for f in members]
            flat = torch.cat(rows, dim=1).reshape(-1)
            shard = flat.new_empty(flat.numel() // self.shard_size)
            dist.reduce_scatter_tensor(shard, flat, group=self.shard_group)
            if self.replicate_group is not None:
                dist.all_reduce(shard, group=self.replicate_group)
            for f, piece in zip(members, shard.split([r.shape[1] for r in rows])):
                if f in index_of:
                    out[index_of[f]] = piece.reshape(shard_shapes[f])
        self.buffers.clear()
        return out
