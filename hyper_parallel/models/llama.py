"""A small Llama-style decoder written to capture cleanly, used by tests, examples and benchmarks.

It mirrors transformers' ``LlamaForCausalLM`` (same module and parameter names, same maths, so an HF
state dict loads into it) but is written with plain ops only, so ``torch.export.export(strict=False)``
and aot_autograd give a small, readable aten graph:

- no ``torch.no_grad`` / autocast regions (HF's rotary embedding adds a ``wrap_with_set_grad_enabled``
  higher-order op), no mask construction (attention uses SDPA's ``is_causal=True``), no cache;
- every view over heads infers the head count with ``-1``, so tensor parallelism can shard the heads
  (the local head count is then smaller than the configured one);
- RMSNorm is ``x.pow(2).mean(-1, keepdim=True)`` + ``rsqrt`` + multiply, no fused kernel.

Outputs are a :class:`CausalLMOutput`: a ``dict`` (keys ``"logits"`` and, when labels are given,
``"loss"``) that also allows attribute access (``out.loss``), registered as a pytree node so
torch.export and aot_autograd flatten and rebuild it.

Weights: ``torch.manual_seed(seed); model = LlamaForCausalLM(cfg)`` gives deterministic weights, and
``model.init_weights(seed)`` re-initialises an existing model (e.g. one built on the meta device and
materialised with ``to_empty``) from its own generator without touching the global RNG. Linear and
Embedding weights are normal(0, 0.02), norm weights are ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import pytree

__all__ = [
    "CausalLMOutput",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "apply_rotary_pos_emb",
    "causal_lm_loss",
    "rotate_half",
]

INIT_STD = 0.02


@dataclasses.dataclass
class LlamaConfig:
    """Hyper-parameters of :class:`LlamaForCausalLM` (names follow ``transformers.LlamaConfig``).

    The defaults give a tiny model (about 0.2 M parameters) that compiles and runs in well under a
    second on CPU. ``num_attention_heads`` must be a multiple of ``num_key_value_heads`` (grouped-query
    attention) and divide ``hidden_size``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # How each decoder layer's activations are kept for backward: "keep" (saved), "checkpoint"
    # (hp.checkpoint: recomputed) or "swap" (hp.swap: kept in host memory). Eagerly these are
    # torch.utils.checkpoint and save_on_cpu; parallelized, the compiler's recompute/swap passes.
    layer_activations: str = "keep"

    def __post_init__(self) -> None:
        if self.layer_activations not in ("keep", "checkpoint", "swap"):
            raise ValueError(
                f"LlamaConfig: layer_activations={self.layer_activations!r}; use 'keep', "
                "'checkpoint' or 'swap'"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention needs it)."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim={self.head_dim} must be even for rotary embeddings."
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head: ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads


class CausalLMOutput(dict):
    """Output of :class:`LlamaForCausalLM`: a ``dict`` with attribute access.

    Keys: ``"logits"`` (``(batch, seq, vocab)``) and ``"loss"`` (a scalar, only present when labels
    were passed). ``out["loss"]`` and ``out.loss`` are the same; ``out.loss`` is ``None`` when absent,
    as with HF's ``ModelOutput`` (other missing names raise ``AttributeError``). Registered as a pytree node (keys in insertion order) so
    torch.export and aot_autograd treat it like a dict and rebuild this type.
    """

    _FIELDS = ("loss", "logits")

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name in CausalLMOutput._FIELDS:
            return None
        raise AttributeError(f"CausalLMOutput has no field {name!r}; it holds {list(self)}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __reduce__(self):
        return (type(self), (dict(self),))


def _output_flatten(out: CausalLMOutput):
    return list(out.values()), list(out.keys())


def _output_unflatten(values, keys) -> CausalLMOutput:
    return CausalLMOutput(zip(keys, values))


def _output_flatten_with_keys(out: CausalLMOutput):
    return [(pytree.MappingKey(k), v) for k, v in out.items()], list(out.keys())


pytree.register_pytree_node(
    CausalLMOutput,
    _output_flatten,
    _output_unflatten,
    serialized_type_name=f"{__name__}.CausalLMOutput",
    flatten_with_keys_fn=_output_flatten_with_keys,
)


class LlamaRMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned ``weight`` (initialised to ones).

    Computed in fp32 and cast back, as HF does, with plain ops so it is easy to shard along the
    sequence (sequence parallelism) and needs no custom sharding rule.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def reset_parameters(self) -> None:
        """Set ``weight`` to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension and scale by ``weight``."""
        dtype = x.dtype
        h = x.float() if dtype != torch.float32 else x
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if dtype != torch.float32:
            h = h.to(dtype)
        return self.weight * h

    def extra_repr(self) -> str:
        """Shown in ``repr(module)``: size and epsilon."""
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LlamaRotaryEmbedding(nn.Module):
    """Rotary position embedding: returns ``cos`` and ``sin`` of shape ``(seq_len, head_dim)``.

    ``inv_freq`` is a non-persistent buffer (not in the state dict, like HF); positions are
    ``torch.arange(seq_len)`` computed in forward, so nothing depends on ``max_position_embeddings``.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._compute_inv_freq(None), persistent=False)

    def _compute_inv_freq(self, device: Optional[torch.device]) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponent)

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` in place (needed after ``to_empty`` from the meta device)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._compute_inv_freq(self.inv_freq.device))

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` for positions ``0 .. seq_len-1`` in ``x``'s dtype and device."""
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if x.dtype != torch.float32:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension: ``(x1, x2) -> (-x2, x1)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to ``q``/``k`` of shape ``(b, heads, s, head_dim)``.

    ``cos``/``sin`` have shape ``(s, head_dim)`` and broadcast over batch and heads.
    """
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed, k_embed


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (``q/k/v/o_proj``, no bias).

    Head counts are never hard-coded in a view: tensor parallelism shards ``q/k/v_proj`` column-wise,
    so the local tensors hold ``heads / tp`` heads and every reshape infers the count with ``-1``.
    Only the ratio ``num_attention_heads // num_key_value_heads``, which sharding preserves, is used.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_kv_groups = config.num_attention_heads // config.num_key_value_heads
        kv_size = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        # (b, kv_heads, s, d) -> (b, kv_heads * groups, s, d); each kv head serves `groups` q heads.
        if self.num_kv_groups == 1:
            return x
        b, _, s, d = x.shape
        return x[:, :, None].expand(-1, -1, self.num_kv_groups, -1, -1).reshape(b, -1, s, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(b, s, hidden)``; returns the same shape."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no bias."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward block to ``x`` of shape ``(..., hidden)``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Run the block on ``x`` of shape ``(b, s, hidden)``."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder stack without the LM head: embeddings, ``layers``, final ``norm``, ``rotary_emb``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layer_activations = config.layer_activations
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.head_dim, theta=config.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(b, s)`` to final hidden states ``(b, s, hidden)``."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, input_ids.shape[1])
        mode = self.layer_activations
        for layer in self.layers:
            if mode == "keep":
                h = layer(h, cos, sin)
            else:
                from .. import recompute

                h = (recompute.checkpoint if mode == "checkpoint" else recompute.swap)(layer, h, cos, sin)
        return self.norm(h)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next-token cross-entropy as HF computes it: position ``t`` predicts ``labels[:, t + 1]``.

    Computed in fp32, mean over the predicted tokens whose label is not -100 (``F.cross_entropy``'s
    default ``ignore_index``). ``num_items_in_batch`` (HF's argument): divide the summed loss by this
    count instead, e.g. the tokens of every micro-batch of a gradient-accumulation step, so the
    micro-steps' losses add up to the mean over the whole step's tokens.
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    # The labels move one left (the last position gets -100, ignored), not the logits: slicing the
    # logits on the sequence dim would gather them whole when the sequence is sharded (context
    # parallelism); the labels are a small integer tensor.
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(flat_logits, flat_labels, reduction="mean")
    return F.cross_entropy(flat_logits, flat_labels, reduction="sum") / num_items_in_batch


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head, named exactly like ``transformers.LlamaForCausalLM``.

    ``forward(input_ids, labels=None)`` returns a :class:`CausalLMOutput` (a dict with attribute
    access): ``{"logits": (b, s, vocab)}``, plus ``"loss"`` (scalar fp32, see :func:`causal_lm_loss`)
    first when ``labels`` is given. Parameter names: ``model.embed_tokens.weight``,
    ``model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight``
    (absent from ``named_parameters()`` when ``tie_word_embeddings`` shares it with the embedding).
    """

    def __init__(self, config: Optional[LlamaConfig] = None) -> None:
        super().__init__()
        self.config = config if config is not None else LlamaConfig()
        self.model = LlamaModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """(Re-)initialise every parameter and the rotary buffer, deterministically.

        Linear and Embedding weights ~ normal(0, 0.02), norm weights = 1, ``inv_freq`` recomputed.
        Modules are visited in ``named_modules()`` order, so the same RNG state gives the same
        weights. With ``seed=None`` the global RNG is used (so ``torch.manual_seed(seed)`` before
        construction fixes the weights); with a seed, a private generator on the parameters' device
        is used and the global RNG is left alone. Parameters on the meta device are skipped.
        """
        generators: dict[torch.device, torch.Generator] = {}

        def _generator_for(t: torch.Tensor) -> Optional[torch.Generator]:
            if seed is None or t.device.type == "meta":
                return None
            if t.device not in generators:
                generators[t.device] = torch.Generator(device=t.device).manual_seed(seed)
            return generators[t.device]

        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) in seen:  # tied lm_head / embedding: initialise once
                    continue
                seen.add(id(module.weight))
                if module.weight.device.type != "meta":
                    nn.init.normal_(module.weight, 0.0, INIT_STD, generator=_generator_for(module.weight))
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (LlamaRMSNorm, LlamaRotaryEmbedding)):
                module.reset_parameters()

    def reset_parameters(self) -> None:
        """Same as :meth:`init_weights` with the global RNG (``nn.Module`` convention)."""
        self.init_weights()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[torch.Tensor] = None) -> CausalLMOutput:
        """Compute logits for ``input_ids`` ``(b, s)`` and, with ``labels`` ``(b, s)``, the loss
        (:func:`causal_lm_loss`; ``num_items_in_batch`` as there, a 0-d tensor)."""
        logits = self.lm_head(self.model(input_ids))
        if labels is None:
            return CausalLMOutput(logits=logits)
        return CausalLMOutput(loss=causal_lm_loss(logits, labels, num_items_in_batch), logits=logits)

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

