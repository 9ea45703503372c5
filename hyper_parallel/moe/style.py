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

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertParallel", "ExpertTensorParallel", "ExpertWeightTensorParallel", "parse_expert_style"]


@dataclass(frozen=True)
class ExpertParallel:
    """Shard an experts module's stacked weights over ``axis`` (default ``"ep"``) on dim 0 and route
    tokens to them with a dropless all-to-all dispatch and combine (docs/architecture.md §2.10).

    ``overlap=True`` is the reference's ``CommComputeOverlap``: each rank's tokens go through the
    layer as two chunks, and the ``expert_overlap`` pass interleaves them so one chunk's dispatch
    and combine run while the other chunk's experts compute (forward and backward)."""

    axis: str | None = "ep"
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.axis is not None and (not isinstance(self.axis, str) or not self.axis):
            raise TypeError(f"{type(self).__name__}(axis=...) takes a mesh axis name, got {self.axis!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"{type(self).__name__}(overlap=...) is True or False, got {self.overlap!r}")

    @property
    def tensor_parallel_axis(self) -> str | None:
        """Mesh axis each expert's weights are split over (None: whole experts)."""
        return None

    def __repr__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(changed)})"


@dataclass(frozen=True, repr=False)
class ExpertTensorParallel(ExpertParallel):
    """Experts spread over ``axis`` (``"ep"``) and each expert's weights split over ``tp_axis``
    (``"tp"``), Megatron-style: the gate and up projections by output column, the down projection
    by input row, so each rank computes a partial sum that one all-reduce over ``tp_axis`` completes.
    Reference name: HyperParallel's ``ExpertTensorParallel`` (a 2-D ``("ep", "tp")`` mesh).

    ``shard_dims`` maps each stacked weight to the dim holding the expert's intermediate size (the
    one split over ``tp_axis``); by default the experts module's ``expert_tensor_parallel_dims``
    attribute (``models.moe.MoEExperts`` has one). Every split dim has the intermediate size, or
    twice it for a fused gate/up weight, which is split as two halves (moe/resolve.py)."""

    tp_axis: str = "tp"
    shard_dims: tuple | None = None  # ((weight name, dim), ...); a dict is accepted

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.shard_dims, dict):  # stored as sorted pairs: the style stays hashable
            object.__setattr__(self, "shard_dims", tuple(sorted(self.shard_dims.items())))
        if self.shard_dims is not None and not all(
                isinstance(n, str) and isinstance(d, int) for n, d in self.shard_dims):
            raise TypeError(f"{type(self).__name__}(shard_dims=...) maps weight names to dims, got {self.shard_dims!r}")

    @property
    def tensor_parallel_axis(self) -> str | None:
        return self.tp_axis


@dataclass(frozen=True, repr=False)
class ExpertWeightTensorParallel(ExpertTensorParallel):
    """Every rank keeps all experts, each expert's weights split over ``tp_axis`` as
    :class:`ExpertTensorParallel` splits them; no all-to-all (every tensor-parallel rank routes the
    same tokens). Reference name: HyperParallel's ``TensorParallel`` applied to expert weights
    (expert parallelism off); named apart from the dense ``ColwiseParallel`` / ``RowwiseParallel``."""

    axis: str | None = None


_STYLES = {
    "expert_parallel": ExpertParallel, "ExpertParallel": ExpertParallel,
    "expert_tensor_parallel": ExpertTensorParallel, "ExpertTensorParallel": ExpertTensorParallel,
    "expert_weight_tensor_parallel": ExpertWeightTensorParallel,
    "ExpertWeightTensorParallel": ExpertWeightTensorParallel,
}


def parse_expert_style(spec: Any, where: str) -> ExpertParallel:
    """An expert_parallel plan value: a style object, its name (``"expert_parallel"``,
    ``"expert_tensor_parallel"``, ``"expert_weight_tensor_parallel"``) or a dict ``{"style": name,
    **fields}`` (YAML/JSON plans)."""
    if isinstance(spec, ExpertParallel):
        return spec
    if isinstance(spec, str) and spec in _STYLES:
        return _STYLES[spec]()
    if isinstance(spec, dict) and spec.get("style") in _STYLES:
        cls = _STYLES[spec["style"]]
        fields = {k: v for k, v in spec.items() if k != "style"}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    raise TypeError(
        f"{where}: expected hp.ExpertParallel(), hp.ExpertTensorParallel() or "
        f"hp.ExpertWeightTensorParallel() (or their names), got {spec!r}"
    )
