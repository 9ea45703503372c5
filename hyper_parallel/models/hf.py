"""Tiny transformers ``LlamaForCausalLM`` (and ``GPT2LMHeadModel``, :func:`tiny_hf_gpt2`) for tests that
check real HF models capture and parallelize.

transformers is an optional (dev) dependency and is imported only when a builder is called.
Notes on capturing it with ``torch.export.export(model, (), {"input_ids": ids, "labels": ids},
strict=False)`` (torch 2.13, transformers 5.23): it works with the config below and no patches.
``use_cache=False`` keeps the ``DynamicCache`` object out of the graph and the outputs;
``attn_implementation="sdpa"`` gives one ``aten.scaled_dot_product_attention`` per layer. Under
export HF never skips its mask, so the graph contains the mask construction (``arange``/``le``/
``__and__``/``expand`` to a ``(b, 1, s, s)`` bool mask) and SDPA gets ``attn_mask`` instead of
``is_causal=True`` (hence also ``repeat_kv`` rather than ``enable_gqa``); the rotary embedding runs
under ``torch.no_grad`` and appears as a ``wrap_with_set_grad_enabled`` higher-order op; the buffers
``model.rotary_emb.inv_freq`` and ``original_inv_freq`` are non-persistent. Our own
:class:`hyper_parallel.models.LlamaForCausalLM` has the same parameter names without these extras.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_hf_gpt2", "tiny_hf_llama", "tiny_hf_llama_config"]

_TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    use_cache=False,
    attn_implementation="sdpa",
    tie_word_embeddings=False,
)

# GPT-2's projections are ``Conv1D`` modules: weight [in, out] (transposed against nn.Linear), so a
# column-parallel one is weight Shard(1) + bias Shard(0). bos/eos default to 50256, outside the
# tiny vocabulary; they are unused in training but transformers warns, so point them at 0. Dropout
# off (GPT-2 defaults to 0.1): tests compare against one device, where random ops cannot agree.
_TINY_GPT2 = dict(
    vocab_size=256,
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    use_cache=False,
    attn_implementation="sdpa",
)


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "hyper_parallel.models.hf needs transformers, an optional dependency; "
            "install it with `pip install -e '.[dev]'` (or `pip install transformers`)."
        ) from e
    return transformers


def tiny_hf_llama_config(**overrides: Any):
    """Return the ``transformers.LlamaConfig`` used by :func:`tiny_hf_llama`, with ``overrides``."""
    transformers = _import_transformers()
    return transformers.LlamaConfig(**{**_TINY_LLAMA, **overrides})


def tiny_hf_llama(seed: int = 0, **overrides: Any):
    """Build a tiny ``transformers.LlamaForCausalLM`` (2 layers, hidden 64, vocab 256), in train mode.

    ``overrides`` replace entries of the config (e.g. ``num_hidden_layers=4``). The weights depend
    only on ``seed``: the model is built under ``torch.random.fork_rng`` so the caller's global RNG
    state is untouched. Raises ``ImportError`` (with the install command) without transformers.
    """
    transformers = _import_transformers()
    config = tiny_hf_llama_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def tiny_hf_gpt2(seed: int = 0, **overrides: Any):
    """Build a tiny ``transformers.GPT2LMHeadModel`` (2 layers, n_embd 64, 4 heads, vocab 256), in
    train mode, its weights depending only on ``seed`` (as :func:`tiny_hf_llama`). ``overrides``
    replace entries of the ``GPT2Config``. Raises ``ImportError`` (with the install command) without
    transformers."""
    transformers = _import_transformers()
    config = transformers.GPT2Config(**{**_TINY_GPT2, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model
