"""An analytic step time per candidate: the order in which ``auto_plan`` compiles them.

Compiling a candidate on fake ranks takes seconds (10-20 s for a Llama 3 8B pipeline on this
machine), and a world of 256 ranks has hundreds of candidates, so the search compiles the most
promising first and at most ``max_compiles`` of them (``search.py``). This module says which are
promising, from the model config and the degrees alone, in microseconds. It decides nothing else:
every prediction ``auto_plan`` reports, and the choice, come from the compiled programs.

The estimate, per rank and step (``h`` hidden size, ``L`` layers, tokens the rank computes):

* compute: the matmul FLOPs of a decoder (attention projections, MLP or the routed experts'
  share, the LM head), 3x for forward and backward, one more forward of the layers with full
  recompute, at the profile's achievable matmul rate; causal attention's scores and values (and
  their recompute under selective or full) at its attention rate;
* pipeline bubble: 1F1B keeps ``(pp - 1) / (m + pp - 1)`` of the step idle, interleaving with
  ``v`` stages per rank ``(pp - 1) / (v m + pp - 1)``;
* tensor parallelism: per layer and step two all-gathers and two reduce-scatters of the layer's
  activations in forward and as many in backward, none overlapped;
* FSDP: each step gathers the rank's parameters twice (forward, backward; under a pipeline twice per
  micro-batch) and reduce-scatters its gradients; overlapped with compute, only what exceeds it
  counts;
* pipeline sends: two per micro-batch and stage boundary.

The search also expects a peak (:func:`expected_peak_bytes`: the memory lower bound with the saved
activations the compiled estimates have): candidates expected over the budget go after the rest,
so the compile budget is not spent confirming OOMs. Neither is a bound: the raw step estimate came
out 0.6-0.7 of the compiled predictions without a pipeline and 0.4-0.5 with one (Llama 3 8B, 70B,
405B on H100s), so ``search.py`` scales both by what the compiles so far found, per kind.

Reads: the candidate, the config fields, the hardware profile. Writes: nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...cost.comm import AxisInfo, collective_time
from ...cost.hardware import HardwareProfile
from .space import Candidate

__all__ = ["analytic_step_s", "expected_peak_bytes"]

# Saved activations per layer and token over prune.activation_lower_bound's count (without
# recompute), as compiled estimates have them: Llama 3 8B saves 26 h without recompute where the
# bound counts 15.4 h, and 11.5 h with selective recompute (taken as the bound's whole count: a
# pipeline's interleaved stages hold more micro-batches than the bound counts, and Llama 3 70B's
# selective candidates came out over what 0.75 predicted); full saves the layer input the bound
# counts. An expectation for the order, never a bound.
_SAVED_OVER_BOUND = {"none": 1.7, "selective": 1.0, "full": 1.0}

_BYTES = {"bf16": 2, "fp32": 4}


def analytic_step_s(candidate: Candidate, fields: Mapping[str, Any], profile: HardwareProfile, *,
                    seq_len: int, dtype: str) -> float:
    """Seconds of one optimizer step of ``candidate``, roughly (module docstring)."""
    h = int(fields["hidden_size"])
    layers = int(fields.get("num_hidden_layers", 1))
    heads = int(fields.get("num_attention_heads", 1))
    head_dim = int(fields.get("head_dim") or h // heads)
    q_width, kv_width = heads * head_dim, int(fields.get("num_key_value_heads", heads)) * head_dim
    attention = h * (q_width + 2 * kv_width) + q_width * h
    mlp = 3 * h * int(fields.get("intermediate_size", 4 * h))
    if "num_experts" in fields:
        routed = int(fields.get("num_experts_per_tok", 1)) * 3 * h * int(fields.get("moe_intermediate_size", 4 * h))
        shared = 3 * h * int(fields.get("shared_expert_intermediate_size", 0))
        dense = int(fields.get("first_k_dense_layers", 0))
        mlp = (dense * mlp + (layers - dense) * (routed + shared)) / layers
    c = candidate
    tokens = c.local_batch * seq_len // c.cp  # what one data-parallel rank's tp group computes per step
    # Per token and layer, forward: 2 FLOPs per weight, and causal attention's scores and values
    # (2 matmuls of the sequence by itself, half of them masked) over this rank's cp share.
    # The two run different kernels: projections at the matmul rate, the fused attention kernel
    # (scores and values) at the profile's attention rate (on the CPU about 0.6 of the matmul's).
    dense_forward = 2 * (attention + mlp)
    scores_forward = 2 * q_width * seq_len / c.cp
    head_forward = 2 * h * int(fields.get("vocab_size", 0))
    dense_again = dense_forward if c.recompute == "full" else 0.0
    scores_again = 0.0 if c.recompute == "none" else scores_forward
    per_rank = tokens / (c.tp * c.pp)
    dense = per_rank * (layers * (3 * dense_forward + dense_again) + 3 * head_forward)
    scores = per_rank * layers * (3 * scores_forward + scores_again)
    peak = profile.flops_per_s(dtype)
    compute = dense / (peak * profile.matmul_efficiency) + scores / (peak * profile.compute_efficiency(attention=True))
    if c.pp > 1:
        virtual = c.stages_per_rank or 1
        compute /= 1 - (c.pp - 1) / (virtual * c.micro_batches + c.pp - 1)

    width = _BYTES.get(dtype, 2)
    axes = _axes(c, profile)
    comm = 0.0
    if c.tp > 1:
        activation = tokens * h * width  # one layer's activations of the tp group
        per_layer = 2 * (collective_time("all_gather", activation // c.tp, axes["tp"], profile)
                         + collective_time("reduce_scatter", activation, axes["tp"], profile))
        comm += 2 * per_layer * layers / c.pp
    if c.dp_shard > 1:
        params = (layers * (attention + mlp) + head_forward) / (c.tp * c.pp)  # this rank's share, unsharded
        # Gathered for forward and again for backward, per micro-batch under a pipeline (a stage
        # reshards between its micro-batches); gradients reduced once, after the last.
        gathers = 2 * (c.micro_batches if c.pp > 1 else 1)
        fsdp = (gathers * collective_time("all_gather", int(params * width) // c.dp_shard, axes["dp_shard"], profile)
                + collective_time("reduce_scatter", int(params * 4), axes["dp_shard"], profile))
        comm += max(0.0, fsdp - compute)
    if c.pp > 1:
        boundary = tokens // c.micro_batches * h * width // c.tp
        comm += 2 * c.micro_batches * collective_time("send_recv", boundary, axes["pp"], profile)
    return compute + comm


def _axes(c: Candidate, profile: HardwareProfile) -> dict[str, AxisInfo]:
    """Each axis's size and rank stride in ParallelDims' mesh order (pp outermost, tp innermost),
    which decides intra- or inter-node links."""
    order = [("pp", c.pp), ("dp_replicate", c.dp_replicate), ("dp_shard", c.dp_shard * c.ep), ("cp", c.cp),
             ("tp", c.tp)]
    out, stride = {}, 1
    for name, size in reversed(order):
        out[name] = AxisInfo(name, size, stride)
        stride *= size
    return out


def expected_peak_bytes(candidate: Candidate, fields: Mapping[str, Any], num_params: int, *, seq_len: int,
                        dtype: str, optimizer: str) -> int:
    """Roughly the peak the compile will estimate: :func:`~.prune.memory_lower_bound` with the saved
    activations scaled to what compiles of Llama 3 8B save (``_SAVED_OVER_BOUND``), and under a
    pipeline with FSDP the unsharded gradient sums its stages keep between micro-batches."""
    from .prune import activation_lower_bound, memory_lower_bound, state_lower_bound

    bound, _ = memory_lower_bound(num_params, fields, candidate, seq_len, dtype, optimizer)
    if candidate.recompute == "selective":  # the bound counts selective as full: scale none's count
        activations = activation_lower_bound(fields, _with_recompute(candidate, "none"), seq_len, dtype)
    else:
        activations = activation_lower_bound(fields, candidate, seq_len, dtype)
    state = state_lower_bound(num_params, candidate, dtype, optimizer)
    if candidate.pp > 1 and candidate.dp_shard > 1 and candidate.fp32_masters:
        # A pipeline stage defers its gradients' reduce-scatter to the step's last micro-batch and
        # sums them unsharded until then (fp32): the stage's whole share, not 1/dp_shard of it.
        state += num_params * 4 // (candidate.tp * candidate.pp * candidate.ep)
    return max(bound, state + int(activations * _SAVED_OVER_BOUND[candidate.recompute]))


def _with_recompute(candidate: Candidate, recompute: str) -> Candidate:
    import dataclasses

    return dataclasses.replace(candidate, recompute=recompute)
