"""Activation recompute as a plan entry: which modules recompute, and which of their values to keep.

``ParallelPlan.recompute = {module glob: policy}``, policy one of:

* ``"full"``: nothing computed inside the module is kept for backward; backward recomputes it from
  the module's inputs (what ``torch.utils.checkpoint`` does to a module).
* ``"selective"``: keep the outputs of the expensive ops (matmuls, attention, collectives) and
  recompute the cheap ones (pointwise, norms, views) — the usual "selective activation
  checkpointing" trade.
* a callable ``policy(op_name: str, module_fqn: str) -> CheckpointPolicy`` deciding per op, where
  ``op_name`` is the aten overload (``"aten.mm.default"``).

``hp.checkpoint_wrapper(module, policy="full")`` records the same on a module, the way the
``fully_shard`` calls do. :func:`resolve_recompute` turns either into a :class:`RecomputePlan`
(module FQN -> :class:`CheckpointPolicy` decider) that the recompute pass reads.

Random ops are always kept (their outputs are never recomputed), so recompute never changes
numbers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import torch.nn as nn

from .plan import fqn_matches


class CheckpointPolicy(enum.Enum):
    """Per-op decision (the names of torch's selective-checkpoint policies)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"

    @property
    def saves(self) -> bool:
        return self in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


# Ops whose outputs "selective" keeps: the expensive ones to recompute.
SELECTIVE_SAVE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.linear.default", "aten.matmul.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.wait_tensor.default",
})

# Ops whose result must never be recomputed: recomputing them would draw new random numbers.
RANDOM_OPS = frozenset({
    "aten.native_dropout.default", "aten.bernoulli.default", "aten.bernoulli_.float",
    "aten.rand.default", "aten.randn.default", "aten.rand_like.default", "aten.randn_like.default",
    "aten.randint.default", "aten.randperm.default", "aten.uniform_.default", "aten.normal_.default",
})

POLICY_NAMES = ("full", "selective")


def _full(op_name: str, module_fqn: str) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(op_name: str, module_fqn: str) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_SAVE if op_name in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclasses.dataclass(frozen=True)
class RecomputeRegion:
    module_fqn: str
    policy_name: str  # "full", "selective" or the callable's name
    decide: Callable[[str, str], CheckpointPolicy] = dataclasses.field(compare=False)

    def saves(self, op_name: str, module_fqn: str) -> bool:
        if op_name in RANDOM_OPS:
            return True
        decision = self.decide(op_name, module_fqn)
        if not isinstance(decision, CheckpointPolicy):
            raise TypeError(
                f"recompute policy {self.policy_name!r} for module {self.module_fqn!r} returned "
                f"{decision!r} for {op_name}; return an hp.CheckpointPolicy"
            )
        return decision.saves


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """The resolved ``recompute`` entry: regions, outermost first (a module inside a region belongs
    to the outermost one)."""

    regions: tuple[RecomputeRegion, ...]

    def region_of(self, module_fqn: str) -> RecomputeRegion | None:
        for region in self.regions:
            if region.module_fqn == "" or module_fqn == region.module_fqn or module_fqn.startswith(region.module_fqn + "."):
                return region
        return None


_RECORD_ATTR = "_hp_recompute"


def checkpoint_wrapper(module: nn.Module, policy: Any = "full") -> nn.Module:
    """Mark ``module`` for recompute (``"full"``, ``"selective"`` or a policy callable); the
    parallelized model recompute it in backward. The module is returned unchanged otherwise."""
    _decider(policy, "checkpoint_wrapper(policy=...)")
    setattr(module, _RECORD_ATTR, policy)
    return module


def collect_recorded_recompute(model: nn.Module) -> dict[str, Any]:
    """``{module FQN: policy}`` from ``checkpoint_wrapper`` calls on ``model``'s modules."""
    return {fqn: getattr(m, _RECORD_ATTR) for fqn, m in model.named_modules() if hasattr(m, _RECORD_ATTR)}


def _decider(policy: Any, where: str) -> tuple[str, Callable[[str, str], CheckpointPolicy]]:
    if policy == "full":
        return "full", _full
    if policy == "selective":
        return "selective", _selective
    if callable(policy):
        return getattr(policy, "__name__", repr(policy)), policy
    raise ValueError(
        f"{where}: unknown recompute policy {policy!r}; use 'full', 'selective' or a callable "
        "(op_name, module_fqn) -> hp.CheckpointPolicy"
    )


def resolve_recompute(spec: Any, model: nn.Module) -> RecomputePlan | None:
    """The plan's ``recompute`` dict (globs) plus recorded ``checkpoint_wrapper`` calls, resolved
    against ``model``'s modules."""
    entries = dict(collect_recorded_recompute(model))
    if spec is not None:
        if not isinstance(spec, dict):
            raise TypeError(
                f"ParallelPlan.recompute must be a dict {{module glob: 'full' | 'selective' | policy}}, "
                f"got {type(spec).__name__}"
            )
        module_fqns = [fqn for fqn, _ in model.named_modules()]
        for glob, policy in spec.items():
            matched = [fqn for fqn in module_fqns if fqn_matches(glob, fqn)] if glob else [""]
            if not matched:
                raise ValueError(
                    f"recompute[{glob!r}] matches no module of {type(model).__name__}; globs match "
                    "module FQNs segment by segment, e.g. 'model.layers.*'"
                )
            for fqn in matched:
                entries.setdefault(fqn, policy)
    if not entries:
        return None
    regions = []
    for fqn in sorted(entries, key=lambda f: (f.count(".") + (f != ""), f)):  # outermost first
        name, decide = _decider(entries[fqn], f"recompute[{fqn!r}]")
        regions.append(RecomputeRegion(fqn, name, decide))
    return RecomputePlan(tuple(regions))
