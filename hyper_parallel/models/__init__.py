"""Small models (own Llama and mixture of experts, MLP, tiny HF models) and ready-made plans used by
tests, examples, bench.

transformers is only imported when :func:`tiny_hf_llama` is called.
"""

from hyper_parallel.models.hf import tiny_hf_gpt2, tiny_hf_llama, tiny_hf_llama_config
from hyper_parallel.models.llama import (
    CausalLMOutput,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRMSNorm,
    causal_lm_loss,
)
from hyper_parallel.models.moe import MoEConfig, MoEForCausalLM
from hyper_parallel.models.convnet import ConvNet
from hyper_parallel.models.mlp import MLP
from hyper_parallel.models.plans import llama_dp_plan, llama_tp_plan, mlp_tp_plan

__all__ = [
    "ConvNet",
    "MLP",
    "MoEConfig",
    "MoEForCausalLM",
    "CausalLMOutput",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "LlamaRMSNorm",
    "causal_lm_loss",
    "llama_dp_plan",
    "llama_tp_plan",
    "mlp_tp_plan",
    "tiny_hf_gpt2",
    "tiny_hf_llama",
    "tiny_hf_llama_config",
]
