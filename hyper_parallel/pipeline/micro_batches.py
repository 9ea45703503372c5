"""A step's inputs cut into micro-batches: each tensor input along its batch dim
(``PipelinePlan.batch_dims``, by the name of its forward argument; dim 0 by default), with errors
naming the input when a dim does not exist or the batch does not divide."""

from __future__ import annotations

import inspect
from typing import Callable, Mapping

import torch

from ..compat import pytree
from .plan import DEFAULT_INPUT, TARGETS, BatchDimSpec


def input_names(forward: Callable, num_args: int, kwargs: Mapping, with_targets: bool) -> list[str]:
    """The batch_dims name of each top-level input of a step: ``forward``'s parameter names for the
    positional ones (``[i]`` past them), the keys for the keyword ones, ``"targets"`` last when
    ``step`` appended the targets."""
    try:
        params = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"[{i}]" for i in range(num_args)]
    if with_targets and names:
        names[-1] = TARGETS
    return names + list(kwargs)


def forward_parameters(forward: Callable) -> set[str]:
    try:
        return set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return set()


def leaf_specs(args: tuple, kwargs: dict, names: list[str], batch_dims: Mapping[str, BatchDimSpec],
               forward: Callable) -> tuple[list[str], list[BatchDimSpec]]:
    """(label, BatchDimSpec) of every leaf of ``pytree.tree_flatten((args, kwargs))``, in order."""
    known = set(names) | forward_parameters(forward) | {DEFAULT_INPUT}
    unknown = sorted(set(batch_dims) - known)
    if unknown:
        raise ValueError(
            f"PipelinePlan(batch_dims=...) names {unknown}, which are neither inputs of this step nor "
            f"arguments of forward; this step's inputs are {names} ('*': every input not named)"
        )
    default = batch_dims.get(DEFAULT_INPUT, BatchDimSpec(0))
    labels, specs = [], []
    for name, value in zip(names, (*args, *kwargs.values())):
        spec = batch_dims.get(name, default)
        for path, _ in pytree.tree_flatten_with_path(value)[0]:
            labels.append(name + pytree.keystr(path))
            specs.append(spec)
    return labels, specs


def micro_batches(flat: list, num_microbatches: int, labels: list[str],
                  specs: list[BatchDimSpec] | None = None) -> list[list]:
    """Every tensor input cut into ``num_microbatches`` equal chunks along its batch dim (dim 0
    unless ``specs`` names another; contiguous); ``micro_batches[mb]``: the flat inputs of ``mb``."""
    specs = specs or [BatchDimSpec(0)] * len(flat)
    per_input = []
    for label, x, spec in zip(labels, flat, specs, strict=True):
        dim = spec.batch_dim
        if not isinstance(x, torch.Tensor) or dim is None:
            per_input.append([x] * num_microbatches)
            continue
        if dim >= x.dim():
            raise ValueError(
                f"pipeline: input {label!r} has shape {list(x.shape)}, with no batch dim {dim} to split into "
                f"micro-batches; set its PipelinePlan(batch_dims=...) entry ({spec!r} now), or "
                "BatchDimSpec(None) to give every micro-batch the whole tensor"
            )
        if x.shape[dim] % num_microbatches:
            raise ValueError(
                f"pipeline: input {label!r} has batch size {x.shape[dim]} on dim {dim} ({spec!r}, shape "
                f"{list(x.shape)}), which num_microbatches={num_microbatches} does not divide; use a local "
                "batch that is a multiple of num_microbatches"
            )
        chunks = x.chunk(num_microbatches, dim=dim)
        per_input.append(list(chunks) if dim == 0 else [c.contiguous() for c in chunks])
    return [[chunks[mb] for chunks in per_input] for mb in range(num_microbatches)]
