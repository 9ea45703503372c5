"""An example mixture-of-experts decoder: Llama attention, token-choice top-k routed SwiGLU experts.

Structure (names follow the HF MoE models, so plans written for them read the same)::

    model.layers.{i}.mlp                   MoEBlock (router + experts [+ shared expert])
    model.layers.{i}.mlp.router.gate       Linear(hidden, num_experts): routing scores
    model.layers.{i}.mlp.experts           MoEExperts: stacked weights [num_experts, ...]
    model.layers.{i}.mlp.shared_expert     LlamaMLP-shaped dense expert (optional)

The experts module has the interface the compiler's expert parallelism works on (``hp.ExpertParallel``,
docs/architecture.md §2.10): ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) ->
[T, H]``, every output row computed from the same input row only, and every parameter stacked with
the experts on dim 0. HF's ``MixtralExperts`` / ``Qwen2MoeExperts`` have the same interface.

The experts run dropless (no capacity factor): tokens are sorted by expert and each expert multiplies
exactly the rows routed to it, so the per-expert row counts are data-dependent. The load-balancing
auxiliary loss (Switch Transformer form, ``num_experts * sum_e f_e * P_e`` with ``f_e`` the fraction
of routed (token, choice) pairs and ``P_e`` the mean routing probability, over the whole batch) is
returned as ``aux_loss`` and added to ``loss`` times ``router_aux_loss_coef``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .llama import (
    INIT_STD,
    CausalLMOutput,
    LlamaAttention,
    LlamaConfig,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    causal_lm_loss,
)

__all__ = ["MoEConfig", "MoEExperts", "MoERouter", "MoEBlock", "MoEForCausalLM"]


@dataclasses.dataclass
class MoEConfig(LlamaConfig):
    """Hyper-parameters of :class:`MoEForCausalLM`: :class:`LlamaConfig`'s plus the MoE ones.

    ``num_experts`` routed experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen
    per token; ``score_func`` "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3);
    ``norm_topk_prob`` renormalises the chosen scores to sum to 1; ``shared_expert_intermediate_size``
    > 0 adds a dense expert every token goes through; the first ``first_k_dense_layers`` layers use a
    dense MLP of ``intermediate_size`` (DeepSeek's ``first_k_dense_replace``).
    """

    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 0
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    first_k_dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig: score_func={self.score_func!r}; use 'softmax' or 'sigmoid'")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"MoEConfig: num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}"
            )


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights, run dropless.

    Parameters ``gate_proj``, ``up_proj`` ``[E, hidden, inter]`` and ``down_proj`` ``[E, inter,
    hidden]``. ``forward(x [T, H], top_k_index [T, k], top_k_weights [T, k])``: the k expert outputs
    of every token weighted by its routing weights and summed, in fp32 when the weights are fp32, then
    cast to ``x``'s dtype. Rows are sorted by expert (stable) and each expert multiplies its rows in
    one matmul; the per-expert counts are data-dependent.
    """

    # The dim of each weight holding the intermediate size, which hp.ExpertTensorParallel splits.
    expert_tensor_parallel_dims = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, expert_ids, torch.ones_like(expert_ids)
        )
        sizes = counts.tolist()
        # The last expert takes the rest: the same number, but traced on data-dependent row counts
        # (expert parallelism) the chunks then provably add up to the rows.
        sizes[-1] = rows.shape[0] - sum(sizes[:-1])
        outs = [
            (F.silu(chunk @ self.gate_proj[e]) * (chunk @ self.up_proj[e])) @ self.down_proj[e]
            for e, chunk in enumerate(torch.split(rows, sizes))
        ]
        by_expert = torch.cat(outs)
        # Back to (token, choice) order, weighted, summed over the k choices.
        per_choice = torch.empty_like(by_expert).index_copy(0, order, by_expert)
        weighted = per_choice.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(x.dtype)

    def extra_repr(self) -> str:
        e, h, i = self.gate_proj.shape
        return f"num_experts={e}, hidden={h}, intermediate={i}"


class MoERouter(nn.Module):
    """Token-choice top-k router: ``gate`` scores, softmax or sigmoid, top-k (optionally renormalised).

    ``forward(x [T, H]) -> (top_k_weights [T, k] fp32, top_k_index [T, k], scores [T, E] fp32)``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.score_func = config.score_func
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        top, index = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top, index, scores


def load_balancing_loss(scores: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over the whole batch: ``E * sum_e f_e * P_e``.

    Written with sums over the token dim only (a comparison against ``arange(E)``, not a scatter),
    so a batch-sharded run reduces it across ranks exactly."""
    num_experts = scores.shape[-1]
    experts = torch.arange(num_experts, device=top_k_index.device)
    routed = (top_k_index.unsqueeze(-1) == experts).sum((0, 1)).float()
    fraction = routed / top_k_index.numel()
    mean_prob = scores.sum(0) / scores.shape[0]
    return num_experts * (fraction * mean_prob.float()).sum()


class _SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Router, routed experts and an optional shared expert; returns ``(y, aux_loss)``.

    ``aux_loss_fn(scores, top_k_index)`` computes the auxiliary loss (:func:`load_balancing_loss`
    by default; an eager expert-parallel script can swap in one that all-reduces its statistics)."""

    aux_loss_fn = staticmethod(load_balancing_loss)

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = MoERouter(config)
        self.experts = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = (
            _SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, index, scores = self.router(tokens)
        y = self.experts(tokens, index, weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)
        return y.view(shape), self.aux_loss_fn(scores, index)


class MoEDecoderLayer(nn.Module):
    """Pre-norm block whose feed-forward is an :class:`MoEBlock` (or dense for the first layers)."""

    def __init__(self, config: MoEConfig, dense: bool) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = _SwiGLU(config.hidden_size, config.intermediate_size) if dense else MoEBlock(config)

    def forward(self, x, cos, sin) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            return h + out[0], out[1]
        return h + out, None


class MoEModel(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, dense=i < config.first_k_dense_layers)
            for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.head_dim, theta=config.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, input_ids.shape[1])
        aux_total = None
        for layer in self.layers:
            h, aux = layer(h, cos, sin)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return self.norm(h), aux_total


class MoEForCausalLM(nn.Module):
    """MoE decoder with an LM head. ``forward(input_ids, labels=None)`` returns a
    :class:`~hyper_parallel.models.CausalLMOutput`: ``logits``, and with labels ``loss`` (token-mean
    cross-entropy plus ``router_aux_loss_coef`` times the summed load-balancing losses) and
    ``aux_loss`` (the sum). Deterministic init as :class:`LlamaForCausalLM` (``init_weights``)."""

    def __init__(self, config: Optional[MoEConfig] = None) -> None:
        super().__init__()
        self.config = config if config is not None else MoEConfig()
        self.model = MoEModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """normal(0, 0.02) for linear, embedding and expert weights, ones for norms; modules in
        ``named_modules()`` order (the global RNG, or a private generator with ``seed``)."""
        generator = None
        for module in self.modules():
            weights = []
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weights = [module.weight]
            elif isinstance(module, MoEExperts):
                weights = [module.gate_proj, module.up_proj, module.down_proj]
            elif isinstance(module, (LlamaRMSNorm, LlamaRotaryEmbedding)):
                module.reset_parameters()
            for w in weights:
                if w.device.type == "meta":
                    continue
                if seed is not None and generator is None:
                    generator = torch.Generator(device=w.device).manual_seed(seed)
                nn.init.normal_(w, 0.0, INIT_STD, generator=generator)

    def reset_parameters(self) -> None:
        self.init_weights()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> CausalLMOutput:
        hidden, aux = self.model(input_ids)
        logits = self.lm_head(hidden)
        if labels is None:
            return CausalLMOutput(logits=logits)
        loss = causal_lm_loss(logits, labels)
        if aux is None:
            return CausalLMOutput(loss=loss, logits=logits)
        if self.config.router_aux_loss_coef:  # 0: the loss stays the plain token mean
            loss = loss + self.config.router_aux_loss_coef * aux
        return CausalLMOutput(loss=loss, logits=logits, aux_loss=aux)
