"""Ready-made parallel plans for the bundled models, as plain nested dicts.

``hyper_parallel.parallelize`` accepts a ``ParallelPlan`` or the same thing as a plain dict whose
styles may be strings (``"colwise"``, ``"rowwise"``, ``"sequence_parallel"``), so these plans need no
import of the plan classes. Only plans that need non-default layouts (sequence parallelism, loss
parallelism) build style objects, importing ``hyper_parallel.tp.styles`` lazily inside the function.
Module globs match segment by segment (``"model.layers.*.mlp.up_proj"``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["llama_dp_plan", "llama_tp_plan", "mlp_tp_plan"]


def llama_tp_plan(sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """Megatron-style tensor parallelism for :class:`~hyper_parallel.models.LlamaForCausalLM` (and HF's).

    Applies on the ``"tp"`` mesh axis. ``model.embed_tokens`` is ``"rowwise"`` (vocab-parallel
    embedding: the table is sharded over the vocabulary, lookups give partial sums that are
    all-reduced); ``q/k/v_proj`` and ``gate/up_proj`` are ``"colwise"`` (heads and the FFN width are
    sharded, so attention and SwiGLU run locally); ``o_proj`` and ``down_proj`` are ``"rowwise"``
    (their partial outputs are all-reduced); ``lm_head`` is ``"colwise"`` (vocab-sharded logits).
    Needs ``num_key_value_heads``, ``intermediate_size`` and ``vocab_size`` divisible by the TP degree.

    With the defaults every style is a string and the logits leave ``lm_head`` sharded over the
    vocabulary (``S(-1)``, ``ColwiseParallel``'s default). The cross-entropy then runs
    vocab-parallel on those shards (``propagation/rules.py``: per-token max and exp-sum all-reduces,
    each rank picking the targets in its vocabulary range), so the loss never gathers the logits.
    The logits *returned* to the user stay vocab-sharded too: a ``DTensor`` (``Shard(-1)`` on
    ``tp``) whose ``full_tensor()`` gathers them; ``ParallelPlan.outputs = {"logits": Replicate()}``
    returns them whole instead, for one all-gather in the logits' own dtype.

    ``sequence_parallel=True`` (needs ``hyper_parallel.tp.styles``): the norms
    (``model.layers.*.input_layernorm``, ``post_attention_layernorm``, ``model.norm``) become
    ``SequenceParallel()`` and run on sequence shards (``S(1)`` activations between blocks), so the
    rowwise layers reduce-scatter to ``S(1)`` (``RowwiseParallel(output_layouts=Shard(1))``, the
    embedding with ``input_layouts=Replicate()``) and the colwise ones all-gather from it
    (``ColwiseParallel(input_layouts=Shard(1))``). ``lm_head`` then returns ``Replicate()`` logits
    unless ``loss_parallel``.

    ``loss_parallel=True`` (needs ``hyper_parallel.tp.styles``): ``lm_head`` is
    ``ColwiseParallel(output_layouts=Shard(-1))`` stated explicitly, i.e. vocab-sharded logits go
    into the cross-entropy, which runs vocab-parallel (no ``[tokens, vocab]`` buffer per rank on the
    loss path; exact, also with ``ignore_index`` labels, class weights and every reduction). Without
    SP this pins the same placement as the string ``"colwise"``; the flag matters with
    ``sequence_parallel=True``, which otherwise gathers the logits at ``lm_head``'s output and runs
    the loss on whole rows.
    """
    if not sequence_parallel and not loss_parallel:
        return {
            "tensor_parallel": {
                "model.embed_tokens": "rowwise",
                "model.layers.*.self_attn.q_proj": "colwise",
                "model.layers.*.self_attn.k_proj": "colwise",
                "model.layers.*.self_attn.v_proj": "colwise",
                "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.mlp.gate_proj": "colwise",
                "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise",
                "lm_head": "colwise",
            }
        }

    from torch.distributed.tensor import Replicate, Shard

    from hyper_parallel.tp.styles import ColwiseParallel, RowwiseParallel, SequenceParallel

    # Vocab-sharded logits into the loss (loss parallel), or gathered at lm_head's output.
    lm_head_out = Shard(-1) if loss_parallel else Replicate()
    if not sequence_parallel:
        plan = llama_tp_plan()
        plan["tensor_parallel"]["lm_head"] = ColwiseParallel(output_layouts=lm_head_out)
        return plan

    return {
        "tensor_parallel": {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(input_layouts=Shard(1)),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(input_layouts=Shard(1)),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(input_layouts=Shard(1)),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(input_layouts=Shard(1)),
            "model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(1)),
            "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=lm_head_out),
        }
    }


def llama_dp_plan() -> dict[str, Any]:
    """Pure data parallelism: the empty plan ``{}``.

    With no entries every parameter is replicated on every rank and every tensor input is, by the
    user contract, a per-rank local batch (``S(0)`` over the data-parallel mesh axes), so the
    compiler only adds the gradient all-reduce (DDP). Add ``fully_shard`` for FSDP.
    """
    return {}


def mlp_tp_plan(num_layers: int = 2) -> dict[str, Any]:
    """Megatron-style TP for :class:`~hyper_parallel.models.MLP`: alternate colwise / rowwise.

    ``layers.0`` colwise, ``layers.1`` rowwise, ``layers.2`` colwise, ...; with an odd
    ``num_layers`` the last layer's output stays sharded over features and the compiler
    redistributes it as the loss needs.
    """
    return {
        "tensor_parallel": {
            f"layers.{i}": ("colwise" if i % 2 == 0 else "rowwise") for i in range(num_layers)
        }
    }
