"""Plan resolution of ``expert_parallel`` entries: which modules are expert regions, on which axis.

Reads ``ParallelPlan.expert_parallel`` (glob -> :class:`~hyper_parallel.moe.style.ExpertParallel`),
the model and the mesh's axis names and sizes. Returns one :class:`ExpertRegionPlan` per matched
module and the placements of its stacked parameters (``Shard(0)`` on the expert axis). Raises
``TypeError`` / ``ValueError`` naming the entry, module and parameter for: a module without
parameters stacked over the experts on dim 0, an expert count the axis does not divide, a module
matched twice, an axis the mesh does not have when it is also a data-parallel name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard

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
) -> tuple[dict[str, ExpertRegionPlan], dict[str, tuple]]:
    """``matched(where, glob)`` gives the module FQNs a glob names (raising when none)."""
    regions: dict[str, ExpertRegionPlan] = {}
    placements: dict[str, tuple] = {}
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
            regions[fqn] = ExpertRegionPlan(fqn, axis, degree, num_experts, tuple(params), where)
            for name in params:
                placements[f"{fqn}.{name}" if fqn else name] = tuple(
                    Shard(0) if a == axis else Replicate() for a in axis_names
                )
    return regions, placements
