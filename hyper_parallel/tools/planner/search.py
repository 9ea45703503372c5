"""``hp.auto_plan``: choose the parallel configuration from the compiler's own estimates.

The search: enumerate every factorisation of the world (:mod:`.space`), reject what cannot run or
cannot fit without compiling (:mod:`.prune`), then compile each survivor with
:func:`~hyper_parallel.tools.explain.explain` on fake ranks (the passes, memory estimate and
simulated step a real run's plan gets) and rank the ones that fit by predicted step time.
Recompute modes are tried in the order none, selective, full per configuration and the first that
fits ends it: recompute only adds compute, so a later mode cannot be faster (it is listed as not
compiled, with that reason). Everything is deterministic: the order of :mod:`.space`, ties broken
by the candidate's description.

Reads: the model config, world size, hardware profile, batch, sequence length, dtype, optimizer,
memory budget and restrictions. Writes: a :class:`~.result.Choice` (progress lines on stderr).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any, Mapping

from ...analysis.memory import format_bytes
from ...cost.hardware import HardwareProfile, get_profile
from ...progress import enable_default_logging
from .. import presets
from .prune import batch_problem, dims_problem, memory_problem, plan_problem
from .result import NOT_COMPILED_RECOMPUTE, Choice, PlanContext, Ranked
from .space import Candidate, candidates, degree_choices, dp_degree, parse_search

__all__ = ["auto_plan"]

log = logging.getLogger(__name__)


def auto_plan(
    model_or_config: Any,
    *,
    world_size: int,
    hardware: str | HardwareProfile = "h100",
    global_batch: int,
    seq_len: int,
    memory_per_device: int | None = None,
    optimizer: str = "adamw",
    dtype: str = "bf16",
    top_k: int = 5,
    search: Mapping[str, Any] | None = None,
    model: str = "example",
    num_layers: int | None = None,
    progress: bool = True,
) -> Choice:
    """The fastest configuration of ``world_size`` ranks that fits, and every one considered.

    ``model_or_config``: a config preset name (``"llama3-70b"``), a JSON config path, a dict of
    config fields (which may name a preset under ``"base"``), or a transformers model (its class
    and config); ``model``: ``"example"`` (hyper_parallel's Llama / MoE) or ``"hf:<Architecture>"``
    for a config. ``hardware``: a profile name (``"h100"``, ``"cpu"``, ...) or a
    ``HardwareProfile``; ``memory_per_device``: the per-rank budget in bytes (None: the profile's
    memory). ``global_batch`` sequences of ``seq_len`` tokens per optimizer step. ``search``:
    restrictions, e.g. ``{"pp": 1}``, ``{"tp": [1, 2, 4]}``, ``{"recompute": "full"}``,
    ``{"pp_schedule": "1F1B"}``, ``{"dp_replicate": [1, 2]}`` (HSDP is not searched otherwise).
    ``top_k``: how many of the fitting candidates :meth:`Choice.table` shows (all are in
    ``ranked``). ``progress``: a line per compiled candidate on stderr.

    Returns a :class:`~.result.Choice`: ``dims``, ``plan``, ``mesh(device)``, ``local_batch``,
    ``micro_batches``, ``predicted`` of the best, and ``ranked``, every candidate best first (the
    rejected ones after those that fit, each with ``rejected`` saying why). Raises ValueError when
    nothing fits, with the closest candidates and their reasons.
    """
    started = time.perf_counter()
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"auto_plan: world_size must be a positive integer, got {world_size!r}")
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len), ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"auto_plan: {name} must be a positive integer, got {value!r}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"auto_plan: dtype {dtype!r}; choose bf16 or fp32")
    profile = get_profile(hardware.lower() if isinstance(hardware, str) else hardware)
    budget = profile.memory_bytes if memory_per_device is None else memory_per_device
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"auto_plan: memory_per_device is a number of bytes, got {memory_per_device!r}")
    source, config_name, fields = _model_and_fields(model_or_config, model)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    space = parse_search(search)
    context = PlanContext(source=source, config_name=config_name, fields=fields, world_size=world_size,
                          hardware=profile, seq_len=seq_len, global_batch=global_batch, dtype=dtype,
                          optimizer=optimizer, budget=budget)
    num_params = context.num_params()

    enable_default_logging()
    ranked, to_compile = _enumerate(context, space, num_params)
    total = sum(len(g) for g in to_compile)
    log.info("auto_plan: %d candidates, %d rejected without compiling, at most %d to compile",
             len(ranked) + total, len(ranked), total)
    done = 0
    for group in to_compile:
        fitted = None
        for candidate in group:
            if fitted is not None:
                ranked.append(Ranked(candidate, context, rejected=f"{NOT_COMPILED_RECOMPUTE}{fitted.recompute} fits "
                                     "and recompute only adds compute"))
                continue
            done += 1
            entry = _evaluate(candidate, context)
            ranked.append(entry)
            if progress:
                log.info("auto_plan: [%d/%d] %s: %s", done, total, candidate.describe(), entry.outcome())
            if entry.rejected is None:
                fitted = candidate
    fitting = sorted((r for r in ranked if r.rejected is None),
                     key=lambda r: (r.predicted["step_s"], r.candidate.describe()))
    rejected = [r for r in ranked if r.rejected is not None]
    choice = Choice(fitting + rejected, context, top_k=top_k, search_s=time.perf_counter() - started)
    if not fitting:
        raise ValueError(f"auto_plan: no configuration of {world_size} ranks fits {format_bytes(budget)} per rank:\n"
                         + choice.table(rejected_rows=8)
                         + "\nallow more memory, recompute or pipeline stages (search=...), or more ranks")
    log.info("auto_plan: chose %s (%.1f s of search)", fitting[0].candidate.describe(), choice.search_s)
    return choice


def _enumerate(context: PlanContext, space, num_params: int) -> tuple[list[Ranked], list[list[Candidate]]]:
    """(the candidates rejected without compiling, the groups to compile): each group one
    configuration and pipeline choice with its recompute modes in order, cheapest first."""
    layers = int(context.fields.get("num_hidden_layers", 1))
    ranked: list[Ranked] = []
    to_compile: list[list[Candidate]] = []
    for degrees in degree_choices(context.world_size, context.fields, context.seq_len,
                                  context.hardware.devices_per_node, space):
        shape = Candidate(**degrees)
        problem = dims_problem(degrees, context.world_size, context.fields, context.seq_len) \
            or plan_problem(shape) or batch_problem(degrees, context.global_batch)
        if problem:
            ranked.append(Ranked(shape, context, rejected=problem))
            continue
        local_batch = context.global_batch // dp_degree(degrees)
        group = candidates(degrees, local_batch, layers, space)
        if not group:
            ranked.append(Ranked(Candidate(**degrees, local_batch=local_batch), context,
                                 rejected=f"pp={degrees['pp']}: no schedule fits {layers} layers and a local batch "
                                 f"of {local_batch} ({', '.join(space.schedules)}; at least pp micro-batches)"))
            continue
        by_pipeline: dict[tuple, list[Candidate]] = {}
        for candidate in group:
            problem = memory_problem(num_params, candidate, context.dtype, context.optimizer, context.budget)
            if problem:
                ranked.append(Ranked(candidate, context, rejected=problem))
            else:
                key = (candidate.pp_schedule, candidate.stages_per_rank, candidate.num_microbatches)
                by_pipeline.setdefault(key, []).append(candidate)
        to_compile.extend(by_pipeline.values())
    return ranked, to_compile


def _evaluate(candidate: Candidate, context: PlanContext) -> Ranked:
    """Compile ``candidate`` on fake ranks (explain) and price it; a ValueError of the compile is
    the candidate's rejection."""
    from ..explain import explain

    try:
        with _quiet_compiles():
            report = explain(model=context.source, config=dict(context.fields), parallel=candidate.degrees,
                             world_size=context.world_size, plan=candidate.plan_name, hardware=context.hardware,
                             optimizer=context.optimizer, local_batch=candidate.local_batch, seq_len=context.seq_len,
                             dtype=context.dtype, recompute=candidate.recompute,
                             pp_schedule=candidate.pp_schedule or "1F1B", num_microbatches=candidate.num_microbatches,
                             stages_per_rank=candidate.stages_per_rank)
    except ValueError as exc:  # the compiler refuses the plan, saying why
        return Ranked(candidate, context, rejected=f"does not compile: {str(exc).splitlines()[0]}", compiled=True)
    except Exception as exc:  # a compiler bug: the search goes on, and says so loudly
        log.warning("auto_plan: %s failed to compile (%s: %s); rejected, please report it with this configuration",
                    candidate.describe(), type(exc).__name__, exc, exc_info=True)
        return Ranked(candidate, context, rejected=f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                      compiled=True)
    entry = Ranked(candidate, context, predicted=predicted_of(report), report=report, compiled=True)
    peak = entry.predicted["peak_bytes"]
    if peak > context.budget:
        entry.rejected = f"OOM by {format_bytes(peak - context.budget)} (predicted peak {format_bytes(peak)})"
    elif not report["step"].get("available"):
        entry.rejected = f"no simulated step: {report['step'].get('reason')}"
    return entry


def predicted_of(report: dict) -> dict:
    """``explain``'s report as ``predicted``: step seconds, tokens/s per device, MFU, the peak and
    the caching allocator's reserved peaks (with and without expandable segments), and with a
    pipeline each stage's and each pp rank's figures."""
    step, memory = report["step"], report["memory"]
    out = {"step_s": step.get("step_s", float("inf")), "tokens_per_s": step.get("tokens_per_s_per_device", 0.0),
           "mfu": step.get("mfu", 0.0), "peak_bytes": memory["peak"],
           "reserved_bytes": memory.get("reserved_expandable", memory["peak"]),
           "reserved_default_bytes": memory.get("reserved_default", memory["peak"])}
    if "pipeline" in report:
        pipeline = report["pipeline"]
        out["bubble"] = pipeline["bubble_fraction"]
        out["stages"] = pipeline["stages"]
        out["pp_ranks"] = pipeline["ranks"]
    return out


@contextlib.contextmanager
def _quiet_compiles():
    """The package's INFO lines (each compile's phases) off while a candidate compiles; the
    planner's own lines stay."""
    package = logging.getLogger("hyper_parallel")
    level = package.level
    if package.getEffectiveLevel() > logging.INFO:
        yield
        return
    log.setLevel(logging.INFO)
    # A compile's advice to a user running the plan (clip gradients through the pipelined module)
    # is for the plan chosen, not for each candidate; errors still show.
    package.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, once per compile
            yield
    finally:
        package.setLevel(level)


def _model_and_fields(model_or_config: Any, model: str) -> tuple[str, str, dict]:
    """(explain's model source, config name, config fields) of what ``auto_plan`` was given."""
    import torch.nn as nn

    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if config is None or not hasattr(config, "to_diff_dict"):
            raise TypeError(f"auto_plan: a {type(model_or_config).__name__} has no transformers config to rebuild it "
                            "from on fake ranks; pass its config (a preset name, JSON path or dict of fields)")
        fields = {k: v for k, v in config.to_diff_dict().items() if k not in ("architectures", "transformers_version")}
        return f"hf:{type(model_or_config).__name__}", type(config).__name__, fields
    if isinstance(model_or_config, dict):
        fields = dict(model_or_config)
        base = fields.pop("base", None)
        if base is None:
            return model, "custom", fields
        name, base_fields = presets.load_model_config(base)
        return model, f"{name} (modified)", {**base_fields, **fields}
    if isinstance(model_or_config, str):
        name, fields = presets.load_model_config(model_or_config)
        return model, name, dict(fields)
    raise TypeError(f"auto_plan: model_or_config is a config preset name, a JSON path, a dict of fields or a "
                    f"transformers model, got {type(model_or_config).__name__}")
