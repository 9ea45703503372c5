"""The ordered graph rewrites and passes, run by one runner (runner.py) with one context (context.py).

*Rewrites* run on the captured joint graph before propagation (compile/driver.capture_and_lower);
single-device numerics depend on all but the first, so they cannot be disabled:

0. ``causal_mask`` (propagation/causal_mask.py, optional): attention reading a constant causal
   mask (transformers' under export) computes with ``is_causal=True`` and no mask, and one reading
   a constant mask that hides nothing without it;
1. ``loss_reduction`` (propagation/loss_reduction.py): mean token losses become ``sum / count``,
   so a sharded batch gives the global token mean;
2. ``merge_boundaries`` (propagation/boundaries.py): plan boundaries that change nothing go, and
   one value's gradient boundaries are merged so its gradients are summed before they are reduced;
3. ``fsdp_unshard`` (propagation/unshard.py): FSDP parameters read through an unshard node, their
   gradients cast to the reduce dtype and scaled;
4. ``gradient_accumulation`` (propagation/accumulation.py): pending-gradient inputs for
   ``set_requires_gradient_sync(False)`` micro-steps.

*Passes* run on the lowered local joint graph (compile/programs.run_pass_pipeline), each
``pass(gm, ctx) -> gm``, a pure graph-to-graph function whose module docstring says what it reads
and writes in ``node.meta``; ``parallelize(disable_passes=...)`` skips any of them and that never
changes numerics. Every step is timed into the compile summary's ``pass_seconds`` and dumped.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir.names import renumber
from ..propagation import recompile
from ..propagation.accumulation import insert_gradient_accumulation
from ..propagation.boundaries import merge_boundaries
from ..propagation.causal_mask import make_constant_causal_masks_causal
from ..propagation.loss_reduction import make_token_means_global
from ..propagation.unshard import insert_unshard_nodes
from .bucketing import bucketing_pass
from .cleanup import cleanup_pass
from .context import DEFAULT_GRADIENT_BUCKET_BYTES, DEFAULT_PREFETCH_DEPTH, PassContext
from .cse import cse_pass
from .expert_overlap import expert_overlap_pass
from .fuse_small_reductions import fuse_small_reductions_pass
from .inplace_reuse import inplace_reuse_pass
from .overlap_reductions import overlap_reductions_pass
from .prefetch import prefetch_pass
from .recompute import recompute_pass
from .reshard_after_forward import reshard_after_forward_pass
from .ring_overlap import ring_overlap_pass
from .runner import Step, check_disabled, run_steps
from .reduction_lanes import reduction_lanes_pass
from .serialize_collectives import serialize_collectives_pass
from .swap import swap_pass

__all__ = ["DEFAULT_GRADIENT_BUCKET_BYTES", "DEFAULT_PREFETCH_DEPTH", "PASSES", "REWRITES", "PassContext",
           "check_disabled_passes", "pass_names", "rewrite_names", "run_passes", "run_rewrites"]


def _causal_mask(captured, ctx):
    make_constant_causal_masks_causal(captured.gm)
    return captured


def _loss_reduction(captured, ctx):
    make_token_means_global(captured.gm)
    return captured


def _merge_boundaries(captured, ctx):
    merge_boundaries(captured.gm, ctx.resolved)
    return captured


def _fsdp_unshard(captured, ctx):
    insert_unshard_nodes(captured, ctx.resolved, ctx.storage_dtypes, ctx.mesh.device_type)
    return captured


def _gradient_accumulation(captured, ctx):
    insert_gradient_accumulation(captured, ctx.resolved)
    return captured


REWRITES: list[Step] = [
    Step("causal_mask", _causal_mask),
    Step("loss_reduction", _loss_reduction, required=True),
    Step("merge_boundaries", _merge_boundaries, required=True),
    Step("fsdp_unshard", _fsdp_unshard, required=True),
    Step("gradient_accumulation", _gradient_accumulation, required=True),
]

PASSES: list[tuple[str, object]] = [
    ("cleanup", cleanup_pass),
    ("cse", cse_pass),
    ("recompute", recompute_pass),
    ("reshard_after_forward", reshard_after_forward_pass),
    ("swap", swap_pass),
    ("expert_overlap", expert_overlap_pass),
    ("ring_overlap", ring_overlap_pass),
    ("bucketing", bucketing_pass),
    ("fuse_small_reductions", fuse_small_reductions_pass),
    ("prefetch", prefetch_pass),
    ("overlap_reductions", overlap_reductions_pass),
    ("reduction_lanes", reduction_lanes_pass),
    ("serialize_collectives", serialize_collectives_pass),
    ("inplace_reuse", inplace_reuse_pass),
]


def pass_names() -> list[str]:
    """The passes on the lowered graph, in order (``disable_passes`` may also name the optional
    rewrites: ``causal_mask``)."""
    return [name for name, _ in PASSES]


def rewrite_names() -> list[str]:
    return [step.name for step in REWRITES]


def run_rewrites(captured, ctx: PassContext):
    """The rewrites on the captured joint graph (in place); returns ``captured``. Each leaves its
    graph's nodes numbered without gaps (ir/names.py), as a graph built afresh."""
    return run_steps([dataclasses.replace(step, fn=_renumbered(step.fn)) for step in REWRITES], captured, ctx,
                     graph_of=lambda c: c.gm)


def _renumbered(rewrite):
    def run(captured, ctx):
        captured = rewrite(captured, ctx)
        recompile(renumber(captured.gm, recompile=False))  # once, at run_steps' end
        return captured

    return run


def check_disabled_passes(names) -> None:
    """``parallelize(disable_passes=...)`` names only passes that exist and may be disabled."""
    check_disabled(names, [s for s in REWRITES if not s.required] + [Step(name, fn) for name, fn in PASSES], REWRITES)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    check_disabled_passes(ctx.disable_passes)
    return run_steps([Step(name, fn) for name, fn in PASSES], gm, ctx)
