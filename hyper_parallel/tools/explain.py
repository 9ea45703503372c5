"""Planning at scale without hardware: compile a plan for a simulated mesh and explain one rank.

``hyper-parallel explain`` (``hyper_parallel/tools/cli.py``) and :func:`explain` build the model on the
meta device, start torch's ``fake`` process-group backend with the requested world size (one
process plays rank 0, or ``rank``; collectives are never executed), build the mesh with
:class:`~hyper_parallel.ParallelDims`, and compile the plan exactly as a real run would: capture on
fake tensors of the global shapes, propagation, lowering, every pass, the partition. Nothing is
materialised and no step runs (:func:`compile_for_explain`). From the compiled per-rank programs it
reports:

- memory: the estimator of ``hyper_parallel/analysis/memory.py`` (``ParallelModule.memory_report``):
  parameters, gradients, optimizer state, saved activations, the peak and where it is reached,
  and whether the peak fits the device's memory;
- communication: every collective of the step by kind and mesh axis, forward and backward
  (``compile_summary()["collectives"]``; bytes are the local input of each collective);
- time: the step simulated by the cost model (``hyper_parallel/cost``) on a hardware profile,
  with MFU and tokens per second per device.

Context parallelism (``parallel="...,cp=N"``): the plan presets put a ``context_parallel`` entry on
the attention modules (load-balanced ring attention by default, ``cp_mode="all_gather"`` for its
blocks gathered at once, ``cp_mode="all_to_all"`` for Ulysses). Each rank is compiled for its slice of the sequence, ``[local_batch, seq_len / cp]``
tokens (``seq_len`` stays the global sequence length), so saved activations per rank shrink by
about ``cp``; cp ranks share sequences, so ``global_batch`` and ``tokens_per_step`` count only the
data-parallel axes (``dp_replicate``, ``dp_shard``, ``ep``). Ring transfers appear as
``send_recv`` over ``cp`` in the collectives and on the simulated timeline (``cp − 1`` per attention
forward, each key and value stacked: one step of the full bytes).

Llama 3 8B at 128k tokens (``config="llama3-8b", seq_len=131072, recompute="full"``, h100): with
``parallel="dp_shard=8,cp=8"`` on 64 ranks the predicted peak is 41.5 GiB (fits, 56% of 74.5 GiB);
with ``"dp_shard=64"`` on the same 64 ranks it is 288 GiB (does not fit). Measured with all 32
layers (compiling the cp=8 one took 143 s on a 2-core CPU host, the other 80 s; tests use 1 layer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import presets
from ..cost.hardware import PROFILES, HardwareProfile, get_profile
from ..analysis.memory import format_bytes, optimizer_model
from ..progress import Progress, enable_default_logging
from ..distributed import host_reduce

__all__ = ["compile_for_explain", "explain", "fake_world", "format_report"]

log = logging.getLogger(__name__)

# The profiles explain prices: the accelerators, and "cpu" (gloo on this machine's cores, calibrated:
# what a run of the same plan on CPU ranks measures).
HARDWARE = tuple(PROFILES)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "none")


# --- the simulated world and compiling without running -------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` ranks on torch's ``fake`` backend, this process
    being ``rank``; destroyed on exit. An already initialised fake group of that size is reused
    (and left alone)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks (0 .. {world_size - 1})")
    if dist.is_initialized():
        backend, size, me = dist.get_backend(), dist.get_world_size(), dist.get_rank()
        if backend != "fake" or size != world_size or me != rank:
            raise ValueError(
                f"a default process group is already initialised ({backend}, rank {me} of {size}); "
                f"explain needs a fake one of {world_size} ranks as rank {rank}: destroy it first"
            )
        yield
        return
    from .. import compat

    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_for_explain(model: torch.nn.Module, plan: Any, mesh, args: tuple = (), kwargs: dict | None = None,
                        **parallelize_options):
    """``parallelize(model, plan, mesh, materialize=False)`` and compile it for ``args``/``kwargs``
    without running: for a meta-device model on a (fake) mesh, nothing is allocated but the
    programs. The returned module can be inspected (``compile_summary``, ``memory_report``,
    ``compiled_programs``) but not called: its parameters hold no data."""
    from ..api import compile_for_inputs, parallelize

    pmodel = parallelize(model, plan, mesh, materialize=False, **parallelize_options)
    compile_for_inputs(pmodel, args, kwargs)
    return pmodel


# --- models ----------------------------------------------------------------------------------------


def build_model(source: str, fields: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """A model on the meta device: ``"example"`` (hyper_parallel.models.LlamaForCausalLM) or
    ``"hf:<Architecture>"`` (a transformers class built from its config class with ``fields``).
    Returns (model, its config)."""
    from ..init import init_empty_weights

    if source == "example":
        from ..models.llama import LlamaConfig, LlamaForCausalLM
        from ..models.moe import MoEConfig, MoEForCausalLM

        # A config with experts is the example mixture-of-experts decoder.
        config_cls, model_cls = (MoEConfig, MoEForCausalLM) if "num_experts" in fields else (LlamaConfig, LlamaForCausalLM)
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"model config: unknown {config_cls.__name__} fields {unknown}; valid fields: {sorted(known)}")
        config = config_cls(**fields)
        with init_empty_weights():
            model = model_cls(config)
        return model, config
    if source.startswith("hf:"):
        return _build_hf(source[3:], fields)
    raise ValueError(f"--model {source!r}: choose 'example' or 'hf:<Architecture>' (e.g. hf:LlamaForCausalLM)")


def _build_hf(architecture: str, fields: dict[str, Any]):
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"--model hf:{architecture} needs transformers, an optional dependency: "
            "pip install transformers (or pip install -e '.[dev]')"
        ) from e
    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not hasattr(cls, "config_class"):
        raise ValueError(
            f"--model hf:{architecture}: transformers {transformers.__version__} has no model class "
            f"{architecture!r} (e.g. hf:LlamaForCausalLM, hf:MistralForCausalLM, hf:Qwen2ForCausalLM)"
        )
    fields = dict(fields)
    fields.pop("layer_activations", None)  # the example model's own option
    config = cls.config_class(**fields, use_cache=False, attn_implementation="sdpa")
    from ..init import init_empty_weights

    with init_empty_weights():
        model = cls(config)
    model.train()
    return model, config


# --- explain ---------------------------------------------------------------------------------------


def _uses_fp32_masters(plan: Any) -> bool:
    """The plan's FSDP keeps fp32 master weights and computes in a lower param_dtype."""
    fs = plan.get("fully_shard") if isinstance(plan, dict) else getattr(plan, "fully_shard", None)
    if fs is None:
        return False
    from ..fsdp.plan import FullyShard

    policy = FullyShard.from_value(fs).mixed_precision
    return policy is not None and policy.param_dtype is not None


def explain(
    model: str = "example",
    config: str | dict = "llama3-8b",
    parallel: str | dict = "dp_shard=-1",
    world_size: int = 8,
    plan: str = "fsdp",
    hardware: str | HardwareProfile = "h100",
    *,
    rank: int = 0,
    optimizer: str = "adamw",
    local_batch: int = 1,
    seq_len: int = 8192,
    dtype: str = "bf16",
    recompute: str = "none",
    num_layers: int | None = None,
    cp_mode: str = "ring",
    trace_path: str | None = None,
    dump_dir: str | None = None,
    repeated_blocks: str | None = "auto",
    pp_schedule: str = "1F1B",
    num_microbatches: int | None = None,
    stages_per_rank: int | None = None,
) -> dict:
    """Compile ``plan`` for ``model`` on a simulated ``world_size``-rank mesh and return the
    report of rank ``rank`` (a JSON-friendly dict; :func:`format_report` prints it).

    ``config``: a preset name, a JSON path (see :func:`presets.load_model_config`) or a dict of
    config fields (which may name a preset under ``"base"`` and override some of its fields);
    ``parallel``: ParallelDims degrees (``"dp_shard=-1,tp=8"``, ``"dp_shard=8,cp=8"`` or a dict);
    ``plan``: a plan preset or a Python file defining ``plan``; ``hardware``: a profile name
    (:data:`HARDWARE`; "cpu" prices gloo ranks on this machine's cores) or a ``HardwareProfile``;
    ``local_batch`` sequences of
    ``seq_len`` tokens per data-parallel rank; ``dtype``: "bf16" (FSDP presets: bf16 compute over
    fp32 master weights with fp32 gradient reduction; otherwise bf16 parameters) or "fp32";
    ``num_layers`` overrides the config's ``num_hidden_layers``; ``cp_mode``: "ring" (load-balanced
    ring attention, the default), "all_gather" (the same, K/V gathered) or "all_to_all" (Ulysses),
    the attention of a preset plan when ``parallel`` has ``cp`` > 1 (each rank then holds
    ``seq_len / cp`` tokens of each of its ``local_batch`` sequences); ``trace_path``: also write the
    simulated step as a Chrome trace JSON there (open it in Perfetto); ``dump_dir``: write the
    compile's dumps there as ``parallelize(dump_dir=)`` does, with the step trace of ``hardware``
    (``hyper-parallel report DUMP_DIR`` turns them into a page); ``repeated_blocks``: as
    ``parallelize``'s (``"auto"``, the default: trace two layers and copy the others; None: trace
    every layer, the same report later).
    With ``pp`` in ``parallel`` a preset plan gets a pipeline (``presets.pipeline_entry``: equal
    stages, ``pp_schedule`` "GPipe", "1F1B", "Interleaved1F1B" or "ZBH1", ``num_microbatches``
    (default pp) micro-batches of the ``local_batch`` sequences, ``stages_per_rank``) and the report
    is the whole pipelined step (``tools/explain_pipeline.py``): its ``pipeline`` entry has the
    bubble, each stage's times and memory and each pp rank's peak.
    """
    started = time.perf_counter()
    if isinstance(hardware, str) and hardware.lower() not in HARDWARE and not hardware.endswith(".json"):
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {', '.join(HARDWARE)}, a profile JSON file "
                         "(hyper-parallel calibrate --out FILE) or pass a hyper_parallel.cost.HardwareProfile")
    profile = get_profile(hardware if isinstance(hardware, str) and hardware.endswith(".json")
                          else hardware.lower() if isinstance(hardware, str) else hardware)
    hardware = profile.name
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"unknown dtype {dtype!r}; choose bf16 or fp32")
    for name, value in (("local batch", local_batch), ("sequence length", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(config, dict):
        config_name, fields = "custom", dict(config)
        base = fields.pop("base", None)
        if base is not None:  # a preset's fields, some overridden (as a JSON config file may)
            config_name = f"{presets.load_model_config(base)[0]} (modified)"
            fields = {**presets.load_model_config(base)[1], **fields}
    else:
        config_name, fields = presets.load_model_config(config)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    degrees = presets.parse_parallel(parallel) if isinstance(parallel, str) else dict(parallel)
    if cp_mode not in presets.CP_MODES:
        raise ValueError(f"unknown cp mode {cp_mode!r}; choose one of {', '.join(presets.CP_MODES)}")
    if cp_mode in ("ring", "all_gather") and degrees.get("cp", 1) > 1:
        # All of cp is ring attention: ParallelDims then checks no head divisibility for it.
        degrees.setdefault("ulysses_degree", 1)

    from ..distributed.parallel_dims import ParallelDims

    dims = ParallelDims(**degrees, world_size=world_size, seq_len=seq_len, model_config=fields)
    axes = dims.mesh_axes()
    cp = axes.get("cp", 1)
    pp = axes.get("pp", 1)
    pipeline = {"schedule": pp_schedule, "num_microbatches": num_microbatches, "stages_per_rank": stages_per_rank}
    choice = presets.build_plan(plan, axes, fields, mixed_precision=dtype == "bf16", recompute=recompute,
                                cp_mode=cp_mode, ulysses_degree=degrees.get("ulysses_degree"), pipeline=pipeline)
    if pp > 1:
        pipe_plan = choice.plan.get("pipeline") if isinstance(choice.plan, dict) else getattr(choice.plan, "pipeline")
        microbatches = getattr(pipe_plan, "num_microbatches", None) or (pipe_plan or {}).get("num_microbatches", 1)
        if local_batch % microbatches:
            raise ValueError(f"--local-batch {local_batch} does not split into {microbatches} micro-batches: give a "
                             f"multiple of {microbatches} sequences per data-parallel rank (or --microbatches)")
    compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    net, _ = build_model(model, fields)
    num_params = sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())
    masters = _uses_fp32_masters(choice.plan)
    if not masters and compute_dtype != torch.float32:
        net = net.to(compute_dtype)
    precision = (
        f"{dtype} compute, fp32 master weights" + (", fp32 gradient reduction" if masters else "")
        if masters else f"{dtype} parameters and compute"
    )

    enable_default_logging()
    progress = Progress(f"explain {config_name}")  # fake_world below: this process is "rank 0"
    with fake_world(world_size, rank):
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):  # this rank's inputs: its slice of each sequence under cp
            ids = torch.zeros(local_batch, seq_len // cp, dtype=torch.long)
        compile_start = time.perf_counter()
        labels = _flattened_axis_labels(mesh, dims.flattened_axes())
        # The optimizer as torch runs it on the accelerator priced (foreach: one temporary per
        # parameter during the step), not as on this CPU (one parameter at a time).
        optimizer_priced = dataclasses.replace(optimizer_model(optimizer), foreach=True)
        pipelined = None
        if pp > 1:
            from .explain_pipeline import explain_pipelined

            pipelined = explain_pipelined(net, choice.plan, mesh, ids, profile, optimizer_priced, dtype,
                                          dump_dir=dump_dir, repeated_blocks=repeated_blocks)
            pmodel, memory, step = pipelined["pmodel"], pipelined["memory"], pipelined["step"]
            collectives, fallbacks = pipelined["collectives"], ()
            compile_s = time.perf_counter() - compile_start
        else:
            pmodel = compile_for_explain(net, choice.plan, mesh, (), {"input_ids": ids, "labels": ids},
                                         dump_dir=dump_dir, repeated_blocks=repeated_blocks)
            compile_s = time.perf_counter() - compile_start
            summary = pmodel.compile_summary(memory=False)  # memory_report prices it with the optimizer
            collectives = {"forward": summary["collectives"]["forward"], "backward": summary["collectives"]["backward"],
                           "per_step": summary["collectives_per_step"]}
            fallbacks = summary.get("fallbacks") or ()
            memory = pmodel.memory_report(optimizer_priced)
            with progress.phase("simulated step"):
                step = _simulate(pmodel, mesh, profile, optimizer, dtype)
    progress.done()
    # CPU ranks beyond the host's cores time-share them (a pipeline's less: its ranks idle in the bubble).
    busy = 1.0 - pipelined["pipeline"]["bubble_fraction"] if pipelined else 1.0
    sharing = profile.host_sharing(min(world_size, profile.devices_per_node), busy)
    if sharing > 1.0 and step.get("available"):
        step = _time_shared(step, sharing)
    timeline = step.pop("timeline", None)
    if trace_path is not None and timeline is None:
        raise ValueError(f"explain(trace_path={trace_path!r}): no simulated step to trace ({step.get('reason')})")
    if timeline is not None:
        from ..cost import to_chrome_trace

        trace = to_chrome_trace(timeline, rank=rank)
        # The totals the report page prints above the timeline, as this report has them.
        trace["otherData"] = {**{k: v for k, v in sorted(step.items()) if k != "available"},
                              "optimizer_model": optimizer, "device_type": hardware}
        # The dump's own trace prices the step on the mesh's device (cpu here); this one is the
        # requested hardware with the requested optimizer.
        paths = [trace_path] + ([os.path.join(dump_dir, f"rank{rank}", "trace.json")] if dump_dir else [])
        for path in filter(None, paths):
            with open(path, "w") as f:
                json.dump(trace, f, sort_keys=True)
    if dump_dir:
        _dump_memory_as_explained(os.path.join(dump_dir, f"rank{rank}"), memory, hardware, optimizer)

    # Ranks that take different sequences; cp (and tp) ranks share theirs.
    dp_degree = math.prod(size for axis, size in axes.items() if axis.startswith("dp") or axis == "ep")
    tokens = local_batch * seq_len * dp_degree
    device_bytes = profile.memory_bytes
    if step.get("available"):
        step["tokens_per_s_per_device"] = tokens / step["step_s"] / world_size
    notes = list(choice.notes)
    if fallbacks:
        notes.append(f"{len(fallbacks)} op(s) without a sharding rule run replicated: {sorted(fallbacks)[:5]}")
    return {
        "model": {"source": model, "config": config_name, "num_params": num_params, "fields": fields},
        "plan": {"name": choice.name, "recompute": recompute, "notes": notes,
                 "context_parallel": _context_parallel(pmodel)},
        "mesh": {"axes": axes, "world_size": world_size, "rank": rank},
        "batch": {"local_batch": local_batch, "seq_len": seq_len, "global_batch": local_batch * dp_degree,
                  "tokens_per_step": tokens},
        "precision": precision,
        "optimizer": optimizer,
        "memory": memory,
        "device": {"name": hardware, "memory_bytes": device_bytes, "fits": memory["peak"] <= device_bytes,
                   "host_cores": profile.host_cores,
                   "peak_fraction": memory["peak"] / device_bytes},
        "collectives": {key: _relabel(table, labels) for key, table in collectives.items()},
        "step": step,
        **({"pipeline": pipelined["pipeline"]} if pipelined else {}),
        "compile_s": compile_s,
        "wall_s": time.perf_counter() - started,
    }


def _dump_memory_as_explained(folder: str, memory: dict, hardware: str, optimizer: str) -> None:
    """The dump's memory estimate (summary.json, memory.json) made the one explain printed: with the
    optimizer's state and named by the hardware profile, not the compile's (no optimizer, cpu)."""
    explained = {**memory, "device": hardware, "optimizer": optimizer}
    for name, key in (("summary.json", "memory"), ("memory.json", "estimate")):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        data[key] = explained
        with open(path, "w") as f:
            json.dump(data, f, indent=2 if name == "summary.json" else None, sort_keys=True)


def _context_parallel(pmodel) -> dict | None:
    """The compiled plan's context parallelism (axis, degree, mode, load balance, overlap), or None."""
    state = pmodel._hp
    context = getattr(state.resolved if state.pipeline is not None else state.last.resolved, "context", None)
    if context is None:
        return None
    return {"axis": context.axis, "degree": context.degree, "mode": context.mode, "ulysses": context.ulysses,
            "load_balance": context.balanced, "asynchronous": context.asynchronous,
            "kv_exchange": context.kv_exchange if context.mode != "all_to_all" else None,
            "modules": len(context.modules)}


def _flattened_axis_labels(mesh, aliases: dict | None = None) -> dict[str, str]:
    """Process-group name -> alias for the meshes flattened from ``mesh``'s root (ParallelDims'
    ``dp`` / ``fsdp`` / ``loss``): reductions over several data-parallel axes run on those groups,
    which the compile summary names by their (rank-dependent) group name. ``aliases``
    (``ParallelDims.flattened_axes()``) names an alias over the cp axis by its axes
    (``dp_shard+cp``: FSDP over dp_shard x cp gathers and reduce-scatters there, not only the loss)."""
    from .. import compat

    labels = {}
    by_ranks: dict[tuple, str] = {}
    for alias, flat in compat.flattened_meshes(mesh).items():
        name = flat.mesh_dim_names[0] if flat.mesh_dim_names else alias
        sources = getattr((aliases or {}).get(name), "sources", ())
        if "cp" in sources:
            name = "+".join(sources)
        # Aliases over the same ranks (``loss`` is ``dp`` without cp) share the first one's label:
        # DTensor may run a multi-axis collective (dense FSDP over dp_shard x ep) on either group.
        ranks = tuple(flat.mesh.flatten().tolist())
        labels[flat.get_group(0).group_name] = by_ranks.setdefault(ranks, name)
    return labels


def _relabel(table: dict, labels: dict[str, str]) -> dict:
    """``{kind: {axis: entry}}`` with flattened groups' names replaced by their aliases."""
    out: dict = {}
    for kind, per_axis in table.items():
        merged: dict = {}
        for axis, entry in per_axis.items():
            name = labels.get(axis, axis)
            if name in merged:
                merged[name] = {k: merged[name][k] + entry[k] for k in ("count", "bytes")}
            else:
                merged[name] = dict(entry)
        out[kind] = dict(sorted(merged.items()))
    return out


def _simulate(pmodel, mesh, profile, optimizer: str, dtype: str) -> dict:
    """The cost model's estimate of the step ``pmodel`` last compiled, or, should the cost model
    fail on it, {"available": False, "reason": ...} (memory and communication still stand)."""
    from ..cost import mfu
    from ..analysis.debug import simulate_step

    entry = pmodel._hp.last
    state = None if optimizer == "none" else optimizer_model(optimizer).state
    try:
        est = simulate_step(entry.program, mesh, entry.resolved.fsdp, profile, state, context=entry.resolved.context)
    except Exception as e:  # noqa: BLE001 - memory and communication are still worth printing
        log.warning("explain: the cost model failed: %s", e, exc_info=True)
        return {"available": False, "reason": f"the cost model failed: {type(e).__name__}: {e}"}
    positive = est.step_s > 0
    return {**est.as_dict(), "available": True, "profile": profile.name, "model_flops": est.model_flops,
            "mfu": mfu(est.model_flops, est.step_s, profile, dtype) if positive else 0.0,
            "hfu": mfu(est.flops, est.step_s, profile, dtype) if positive else 0.0,
            "timeline": est.timeline}


def _time_shared(step: dict, factor: float) -> dict:
    """The simulated step on ranks that share a host's cores: every time ``factor`` longer (compute
    and gloo's host-side communication alike), MFU ``factor`` lower; ``host_sharing`` says by how
    much. The timeline (``trace_path``) and a pipeline's per-stage times stay those of one rank
    with a core of its own."""
    scaled = {k: v * factor if k.endswith("_s") and isinstance(v, float) else v for k, v in step.items()}
    for key in ("mfu", "hfu"):
        if key in scaled:
            scaled[key] = step[key] / factor
    scaled["host_sharing"] = factor
    return scaled


# --- text ------------------------------------------------------------------------------------------


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _fmt_us(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else _fmt_s(s)


def _fmt_s(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _short_site(site: dict) -> str:
    """``backward node in module (file.py:N: code)``, the code cut to fit a terminal line."""
    text = f"{site['phase']} {site['node']}".strip()
    if site.get("module"):
        text += f" in {site['module']}"
    match = re.match(r'File "([^"]+)", line (\d+), in [^:]+: (.*)', site.get("source") or "")
    if match:
        path, line, code = match.groups()
        code = code if len(code) <= 48 else code[:45] + "..."
        text += f" ({os.path.basename(path)}:{line}: {code})"
    return text


def _context_label(context: dict) -> str:
    """``ring attention over cp=8 (load-balanced, async)`` / ``all-to-all attention over cp=4``."""
    if context["mode"] == "all_to_all":
        return f"all-to-all attention over {context['axis']}={context['degree']}"
    how = ["load-balanced" if context["load_balance"] else "not load-balanced"]
    how += ["async"] if context["asynchronous"] else []
    kind = "all-gather attention" if context.get("kv_exchange") == "all_gather" else "ring attention"
    if context["mode"] == "hybrid":
        u = context["ulysses"]
        return (f"{kind} over {context['degree'] // u} groups of {u} all-to-all ranks, "
                f"{context['axis']}={context['degree']} ({', '.join(how)})")
    return f"{kind} over {context['axis']}={context['degree']} ({', '.join(how)})"


def format_report(report: dict) -> str:
    """The report as a short terminal table."""
    m, mesh, batch, mem, dev = report["model"], report["mesh"], report["batch"], report["memory"], report["device"]
    context = report["plan"].get("context_parallel")
    axes = " x ".join(f"{a}={s}" for a, s in mesh["axes"].items()) or "1 rank"
    layers = m["fields"].get("num_hidden_layers")
    lines = [
        f"model     {m['config']} ({m['source']}, {layers} layers, {_fmt_count(m['num_params'])} parameters)",
        f"plan      {report['plan']['name']}"
        + (f", recompute {report['plan']['recompute']}" if report["plan"]["recompute"] != "none" else "")
        + (f", {_context_label(context)}" if context else "")
        + f"; {report['precision']}; optimizer {report['optimizer']}",
        f"mesh      {axes} ({mesh['world_size']} ranks, simulated); showing rank {mesh['rank']}",
        f"batch     {batch['local_batch']} x {batch['seq_len']} tokens per data-parallel rank"
        + (f" (each of {context['degree']} cp ranks holds {batch['seq_len'] // context['degree']:,} tokens of "
           f"every sequence)" if context else "")
        + f"; global {batch['global_batch']} x {batch['seq_len']} = {batch['tokens_per_step']:,} tokens per step",
        "",
        "memory per rank (estimate)" + (f", pp rank {mem['pp_rank']} (stages {', '.join(map(str, mem['stages']))}):"
                                        " the highest peak" if "pp_rank" in mem else ""),
    ]
    rows = [
        ("parameters", mem["params"]), ("gradients", mem["grads"]),
        ("optimizer state", mem["optimizer_state"]), ("saved activations", mem["saved_activations"]),
        ("peak", mem["peak"]),
    ]
    lines += [f"  {name:<20}{format_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'peak at':<20}{_short_site(mem['peak_site'])}")
    lines.append(f"  {'reserved':<20}{format_bytes(mem['reserved_expandable']):>12}  (max_memory_reserved with "
                 f"expandable_segments:True; {format_bytes(mem['reserved_default'])} without)")
    verdict = "fits" if dev["fits"] else "DOES NOT FIT"
    if dev["fits"] and mem["reserved_expandable"] > dev["memory_bytes"]:
        # The allocated peak fits, the cache does not: the allocator returns cached memory and
        # retries when a request fails (slower steps, allocation retries in its stats).
        verdict = "fits, but not the allocator's cache: expect allocation retries"
    lines.append(
        f"  {dev['name'] + ' memory':<20}{format_bytes(dev['memory_bytes']):>12}  -> {verdict} "
        f"(peak = {dev['peak_fraction'] * 100:.0f}% of device memory)"
    )
    lines += ["", "collectives per step (bytes = each collective's local input)",
              f"  {'kind':<16}{'axis':<14}{'fwd':>6}{'bwd':>6}{'bytes/step':>14}"]
    fwd, bwd = report["collectives"]["forward"], report["collectives"]["backward"]
    for kind, per_axis in report["collectives"]["per_step"].items():
        for axis, entry in per_axis.items():
            nf = fwd.get(kind, {}).get(axis, {}).get("count", 0)
            nb = bwd.get(kind, {}).get(axis, {}).get("count", 0)
            lines.append(f"  {kind:<16}{axis:<14}{nf:>6}{nb:>6}{format_bytes(entry['bytes']):>14}")
    step = report["step"]
    lines.append("")
    if step.get("available"):
        lines += [
            f"step time (cost model, {step['profile']}): {_fmt_s(step['step_s'])}"
            f"  (forward {_fmt_s(step['forward_s'])}, backward {_fmt_s(step['backward_s'])}, "
            f"optimizer {_fmt_s(step['optimizer_s'])})",
            f"  compute {_fmt_s(step['compute_s'])}, communication {_fmt_s(step['comm_s'])} of which "
            f"{_fmt_s(step['exposed_comm_s'])} exposed",
            f"  MFU {step['mfu'] * 100:.1f}%  ({step['model_flops'] / 1e12:.1f} model TFLOP per rank per step"
            + (f"; with recompute {step['flops'] / 1e12:.1f} TFLOP, HFU {step['hfu'] * 100:.1f}%"
               if step["recompute_flops"] else "") + "), "
            f"{step['tokens_per_s_per_device']:,.0f} tokens/s per device",
        ]
        if step.get("agreement_s"):
            world = report["mesh"]["world_size"]
            lines.append(f"  per-call agreement over {world:,} ranks: {_fmt_us(step['agreement_s'])} "
                         f"({host_reduce.rounds(world)} host message rounds), {_fmt_us(step['agreement_exposed_s'])} "
                         "of it waited for")
        if step.get("host_sharing"):
            lines.append(f"  ranks share the host's {report['device'].get('host_cores')} cores: times x"
                         f"{step['host_sharing']:.2f} (the busy ranks over the cores)")
    else:
        lines.append(f"step time: cost model not available ({step.get('reason', '')})")
    if "pipeline" in report:
        from .explain_pipeline import format_pipeline

        lines += format_pipeline(report["pipeline"])
    for note in report["plan"]["notes"]:
        lines.append(f"note: {note}")
    lines.append(f"compiled in {report['compile_s']:.1f} s (explain total {report['wall_s']:.1f} s)")
    return "\n".join(lines)
