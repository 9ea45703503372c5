"""The values of fully sharded data parallelism: the plan entry, its policies, the resolved units.

``FullyShard`` is the ``ParallelPlan.fully_shard`` entry (``fully_shard.py`` records the same from
FSDP2-style calls) with its ``MixedPrecisionPolicy`` and ``OffloadPolicy`` / ``CPUOffloadPolicy``.
``resolve.py`` turns it into an ``FsdpPlan`` of ``FsdpUnit`` entries (``ResolvedPlan.fsdp``), which
the compiler reads; ``GRADIENT_LAYOUTS`` names the layouts an FSDP gradient can leave a program in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Gather parameters in ``param_dtype``, reduce gradients in ``reduce_dtype`` (seed/FSDP2 names)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and the optimizer step on the CPU."""

    pin_memory: bool = True


@dataclasses.dataclass(frozen=True)
class FullyShard:
    """FSDP/HSDP units (module-FQN globs, innermost first; "" is the root) and their options.

    ``mesh_axes``: ("dp_shard",) style for FSDP, (replicate_axis, shard_axis) for HSDP; by default
    the mesh's ("dp_replicate", "dp_shard") pair, else its "dp_shard", "fsdp" or "dp" axis.
    """

    units: tuple[str, ...] = ("",)
    mesh_axes: tuple[str, ...] | None = None
    reshard_after_forward: bool | int = True
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    comm_fusion: bool = True

    def __post_init__(self):
        if isinstance(self.units, str):
            object.__setattr__(self, "units", (self.units,))
        object.__setattr__(self, "units", tuple(self.units))
        if self.mesh_axes is not None:
            axes = (self.mesh_axes,) if isinstance(self.mesh_axes, str) else tuple(self.mesh_axes)
            object.__setattr__(self, "mesh_axes", axes)
        if isinstance(self.mixed_precision, dict):
            object.__setattr__(self, "mixed_precision", MixedPrecisionPolicy(**self.mixed_precision))
        if not isinstance(self.reshard_after_forward, (bool, int)):
            raise TypeError(
                f"FullyShard.reshard_after_forward must be True, False or an int, "
                f"got {self.reshard_after_forward!r}"
            )

    @classmethod
    def from_value(cls, value: Any) -> "FullyShard":
        """Accept a FullyShard or the same as a plain dict (plans read from YAML/JSON)."""
        from ..plan import option_from_value

        return option_from_value(cls, value, "fully_shard")


@dataclasses.dataclass(frozen=True)
class FsdpUnit:
    """One unit: its module, the parameters it owns (FQNs) and whether it reshards after forward.

    ``reshard_after_forward``: True (keep only the shard), False (keep the gathered parameters), or
    an int 1 < k < shard-axis size (FSDP2's "world size to reshard to"): each rank keeps 1/k of the
    unit's parameters and backward gathers them over a group of k ranks, contiguous along the shard
    axis. For such a unit, ``parallelize`` sets ``post_forward_group`` (that group's process-group
    name on this rank) and ``post_forward_rank`` (this rank's position in it).
    """

    module_fqn: str
    params: tuple[str, ...]
    reshard_after_forward: bool | int
    post_forward_group: str | None = None
    post_forward_rank: int = 0


def post_forward_size(unit: FsdpUnit) -> int | None:
    """k of a unit with ``reshard_after_forward=<k>``, else None."""
    k = unit.reshard_after_forward
    return k if isinstance(k, int) and not isinstance(k, bool) else None


@dataclasses.dataclass(frozen=True)
class FsdpPlan:
    """The resolved FSDP entry the compiler reads (ResolvedPlan.fsdp)."""

    shard_axis: str
    replicate_axis: str | None
    units: tuple[FsdpUnit, ...]
    unit_of: dict[str, str] = dataclasses.field(hash=False)  # parameter FQN -> unit module FQN
    compute_placements: dict[str, tuple] = dataclasses.field(hash=False)
    # Expert- and context-parallel axes FSDP also shards over: their ranks take other tokens, so
    # they are data-parallel for every parameter not split over them. A dense parameter is stored
    # sharded over shard_axis x these (torchtitan's dense FSDP over dp_shard x ep, and its
    # dp_shard_cp), an expert weight over shard_axis only.
    extra_shard_axes: tuple[str, ...] = ()
    comm_fusion: bool = True
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    # False while accumulating gradients (set_requires_gradient_sync(False)): each FSDP gradient
    # stays the unsharded partial sum of this rank's data, nothing is reduced.
    gradient_sync: bool = True
    # HSDP, set_requires_all_reduce(False): gradients are reduce-scattered over the shard axis but
    # stay partial sums over the replicate axis (accumulation with reduce-scatter only).
    all_reduce: bool = True
    # Gradients accumulated by earlier micro-steps that this program adds to its own before they
    # are reduced: None, or the GRADIENT_LAYOUTS name of their layout.
    accumulated: str | None = None
    # Units whose parameters the user gathered ahead (``unshard()``): the program takes them
    # gathered as inputs and all-gathers them only again in backward, when the unit reshards.
    pregathered: tuple[str, ...] = ()
    # set_reshard_after_backward(False): backward also returns the gathered parameters, kept for the
    # next forward (gradient accumulation micro-steps then skip the forward all-gathers).
    reshard_after_backward: bool = True
    # set_reduce_op_type: "avg" gives the gradient of the global mean loss (one device's numbers);
    # "sum" sums the data-parallel ranks' gradients instead, i.e. scales by the dp degree.
    reduce_op: str = "avg"

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every axis whose ranks take different batch rows for FSDP parameters: a gradient is a
        partial sum over each of these where its parameter is computed replicated."""
        return tuple(a for a in (self.replicate_axis, self.shard_axis, *self.extra_shard_axes) if a is not None)

    def unit(self, module_fqn: str) -> FsdpUnit:
        return next(u for u in self.units if u.module_fqn == module_fqn)

    @property
    def gradient_layout(self) -> str:
        """Which of GRADIENT_LAYOUTS this program leaves FSDP gradients in."""
        if not self.gradient_sync:
            return "unsharded"
        if not self.all_reduce and self.replicate_axis is not None:
            return "reduce_scattered"
        return "reduced"

    def gradient_placements(self, param: str, layout: str, axis_names, storage: tuple) -> tuple:
        """Placements (one per mesh axis) of ``param``'s gradient in ``layout``; ``storage`` is the
        parameter's own (sharded) placements, which "reduced" gradients have."""
        if layout == "reduced":
            return storage
        if layout == "reduce_scattered":
            return tuple(Partial("sum") if name == self.replicate_axis else p for name, p in zip(axis_names, storage))
        if layout == "unsharded":
            dp_axes = set(self.data_axes)
            # An expert weight is computed sharded over the expert axis: each rank's gradient is
            # already its own experts' whole gradient there, not a partial sum.
            return tuple(
                Partial("sum") if name in dp_axes and isinstance(p, Replicate) else p
                for name, p in zip(axis_names, self.compute_placements[param])
            )
        raise ValueError(f"unknown gradient layout {layout!r}; expected one of {GRADIENT_LAYOUTS}")


# How an FSDP gradient leaves a compiled backward: "reduced" (sharded like its parameter, the final
# gradient), "reduce_scattered" (HSDP without the replicate all-reduce: sharded, a partial sum over
# the replicate axis) or "unsharded" (no communication: this rank's partial sum, whole on dp axes).
GRADIENT_LAYOUTS = ("reduced", "reduce_scattered", "unsharded")
