"""torchtitan's selective *op* activation checkpointing as a hyper_parallel plan, for
``bench_cost_model_published.py``: the FSDP preset with every decoder layer recomputed under the
policy torchtitan's published Llama 3.1 runs used (``selective_ac_option = 'op'``, its commit
9dec370, ``parallelize_llama.py``): keep the outputs of matmuls, attention, reduce-scatters and
``abs`` / ``max``, except every second matmul of a block, and recompute the rest.

torchtitan counts matmuls as they run in its block (wq, wk, wv, wo, w1, w3, w2) and recomputes the
even ones: wk, wo and w3. This plan names them by module instead (``k_proj``, ``o_proj`` and
``up_proj`` in the example Llama, whose ``gate_proj`` is w1 and ``up_proj`` w3), so the policy is
the same without a counter. hyper_parallel's own ``"selective"`` keeps every matmul.

``hyper-parallel explain --plan bench/plans/torchtitan_op_sac.py`` uses it too.
"""

from __future__ import annotations

import dataclasses

import torch

import hyper_parallel as hp

aten = torch.ops.aten
_SAVED = frozenset({
    aten.mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    # The CPU form of the flash kernel: what a model captured off a GPU (explain's meta tensors) calls.
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    aten.abs.default,
    aten.max.default,
})
_SECOND_MATMULS = ("self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj")


def op_sac_policy(ctx, op, *args, **kwargs) -> hp.CheckpointPolicy:
    if op is aten.mm.default and ctx.module_fqn.endswith(_SECOND_MATMULS):
        return hp.CheckpointPolicy.PREFER_RECOMPUTE
    return hp.CheckpointPolicy.MUST_SAVE if op in _SAVED else hp.CheckpointPolicy.PREFER_RECOMPUTE


def plan(mesh_axes: dict, config: dict):
    from hyper_parallel.tools.presets import build_plan

    base = build_plan("fsdp", mesh_axes, config).plan
    recompute = {"model.layers.*": op_sac_policy}
    if isinstance(base, dict):
        return {**base, "recompute": recompute}
    return dataclasses.replace(base, recompute=recompute)
