"""Batches for parity tests: one global batch per step, this rank's slice of it, a pipeline's
micro-batches, and the loss read from a model's output. The single-device reference runs the global
batch; the parallel model the slice (:mod:`hyper_parallel.testing.stepper`)."""

from __future__ import annotations

import math
from typing import Any

import torch

import hyper_parallel as hp


def global_batch(model_name: str, batch: int, seq_len: int, seed: int = 1,
                 ignore_fraction: float = 0.0) -> dict[str, torch.Tensor]:
    """One global batch. ``ignore_fraction`` > 0 sets labels to -100 (padding, unmasked tokens) at
    random with that probability, and the whole of the last row, so data-parallel ranks count
    different numbers of tokens (one possibly none): what real training with padded labels sees."""
    g = torch.Generator().manual_seed(seed)
    if model_name == "mlp":
        return {"x": torch.randn(batch, 16, generator=g), "target": torch.randn(batch, 8, generator=g)}
    ids = torch.randint(0, 256, (batch, seq_len), generator=g)
    labels = ids
    if ignore_fraction > 0:
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < ignore_fraction, -100)
        labels[-1] = -100
    return {"input_ids": ids, "labels": labels}


def _data_axes(mesh) -> list[int]:
    return [i for i, n in enumerate(mesh.mesh_dim_names) if n.startswith("dp") or n in ("fsdp", "ep")]


def micro_batch(batch: dict, mesh, m: int, num_microbatches: int) -> dict:
    """Micro-batch ``m`` of ``num_microbatches`` of the whole step, as a pipeline forms it: every
    data-parallel rank's m-th chunk of its :func:`local_batch`, concatenated in rank order."""
    degree = math.prod(mesh.size(i) for i in _data_axes(mesh))
    return {k: torch.cat([piece.chunk(num_microbatches, dim=0)[m] for piece in v.chunk(degree, dim=0)])
            for k, v in batch.items()}


def local_batch(batch: dict, mesh) -> dict:
    """This rank's slice: dim 0 split over the data-parallel axes (in mesh order; ``ep`` is one, as
    under an expert-parallel plan), dim 1 (the sequence) over a ``cp`` axis (context parallelism),
    whole elsewhere."""
    dp_axes = _data_axes(mesh)
    degree = math.prod(mesh.size(i) for i in dp_axes) if dp_axes else 1
    index = 0
    for i in dp_axes:
        index = index * mesh.size(i) + mesh.get_local_rank(i)
    out = {k: v.chunk(degree, dim=0)[index] for k, v in batch.items()}
    if "cp" in mesh.mesh_dim_names:
        out = hp.shard_sequence(out, mesh)
    return out


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model returned: the output itself when it is a tensor, the first value of a tuple
    (transformers' ``return_dict=False``), else ``out["loss"]`` (a dict or a ``ModelOutput``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out["loss"]
