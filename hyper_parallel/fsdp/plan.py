"""The values of fully sharded data parallelism: the plan entry, its policies, the resolved units.

``FullyShard`` is the ``ParallelPlan.fully_shard`` entry (``fully_shard.py`` records the same from
FSDP2-style calls) with its ``MixedPrecisionPolicy`` and ``OffloadPolicy`` / ``CPUOffloadPolicy``.
``resolve.py`` turns it into an ``FsdpPlan`` of ``FsdpUnit`` entries (``ResolvedPlan.fsdp``), which
the compiler reads; ``GRADIENT_LAYOUTS`` names the layouts an FSDP gradient can leave a program in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
from torch.distributed.tensor import Partial, Replicate


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Gather parameters in ``param_dtype``, reduce gradients in ``reduce_dtype`` (seed/FSDP2 names).

    ``cast_forward_inputs``: the unit's floating-point forward inputs are cast to ``param_dtype``
    (when it is set); ``output_dtype``: its floating-point forward outputs are cast to that dtype.
    Both are casts at the unit's module boundary inside the compiled program, as FSDP2's hooks do,
    so units with different policies can follow each other."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )

    @property
    def casts(self) -> bool:
        """Whether the policy casts anything at the unit's boundary."""
        return self.output_dtype is not None or (self.cast_forward_inputs and self.param_dtype is not None)


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

    A unit given as a list/tuple of globs is one unit over all the modules they match (FSDP2's
    ``fully_shard([a, b])``: one all-gather and one reduce-scatter for their parameters).
    ``mesh_axes``: ("dp_shard",) style for FSDP, (replicate_axis, shard_axis) for HSDP; by default
    the mesh's ("dp_replicate", "dp_shard") pair, else its "dp_shard", "fsdp" or "dp" axis.
    ``shard_placement_fn``: FSDP2's: called with each parameter, returns ``Shard(dim)`` to store it
    sharded on that dim (even shards only when dim != 0) or None for the default ``Shard(0)``.
    ``ignored_params``: parameter-FQN globs FSDP leaves alone: stored replicated, their gradients
    all-reduced over the data-parallel axes like parameters outside every unit.
    ``reshard_after_forward=None``: FSDP2's default, False for the root unit and True for the others.
    """

    units: tuple = ("",)
    mesh_axes: tuple[str, ...] | None = None
    reshard_after_forward: bool | int | None = True
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    comm_fusion: bool = True
    shard_placement_fn: Any = None
    ignored_params: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.units, str):
            object.__setattr__(self, "units", (self.units,))
        object.__setattr__(self, "units", tuple(
            u if isinstance(u, str) else tuple(u) for u in self.units
        ))
        for unit in self.units:
            if not isinstance(unit, str) and (not unit or not all(isinstance(g, str) for g in unit)):
                raise TypeError(
                    f"FullyShard.units entries are module-FQN globs, or a non-empty list of them for one "
                    f"unit over several modules; got {unit!r}"
                )
        if isinstance(self.ignored_params, str):
            object.__setattr__(self, "ignored_params", (self.ignored_params,))
        object.__setattr__(self, "ignored_params", tuple(self.ignored_params))
        if self.shard_placement_fn is not None and not callable(self.shard_placement_fn):
            raise TypeError(
                "FullyShard.shard_placement_fn must be a callable taking a parameter and returning "
                f"Shard(dim) or None, got {self.shard_placement_fn!r}"
            )
        if self.offload_policy is not None and not isinstance(self.offload_policy, OffloadPolicy):
            raise TypeError(
                f"FullyShard.offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {self.offload_policy!r}"
            )
        if self.mesh_axes is not None:
            axes = (self.mesh_axes,) if isinstance(self.mesh_axes, str) else tuple(self.mesh_axes)
            object.__setattr__(self, "mesh_axes", axes)
        if isinstance(self.mixed_precision, dict):
            object.__setattr__(self, "mixed_precision", MixedPrecisionPolicy(**self.mixed_precision))
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"FullyShard.mixed_precision must be a MixedPrecisionPolicy, got {self.mixed_precision!r}"
            )
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, (bool, int)):
            raise TypeError(
                f"FullyShard.reshard_after_forward must be True, False, an int or None, "
                f"got {self.reshard_after_forward!r}"
            )

    @classmethod
    def from_value(cls, value: Any) -> "FullyShard":
        """Accept a FullyShard or the same as a plain dict (plans read from YAML/JSON)."""
        from ..plan.values import option_from_value

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
    # The modules of a unit over several modules (``fully_shard([a, b])``), ``module_fqn`` first;
    # empty for a unit of one module.
    members: tuple[str, ...] = ()
    # This unit's policies (``fully_shard(mp_policy=, offload_policy=)`` per call, else the entry's).
    mixed_precision: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    # Switches set per unit (FsdpFlags, the FSDP2 methods on this unit or recursively above it):
    # set_reduce_op_type, set_reduce_scatter_divide_factor, set_reshard_after_backward.
    reduce_op: str = "avg"
    divide_factor: float | None = None
    reshard_after_backward: bool = True

    @property
    def modules(self) -> tuple[str, ...]:
        """The unit's module FQNs (one, or the members of a unit over several modules)."""
        return self.members or (self.module_fqn,)

    def contains(self, fqn: str) -> bool:
        """Whether module or parameter ``fqn`` is inside one of the unit's modules."""
        return any(m == "" or fqn == m or fqn.startswith(m + ".") for m in self.modules)


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
    # The mesh axes (in mesh order) a dense parameter is sharded over when there are several, and
    # the process group of the mesh flattened over them (attach_joint_shard_group): DTensor gathers
    # and reduce-scatters over it as one collective instead of one per axis.
    joint_axes: tuple[str, ...] = ()
    joint_group: str | None = dataclasses.field(default=None, compare=False)
    comm_fusion: bool = True
    # Mixed precision and offload policies are per unit (FsdpUnit; policy_of / offload_of below).
    # (unit, DeviceMesh) for each hp.fully_shard(mesh=...) call, checked against parallelize's mesh.
    unit_meshes: tuple = dataclasses.field(default=(), hash=False, compare=False)
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
    # set_reshard_after_backward(False) on every unit: backward also returns the gathered
    # parameters, kept for the next forward (gradient accumulation micro-steps then skip the
    # forward all-gathers). Per unit: FsdpUnit.reshard_after_backward (keeps_gathered).
    reshard_after_backward: bool = True

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every axis whose ranks take different batch rows for FSDP parameters: a gradient is a
        partial sum over each of these where its parameter is computed replicated."""
        return tuple(a for a in (self.replicate_axis, self.shard_axis, *self.extra_shard_axes) if a is not None)

    def unit(self, module_fqn: str) -> FsdpUnit:
        return next(u for u in self.units if u.module_fqn == module_fqn)

    def policy_of(self, param: str) -> MixedPrecisionPolicy | None:
        """The mixed precision policy of ``param``'s unit (None: it computes in its own dtype)."""
        return self.unit(self.unit_of[param]).mixed_precision

    def compute_dtypes(self, stored: Mapping[str, torch.dtype]) -> dict[str, torch.dtype]:
        """Parameter FQN -> the dtype it computes in (its unit's ``param_dtype``), for the
        floating-point parameters of ``stored`` (FQN -> stored dtype) whose unit casts them."""
        return {
            fqn: policy.param_dtype
            for fqn, dtype in stored.items()
            if fqn in self.unit_of and dtype.is_floating_point
            and (policy := self.policy_of(fqn)) is not None and policy.param_dtype is not None
        }

    def offload_of(self, param: str) -> OffloadPolicy | None:
        """The offload policy of ``param``'s unit."""
        return self.unit(self.unit_of[param]).offload_policy

    def offloaded(self, param: str) -> bool:
        """Whether ``param``'s unit keeps its shards on the host (CPUOffloadPolicy)."""
        return isinstance(self.offload_of(param), CPUOffloadPolicy)

    def keeps_gathered(self, param: str) -> bool:
        """set_reshard_after_backward(False) on ``param``'s unit: backward returns it gathered."""
        return not self.unit(self.unit_of[param]).reshard_after_backward

    def gradient_scale(self, param: str, mesh_dim_names, mesh_shape) -> float:
        """What ``param``'s gradient is multiplied by before it is reduced, relative to the
        default (the gradient of the global mean loss, one device's numbers). The data-parallel
        ranks' gradients summed is ``degree`` times that; ``set_reduce_op_type("sum")`` keeps the
        sum, ``set_reduce_scatter_divide_factor(f)`` divides the sum by ``f`` instead of by the
        degree (FSDP2's custom divide factor), so the scale is ``degree / f``."""
        unit = self.unit(self.unit_of[param])
        if unit.divide_factor is None and unit.reduce_op == "avg":
            return 1.0
        degree = math.prod(mesh_shape[list(mesh_dim_names).index(a)] for a in self.data_axes)
        if unit.divide_factor is not None:
            return degree / unit.divide_factor
        return float(degree)

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
