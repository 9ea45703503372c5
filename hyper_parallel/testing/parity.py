"""Single-device parity runs: the oracle every plan and pass is tested against (docs/architecture.md §4.1).

Each function here runs *on every rank* of a worker pool (hyper_parallel.testing.distributed): it
builds a model from a seed, keeps an untouched single-device copy, parallelizes the other, feeds
each rank its slice of one global batch, and after every step checks the loss and every parameter
gradient against the single-device run on the whole batch. Any difference raises on the rank that
sees it, so a test cannot pass on a broken plan. The loop itself is
:class:`~hyper_parallel.testing.stepper.ParityStepper` (any models, optimizers, batches, losses,
accumulation and bf16 references); :func:`run_parity` and :func:`run_pipeline_parity` run it on the
named models and plans. The batch helpers (:mod:`~hyper_parallel.testing.batches`) and the bf16
references and bounds (:mod:`~hyper_parallel.testing.bf16`) are importable from here too.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, MLP, llama_tp_plan, mlp_tp_plan
from hyper_parallel.testing.batches import global_batch, local_batch, micro_batch, model_loss
from hyper_parallel.testing.bf16 import (
    BF16_EPS, DEVICE_ERRORS_ALLOWED, assert_bf16_gradients_near_exact, assert_gradients_near_exact,
    assert_matches_bf16_reference, bf16_reference_step, float64_gradients,
)
from hyper_parallel.testing.stepper import ParityStepper, batches

__all__ = [
    "BF16_EPS", "DEVICE_ERRORS_ALLOWED", "ParityStepper", "assert_bf16_gradients_near_exact",
    "assert_gradients_near_exact", "assert_matches_bf16_reference", "assert_same_step", "bf16_reference_step",
    "build_model", "build_plan", "error_message", "float64_gradients", "global_batch", "gradient_sum_adds",
    "gradients_waiting", "lm_loss", "local_batch", "micro_batch", "mixed_precision_steps", "model_loss",
    "run_parity", "run_pipeline_parity",
]


def build_model(name: str, seed: int = 0, **overrides):
    """"mlp", "llama" (our example, 2 layers unless overridden), "moe" (our example mixture of
    experts), "hf_llama", "hf_gpt2" or "hf:<Architecture>" (transformers, tiny: models/hf_zoo.py).

    Two layers by default: a repeated layer (and a layer after another) is all most plans need to
    show, and compile time grows with depth; tests that schedule across units ask for more."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(**overrides)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**{"num_hidden_layers": 2, **overrides}))
    if name == "moe":
        from hyper_parallel.models.moe import MoEConfig, MoEForCausalLM

        return MoEForCausalLM(MoEConfig(**overrides))
    if name == "hf_llama":
        from hyper_parallel.models import tiny_hf_llama

        return tiny_hf_llama(seed=seed, **overrides)
    if name.startswith("hf:"):  # any architecture of hyper_parallel.models.hf_zoo
        from hyper_parallel.models.hf_zoo import tiny_hf_model

        return tiny_hf_model(name[3:], seed=seed, **overrides)
    if name == "hf_gpt2":
        from hyper_parallel.models.hf import tiny_hf_gpt2

        return tiny_hf_gpt2(seed=seed, **overrides)
    raise ValueError(f"unknown model {name!r}")


def _gpt2_fsdp_tp_plan():
    """HF GPT-2 under FSDP x TP: hf_zoo's Conv1D tensor-parallel layouts, the blocks as units."""
    from hyper_parallel.models.hf_zoo import gpt2_tp_layouts

    return {"layouts": gpt2_tp_layouts(), "fully_shard": {"units": ["transformer.h.*", ""]}}


def _moe_attention_tp_plan():
    """llama_tp_plan's entries for the attention, embedding and head of the example MoE (its
    feed-forward layers are experts, planned by expert_parallel entries)."""
    entries = llama_tp_plan()["tensor_parallel"]
    return {"tensor_parallel": {k: v for k, v in entries.items() if ".mlp." not in k}}


def build_plan(name: str):
    """Named plans used by the tests: dp ({}), tp, sp (sequence parallel), mlp_tp."""
    return {
        "dp": lambda: {},
        "tp": llama_tp_plan,
        "sp": lambda: llama_tp_plan(sequence_parallel=True),
        "mlp_tp": mlp_tp_plan,
        "fsdp": lambda: {"fully_shard": {"units": ["model.layers.*", ""]}},
        "fsdp_mlp": lambda: {"fully_shard": {"units": ["layers.*", ""]}},
        "fsdp_keep": lambda: {"fully_shard": {"units": ["model.layers.*", ""], "reshard_after_forward": False}},
        "fsdp_offload": lambda: {"fully_shard": {"units": ["model.layers.*", ""], "offload_policy": hp.CPUOffloadPolicy()}},
        "fsdp_unfused": lambda: {"fully_shard": {"units": ["model.layers.*", ""], "comm_fusion": False}},
        "fsdp_tp": lambda: {**llama_tp_plan(), "fully_shard": {"units": ["model.layers.*", ""]}},
        "gpt2_fsdp_tp": _gpt2_fsdp_tp_plan,
        "ep": lambda: {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel()}},
        "ep_overlap": lambda: {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel(overlap=True)}},
        "ep_tp": lambda: {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertTensorParallel()},
                          **_moe_attention_tp_plan()},
        "cp": lambda: {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel()}},
        "expert_tp": lambda: {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertWeightTensorParallel()},
                              **_moe_attention_tp_plan()},
    }[name]()


def run_parity(
    model: str,
    plan: Any,
    mesh_shape: tuple[int, ...],
    mesh_names: tuple[str, ...],
    *,
    steps: int = 3,
    optimizer: str = "sgd",
    batch: int = 4,
    seq_len: int = 16,
    model_overrides: dict | None = None,
    dump_dir: str | None = None,
    loss_rtol: float | None = None,
    disable_passes: tuple[str, ...] = (),
    parallelize_options: dict | None = None,
    ignore_fraction: float = 0.0,
    inspect: Callable[[torch.nn.Module], Any] | None = None,
) -> dict:
    """Train the parallel and the single-device model side by side; assert they agree each step.

    ``ignore_fraction``: labels set to -100 at that rate (:func:`global_batch`), so ranks hold
    different numbers of counted tokens and the loss must still be the global per-token mean.

    SGD: loss and every gradient with ``assert_close`` defaults. AdamW: the loss within
    ``loss_rtol`` (Adam turns noise in near-zero gradients into full-size updates, docs/architecture.md §4.1).
    Returns the losses and the compile summary (rank-local), and what ``inspect(parallel_model)``
    returns after the last step (``"inspected"``), when given.
    """
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    reference = build_model(model, **(model_overrides or {}))
    parallel = hp.parallelize(
        copy.deepcopy(reference), build_plan(plan) if isinstance(plan, str) else plan, mesh,
        dump_dir=dump_dir, disable_passes=disable_passes, **(parallelize_options or {}),
    )
    make_opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    }[optimizer]
    # AdamW: the loss alone, relative to the reference's (rtol = loss_rtol, no absolute slack).
    compare = {} if optimizer == "sgd" else {"grads": None, "loss_rtol": loss_rtol, "loss_atol": 0.0}
    stepper = ParityStepper(reference, parallel, mesh=mesh, optimizer=make_opt,
                            batch=batches(model, batch, seq_len, ignore_fraction=ignore_fraction), **compare)
    stepper.run(steps)
    return {"losses": stepper.losses, "ref_losses": stepper.ref_losses, "summary": parallel.compile_summary(),
            "rank": dist.get_rank(), "inspected": inspect(parallel) if inspect is not None else None}


def assert_same_step(parallel, loss, reference, ref_loss, what: str = "") -> None:
    """The parallel model's loss and every parameter's gradient (gathered whole) equal the
    single-device reference's, with ``assert_close`` defaults; ``what`` prefixes the messages.
    A frozen parameter (requires_grad=False, e.g. a LoRA model's base) has no gradient on either side."""
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), msg=lambda m: f"{what} loss: {m}")
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and ref_params[name].grad is None, f"{what} frozen {name} got a gradient"
            continue
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad,
                                   msg=lambda m, name=name: f"{what} grad of {name}: {m}")


def mixed_precision_steps(master: torch.nn.Module, model, mesh, steps: int = 2, ignore_fraction: float = 0.0) -> None:
    """``steps`` SGD steps of ``model`` (a mixed-precision plan: bf16 parameters, fp32 reduction) on
    ``global_batch`` 4 x 16, each against one device computing in bf16 from ``master``'s fp32
    weights (:func:`bf16_reference_step`, :func:`assert_matches_bf16_reference`); ``master`` then
    takes the same fp32 step from that copy's gradients."""
    ParityStepper(master, model, mesh=mesh, batch=batches(ignore_fraction=ignore_fraction),
                  bf16_reference=True).run(steps)


def lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` for pipeline tests: the example Llama's loss on its logits."""
    from hyper_parallel.models.llama import causal_lm_loss

    return causal_lm_loss(output["logits"], target)


def run_pipeline_parity(
    plan: Any,
    mesh_shape: tuple[int, ...],
    mesh_names: tuple[str, ...],
    *,
    num_layers: int = 4,
    steps: int = 3,
    batch: int = 8,
    seq_len: int = 16,
    with_loss_fn: bool = False,
    dump_dir: str | None = None,
    model_overrides: dict | None = None,
    ignore_fraction: float = 0.0,
    model: str = "llama",
    reference_microbatches: int = 1,
    parallelize_options: dict | None = None,
) -> dict:
    """:func:`run_parity` for a pipelined model: ``pmodel.step`` against forward + backward of the
    single-device model on the whole batch, ``steps`` SGD steps. The optimizer is built before the
    first step (it then holds parameters the split releases; they must leave it). ``with_loss_fn``:
    the model returns logits and ``parallelize(loss_fn=lm_loss)`` / ``step(inputs, targets)`` add
    the loss. ``reference_microbatches=M``: one device accumulates gradients over the same M
    micro-batches instead (``loss_m / M`` each), the contract of a loss that is not a plain token
    mean (pipeline/loss.py). Returns this rank's parameter names, losses and the pipeline report."""
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    reference = build_model(model, num_hidden_layers=num_layers, **(model_overrides or {}))
    parallel = hp.parallelize(copy.deepcopy(reference), plan, mesh, dump_dir=dump_dir,
                              loss_fn=lm_loss if with_loss_fn else None, **(parallelize_options or {}))
    if with_loss_fn:
        def forward(m, local):
            return m.step({"input_ids": local["input_ids"]}, local["labels"])
    else:
        def forward(m, local):
            return m.step(local)
    stepper = ParityStepper(
        reference, parallel, mesh=mesh, batch=batches(model, batch, seq_len, ignore_fraction=ignore_fraction),
        forward=forward, backward_in_forward=True, reference_micro_batches=reference_microbatches,
        split=lambda full, n: [micro_batch(full, mesh, m, n) for m in range(n)],
    )
    stepper.run(steps)
    held = sum(len(group["params"]) for group in stepper.optimizer.param_groups)
    return {"params": sorted(n for n, _ in parallel.named_parameters()), "optimizer_params": held,
            "losses": stepper.losses, "report": parallel.pipeline_report(), "summary": parallel.compile_summary(),
            "all_params": sorted(n for n, _ in reference.named_parameters())}


def gradient_sum_adds(program) -> list[dict]:
    """How a pipeline stage program's backward adds each micro-batch gradient into the step's running
    sum (passes/pipeline_split.py), read from the compiled program: per ``grad_accum`` input, the
    parameter, the sum's dtype, the positions where the gradient is made and where the single
    in-place add into the sum is, and where the first collective reading the sum is (None: the sum
    is returned unreduced). ``program``: a ``pipeline.runtime.StageProgram``."""
    from hyper_parallel.ir.collectives import collective_kind
    from hyper_parallel.ir.kinds import InputKind

    nodes = list(program.backward_gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    tangents = [n for n in nodes if n.op == "placeholder"][-len(program.tangent_infos):]
    adds = []
    for total, info in zip(tangents, program.tangent_infos):
        if info.kind != InputKind.GRAD_ACCUM:
            continue
        (add,) = total.users
        assert add.target is torch.ops.aten.add_.Tensor and add.args[0] is total, add.format_node()
        reduced, stack, seen = None, list(add.users), set()
        while stack:  # the first collective downstream of the sum (through reshapes, casts, packs)
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if collective_kind(node) is not None:
                reduced = where[node] if reduced is None else min(reduced, where[node])
            else:
                stack.extend(node.users)
        adds.append({"param": info.name, "dtype": total.meta["val"].dtype, "made": where[add.args[1]],
                     "added": where[add], "reduced": reduced})
    return adds


def gradients_waiting(adds: list[dict]) -> int:
    """The most gradients made and not yet added into their sums at any point of the program."""
    points = {a["made"] for a in adds}
    return max((sum(1 for a in adds if a["made"] <= i < a["added"]) for i in points), default=0)


def error_message(fn, *args, **kwargs) -> str:
    """``"<type>: <message>"`` of the ValueError / TypeError ``fn(*args, **kwargs)`` raises (what a
    user reads), or ``"no error"``; other exceptions propagate. Run on every rank of a pool."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

