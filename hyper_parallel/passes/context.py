"""What every rewrite and pass may read: :class:`PassContext`, the one home of their defaults.

A compile builds one context (compile/programs.py:run_pass_pipeline and compile/driver.py:capture_and_lower); tests
build their own with only the fields a pass needs, the rest keeping the defaults below, which are
the same ones ``parallelize`` uses. Passes read fields directly, never with a fallback of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..fsdp.plan import FsdpPlan
from ..plan.resolved import ResolvedPlan
from ..recompute import ActivationPlan

DEFAULT_GRADIENT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb=25
# DDP's first bucket (the last parameters, whose gradients backward computes first) is small, so
# the first reduction starts early; 1 MiB as DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``.
DEFAULT_FIRST_GRADIENT_BUCKET_BYTES = 1024 * 1024
DEFAULT_PREFETCH_DEPTH = 1  # FSDP units whose all-gather is issued ahead
DEFAULT_REDUCTIONS_IN_FLIGHT = 1  # gradient reductions of a kind in flight (FSDP2's)


@dataclasses.dataclass(frozen=True)
class PassContext:
    """The mesh, the resolved plan's parts the passes use, the options, and observers."""

    mesh: DeviceMesh | None = None
    resolved: ResolvedPlan | None = None  # (pre-propagation rewrites: boundaries, FSDP unshard)
    storage_dtypes: dict = dataclasses.field(default_factory=dict)  # FSDP parameter FQN -> stored dtype
    fsdp: FsdpPlan | None = None  # ResolvedPlan.fsdp when the plan has fully_shard units
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    reductions_in_flight: int = DEFAULT_REDUCTIONS_IN_FLIGHT
    explicit_prefetch: dict = dataclasses.field(default_factory=dict)  # {"forward"/"backward": {unit: (units,)}}
    activation: ActivationPlan | None = None  # recompute and swap regions
    gradient_bucket_bytes: int = DEFAULT_GRADIENT_BUCKET_BYTES  # DDP-style gradient all-reduce buckets
    first_gradient_bucket_bytes: int = DEFAULT_FIRST_GRADIENT_BUCKET_BYTES  # capped by gradient_bucket_bytes
    disable_passes: frozenset[str] = frozenset()
    reduction_lanes: dict = dataclasses.field(default_factory=dict)  # gloo: group name -> its reduction lane
    # parallelize(codegen=): "inductor" compiles the compute between collectives, and fuses each
    # gradient's cast to the reduce dtype into the kernel that makes it (bucketing keeps the casts).
    codegen: str = "eager"
    # True for a pipeline stage whose backward runs split into input- and weight-gradient programs
    # (zero bubble), in another order than the joint graph's: inplace_reuse leaves backward alone.
    backward_reordered: bool = False
    # Observers: each pass's output graph (dumps) and seconds (the compile summary's pass_seconds).
    on_pass: Callable[[str, torch.fx.GraphModule], None] | None = None
    timings: dict = dataclasses.field(default_factory=dict)
