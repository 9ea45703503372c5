"""The ordered pass pipeline over the lowered local joint graph.

Each pass is ``pass(gm, ctx) -> gm``: a pure graph-to-graph function whose module docstring says
what it reads and writes in ``node.meta``. ``run_passes`` runs them in order, skipping the names in
``ctx.disable_passes``, and hands each intermediate graph to ``ctx.on_pass`` (dumps). Turning an
optimisation pass off never changes numerics. A pass whose own invariant breaks (an ``assert``)
raises :class:`~hyper_parallel.errors.InternalError` naming the pass and that workaround.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ..errors import internal_error
from .bucketing import DEFAULT_GRADIENT_BUCKET_BYTES, bucketing_pass
from .cleanup import cleanup_pass
from .cse import cse_pass
from .prefetch import prefetch_pass
from .recompute import recompute_pass
from .reshard_after_forward import reshard_after_forward_pass
from .swap import swap_pass

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PassContext:
    """What passes may read: the mesh, options, and a callback to observe each pass's output."""

    mesh: object
    fsdp: object = None  # ResolvedPlan.fsdp (FsdpPlan) when the plan has fully_shard units
    prefetch_depth: int = 1  # how many FSDP units ahead all-gathers are issued
    explicit_prefetch: dict | None = None  # {"forward"/"backward": {unit: (units to prefetch,)}}
    activation: object = None  # recompute.ActivationPlan: recompute and swap regions
    gradient_bucket_bytes: int = DEFAULT_GRADIENT_BUCKET_BYTES  # DDP-style gradient all-reduce buckets
    disable_passes: frozenset[str] = frozenset()
    on_pass: Callable[[str, torch.fx.GraphModule], None] | None = None


PASSES: list[tuple[str, Callable]] = [
    ("cleanup", cleanup_pass),
    ("cse", cse_pass),
    ("recompute", recompute_pass),
    ("reshard_after_forward", reshard_after_forward_pass),
    ("swap", swap_pass),
    ("bucketing", bucketing_pass),
    ("prefetch", prefetch_pass),
]


def pass_names() -> list[str]:
    return [name for name, _ in PASSES]


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    unknown = set(ctx.disable_passes) - set(pass_names())
    if unknown:
        raise ValueError(
            f"disable_passes names unknown passes {sorted(unknown)}; the passes are {pass_names()}"
        )
    for name, fn in PASSES:
        if name in ctx.disable_passes:
            continue
        before = len(gm.graph.nodes)
        try:
            gm = fn(gm, ctx)
        except AssertionError as exc:  # a pass's invariant broke: name the pass and the workaround
            raise internal_error(name, str(exc) or type(exc).__name__, pass_name=name) from exc
        log.info("[%s] %d nodes -> %d", name, before, len(gm.graph.nodes))
        if ctx.on_pass is not None:
            ctx.on_pass(name, gm)
    return gm
