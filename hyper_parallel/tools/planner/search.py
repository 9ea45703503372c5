"""``hp.auto_plan``: choose the parallel configuration from the compiler's own estimates.

The search: enumerate every factorisation of the world (:mod:`.space`), reject what cannot run or
cannot fit without compiling (:mod:`.prune`), order the survivors by an analytic step time
(:mod:`.estimate`), then compile them in that order with
:func:`~hyper_parallel.tools.explain.explain` on fake ranks (the passes, memory estimate and
simulated step a real run's plan gets) and rank the ones that fit by predicted step time. A
compile takes seconds, so at most ``max_compiles`` are compiled (and none started after
``time_budget_s``), besides the configurations named in ``include`` (a hand-written plan to
compare with), which always are; the rest are listed as not compiled, with their estimate.
Recompute modes are tried in the order none, selective, full per configuration and the first that
fits ends it: recompute only adds compute, so a later mode cannot be faster (it is listed as not
compiled, with that reason); the ladder starts at the first mode expected to fit, and the estimate
and the expectation are scaled by what the compiles so far found (see ``auto_plan``'s body).
Everything is deterministic (the order of the estimate, ties
broken by the candidate's description) but how far ``time_budget_s`` lets the search get.

Reads: the model config, world size, hardware profile, batch, sequence length, dtype, optimizer,
memory budget and restrictions. Writes: a :class:`~.result.Choice` (progress lines on stderr).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import Any, Mapping, Sequence

from ...analysis.memory import format_bytes
from ...cost.hardware import HardwareProfile, get_profile
from ...progress import enable_default_logging
from .. import presets
from ...compile.lowering_reuse import reusing_lowerings
from .estimate import analytic_step_s, expected_peak_bytes
from .prune import batch_problem, dims_problem, memory_problem, plan_problem
from .result import NOT_COMPILED_BUDGET, NOT_COMPILED_RECOMPUTE, Choice, PlanContext, Ranked
from .space import AXES, RECOMPUTE, Candidate, candidates, degree_choices, dp_degree, parse_search

__all__ = ["auto_plan"]

RECOMPUTE_ORDER = {mode: i for i, mode in enumerate(RECOMPUTE)}  # none < selective < full

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
    max_compiles: int | None = 10,
    time_budget_s: float | None = None,
    include: Sequence[Mapping[str, Any]] = (),
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
    ``ranked``). ``progress``: a line per compiled candidate on stderr. ``max_compiles``: how many
    candidates to compile at most, in the order of the analytic estimate (None: all);
    ``time_budget_s``: start no compile after this many seconds of search. ``include``:
    configurations compiled and ranked whatever the budget, each a dict of degrees (``dp_shard``
    defaults to what the others leave of the world), ``recompute``, ``pp_schedule``,
    ``num_microbatches`` and ``stages_per_rank``, e.g. ``{"dp_shard": 32, "tp": 8, "recompute":
    "full"}``; their entries in ``ranked`` have ``included`` set.

    Returns a :class:`~.result.Choice`: ``dims``, ``plan``, ``mesh(device)``, ``local_batch``,
    ``micro_batches``, ``predicted`` of the best, and ``ranked``, every candidate best first (the
    rejected ones after those that fit, each with ``rejected`` saying why). Raises ValueError when
    nothing fits, with the closest candidates and their reasons.
    """
    started = time.perf_counter()
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"auto_plan: world_size must be a positive integer, got {world_size!r}")
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len), ("top_k", top_k),
                        ("max_compiles", 1 if max_compiles is None else max_compiles)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"auto_plan: {name} must be a positive integer, got {value!r}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"auto_plan: dtype {dtype!r}; choose bf16 or fp32")
    profile = get_profile(hardware if not isinstance(hardware, str) or hardware.endswith(".json") else hardware.lower())
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
    forced = _included(include, context, ranked, to_compile)
    estimate = {c: analytic_step_s(c, context.fields, profile, seq_len=seq_len, dtype=dtype)
                for group in to_compile for c in group}
    expected = {c: expected_peak_bytes(c, context.fields, num_params, seq_len=seq_len, dtype=dtype,
                                       optimizer=optimizer) for group in to_compile for c in group}
    # Each configuration's recompute ladder starts at its first mode expected to fit (the
    # expectation scaled by what the compiles so far estimated over it, per recompute mode and
    # with or without a pipeline); the modes it passes over are compiled after every ladder, while
    # compiles remain, if still expected to fit. Ladders go fastest-estimated first, those
    # expected to fit before the others.
    # The estimate is calibrated the same way: by the median ratio of compiled step times to their
    # estimates among the compiled candidates of its kind (with or without a pipeline and tensor
    # parallelism), so the order after each compile follows what the compiles found.
    total = sum(len(g) for g in to_compile)
    log.info("auto_plan: %d candidates, %d rejected without compiling, %d to compile (at most %s, then %d "
             "included)", len(ranked) + total, len(ranked), total, max_compiles or "all", len(forced))
    done = 0
    ratio: dict = {}  # (recompute, pipelined) -> the largest compiled peak over its expectation
    fitted_of: dict = {}  # a configuration's fitting mode: the modes recomputing more are not compiled
    passed_over: list[Candidate] = []

    step_ratios: dict = {}  # (pipelined, tensor-parallel) -> compiled step over estimate, each compile

    def calibrated(c: Candidate) -> float:
        return expected[c] * ratio.get((c.recompute, c.pp > 1), 1.0)

    def calibrated_estimate(c: Candidate) -> float:
        seen = sorted(step_ratios.get((c.pp > 1, c.tp > 1), ()))
        return estimate[c] * (seen[len(seen) // 2] if seen else 1.0)

    def ladder_key(modes: list[Candidate]) -> tuple:
        hopeful = [c for c in modes if calibrated(c) <= budget]
        return (not hopeful, calibrated_estimate((hopeful or modes)[0]), modes[0].describe())

    def try_compile(candidate: Candidate, passing: bool) -> None:
        """Compile ``candidate`` or record why not; ``passing``: it may be passed over (a mode
        recomputing more follows it in its ladder)."""
        nonlocal done
        fitted = fitted_of.get(candidate.degrees_and_pipeline)
        forced_ = candidate in forced
        if fitted is not None and not forced_ and fitted.recompute != candidate.recompute and \
                RECOMPUTE_ORDER[fitted.recompute] < RECOMPUTE_ORDER[candidate.recompute]:
            ranked.append(Ranked(candidate, context, rejected=f"{NOT_COMPILED_RECOMPUTE}{fitted.recompute} fits "
                                 "and recompute only adds compute", estimate_s=estimate[candidate]))
            return
        at_most = max_compiles is not None and done >= max_compiles
        if (at_most or (time_budget_s is not None and time.perf_counter() - started > time_budget_s)) and not forced_:
            limit = f"max_compiles={max_compiles}" if at_most else f"time_budget_s={time_budget_s:g}"
            ranked.append(Ranked(candidate, context, rejected=f"{NOT_COMPILED_BUDGET}{limit} spent on candidates "
                                 f"estimated faster (analytic estimate {estimate[candidate] * 1e3:.0f} ms, expected "
                                 f"peak {format_bytes(int(calibrated(candidate)))})", estimate_s=estimate[candidate]))
            return
        if not forced_ and calibrated(candidate) > budget:
            if passing:
                passed_over.append(candidate)
                return
            if candidate in passed_over_set:
                ranked.append(Ranked(candidate, context, rejected=f"{NOT_COMPILED_BUDGET}expected peak "
                                     f"{format_bytes(int(calibrated(candidate)))} over the budget (calibrated on the "
                                     "compiles so far)", estimate_s=estimate[candidate]))
                return
        done += not forced_
        entry = _evaluate(candidate, context)
        entry.estimate_s, entry.included = estimate[candidate], forced_
        ranked.append(entry)
        if entry.predicted is not None and expected[candidate] > 0:
            key = (candidate.recompute, candidate.pp > 1)
            ratio[key] = max(ratio.get(key, 1.0), entry.predicted["peak_bytes"] / expected[candidate])
            if entry.rejected is None and estimate[candidate] > 0:
                step_ratios.setdefault((candidate.pp > 1, candidate.tp > 1), []).append(
                    entry.predicted["step_s"] / estimate[candidate])
        if progress:
            log.info("auto_plan: [%d] %s%s: %s (estimated %.0f ms, %s)", done, candidate.describe(),
                     " (included)" if forced_ else "", entry.outcome(), estimate[candidate] * 1e3,
                     format_bytes(expected[candidate]))
        if entry.rejected is None:
            best = fitted_of.get(candidate.degrees_and_pipeline)
            if best is None or RECOMPUTE_ORDER[candidate.recompute] < RECOMPUTE_ORDER[best.recompute]:
                fitted_of[candidate.degrees_and_pipeline] = candidate

    passed_over_set: set = set()
    ladders = list(to_compile)
    # A configuration's recompute modes share their capture, propagation and lowering (recompute
    # is a pass): compiled inside one reuse scope, the second and third mode run the passes only.
    with reusing_lowerings() as reuse:
        while ladders:  # the most promising ladder by the calibrated expectations, one at a time
            modes = min(ladders, key=ladder_key)
            ladders.remove(modes)
            for i, candidate in enumerate(modes):
                try_compile(candidate, passing=i < len(modes) - 1)
        passed_over_set.update(passed_over)
        for candidate in sorted(passed_over, key=lambda c: (calibrated_estimate(c), c.describe())):
            try_compile(candidate, passing=False)
    log.info("auto_plan: %d lowering(s) made, %d reused by another recompute mode (pipelined candidates lower "
             "their stages apart)", reuse.lowered_count, reuse.reused)
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
            problem = memory_problem(num_params, candidate, context.dtype, context.optimizer, context.budget,
                                     context.fields, context.seq_len)
            if problem:
                ranked.append(Ranked(candidate, context, rejected=problem))
            else:
                key = (candidate.pp_schedule, candidate.stages_per_rank, candidate.num_microbatches)
                by_pipeline.setdefault(key, []).append(candidate)
        to_compile.extend(by_pipeline.values())
    return ranked, to_compile


def _included(include, context: PlanContext, ranked: list[Ranked], to_compile: list[list[Candidate]]) -> set:
    """The candidates ``include`` names (``auto_plan``'s docstring), found among ``to_compile`` or
    added to it as groups of their own; one that the analytic checks rejected stays in ``ranked``
    (its reason said), marked included."""
    keys = set(AXES) | {"recompute", "pp_schedule", "num_microbatches", "stages_per_rank"}
    forced = set()
    for spec in include:
        if not isinstance(spec, Mapping):
            raise TypeError(f"auto_plan include: each entry is a dict of degrees and settings, got {spec!r}")
        unknown = sorted(set(spec) - keys)
        if unknown:
            raise ValueError(f"auto_plan include {dict(spec)}: unknown keys {unknown}; use {sorted(keys)}")
        degrees = {axis: int(spec.get(axis, 1)) for axis in AXES}
        others = math.prod(size for axis, size in degrees.items() if axis != "dp_shard")
        if "dp_shard" not in spec:
            degrees["dp_shard"] = context.world_size // others
        if math.prod(degrees.values()) != context.world_size:
            raise ValueError(f"auto_plan include {dict(spec)}: the degrees multiply to {math.prod(degrees.values())}, "
                             f"not the world size {context.world_size}")
        if spec.get("recompute", "none") not in RECOMPUTE:
            raise ValueError(f"auto_plan include {dict(spec)}: recompute is one of {RECOMPUTE}")
        if spec.get("pp_schedule", "1F1B") not in presets.PIPELINE_SCHEDULES:
            raise ValueError(f"auto_plan include {dict(spec)}: pp_schedule is one of {presets.PIPELINE_SCHEDULES}")
        dp = dp_degree(degrees)
        if context.global_batch % dp:
            raise ValueError(f"auto_plan include {dict(spec)}: {batch_problem(degrees, context.global_batch)}")
        pipelined = degrees["pp"] > 1
        candidate = Candidate(**degrees, recompute=spec.get("recompute", "none"),
                              local_batch=context.global_batch // dp,
                              pp_schedule=spec.get("pp_schedule", "1F1B") if pipelined else None,
                              num_microbatches=spec.get("num_microbatches", degrees["pp"]) if pipelined else None,
                              stages_per_rank=spec.get("stages_per_rank",
                                                       2 if spec.get("pp_schedule") == "Interleaved1F1B" else 1)
                              if pipelined else None)
        forced.add(candidate)
        for entry in ranked:
            if entry.candidate == candidate:
                entry.included = True
                break
        else:
            if not any(candidate in group for group in to_compile):
                to_compile.append([candidate])
    return forced


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
