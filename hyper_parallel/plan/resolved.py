"""The result of resolving a plan: :class:`ResolvedPlan` and the boundary constraints it holds.

A :class:`ResolvedPlan` is a plan matched against a concrete model and mesh (resolver.py builds it):
the full-mesh placement of every parameter and buffer, the layouts activations must have at module
boundaries (:class:`ModuleConstraints` of :class:`ActivationConstraint`), input-layout overrides,
and, once fsdp/resolve.py has resolved the FSDP units, ``fsdp``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from hyper_parallel.cp.resolve import ContextPlan
from hyper_parallel.distributed.mesh import is_data_parallel_axis
from hyper_parallel.layout import Placement, Replicate, Shard, format_placements, normalize_placements
from hyper_parallel.moe.resolve import ExpertRegionPlan

if TYPE_CHECKING:  # running fsdp/__init__ would import fsdp/resolve.py, which imports this package
    from hyper_parallel.fsdp.plan import FsdpPlan


@dataclass(frozen=True)
class ActivationConstraint:
    """Layout an activation must have at a module boundary: mesh axis -> placement.

    Axes not named are left as propagated. Shard dims may be negative (count from the last dim of
    the activation). ``source`` says which plan entry asked for it, for messages and dumps.
    """

    placements: dict[str, Placement] = field(hash=False)
    source: str = ""

    def __repr__(self) -> str:
        inner = ", ".join(f"{axis}={p}" for axis, p in self.placements.items())
        return f"ActivationConstraint({inner})"


@dataclass(frozen=True)
class ModuleConstraints:
    """Boundary layouts of one module: per positional input, per keyword input, per output (None = free)."""

    module_fqn: str
    inputs: tuple[ActivationConstraint | None, ...] = ()
    kwarg_inputs: dict[str, ActivationConstraint] = field(default_factory=dict, hash=False)
    outputs: tuple[ActivationConstraint | None, ...] = ()


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan matched against a model and a mesh; what the compiler consumes.

    * ``param_placements``: every parameter and buffer FQN (tied aliases included) -> one placement
      per mesh axis in mesh order, non-negative Shard dims, never Partial; Replicate by default.
    * ``param_sources``: FQN -> the plan entry that set it (only FQNs a plan entry set).
    * ``modules``: module FQN -> :class:`ModuleConstraints` (only modules with a constraint).
    * ``inputs``: forward argument name -> full-mesh placements overriding the default input layout
      (see :meth:`input_placements`).
    * ``outputs``, ``whole_outputs``: how returned values leave the program (see
      :meth:`output_override` and ``propagation/engine.py``).
    * ``data_parallel_axes``: mesh axes along which inputs are batch-sharded by default.
    * ``tp_axis``: the axis tensor-parallel styles applied on (None if the plan has none and the
      mesh has no such axis).
    """

    param_placements: dict[str, tuple[Placement, ...]] = field(hash=False)
    param_sources: dict[str, str] = field(hash=False)
    modules: dict[str, ModuleConstraints] = field(hash=False)
    inputs: dict[str, tuple[Placement, ...]] = field(hash=False)
    data_parallel_axes: tuple[str, ...]
    tp_axis: str | None
    mesh_dim_names: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    fsdp: FsdpPlan | None = None  # set when the plan shards parameters over data-parallel axes
    # plan.outputs: returned-value name glob -> {non-data-parallel axis: placement}.
    outputs: dict[str, dict[str, Placement]] = field(default_factory=dict, hash=False)
    # Every returned value whole on the non-data-parallel axes, plain tensors (the torch.compile
    # backend: Dynamo's graph expects the model's own output shapes).
    whole_outputs: bool = False
    # expert_parallel: experts module FQN -> its resolved region.
    experts: dict[str, ExpertRegionPlan] = field(default_factory=dict, hash=False)
    # context_parallel, or None. Its axis shards inputs' sequence dim (1).
    context: ContextPlan | None = field(default=None, hash=False)
    # Gradient accumulation of the parameters no FSDP unit owns (``model.no_sync()``,
    # propagation/accumulation.py): False keeps their gradients this rank's partial sums over the
    # data-parallel axes (nothing all-reduced); ``replicated_pending``: the program adds such sums
    # kept by earlier micro-steps before it reduces. Set per call by the runtime, never by a plan.
    replicated_sync: bool = True
    replicated_pending: bool = False
    # Gloo meshes: process-group name of a data-parallel axis -> its reduction lane's, the second
    # group over the same ranks the gradient reductions run on (plan/lanes.py). Empty elsewhere.
    reduction_lanes: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Mesh axes the forward inputs' sequence dim (dim 1) is sharded over by default."""
        return (self.context.axis,) if self.context is not None else ()

    def input_placements(self, name: str, ndim: int) -> tuple[Placement, ...]:
        """Placements of forward input ``name`` with ``ndim`` dims: the plan's override or the default."""
        override = self.inputs.get(name)
        if override is None:
            placements = default_input_placements(self.mesh_dim_names, ndim, self.data_parallel_axes, self.sequence_axes)
            # An axis of one rank shards nothing, so Replicate there is the same layout. Shard would
            # make a batch of one a sharded singleton dim, which DTensor's view rules refuse to
            # flatten ([1, S, H] -> [S, H] in every linear layer): a dp=1 mesh could not train on it.
            sizes = self.mesh_shape or (None,) * len(placements)
            return tuple(Replicate() if size == 1 else p for p, size in zip(placements, sizes))
        return normalize_placements(override, ndim, f"inputs[{name!r}]")

    def output_override(self, name: str) -> dict[str, Placement]:
        """The plan's placements for returned value ``name`` on the non-data-parallel axes it names
        (merged over every matching glob, later entries winning); empty if none matches."""
        found: dict[str, Placement] = {}
        for glob, placements in self.outputs.items():
            if fnmatch.fnmatchcase(name, glob):
                found.update(placements)
        return found

    def describe(self) -> str:
        """A readable table of the resolved plan (for dumps and debugging)."""
        lines = [f"mesh {dict(zip(self.mesh_dim_names, self.mesh_shape))}, tp_axis={self.tp_axis!r}, "
                 f"data_parallel_axes={list(self.data_parallel_axes)}"]
        lines.append("parameters:")
        for fqn, placements in self.param_placements.items():
            source = self.param_sources.get(fqn, "default")
            lines.append(f"  {fqn}: {format_placements(placements)}  <- {source}")
        if self.modules:
            lines.append("module boundaries:")
            for fqn, mc in self.modules.items():
                lines.append(f"  {fqn or '<root>'}: inputs={list(mc.inputs)} "
                             f"kwarg_inputs={mc.kwarg_inputs} outputs={list(mc.outputs)}")
        if self.inputs:
            lines.append("inputs:")
            for name, placements in self.inputs.items():
                lines.append(f"  {name}: {format_placements(placements)}")
        return "\n".join(lines)


def default_input_placements(mesh_dim_names: Iterable[str], ndim: int,
                             data_axes: Iterable[str] | None = None,
                             sequence_axes: Iterable[str] = ()) -> tuple[Placement, ...]:
    """Default layout of a forward input: Shard(0) on data-parallel axes (``data_axes``, by default
    the ones named so), Shard(1) on context-parallel ``sequence_axes`` for inputs of two or more
    dims ([batch, sequence, ...]), Replicate elsewhere; 0-d replicated."""
    data_axes = set(data_axes) if data_axes is not None else None
    sequence_axes = set(sequence_axes)

    def placement(axis):
        if ndim > 0 and (is_data_parallel_axis(axis) if data_axes is None else axis in data_axes):
            return Shard(0)
        if ndim > 1 and axis in sequence_axes:
            return Shard(1)
        return Replicate()

    return tuple(placement(axis) for axis in mesh_dim_names)
