"""Plan resolution of ``expert_parallel`` entries: which modules are expert regions, on which axis.

Reads ``ParallelPlan.expert_parallel`` (glob -> :class:`~hyper_parallel.moe.style.ExpertParallel`),
the model and the mesh's axis names and sizes. Returns one :class:`ExpertRegionPlan` per matched
module, holding the placements of its stacked parameters (``Shard(0)`` on the expert axis, the
intermediate dim on the expert tensor-parallel axis). Raises
``TypeError`` / ``ValueError`` naming the entry, module and parameter for: a module without
parameters stacked over the experts on dim 0, an expert count the axis does not divide, a module
matched twice, an axis the mesh does not have when it is also a data-parallel name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from .. import compat
from .style import ExpertParallel


@dataclass(frozen=True)
class ExpertRegionPlan:
    """One experts module the compiler runs as an expert region (moe/region.py)."""

    module_fqn: str
    axis: str | None  # mesh axis the experts are spread over; None: the mesh has no such axis
    degree: int  # ranks along ``axis`` (1 without it)
    num_experts: int
    param_names: tuple[str, ...]  # local names, in named_parameters() order
    source: str  # the plan entry, for messages
    # Expert tensor parallelism: the axis each expert's weights are split over (None: whole) and
    # its size; weight name -> the dim split (the expert's intermediate size).
    tp_axis: str | None = None
    tp_degree: int = 1
    tp_dims: tuple = ()  # ((weight name, dim), ...)
    placements: tuple = ()  # ((weight name, full-mesh placements), ...)
    chunks: int = 1  # token chunks per rank: 2 with overlap (passes/expert_overlap.py)

    def weight_placements(self, name: str) -> tuple:
        return dict(self.placements)[name]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.degree


def _num_experts(module: nn.Module, params: Mapping[str, nn.Parameter], where: str, fqn: str) -> int:
    nested = sorted({name.split(".")[0] for name in params if "." in name})
    if nested:
        raise TypeError(
            f"{where}: ExpertParallel on module {fqn!r} ({type(module).__name__}) needs a module that "
            f"holds the stacked expert weights itself, but it has parameters in submodules {nested}; "
            f"name the experts module instead (e.g. {fqn + '.' + nested[-1]!r})"
        )
    if not any(p.dim() >= 3 for p in params.values()):
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        raise TypeError(
            f"{where}: ExpertParallel on module {fqn!r} ({type(module).__name__}) needs stacked expert "
            f"weight matrices [num_experts, in, out], but its parameters are {shapes}; name the module "
            "that holds the stacked expert weights (e.g. 'model.layers.*.mlp.experts')"
        )
    declared = getattr(module, "num_experts", None)
    leading = {p.shape[0] if p.dim() else None for p in params.values()}
    if declared is None and len(leading) == 1:
        declared = next(iter(leading))
    for name, p in params.items():
        if p.dim() < 2 or p.shape[0] != declared:
            raise TypeError(
                f"{where}: ExpertParallel on module {fqn!r} ({type(module).__name__}) needs every "
                f"parameter stacked over the experts on dim 0 ([num_experts={declared}, ...]), but "
                f"{name!r} has shape {tuple(p.shape)}. Name the module that holds the stacked expert "
                "weights (e.g. 'model.layers.*.mlp.experts'), not the MoE block or a single expert."
            )
    return int(declared)


def resolve_expert_parallel(
    entries: Mapping[str, ExpertParallel], matched, modules: Mapping[str, nn.Module],
    axis_names: tuple[str, ...], mesh_shape: tuple[int, ...],
) -> dict[str, ExpertRegionPlan]:
    """``matched(where, glob)`` gives the module FQNs a glob names (raising when none)."""
    regions: dict[str, ExpertRegionPlan] = {}
    for glob, style in entries.items():
        where = f"expert_parallel[{glob!r}]"
        for fqn in matched("expert_parallel", glob):
            module = modules[fqn]
            if fqn in regions:
                raise ValueError(f"{where}: module {fqn!r} is already matched by {regions[fqn].source}")
            params = dict(module.named_parameters())
            if not params:
                raise TypeError(
                    f"{where}: module {fqn!r} ({type(module).__name__}) has no parameters; "
                    "ExpertParallel applies to the module holding the stacked expert weights"
                )
            num_experts = _num_experts(module, params, where, fqn)
            axis = style.axis if style.axis in axis_names else None
            degree = mesh_shape[axis_names.index(axis)] if axis is not None else 1
            if num_experts % degree:
                divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
                raise ValueError(
                    f"{where}: module {fqn!r} has {num_experts} experts, which mesh axis {axis!r} of "
                    f"size {degree} does not divide (each rank holds a whole number of experts); use "
                    f"an {axis!r} size from {divisors}"
                )
            tp_axis = style.tensor_parallel_axis
            tp_dims: dict[str, int] = {}
            tp_degree = 1
            if tp_axis is not None:
                if tp_axis not in axis_names:
                    raise ValueError(
                        f"{where}: {type(style).__name__} splits each expert over mesh axis {tp_axis!r}, "
                        f"which the mesh does not have (axes {list(axis_names)}); add that axis to the mesh "
                        "or name one of its axes with tp_axis="
                    )
                tp_degree = mesh_shape[axis_names.index(tp_axis)]
                tp_dims = _tensor_parallel_dims(style, module, params, where, fqn, tp_degree)
                fused = _fused_gate_up(module, params, tp_dims, where, tp_degree)
            weights = {}
            for name, p in params.items():
                weights[name] = tuple(
                    Shard(0) if a == axis else _tp_placement(tp_dims[name], name in fused)
                    if a == tp_axis and name in tp_dims else Replicate() for a in axis_names
                )
            regions[fqn] = ExpertRegionPlan(
                fqn, axis, degree, num_experts, tuple(params), where, tp_axis,
                tp_degree, tuple(tp_dims.items()), tuple(weights.items()), 2 if style.overlap else 1,
            )
    return regions


def _tensor_parallel_dims(style, module: nn.Module, params, where: str, fqn: str, tp: int) -> dict[str, int]:
    """Weight name -> the dim (its expert's intermediate size) expert tensor parallelism splits."""
    declared = dict(style.shard_dims) if style.shard_dims is not None else getattr(
        module, "expert_tensor_parallel_dims", None)
    if not declared:
        raise TypeError(
            f"{where}: {type(style).__name__} needs to know which dim of each stacked weight of "
            f"{fqn!r} ({type(module).__name__}) is the expert's intermediate size; pass "
            f"shard_dims={{name: dim}} for its weights {list(params)} (gate/up: the output dim, down: "
            "the input dim)"
        )
    unknown = sorted(set(declared) - set(params))
    if unknown:
        raise ValueError(f"{where}: shard_dims names {unknown}, which {fqn!r} does not have (it has {list(params)})")
    whole = sorted(set(params) - set(declared))
    if whole:
        # A weight kept whole on every tp rank (a down projection's bias) would enter each rank's
        # partial output and be summed tp times by the all-reduce.
        raise ValueError(
            f"{where}: shard_dims gives no split dim for {whole} of {fqn!r}; under expert tensor "
            "parallelism every stacked weight is split over tp (a weight kept whole, such as a bias "
            "added after the down projection, would be summed once per tp rank)"
        )
    dims = {name: d % params[name].dim() for name, d in declared.items()}
    sizes = {name: params[name].shape[d] for name, d in dims.items()}
    size = min(sizes.values())
    if set(sizes.values()) - {size, 2 * size} or 0 in dims.values():
        raise ValueError(
            f"{where}: the dims split over tensor parallelism must all be the expert's intermediate "
            f"size, or twice it for a fused gate/up weight (never dim 0, the experts), but they have "
            f"sizes {sizes}; check shard_dims"
        )
    if size % tp:
        raise ValueError(f"{where}: the experts' intermediate size {size} is not divisible by tp={tp}")
    return dims


def _fused_gate_up(module: nn.Module, params, tp_dims: dict[str, int], where: str, tp: int) -> set[str]:
    """The weights whose split dim is twice the intermediate size: gate and up fused in one.

    Concatenated ``[gate; up]`` (transformers' default, ``is_concatenated``; the module splits its
    output with ``chunk(2)``): each tp rank must hold its slice of gate *and* of up, so the dim is
    split as two halves (a strided shard). Interleaved (``is_concatenated=False``, gate and up
    alternating): a plain split keeps pairs together when each rank's slice has whole pairs."""
    sizes = {name: params[name].shape[d] for name, d in tp_dims.items()}
    size = min(sizes.values())
    fused = {name for name, s in sizes.items() if s == 2 * size}
    if fused and not getattr(module, "is_concatenated", True) and (2 * size // tp) % 2:
        raise ValueError(
            f"{where}: the interleaved gate/up weights {sorted(fused)} ({2 * size} alternating gate "
            f"and up columns) do not split over tp={tp} into whole gate/up pairs; use a tp that "
            f"divides {size}"
        )
    return fused if getattr(module, "is_concatenated", True) else set()


def _tp_placement(dim: int, fused: bool):
    """``Shard(dim)``; a concatenated gate/up weight's dim as two halves, each split over tp."""
    return compat.StridedShard(dim, split_factor=2) if fused else Shard(dim)
