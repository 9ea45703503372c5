"""Tiny configurations of ``transformers`` architectures, their FSDP units and Megatron TP plans.

``tiny_hf_model("MistralForCausalLM")`` builds a randomly initialised, tiny version of a
``transformers`` model class (vocabulary 256, hidden 64, 2 layers, 4 heads, 2 key/value heads where
the architecture has grouped-query attention, FFN width 128, MoE with 4 experts top-2, dropout 0,
``use_cache=False``, SDPA attention where the class supports it), in train mode, its weights
depending only on ``seed``. These are the models ``tests/end_to_end/test_hf_models.py`` checks at
single-device parity (README, "Verified models").

``hf_fsdp_plan(arch)`` gives the ``fully_shard`` plan with each decoder / encoder layer as a unit
and the root as the last, ``hf_tp_plan(arch)`` a Megatron tensor-parallel plan on the ``"tp"`` mesh
axis (column-parallel Q/K/V and FFN input projections, row-parallel output projections,
vocab-parallel embedding and head where the architecture has them), or ``None`` where the
architecture has none here.

Inputs are ``input_ids`` and ``labels`` of shape ``(batch, seq)`` for every architecture (T5 builds
its decoder inputs from the labels; BERT's masked-LM loss counts every labelled position).

transformers is an optional (dev) dependency, imported only when a builder is called.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.models.hf import _TINY_GPT2, _TINY_LLAMA, _import_transformers

__all__ = ["HF_ARCHS", "hf_fsdp_plan", "hf_layer_globs", "hf_tp_plan", "tiny_hf_config", "tiny_hf_model"]

# Shared by the decoder-only LMs with Llama-style configs: the tiny Llama's sizes (the attention
# implementation is chosen per architecture below). Head dim 64 / 4 = 16 everywhere (several
# architectures default to head_dim 128 or 256 independently of hidden_size, so it is set).
_DECODER = {k: v for k, v in _TINY_LLAMA.items() if k != "attn_implementation"}
_MOE = dict(intermediate_size=64)  # Mixtral's intermediate_size is each expert's width

# arch -> (config class, config entries, attention implementation). Token ids that default to
# values outside the tiny vocabulary (padding_idx of the embedding, bos/eos) are moved inside it.
_SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "LlamaForCausalLM": ("LlamaConfig", dict(_TINY_LLAMA), "sdpa"),
    # sliding_window 8 < seq 16: the sliding-window mask is part of the captured graph.
    "MistralForCausalLM": ("MistralConfig", dict(_DECODER, head_dim=16, sliding_window=8), "sdpa"),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(_DECODER), "sdpa"),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(_DECODER, head_dim=16), "sdpa"),
    # Gemma 2 has no SDPA path in transformers (attention logit soft-capping): eager attention.
    # sliding_window 8 < seq 16 so the sliding-window mask of layer 0 matters; tied embeddings as
    # the real models.
    "Gemma2ForCausalLM": ("Gemma2Config", dict(
        _DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        _DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    # As many key/value heads as query heads, as Phi-3-mini and Phi-3.5-mini: the fused [q; k; v]
    # is three equal parts (hf_tp_plan).
    "Phi3ForCausalLM": ("Phi3Config", dict(_DECODER, num_key_value_heads=_DECODER["num_attention_heads"],
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2), "sdpa"),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, use_cache=False, tie_word_embeddings=False), "sdpa"),
    # OPT ties lm_head to the embedding (as the released checkpoints).
    "OPTForCausalLM": ("OPTConfig", dict(
        vocab_size=256, hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, use_cache=False), "sdpa"),
    "GPT2LMHeadModel": ("GPT2Config", dict(_TINY_GPT2), "sdpa"),
    # Falcon's "new decoder architecture" (Falcon-40B/180B): grouped K/V heads, fused QKV laid out
    # per K/V group, so a column split of query_key_value keeps whole groups on a rank.
    "FalconForCausalLM": ("FalconConfig", dict(
        vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True, multi_query=False, parallel_attn=True, bias=False,
        alibi=False, bos_token_id=0, eos_token_id=0, use_cache=False, tie_word_embeddings=False), "sdpa"),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(_DECODER, pad_token_id=1, eos_token_id=0), "sdpa"),
    "StableLmForCausalLM": ("StableLmConfig", dict(_DECODER), "sdpa"),
    "MixtralForCausalLM": ("MixtralConfig", dict(
        _DECODER, **_MOE, head_dim=16, num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(
        _DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1), "sdpa"),
    # DeepSeek-V3: multi-head latent attention (low-rank Q and KV, decoupled RoPE dims) and an MoE
    # with one shared expert after first_k_dense_replace dense layers; one expert group.
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(
        _DECODER, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1),
        "sdpa"),
    # GPT-OSS: attention sinks (a learned logit per head), sliding + full layers, experts with
    # biases and a clamped SwiGLU, run by transformers' batched kernel (its grouped one sorts every
    # token by expert, which runs replicated under DP as for Mixtral).
    "GptOssForCausalLM": ("GptOssConfig", dict(
        _DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], experts_implementation="batched_mm"), "eager"),
    # Qwen3-Next: a gated delta-net linear-attention layer (causal conv1d, softplus gates, chunked
    # delta rule: transformers' PyTorch reference kernels) before a full-attention one; MoE with a
    # shared expert.
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(
        _DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        experts_implementation="batched_mm"), "sdpa"),
    "T5ForConditionalGeneration": ("T5Config", dict(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False), "sdpa"),
    "BertForMaskedLM": ("BertConfig", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        use_cache=False), "sdpa"),
}

HF_ARCHS: tuple[str, ...] = tuple(_SPECS)

# The repeated blocks (FSDP units, TP globs) of each architecture's module tree.
_LAYERS = {
    "GPTNeoXForCausalLM": ("gpt_neox.layers.*",),
    "OPTForCausalLM": ("model.decoder.layers.*",),
    "GPT2LMHeadModel": ("transformer.h.*",),
    "FalconForCausalLM": ("transformer.h.*",),
    "T5ForConditionalGeneration": ("encoder.block.*", "decoder.block.*"),
    "BertForMaskedLM": ("bert.encoder.layer.*",),
}


def _spec(arch: str):
    try:
        return _SPECS[arch]
    except KeyError:
        raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(HF_ARCHS)}") from None


def tiny_hf_config(arch: str, **overrides: Any):
    """The ``transformers`` config :func:`tiny_hf_model` builds ``arch`` with, ``overrides`` applied."""
    transformers = _import_transformers()
    config_name, entries, attn = _spec(arch)
    entries = {"attn_implementation": attn, **entries, **overrides}
    return getattr(transformers, config_name)(**entries)


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any):
    """Build a tiny ``transformers.<arch>`` (e.g. ``"MistralForCausalLM"``), in train mode.

    ``overrides`` replace entries of its config. The weights depend only on ``seed``: the model is
    built under ``torch.random.fork_rng`` so the caller's global RNG state is untouched. Raises
    ``ValueError`` for an architecture without a tiny config here (the message lists them) and
    ``ImportError`` (with the install command) without transformers.
    """
    transformers = _import_transformers()
    config = tiny_hf_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(config)
    model.train()
    return model


def hf_layer_globs(arch: str) -> tuple[str, ...]:
    """Module globs of ``arch``'s repeated layers (``("model.layers.*",)`` for Llama-style models)."""
    _spec(arch)
    return _LAYERS.get(arch, ("model.layers.*",))


def hf_fsdp_plan(arch: str, **fully_shard: Any) -> dict[str, Any]:
    """``fully_shard`` plan: each layer a unit, then the root (embeddings, final norm, head).
    ``fully_shard`` adds entries (``reshard_after_forward=...``)."""
    return {"fully_shard": {"units": [*hf_layer_globs(arch), ""], **fully_shard}}


def _megatron(prefix: str, colwise: tuple[str, ...], rowwise: tuple[str, ...]) -> dict[str, str]:
    """``{prefix.name: "colwise"}`` for each of ``colwise``, ``"rowwise"`` for each of ``rowwise``."""
    return {**{f"{prefix}.{n}": "colwise" for n in colwise}, **{f"{prefix}.{n}": "rowwise" for n in rowwise}}


def gpt2_tp_layouts() -> dict[str, Any]:
    """GPT-2's tensor parallelism as ``layouts``: its ``Conv1D`` weights are [in, out], so the
    column-parallel c_attn / c_fc split weight dim 1 and bias dim 0 over tp, the row-parallel
    c_proj weight dim 0. c_attn's columns are q, k and v side by side, split apart after the
    projection: each third is split over tp (``_StridedShard(split_factor=3)``), so every rank holds
    its heads' q, k and v and the attention runs on them (propagation/fused_projections.py); a
    plain column split would leave the split to gather the projection's output."""
    from torch.distributed.tensor import Shard

    from hyper_parallel.compat import StridedShard

    col = {"parameter": {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}}
    qkv = {"parameter": {"weight": {"tp": StridedShard(1, split_factor=3)},
                         "bias": {"tp": StridedShard(0, split_factor=3)}}}
    row = {"parameter": {"weight": {"tp": Shard(0)}}}
    return {"transformer.h.*.attn.c_attn": qkv, "transformer.h.*.mlp.c_fc": col,
            "transformer.h.*.attn.c_proj": row, "transformer.h.*.mlp.c_proj": row}


def hf_tp_plan(arch: str) -> dict[str, Any] | None:
    """A Megatron tensor-parallel plan for ``arch`` on the ``"tp"`` mesh axis, or ``None``.

    Needs the head count, the K/V head count and the FFN width divisible by the TP degree (2 for
    the tiny configs). Notes per architecture:

    * Llama-style (Llama, Mistral, Qwen2/3, Gemma2/3, Olmo2, StableLM): the plan of
      :func:`hyper_parallel.models.llama_tp_plan`. Gemma's tied embedding and head are both sharded
      over the vocabulary (dim 0 of the one weight).
    * Mixtral, GPT-OSS: attention only; the experts (3-D ``gate_up_proj`` / ``down_proj`` parameters
      of one module) stay replicated, as do GPT-OSS's attention sinks (one logit per head: each rank
      reads its heads'). Qwen2-MoE: attention and the shared expert.
    * Qwen3-Next: none here (its linear-attention layers' fused projections would need their own).
    * DeepSeek-V3 (MLA): ``q_b_proj`` and ``kv_b_proj`` column-parallel (per-head up-projections),
      ``o_proj`` row-parallel, the dense first layer's MLP Megatron-style; the low-rank
      down-projections and the routed experts replicated.
    * GPT-NeoX, Falcon (new decoder architecture): the fused ``query_key_value`` is laid out per
      head / per K/V group, so a column split keeps whole heads on a rank.
    * GPT-2: ``Conv1D`` weights are ``[in, out]``, so the plan is ``layouts=`` (weight ``Shard(1)`` +
      bias ``Shard(0)`` column-parallel, weight ``Shard(0)`` row-parallel); the fused ``c_attn``
      is split per third of q, k, v (:func:`gpt2_tp_layouts`).
    * Phi-3: the fused ``qkv_proj`` ([q; k; v]) and ``gate_up_proj`` ([gate; up]) are
      ``ColwiseParallel(parts=3)`` / ``parts=2``: each part split over tp, so every rank holds its
      heads' q, k and v and its columns of gate and up. For Phi-3-mini and Phi-3.5-mini (as many
      key/value heads as query heads). Under grouped-query attention (Phi-3-medium, Phi-4-mini) k
      and v are narrower than q, parts of unequal width no strided shard describes: ``parallelize``
      raises when the width does not split in three, else the slices gather each layer's
      projection output (warned as collectives beyond the plan). Leave ``qkv_proj`` and ``o_proj``
      out of the plan there: the attention then runs replicated.
    """
    from hyper_parallel.models.plans import llama_tp_plan

    _spec(arch)
    if arch == "Qwen3NextForCausalLM":
        return None
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "StableLmForCausalLM"):
        return llama_tp_plan()
    layer = "model.layers.*"
    qkv, o = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",)
    lm = {"model.embed_tokens": "rowwise", "lm_head": "colwise"}
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        tp = {**_megatron(layer, qkv, o), **lm}
    elif arch == "Qwen2MoeForCausalLM":
        tp = {**_megatron(layer, qkv + ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                          o + ("mlp.shared_expert.down_proj",)), **lm}
    elif arch == "DeepseekV3ForCausalLM":
        tp = {**_megatron(layer, ("self_attn.q_b_proj", "self_attn.kv_b_proj"), o),
              **_megatron("model.layers.0.mlp", ("gate_proj", "up_proj"), ("down_proj",)), **lm}
    elif arch == "GPTNeoXForCausalLM":
        tp = {"gpt_neox.embed_in": "rowwise", "lm_head": "colwise",
              **_megatron("gpt_neox.layers.*", ("attention.query_key_value", "mlp.dense_h_to_4h"),
                          ("attention.dense", "mlp.dense_4h_to_h"))}
    elif arch == "OPTForCausalLM":
        tp = {"model.decoder.embed_tokens": "rowwise", "lm_head": "colwise",
              **_megatron("model.decoder.layers.*", qkv + ("fc1",), ("self_attn.out_proj", "fc2"))}
    elif arch == "FalconForCausalLM":
        tp = {"transformer.word_embeddings": "rowwise", "lm_head": "colwise",
              **_megatron("transformer.h.*", ("self_attention.query_key_value", "mlp.dense_h_to_4h"),
                          ("self_attention.dense", "mlp.dense_4h_to_h"))}
    elif arch == "GPT2LMHeadModel":
        return {"layouts": gpt2_tp_layouts()}
    elif arch == "T5ForConditionalGeneration":
        # The shared embedding is the encoder's and decoder's embed_tokens and (tied) the head.
        tp = {"shared": "rowwise", "lm_head": "colwise"}
        attn = lambda name: (f"{name}.q", f"{name}.k", f"{name}.v")  # noqa: E731
        tp.update(_megatron("encoder.block.*.layer", attn("0.SelfAttention") + ("1.DenseReluDense.wi",),
                            ("0.SelfAttention.o", "1.DenseReluDense.wo")))
        tp.update(_megatron("decoder.block.*.layer",
                            attn("0.SelfAttention") + attn("1.EncDecAttention") + ("2.DenseReluDense.wi",),
                            ("0.SelfAttention.o", "1.EncDecAttention.o", "2.DenseReluDense.wo")))
    elif arch == "BertForMaskedLM":
        tp = _megatron("bert.encoder.layer.*",
                       ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
                       ("attention.output.dense", "output.dense"))
    else:  # Phi3ForCausalLM
        from hyper_parallel.tp.styles import ColwiseParallel

        tp = {**lm, f"{layer}.self_attn.qkv_proj": ColwiseParallel(parts=3),
              f"{layer}.mlp.gate_up_proj": ColwiseParallel(parts=2),
              **_megatron(layer, (), ("self_attn.o_proj", "mlp.down_proj"))}
    return {"tensor_parallel": tp}
