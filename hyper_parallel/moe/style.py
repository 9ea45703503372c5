"""``ExpertParallel``: the plan entry that spreads a mixture-of-experts layer's experts over a mesh axis.

Reference name: HyperParallel's ``ExpertParallel`` (experts split over a 1-D ``("ep",)`` mesh, tokens
dispatched to and combined from their experts' ranks by all-to-all). Written in a plan as
``ParallelPlan(expert_parallel={"model.layers.*.mlp.experts": hp.ExpertParallel()})``.

The entry names the *experts module*: a module whose ``forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`` returns ``[T, H]``, each output row computed from the same input row, and
whose parameters are all stacked over the experts on dim 0 (our ``models.moe.MoEExperts``, HF's
``MixtralExperts`` / ``Qwen2MoeExperts``). Each rank of the ``axis`` keeps ``num_experts / ep`` of
them; the axis is also a data-parallel axis for everything else (its ranks take different batch
rows, dense gradients are reduced over it), as torchtitan borrows its expert-parallel ranks from
data parallelism. On a mesh without the axis the experts are replicated and each rank runs all of
them on its own tokens (the same compiled region, no all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertParallel", "parse_expert_style"]


@dataclass(frozen=True)
class ExpertParallel:
    """Shard an experts module's stacked weights over ``axis`` (default ``"ep"``) on dim 0 and route
    tokens to them with a dropless all-to-all dispatch and combine (docs/architecture.md §2.10)."""

    axis: str = "ep"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"ExpertParallel(axis=...) takes a mesh axis name, got {self.axis!r}")

    def __repr__(self) -> str:
        return "ExpertParallel()" if self.axis == "ep" else f"ExpertParallel(axis={self.axis!r})"


def parse_expert_style(spec: Any, where: str) -> ExpertParallel:
    """An expert_parallel plan value: an ``ExpertParallel``, the string ``"expert_parallel"``, or a
    dict ``{"style": "expert_parallel", "axis": ...}`` (YAML/JSON plans)."""
    if isinstance(spec, ExpertParallel):
        return spec
    if spec in ("expert_parallel", "ExpertParallel"):
        return ExpertParallel()
    if isinstance(spec, dict) and spec.get("style") in ("expert_parallel", "ExpertParallel"):
        extra = set(spec) - {"style", "axis"}
        if extra:
            raise ValueError(f"{where}: unknown field {sorted(extra)[0]!r}; ExpertParallel takes 'axis'")
        return ExpertParallel(axis=spec.get("axis", "ep"))
    raise TypeError(
        f"{where}: expected hp.ExpertParallel() (or 'expert_parallel'), got {spec!r}"
    )
