"""Analytic checks that reject a configuration before anything is compiled.

Each check returns the reason a user reads in ``ranked`` (``"heads not divisible by tp"``, ``"OOM:
the model state alone needs 9.1 GiB per rank"``) or None. They are sound: a configuration they
reject cannot run (ParallelDims' own validation, the batch split, the pipeline's stages) or cannot
fit (:func:`memory_lower_bound` is at most the compiled estimate's peak: tests/tools/test_auto_plan.py
compiles candidates of every kind to check).

Reads: the degrees, the model config's fields, the parameter count, the batch, dtype and
optimizer. Writes: nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...analysis.memory import format_bytes, optimizer_model
from .space import Candidate, dp_degree

__all__ = ["activation_lower_bound", "batch_problem", "dims_problem", "memory_lower_bound", "memory_problem",
           "plan_problem", "state_lower_bound"]


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


def _state_bytes_per_param(candidate: Candidate, dtype: str, optimizer: str) -> tuple[int, int]:
    """(bytes of a parameter's weight, of its optimizer state) in the preset's storage: FSDP presets
    keep fp32 master weights and gradients (bf16 only in compute), the TP preset ``dtype`` ones."""
    width = 4 if candidate.fp32_masters or dtype == "fp32" else 2
    return width, width * optimizer_model(optimizer).state


def _spread(candidate: Candidate) -> int:
    degrees = candidate.degrees
    return degrees["dp_shard"] * degrees["cp"] * degrees["tp"] * degrees["pp"] * degrees["ep"]


def state_lower_bound(num_params: int, candidate: Candidate, dtype: str, optimizer: str) -> int:
    """Bytes per rank that parameters, gradients and optimizer state take at least, all live at the
    optimizer step; each optimizer state tensor is the size of a parameter; all spread over at most
    every axis but ``dp_replicate`` (a lower bound: embeddings that tensor parallelism leaves whole,
    or a first pipeline stage that holds more, only add to it)."""
    weight, state = _state_bytes_per_param(candidate, dtype, optimizer)
    return num_params * (2 * weight + state) // _spread(candidate)


def activation_lower_bound(fields: Mapping[str, Any], candidate: Candidate, seq_len: int, dtype: str) -> int:
    """Bytes of activations one rank holds at least when its forward ends, for backward: per
    decoder layer and token, in the compute dtype and over ``tp`` (sequence parallelism), full
    recompute keeps the layer's input (``h``); selective at least as much; none at least the
    inputs of its matmuls and what attention and a dense MLP produce for backward (``4 h + 2 kv +
    3 ffn``, the MLP left out for experts). Tokens: the local batch's over ``cp``; with a pipeline
    the first rank holds at least min(pp, micro-batches) micro-batches of each of its stages' layers.
    The compiled estimates hold more (26 h and 11.5 h per layer and token for Llama 3 8B without
    and with selective recompute, 1.0 h with full: tests/tools/test_auto_plan.py checks the bound
    against compiles of each kind)."""
    h = int(fields["hidden_size"])
    layers = int(fields.get("num_hidden_layers", 1))
    heads = int(fields.get("num_attention_heads", 1))
    head_dim = int(fields.get("head_dim") or h // heads)
    kv = int(fields.get("num_key_value_heads", heads)) * head_dim
    per_token = h
    if candidate.recompute == "none":
        mlp = 0 if "num_experts" in fields else 3 * int(fields.get("intermediate_size", 4 * h))
        per_token = 4 * h + 2 * kv + mlp
    tokens = candidate.local_batch * seq_len // candidate.cp
    held_layers = layers
    if candidate.pp > 1:
        micro = candidate.micro_batches
        tokens = tokens // micro * min(candidate.pp, micro)
        # Interleaved: before its first backward the rank runs each of its v stages' forward of
        # those micro-batches (its warm-up is at least v * pp forwards).
        virtual = candidate.stages_per_rank or 1
        held_layers = layers // (candidate.pp * virtual) * virtual
    width = 4 if dtype == "fp32" else 2
    return held_layers * tokens * per_token * width // candidate.tp


def memory_lower_bound(num_params: int, fields: Mapping[str, Any], candidate: Candidate, seq_len: int, dtype: str,
                       optimizer: str) -> tuple[int, str]:
    """(bytes, what they are) a rank needs at least: the larger of the optimizer step's (weights,
    gradients, state: :func:`state_lower_bound`) and the end of forward's (weights, state and the
    saved activations, :func:`activation_lower_bound`; gradients may not exist yet)."""
    weight, state = _state_bytes_per_param(candidate, dtype, optimizer)
    at_step = state_lower_bound(num_params, candidate, dtype, optimizer)
    at_forward_end = num_params * (weight + state) // _spread(candidate) + \
        activation_lower_bound(fields, candidate, seq_len, dtype)
    if at_forward_end > at_step:
        return at_forward_end, f"parameters, {optimizer} state and the activations saved for backward"
    return at_step, f"parameters, gradients and {optimizer} state alone"


def memory_problem(num_params: int, candidate: Candidate, dtype: str, optimizer: str, budget: int,
                   fields: Mapping[str, Any] | None = None, seq_len: int = 0) -> str | None:
    """"OOM: ..." when what a rank needs at least (:func:`memory_lower_bound`; without ``fields``
    the model state alone) exceeds ``budget`` bytes, else None."""
    if fields is None:
        bound, what = state_lower_bound(num_params, candidate, dtype, optimizer), \
            f"parameters, gradients and {optimizer} state alone"
    else:
        bound, what = memory_lower_bound(num_params, fields, candidate, seq_len, dtype, optimizer)
    if bound > budget:
        return f"OOM: {what} need at least {format_bytes(bound)} per rank (budget {format_bytes(budget)})"
    return None
