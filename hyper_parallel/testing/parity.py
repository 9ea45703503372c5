"""Single-device parity runs: the oracle every plan and pass is tested against (docs/architecture.md §4.1).

Each function here runs *on every rank* of a worker pool (hyper_parallel.testing.distributed): it
builds a model from a seed, keeps an untouched single-device copy, parallelizes the other, feeds
each rank its slice of one global batch, and after every step checks the loss and every parameter
gradient against the single-device run on the whole batch. Any difference raises on the rank that
sees it, so a test cannot pass on a broken plan.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, MLP, llama_tp_plan, mlp_tp_plan


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


def global_batch(model_name: str, batch: int, seq_len: int, seed: int = 1,
                 ignore_fraction: float = 0.0) -> dict[str, torch.Tensor]:
    """One global batch. ``ignore_fraction`` > 0 sets labels to -100 (padding, unmasked tokens) at
    random with that probability, and the whole of the last row, so data-parallel ranks count
    different numbers of tokens (one possibly none): what real training with padded labels sees."""
    g = torch.Generator().manual_seed(seed)
    if model_name == "mlp":
        return {"x": torch.randn(batch, 16, generator=g), "target": torch.randn(batch, 8, generator=g)}
    ids = torch.randint(0, 256, (batch, seq_len), generator=g)
    labels = ids
    if ignore_fraction > 0:
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < ignore_fraction, -100)
        labels[-1] = -100
    return {"input_ids": ids, "labels": labels}


def _data_axes(mesh) -> list[int]:
    return [i for i, n in enumerate(mesh.mesh_dim_names) if n.startswith("dp") or n in ("fsdp", "ep")]


def micro_batch(batch: dict, mesh, m: int, num_microbatches: int) -> dict:
    """Micro-batch ``m`` of ``num_microbatches`` of the whole step, as a pipeline forms it: every
    data-parallel rank's m-th chunk of its :func:`local_batch`, concatenated in rank order."""
    degree = math.prod(mesh.size(i) for i in _data_axes(mesh))
    return {k: torch.cat([piece.chunk(num_microbatches, dim=0)[m] for piece in v.chunk(degree, dim=0)])
            for k, v in batch.items()}


def local_batch(batch: dict, mesh) -> dict:
    """This rank's slice: dim 0 split over the data-parallel axes (in mesh order; ``ep`` is one, as
    under an expert-parallel plan), dim 1 (the sequence) over a ``cp`` axis (context parallelism),
    whole elsewhere."""
    dp_axes = _data_axes(mesh)
    degree = math.prod(mesh.size(i) for i in dp_axes) if dp_axes else 1
    index = 0
    for i in dp_axes:
        index = index * mesh.size(i) + mesh.get_local_rank(i)
    out = {k: v.chunk(degree, dim=0)[index] for k, v in batch.items()}
    if "cp" in mesh.mesh_dim_names:
        out = hp.shard_sequence(out, mesh)
    return out


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"]


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
    opt, ref_opt = make_opt(parallel.parameters()), make_opt(reference.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        full = global_batch(model, batch, seq_len, seed=step + 1, ignore_fraction=ignore_fraction)
        loss = _loss(parallel(**local_batch(full, mesh)))
        ref_loss = _loss(reference(**full))
        loss.backward()
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if optimizer == "sgd":
            assert_same_step(parallel, loss, reference, ref_loss, f"step {step}")
        else:
            rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            assert rel <= loss_rtol, f"step {step}: loss {loss.item()} vs {ref_loss.item()} (rel {rel:.2e})"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "summary": parallel.compile_summary(),
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


def bf16_reference_step(master: torch.nn.Module, batch: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """One device computing in bf16 from fp32 master weights, as FSDP2's mixed precision does: a
    bf16 copy of ``master`` runs forward and backward on the whole ``batch``. Returns (the copy, its
    gradients in ``.grad``; its loss)."""
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    loss = _loss(compute(**batch))
    loss.backward()
    return compute, loss


def assert_matches_bf16_reference(model, loss, compute: torch.nn.Module, ref_loss, batch: dict, what: str = "") -> None:
    """A mixed-precision step (bf16 compute, fp32 reduction) against :func:`bf16_reference_step`'s
    ``compute`` copy and loss (on the global ``batch``): the loss within bf16's tolerances (the two
    runs round partial sums at different points), every fp32 gradient within DEVICE_ERRORS_ALLOWED
    times the bf16 device's own distance from the exact gradient (the bound of
    :func:`assert_bf16_gradients_near_exact`; the exact one computed in float64 at ``compute``'s bf16
    weights). A frozen parameter (a LoRA model's base) has no gradient on either side."""
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}loss: {m}")
    device = {n: p.grad for n, p in compute.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and name not in device, f"{what}frozen {name} got a gradient"
            continue
        assert p.grad.dtype == torch.float32, name
    weights = {n: p.detach() for n, p in compute.named_parameters()}
    _assert_near_exact(model, _gradients(compute, weights, batch, torch.float64), device, what)


def _gradients(structure: torch.nn.Module, weights: dict, batch: dict, dtype: torch.dtype) -> dict:
    """Float64 gradients of one step of a copy of ``structure`` on ``batch``, computing in ``dtype``
    at ``weights`` rounded to bf16."""
    copy_ = copy.deepcopy(structure)
    for name, p in copy_.named_parameters():
        p.data = weights[name].to(torch.bfloat16).to(dtype)
    if dtype == torch.float64:
        _float64_experts(copy_)
    return _copy_gradients(copy_, lambda m: _loss(m(**batch)).backward())


def _float64_experts(module: torch.nn.Module) -> None:
    """transformers' grouped experts (Qwen2-MoE, Mixtral ... in bf16) call ``torch._grouped_mm``,
    which has no float64 kernel: a float64 copy runs their reference loop ("eager") instead, the
    same sums of the same products. ``module`` is a copy: its config is its own."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "eager"


def _copy_gradients(copy_: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> dict:
    """The gradients (as float64) that ``run(copy_)`` leaves on ``copy_``'s parameters, from none,
    outside any autocast region (the copy computes in its own dtype)."""
    for p in copy_.parameters():
        p.grad = None
    with torch.autocast("cpu", enabled=False):
        run(copy_)
    return {n: p.grad.double() for n, p in copy_.named_parameters() if p.grad is not None}


# How far from the exact gradient a mixed-precision step's gradients may be, in units of one bf16
# device's own error. Each rank rounds its partial gradient to bf16 before the fp32 reduction where
# one device rounds the whole sum once, so the roundings of several partials add up: measured 0.5-1.0x
# under Inductor on 2-rank FSDP, up to 2.2-2.7x on eager 2- and 4-rank FSDP, FSDP x TP and LoRA
# plans. A gradient 3% off (a wrong token count) still fails 4x (tests/unit/test_bf16_gradient_bound.py).
DEVICE_ERRORS_ALLOWED = 4
BF16_EPS = 2.0 ** -8  # bf16's relative rounding step (8 significant bits)


def _assert_near_exact(model, exact: dict, device: dict, what: str) -> None:
    """Each gradient of ``model`` no further from ``exact`` than DEVICE_ERRORS_ALLOWED times
    ``device``'s distance from it (floor: one bf16 rounding of the tensor's largest exact value)."""
    for name, p in model.named_parameters():
        if name not in exact:
            continue
        ours = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        our_error = (ours.double() - exact[name]).abs().max().item()
        device_error = (device[name].double() - exact[name]).abs().max().item()
        bound = max(DEVICE_ERRORS_ALLOWED * device_error, BF16_EPS * exact[name].abs().max().item())
        assert our_error <= bound, (f"{what}grad of {name}: {our_error:.3g} from the exact gradient, one bf16 "
                                    f"device {device_error:.3g} (bound {bound:.3g})")


def float64_gradients(module: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> dict:
    """The exact gradients at ``module``'s current weights: ``run(copy)`` does the forwards and
    backwards (the step's micro-batches, each loss scaled as the step scales it) on a float64 copy
    of ``module``, outside any autocast region. For :func:`assert_gradients_near_exact`."""
    copy_ = copy.deepcopy(module).double()
    _float64_experts(copy_)
    return _copy_gradients(copy_, run)


def assert_gradients_near_exact(model, exact: dict, device: dict, what: str = "") -> None:
    """Each gradient of ``model`` (a step computing in bf16 somewhere: autocast, bf16 parameters) no
    further from ``exact`` (:func:`float64_gradients`) than DEVICE_ERRORS_ALLOWED times the distance
    of ``device`` (one device's gradients, the same step computing in bf16 the same way) from it."""
    _assert_near_exact(model, {n: g.double() for n, g in exact.items()}, device, what)


def assert_bf16_gradients_near_exact(model, structure: torch.nn.Module, batch: dict, what: str = "") -> None:
    """Every gradient of a mixed-precision step (bf16 compute, fp32 reduction) is no further from
    the exact gradient than DEVICE_ERRORS_ALLOWED times one bf16 device's own error. The exact
    gradient and the device's are computed from the model's current weights rounded to bf16
    (``structure``: a module of the same architecture, copied; ``batch``: the global batch), one in
    float64, one in bf16.

    For kernels that round where eager bf16 does not (``codegen="inductor"`` computes a fused bf16
    chain in fp32 and rounds once), this is the meaningful bound: a fixed tolerance against the
    bf16 device alone measures that device's accumulation error as much as ours (an embedding's
    gradient summed over repeated tokens in bf16 is off by ~1 ulp of its partial sums), while a
    wrong gradient (a missing reduction or scale) is off by far more than either. A floor of one
    bf16 rounding of the tensor's largest exact value keeps a tensor the device gets nearly exact
    from failing on a single rounding."""
    weights = {n: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
               for n, p in model.named_parameters()}
    exact, device = (_gradients(structure, weights, batch, dtype) for dtype in (torch.float64, torch.bfloat16))
    _assert_near_exact(model, exact, device, what)


def mixed_precision_steps(master: torch.nn.Module, model, mesh, steps: int = 2, ignore_fraction: float = 0.0) -> None:
    """``steps`` SGD steps of ``model`` (a mixed-precision plan: bf16 parameters, fp32 reduction) on
    ``global_batch`` 4 x 16, each against one device computing in bf16 from ``master``'s fp32
    weights (:func:`bf16_reference_step`, :func:`assert_matches_bf16_reference`); ``master`` then
    takes the same fp32 step from that copy's gradients."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (master, model)]
    for step in range(steps):
        full = global_batch("llama", 4, 16, seed=step + 1, ignore_fraction=ignore_fraction)
        compute, ref_loss = bf16_reference_step(master, full)
        loss = _loss(model(**local_batch(full, mesh)))
        loss.backward()
        assert_matches_bf16_reference(model, loss, compute, ref_loss, full, what=f"step {step} ")
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.float()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


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
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        full = global_batch(model, batch, seq_len, seed=step + 1, ignore_fraction=ignore_fraction)
        local = local_batch(full, mesh)
        if with_loss_fn:
            loss = parallel.step({"input_ids": local["input_ids"]}, local["labels"])
        else:
            loss = parallel.step(local)
        ref_loss = torch.zeros(())
        for m in range(reference_microbatches):
            chunk = micro_batch(full, mesh, m, reference_microbatches) if reference_microbatches > 1 else full
            part = _loss(reference(**chunk)) / reference_microbatches
            part.backward()
            ref_loss = ref_loss + part.detach()
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"step {step} loss: {m}")
        ref_params = dict(reference.named_parameters())
        for name, p in parallel.named_parameters():
            torch.testing.assert_close(
                p.grad.full_tensor(), ref_params[name].grad,
                msg=lambda m, name=name: f"step {step} grad of {name}: {m}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(loss.item())
    held = sum(len(group["params"]) for group in opt.param_groups)
    return {"params": sorted(n for n, _ in parallel.named_parameters()), "optimizer_params": held,
            "losses": losses, "report": parallel.pipeline_report(), "summary": parallel.compile_summary(),
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

