"""Analytic checks that reject a configuration before anything is compiled.

Each check returns the reason a user reads in ``ranked`` (``"heads not divisible by tp"``, ``"OOM:
the model state alone needs 9.1 GiB per rank"``) or None. They are sound: a configuration they
reject cannot run (ParallelDims' own validation, the batch split, the pipeline's stages) or cannot
fit (:func:`state_lower_bound` is at most the compiled estimate's peak: tests/unit/test_auto_plan.py
compiles pruned candidates to check).

Reads: the degrees, the model config's fields, the parameter count, the batch, dtype and
optimizer. Writes: nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...analysis.memory import format_bytes, optimizer_model
from .space import Candidate, dp_degree

__all__ = ["batch_problem", "dims_problem", "memory_problem", "plan_problem", "state_lower_bound"]


def dims_problem(degrees: Mapping[str, int], world_size: int, fields: Mapping[str, Any], seq_len: int) -> str | None:
    """ParallelDims' validation of the degrees against the model (heads, KV heads, layers, experts
    and the sequence divisible as each axis needs), as its ValueError words it."""
    from ...distributed.parallel_dims import ParallelDims

    extra = {"ulysses_degree": 1} if degrees.get("cp", 1) > 1 else {}  # ring attention: no head split
    try:
        ParallelDims(**degrees, **extra, world_size=world_size, seq_len=seq_len, model_config=dict(fields))
    except ValueError as exc:  # "ParallelDims(...) does not fit the model config:\n  - tp=8 does not divide ..."
        lines = str(exc).splitlines()
        reasons = [line.strip().lstrip("- ") for line in lines[1:] if line.strip()]
        return "; ".join(reasons) or lines[0]
    return None


def batch_problem(degrees: Mapping[str, int], global_batch: int) -> str | None:
    """Why ``global_batch`` sequences cannot be split evenly over the data-parallel ranks, or None."""
    dp = dp_degree(degrees)
    if global_batch % dp:
        return f"global batch {global_batch} does not split over {dp} data-parallel ranks"
    return None


def plan_problem(candidate: Candidate) -> str | None:
    """Why no plan preset covers the candidate's axes, or None."""
    if candidate.plan_name is None:
        return "no preset for these axes: the presets shard parameters over dp_shard or tp (pp or cp alone hold whole layers)"
    return None


def state_lower_bound(num_params: int, candidate: Candidate, dtype: str, optimizer: str) -> int:
    """Bytes per rank that parameters, gradients and optimizer state take at least, all live at the
    optimizer step: FSDP presets keep fp32 master weights and gradients (bf16 only in compute),
    the TP preset ``dtype`` ones; each optimizer state tensor is the size of a parameter; all
    spread over at most every axis but ``dp_replicate`` (a lower bound: embeddings that tensor
    parallelism leaves whole, or a first pipeline stage that holds more, only add to it)."""
    width = 4 if candidate.fp32_masters or dtype == "fp32" else 2
    bytes_per_param = width * (2 + optimizer_model(optimizer).state)
    degrees = candidate.degrees
    spread = degrees["dp_shard"] * degrees["cp"] * degrees["tp"] * degrees["pp"] * degrees["ep"]
    return num_params * bytes_per_param // spread


def memory_problem(num_params: int, candidate: Candidate, dtype: str, optimizer: str, budget: int) -> str | None:
    """"OOM: ..." when the model state alone exceeds ``budget`` bytes per rank, else None."""
    bound = state_lower_bound(num_params, candidate, dtype, optimizer)
    if bound > budget:
        return (f"OOM: parameters, gradients and {optimizer} state alone need at least {format_bytes(bound)} per rank "
                f"(budget {format_bytes(budget)})")
    return None
