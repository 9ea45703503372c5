"""Named model shapes and parallel plans for planning at scale (``hyper-parallel explain``).

Model presets are the Llama 3 / 3.1 shapes (Meta's published configs) as fields of
:class:`hyper_parallel.models.LlamaConfig`; the same fields map one to one onto
``transformers.LlamaConfig``. Plan presets build a plan for a given mesh:

- ``fsdp``: every decoder layer and the root are ``fully_shard`` units, ``reshard_after_forward``,
  mixed precision bf16 parameters / fp32 gradient reduction (fp32 master weights);
- ``tp``: Megatron tensor parallelism (:func:`hyper_parallel.models.llama_tp_plan`: colwise
  q/k/v/gate/up, rowwise o/down, vocab-parallel embedding, colwise ``lm_head``);
- ``fsdp+tp``: both; FSDP over the data-parallel shard axis, TP over ``tp``;
- ``tp+sp`` / ``fsdp+tp+sp``: the same with Megatron sequence parallelism and a vocab-parallel loss
  (``llama_tp_plan(sequence_parallel=True, loss_parallel=True)``: norms and the residual stream
  sharded on the sequence dim, reduce-scatter / all-gather instead of all-reduce), the layout
  torchtitan and Megatron-LM train large models with.

On a mesh with a context-parallel axis (``--parallel cp=N``, N > 1) every preset also gets a
``context_parallel`` entry on the attention modules (``model.layers.*.self_attn``: the example
Llama's, its MoE's and HF Llama's): the sequence is sharded over ``cp`` and, with an FSDP preset,
the weights over ``dp_shard`` x ``cp`` (torchtitan's ``dp_shard_cp``). ``cp_mode`` (``--cp-mode``)
picks its attention: ``"ring"`` (default; ``hp.ContextParallel(mode="ring", load_balance=True)``,
K/V blocks passed around the cp ring, causal work balanced over the cp ranks; the sequence must
cut in ``2·cp`` chunks), ``"all_gather"`` (the same blocks and balance, K/V all-gathered once per
attention) or ``"all_to_all"`` (Ulysses: cp must divide the heads). A Ulysses degree
between 1 and cp (``--parallel cp=8,ulysses_degree=2``) gives the hybrid in either mode: all-to-all
inside groups of that many cp ranks, ring attention across the groups. A plan file chooses its own
context parallelism.

Mixture-of-experts shapes (``mixtral-8x7b``, ``deepseek-v3-like``; fields of
:class:`hyper_parallel.models.moe.MoEConfig`) add an ``expert_parallel`` entry to every plan: the
experts spread over ``ep`` (``--parallel ep=...``) and, under a ``tp`` plan, each expert split over
``tp`` too (``hp.ExpertTensorParallel``).

Everything here is pure data and validation (no process group, no torch model is built).
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
from typing import Any

__all__ = [
    "CP_MODES", "MODEL_PRESETS", "PLAN_PRESETS", "PlanChoice", "build_plan", "load_model_config", "parse_parallel",
]

# Llama 3 / 3.1 (Meta's params.json; HF config.json): untied embeddings, vocabulary 128256, RoPE
# theta 500000, RMSNorm eps 1e-5, 8 key/value heads. max_position_embeddings is Llama 3's 8192.
_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64),
    "llama3-405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128),
}
# Mixture-of-experts shapes as fields of hyper_parallel.models.moe.MoEConfig (Llama attention):
# Mixtral 8x7B (Mistral AI's config: 8 experts of width 14336, top-2) and a DeepSeek-V3-like shape
# (256 routed experts of width 2048, top-8, sigmoid scores, one shared expert, the first 3 layers
# dense) with grouped-query attention in place of DeepSeek's multi-head latent attention.
MODEL_PRESETS.update({
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=14336),
    "deepseek-v3-like": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                             num_attention_heads=128, num_key_value_heads=128, max_position_embeddings=4096,
                             rms_norm_eps=1e-6, rope_theta=10000.0, num_experts=256, num_experts_per_tok=8,
                             moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
                             score_func="sigmoid", first_k_dense_layers=3),
})
_MODEL_ALIASES = {"8b": "llama3-8b", "70b": "llama3-70b", "405b": "llama3-405b", "mixtral": "mixtral-8x7b"}

PLAN_PRESETS = ("fsdp", "tp", "fsdp+tp", "tp+sp", "fsdp+tp+sp")

# The degrees ``--parallel`` accepts (ParallelDims fields) and the ones explain can compile today.
_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "ulysses_degree")
_DEGREE_ALIASES = {"fsdp": "dp_shard", "dp": "dp_replicate"}
SUPPORTED_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "ulysses_degree")
CP_MODES = ("ring", "all_gather", "all_to_all")  # --cp-mode: hp.ContextParallel(mode=...) of the presets' cp entry
# The modules a preset's context_parallel entry names (the example Llama / MoE and HF Llama).
ATTENTION_MODULES = "model.layers.*.self_attn"


def _choices(names) -> str:
    return ", ".join(sorted(names))


def load_model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``spec``: a preset name (``llama3-8b``, ``llama3-70b``, ``llama3-405b``; or ``8b``, ...) or
    the path of a JSON file of LlamaConfig fields. A JSON file may name a preset under ``"base"``
    and override some of its fields (``{"base": "llama3-8b", "num_hidden_layers": 2}``).
    Returns (a display name, the config fields)."""
    name = str(spec).strip()
    key = _MODEL_ALIASES.get(name.lower(), name.lower())
    if key in MODEL_PRESETS:
        return key, dict(MODEL_PRESETS[key])
    if name.endswith(".json") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise ValueError(f"--config {name!r}: no such file (a JSON file of LlamaConfig fields)")
        try:
            with open(name) as f:
                fields = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {name!r} is not valid JSON: {e}") from e
        if not isinstance(fields, dict):
            raise ValueError(f"--config {name!r} must hold a JSON object of LlamaConfig fields")
        base = fields.pop("base", None)
        out: dict[str, Any] = {}
        if base is not None:
            out = load_model_config(base)[1]
        out.update(fields)
        return os.path.basename(name), out
    raise ValueError(
        f"unknown model config {spec!r}: choose a preset ({_choices(list(MODEL_PRESETS) + list(_MODEL_ALIASES))}) "
        "or give the path of a JSON file of LlamaConfig fields"
    )


def parse_parallel(spec: str) -> dict[str, int]:
    """``"dp_shard=-1,tp=8"`` -> ``{"dp_shard": -1, "tp": 8}`` (ParallelDims degrees; ``fsdp`` is
    an alias of ``dp_shard`` and ``dp`` of ``dp_replicate``). Raises ValueError naming the bad
    entry and the valid keys."""
    text = str(spec).strip()
    if not text:
        raise ValueError(f"--parallel {spec!r} is empty; write degrees as e.g. 'dp_shard=-1,tp=8' "
                         f"(keys: {', '.join(_DEGREES)})")
    out: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"--parallel {spec!r}: entry {item.strip()!r} is not KEY=VALUE; write degrees as e.g. "
                f"'dp_shard=-1,tp=8' (keys: {', '.join(_DEGREES)})"
            )
        name = _DEGREE_ALIASES.get(key, key)
        if name not in _DEGREES:
            raise ValueError(
                f"--parallel {spec!r}: unknown degree {key!r}; choose from {', '.join(_DEGREES)} "
                f"(aliases: {', '.join(f'{a}={b}' for a, b in _DEGREE_ALIASES.items())})"
            )
        try:
            degree = int(value.strip())
        except ValueError:
            raise ValueError(f"--parallel {spec!r}: {key}={value.strip()!r} is not an integer") from None
        if name in out:
            raise ValueError(f"--parallel {spec!r}: {name} is given twice")
        out[name] = degree
    unsupported = {k: v for k, v in out.items() if k not in SUPPORTED_DEGREES and v not in (1, None)}
    if unsupported:
        raise ValueError(
            f"--parallel {spec!r}: {', '.join(f'{k}={v}' for k, v in unsupported.items())} is not "
            f"supported by explain yet (it compiles {', '.join(SUPPORTED_DEGREES)}); set "
            f"{'it' if len(unsupported) == 1 else 'them'} to 1"
        )
    return out


@dataclasses.dataclass
class PlanChoice:
    """A plan for one mesh and model, with what a user should know about how it was chosen."""

    name: str
    plan: Any
    notes: list[str] = dataclasses.field(default_factory=list)


def build_plan(spec: str, mesh_axes: dict[str, int], config: dict[str, Any], *,
               mixed_precision: bool = True, recompute: str = "none", cp_mode: str = "ring",
               ulysses_degree: int | None = None, pipeline: dict | None = None) -> PlanChoice:
    """The plan ``spec`` names (a preset in :data:`PLAN_PRESETS`, or the path of a Python file
    that defines ``plan``: a ParallelPlan / dict, or a function ``plan(mesh_axes, config)``
    returning one) for a mesh of ``mesh_axes`` (axis name -> size) and a model of ``config``.
    ``mixed_precision``: FSDP gathers bf16 parameters and reduces fp32 gradients (fp32 masters).
    ``recompute``: "none", "selective" or "full", applied to every decoder layer.
    ``cp_mode``: "ring", "all_gather" or "all_to_all", the attention of a preset's
    ``context_parallel`` entry when ``mesh_axes`` has a ``cp`` axis (a plan file chooses its own);
    ``ulysses_degree`` (ParallelDims'), when given, the entry's Ulysses degree. ``pipeline``:
    ``{"schedule", "num_microbatches", "stages_per_rank"}`` of the ``pipeline`` entry a preset gets
    when ``mesh_axes`` has a ``pp`` axis (:func:`pipeline_entry`; a plan file writes its own)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"--recompute {recompute!r}: choose none, selective or full")
    if cp_mode not in CP_MODES:
        raise ValueError(f"--cp-mode {cp_mode!r}: choose one of {', '.join(CP_MODES)}")
    name = str(spec).strip()
    if name.lower() in PLAN_PRESETS:
        choice = _preset(name.lower(), mesh_axes, config, mixed_precision, cp_mode, ulysses_degree)
        if mesh_axes.get("pp", 1) > 1:
            choice.plan["pipeline"] = pipeline_entry(mesh_axes["pp"], config, **(pipeline or {}))
            choice.notes.append(_pipeline_note(choice.plan["pipeline"], mesh_axes["pp"]))
    elif name.endswith(".py") or os.path.isfile(name):
        choice = _plan_file(name, mesh_axes, config)
    else:
        raise ValueError(
            f"unknown plan {spec!r}: choose a preset ({', '.join(PLAN_PRESETS)}) or give the path of "
            "a Python file that defines `plan`"
        )
    if recompute != "none":
        plan = choice.plan
        if isinstance(plan, dict):
            choice.plan = {**plan, "recompute": {"model.layers.*": recompute}}
        else:
            choice.plan = dataclasses.replace(plan, recompute={"model.layers.*": recompute})
    return choice


def _preset(name: str, axes: dict[str, int], config: dict[str, Any], mixed_precision: bool,
            cp_mode: str = "ring", ulysses_degree: int | None = None) -> PlanChoice:
    from ..models.plans import llama_tp_plan

    notes: list[str] = []
    plan: dict[str, Any] = {}
    moe = "num_experts" in config
    if "tp" in name:
        if "tp" not in axes:
            raise ValueError(f"plan {name!r} needs a tensor-parallel axis: add tp=<degree> to --parallel")
        sp = name.endswith("+sp")
        plan.update(llama_tp_plan(sequence_parallel=sp, loss_parallel=sp))
        if moe and not config.get("first_k_dense_layers"):  # no dense feed-forward layer to split
            plan["tensor_parallel"] = {k: v for k, v in plan["tensor_parallel"].items() if ".mlp." not in k}
    if moe:
        plan["expert_parallel"] = {"model.layers.*.mlp.experts": _expert_style(axes, name)}
    elif "ep" in axes:
        raise ValueError("--parallel ep=... spreads the experts of a mixture-of-experts model; this model "
                         "has none (give a config with num_experts, e.g. --config mixtral-8x7b)")
    if axes.get("cp", 1) > 1:
        plan["context_parallel"] = {ATTENTION_MODULES: _context_style(cp_mode, ulysses_degree)}
        notes.append(_context_note(cp_mode, axes["cp"], ulysses_degree))
    if "fsdp" in name:
        if "dp_shard" not in axes:
            raise ValueError(
                f"plan {name!r} shards over the dp_shard axis, which this mesh does not have "
                f"({axes or 'a single rank'}): add dp_shard=<degree> (or -1) to --parallel"
            )
        import torch

        from ..fsdp.plan import FullyShard, MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
        plan["fully_shard"] = FullyShard(units=("model.layers.*", ""), reshard_after_forward=True,
                                         mixed_precision=policy)
        if "tp" in name:
            notes += _drop_uneven_vocab_tp(plan, axes, config)
    return PlanChoice(name, plan, notes)


PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1")


def pipeline_entry(pp: int, config: dict[str, Any], schedule: str = "1F1B", num_microbatches: int | None = None,
                   stages_per_rank: int | None = None):
    """A preset's ``pipeline`` entry over ``pp`` ranks: the decoder layers cut into ``pp *
    stages_per_rank`` stages of equal numbers of layers (the first stages one more where they do
    not divide), ``num_microbatches`` (default: ``pp``, the fewest that fill 1F1B's warm-up) and
    ``stages_per_rank`` (default 2 for Interleaved1F1B, else 1)."""
    from ..pipeline.plan import PipelinePlan

    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pp-schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule == "Interleaved1F1B" else 1
    if num_microbatches is None:
        num_microbatches = pp
    stages = pp * stages_per_rank
    layers = int(config.get("num_hidden_layers", 0))
    if layers < stages:
        raise ValueError(f"pp={pp} x {stages_per_rank} stage(s) per rank = {stages} stages need at least {stages} "
                         f"decoder layers; the model has {layers}. Use fewer stages")
    sizes = [layers // stages + (1 if k < layers % stages else 0) for k in range(stages)]
    starts = [sum(sizes[:k]) for k in range(1, stages)]
    return PipelinePlan(split_points=tuple(f"model.layers.{i}" for i in starts), schedule=schedule,
                        num_microbatches=num_microbatches, stages_per_rank=stages_per_rank)


def _pipeline_note(plan, pp: int) -> str:
    stages = pp * plan.stages_per_rank
    return (f"pipeline: {stages} stages over pp={pp} ({plan.stages_per_rank} per rank), schedule {plan.schedule}, "
            f"{plan.num_microbatches} micro-batches per step, stages begin at {', '.join(plan.split_points)}")


def _expert_style(axes: dict[str, int], name: str):
    """Experts over ``ep`` (when the mesh has it) and, with a tensor-parallel plan, each expert
    split over ``tp`` as well (ParallelDims' default etp = tp)."""
    from ..moe import ExpertParallel, ExpertTensorParallel, ExpertWeightTensorParallel

    if "tp" in name and "tp" in axes:
        return ExpertTensorParallel() if "ep" in axes else ExpertWeightTensorParallel()
    return ExpertParallel()


def _context_style(cp_mode: str, ulysses_degree: int | None = None):
    """The attention modules' context-parallel style: load-balanced ring attention, Ulysses, or
    (``ulysses_degree`` between 1 and cp) ring attention over groups of Ulysses ranks."""
    from ..cp import ContextParallel

    if cp_mode in ("ring", "all_gather"):
        return ContextParallel(mode=cp_mode, load_balance=True, ulysses_degree=ulysses_degree)
    return ContextParallel(mode="all_to_all", ulysses_degree=ulysses_degree)


def _context_note(cp_mode: str, cp: int, ulysses_degree: int | None = None) -> str:
    if ulysses_degree is not None and 1 < ulysses_degree < cp and cp % ulysses_degree == 0:
        ring = cp // ulysses_degree
        across = (f"all-gather attention over the {ring} groups (their K/V blocks of 1/{ulysses_degree} of the "
                  "heads gathered once per attention forward)" if cp_mode == "all_gather" else
                  f"ring attention over the {ring} groups ({ring - 1} K/V transfer{'s' if ring > 2 else ''} of "
                  f"1/{ulysses_degree} of the heads per attention forward)")
        return (f"context parallelism: the sequence sharded over cp={cp}; all-to-all (Ulysses) inside "
                f"groups of {ulysses_degree} cp ranks, {across}, load-balanced causal chunks")
    if cp_mode == "ring":
        return (f"context parallelism: the sequence sharded over cp={cp}; ring attention ({cp - 1} K/V "
                f"transfer{'s' if cp > 2 else ''} to the next cp rank per attention forward), load-balanced "
                "causal chunks")
    if cp_mode == "all_gather":
        return (f"context parallelism: the sequence sharded over cp={cp}; all-gather attention (every cp "
                "rank's K/V gathered once per attention forward, dK/dV reduce-scattered), load-balanced "
                "causal chunks")
    return (f"context parallelism: the sequence sharded over cp={cp}; all-to-all (Ulysses) attention, "
            f"heads split over cp around each attention")


def _drop_uneven_vocab_tp(plan: dict, axes: dict[str, int], config: dict[str, Any]) -> list[str]:
    """FSDP cannot yet shard unevenly inside a tensor-parallel dim-0 shard (fsdp/resolve.py). When
    the vocabulary rows of one TP shard do not divide over dp_shard, the embedding and lm_head
    leave tensor parallelism and are FSDP-sharded over dp_shard only (replicated over tp)."""
    vocab, tp, shard = config.get("vocab_size"), axes["tp"], axes["dp_shard"]
    if vocab is None or (vocab // tp) % shard == 0:
        return []
    tp_plan = dict(plan["tensor_parallel"])
    for fqn in ("model.embed_tokens", "lm_head"):
        tp_plan.pop(fqn, None)
    if "model.norm" in tp_plan:  # sequence parallel: the final norm's output is sequence-sharded
        from torch.distributed.tensor import Replicate, Shard

        from ..tp.styles import PrepareModuleInput, PrepareModuleOutput

        # The blocks pass sequence shards between them; the replicated embedding's output is cut
        # into them once, before the first block (else block 0 cuts its input twice, at its norm
        # and at its residual add, and gathers both gradients, and its program is not block 1's,
        # so the block copy falls back to lowering every block).
        tp_plan["model.embed_tokens"] = PrepareModuleOutput(output_layouts=(Replicate(),),
                                                            desired_output_layouts=(Shard(1),))
        # lm_head is replicated over tp: gather the whole sequence before it, once, explicitly.
        tp_plan["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan["tensor_parallel"] = tp_plan
    return [
        f"model.embed_tokens and lm_head are not tensor-parallel: the {vocab // tp} vocabulary rows "
        f"of a tp={tp} shard do not divide over dp_shard={shard}, and FSDP does not yet shard "
        "unevenly inside tensor-parallel shards; they are FSDP-sharded over dp_shard only"
    ]


def _plan_file(path: str, axes: dict[str, int], config: dict[str, Any]) -> PlanChoice:
    if not os.path.isfile(path):
        raise ValueError(f"--plan {path!r}: no such file (a Python file that defines `plan`)")
    namespace = runpy.run_path(path)
    if "plan" not in namespace:
        raise ValueError(f"--plan {path!r} defines no `plan` (a ParallelPlan, a dict, or plan(mesh_axes, config))")
    plan = namespace["plan"]
    if callable(plan) and not isinstance(plan, dict):
        plan = plan(dict(axes), dict(config))
    return PlanChoice(os.path.basename(path), plan, [])
