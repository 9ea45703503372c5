"""What ``auto_plan`` returns: every candidate with its prediction or rejection, the choice, the
ranked table, and the plan file a training script or ``explain --plan`` loads.

Reads: candidates and explain's reports (``search.py``). Writes: plan files (:meth:`Choice.write`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math

from ...analysis.memory import format_bytes
from ...cost.hardware import HardwareProfile
from .. import presets
from .space import Candidate

__all__ = ["Choice", "NOT_COMPILED_BUDGET", "NOT_COMPILED_RECOMPUTE", "PlanContext", "Ranked"]

NOT_COMPILED_RECOMPUTE = "not compiled: recompute="
"""How a candidate left out because a mode recomputing less fits is rejected (``search.py``)."""

NOT_COMPILED_BUDGET = "not compiled: "
"""How a candidate beyond ``max_compiles`` / ``time_budget_s`` is rejected (``search.py``), followed
by the limit: ``not compiled: max_compiles=10 spent on ...``."""


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """What every candidate of one search shares: the model, the world and the step."""

    source: str  # explain's model source: "example" or "hf:<Architecture>"
    config_name: str
    fields: dict
    world_size: int
    hardware: HardwareProfile
    seq_len: int
    global_batch: int
    dtype: str
    optimizer: str
    budget: int  # bytes per rank

    def num_params(self) -> int:
        from ..explain import build_model

        net, _ = build_model(self.source, dict(self.fields))
        return sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())


@dataclasses.dataclass
class Ranked:
    """One candidate of the search: its configuration, and its prediction (``predicted``, when it
    was compiled) or why it was left out (``rejected``; None when it fits)."""

    candidate: Candidate
    context: PlanContext
    predicted: dict | None = None
    rejected: str | None = None
    report: dict | None = None  # explain's whole report, when compiled
    compiled: bool = False
    estimate_s: float | None = None  # the analytic step time the search ordered it by (estimate.py)
    included: bool = False  # named by auto_plan's ``include``: compiled whatever the budget

    @property
    def dims(self) -> dict[str, int]:
        """ParallelDims degrees, e.g. ``{"dp_replicate": 1, "dp_shard": 32, "cp": 1, "tp": 8, "pp": 1, "ep": 1}``."""
        return self.candidate.degrees

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel rank per optimizer step."""
        return self.candidate.local_batch

    @property
    def micro_batches(self) -> int:
        """Pipeline micro-batches the local batch is split into (1 without a pipeline)."""
        return self.candidate.micro_batches

    def parallel_dims(self, **overrides):
        """The :class:`~hyper_parallel.ParallelDims` of these degrees (checked against the model)."""
        from ...distributed.parallel_dims import ParallelDims

        extra = {"ulysses_degree": 1} if self.dims["cp"] > 1 else {}
        return ParallelDims(**self.dims, **extra, world_size=self.context.world_size, seq_len=self.context.seq_len,
                            model_config=dict(self.context.fields), **overrides)

    def mesh(self, device_type: str = "cuda"):
        """The DeviceMesh for ``hp.parallelize(model, self.plan, mesh)`` (a collective: every rank calls it)."""
        return self.parallel_dims().build_mesh(device_type)

    @property
    def plan(self):
        """The plan of this configuration: the preset's TP styles, FSDP units (bf16 mixed precision
        with fp32 reduction under bf16), recompute and pipeline entries, as ``explain`` compiled it."""
        c = self.candidate
        if c.plan_name is None:
            raise ValueError(f"{c.describe()}: {self.rejected}")
        axes = self.parallel_dims().mesh_axes()
        return presets.build_plan(c.plan_name, axes, dict(self.context.fields), **self.plan_settings()).plan

    def plan_settings(self) -> dict:
        """``presets.build_plan``'s keyword arguments for this candidate, as ``explain`` passes them
        (ring attention over the whole cp axis: Ulysses degree 1)."""
        c = self.candidate
        settings = {"mixed_precision": self.context.dtype == "bf16", "recompute": c.recompute, "pipeline": c.pipeline}
        if c.cp > 1:
            settings["ulysses_degree"] = 1
        return settings

    def outcome(self) -> str:
        """``step 1.23 s, 41.2 GiB peak`` or the rejection."""
        if self.rejected is not None:
            return self.rejected
        p = self.predicted
        return f"step {p['step_s'] * 1e3:.1f} ms, {p['tokens_per_s']:.0f} tokens/s/device, peak {format_bytes(p['peak_bytes'])}"


class Choice:
    """The best candidate that fits (its ``dims``, ``plan``, ``mesh()``, ``local_batch``,
    ``micro_batches``, ``predicted``) and ``ranked``: every candidate, best first, the rejected
    ones last with their reasons. ``search_s``: seconds the search took."""

    def __init__(self, ranked: list[Ranked], context: PlanContext, top_k: int = 5, search_s: float = 0.0):
        self.ranked = ranked
        self.context = context
        self.top_k = top_k
        self.search_s = search_s

    @property
    def best(self) -> Ranked:
        if not self.ranked or self.ranked[0].rejected is not None:
            raise ValueError("auto_plan found no configuration that fits")
        return self.ranked[0]

    @property
    def dims(self) -> dict[str, int]:
        return self.best.dims

    @property
    def plan(self):
        return self.best.plan

    def mesh(self, device_type: str = "cuda"):
        return self.best.mesh(device_type)

    @property
    def local_batch(self) -> int:
        return self.best.local_batch

    @property
    def micro_batches(self) -> int:
        return self.best.micro_batches

    @property
    def predicted(self) -> dict:
        return self.best.predicted

    @property
    def compiled(self) -> int:
        """How many candidates were compiled."""
        return sum(r.compiled for r in self.ranked)

    def table(self, rejected_rows: int | None = None) -> str:
        """The ranked table: the ``top_k`` fastest that fit, then the rejected ones (``rejected_rows``
        of them, default all) with their reasons."""
        fits = [r for r in self.ranked if r.rejected is None]
        rejected = [r for r in self.ranked if r.rejected is not None]
        c = self.context
        lines = [f"{c.config_name} on {c.world_size} x {c.hardware.name}, global batch {c.global_batch} x {c.seq_len} "
                 f"tokens, {c.dtype}, {c.optimizer}, budget {format_bytes(c.budget)} per rank: {len(self.ranked)} "
                 f"candidates, {self.compiled} compiled, {len(fits)} fit ({self.search_s:.1f} s)",
                 f"{'#':>3}  {'degrees':<32}{'recompute':<11}{'batch':>6}  {'pipeline':<24}{'step':>11}{'tok/s/dev':>11}"
                 f"{'MFU':>7}{'peak':>11}{'reserved':>11}"]
        # The top_k, and any included configuration below them (the plan to compare with).
        shown_fits = [(i, r) for i, r in enumerate(fits, 1) if i <= self.top_k or r.included]
        for i, r in shown_fits:
            p = r.predicted
            degrees, recompute, batch, pipeline = r.candidate.columns()
            mark = "*" if r.included else " "
            lines.append(f"{i:>3}{mark} {degrees:<32}{recompute:<11}{batch:>6}  {pipeline:<24}{p['step_s'] * 1e3:>9.1f}ms"
                         f"{p['tokens_per_s']:>11.0f}{p['mfu'] * 100:>6.1f}%{format_bytes(p['peak_bytes']):>11}"
                         f"{format_bytes(p['reserved_bytes']):>11}")
        if len(fits) > len(shown_fits):
            lines.append(f"     ... {len(fits) - len(shown_fits)} more that fit")
        if any(r.included for r in self.ranked):
            lines.append("   * included: compiled as asked (auto_plan include=, plan --include)")
        # A mode that recomputes more than one that fits is a row per candidate of no interest, and
        # what the compile budget left out is listed best-estimated first: both counted.
        dominated = [r for r in rejected if r.rejected.startswith(NOT_COMPILED_RECOMPUTE)]
        unreached = [r for r in rejected if r not in dominated and r.rejected.startswith(NOT_COMPILED_BUDGET)
                     and "spent on" in r.rejected]
        expected_over = [r for r in rejected if r not in dominated and r.rejected.startswith(NOT_COMPILED_BUDGET)
                         and "over the budget (calibrated" in r.rejected]
        rejected = [r for r in rejected if r not in dominated and r not in unreached and r not in expected_over]
        # The memory lower bound's rejections, often most of a large world's: the first three shown,
        # the rest counted.
        folded = [r for r in rejected if r.rejected.startswith("OOM:")][3:]
        rejected = [r for r in rejected if r not in folded]
        shown = rejected if rejected_rows is None else rejected[:rejected_rows]
        if shown or dominated or unreached or expected_over or folded:
            lines.append("rejected:")
            lines += [f"    {'*' if r.included else ' '}{r.candidate.describe()}: {r.rejected}" for r in shown]
        if len(shown) < len(rejected):
            lines.append(f"     ... {len(rejected) - len(shown)} more")
        if folded:
            lines.append(f"     {len(folded)} more over the budget by the memory lower bound")
        if dominated:
            lines.append(f"     {len(dominated)} not compiled: a mode recomputing less fits with the same configuration")
        if expected_over:
            lines.append(f"     {len(expected_over)} not compiled: a mode recomputing more fits and this one is expected "
                         "over the budget (the expectation scaled by the compiles' estimates)")
        if unreached:
            best = min(unreached, key=lambda r: (r.estimate_s, r.candidate.describe()))
            lines.append(f"     {len(unreached)} not compiled: the compile budget went to candidates estimated faster "
                         f"(the best of these estimated {best.estimate_s * 1e3:.0f} ms: {best.candidate.describe()})")
        return "\n".join(lines)

    def write(self, path: str, which: Ranked | None = None) -> str:
        """Write the chosen configuration (or ``which``, any entry of ``ranked``) as a plan file:
        a Python file defining ``plan(mesh_axes, config)`` (``explain --plan FILE`` and
        ``presets.build_plan(FILE, ...)`` load it), ``parallel`` (its ParallelDims degrees),
        ``local_batch``, ``micro_batches`` and ``predicted``. Returns ``path``."""
        entry = which or self.best
        c = entry.candidate
        parallel = ",".join(f"{axis}={size}" for axis, size in entry.dims.items() if size > 1) or "dp_shard=1"
        config = self.context.config_name if self.context.config_name in presets.MODEL_PRESETS else "<the config>"
        settings = entry.plan_settings()
        predicted = {k: v for k, v in sorted((entry.predicted or {}).items())
                     if isinstance(v, (int, float)) and math.isfinite(v)}
        text = f'''"""A parallel plan chosen by hyper_parallel's auto_plan on {datetime.date.today().isoformat()}.

{self.context.config_name} on {self.context.world_size} x {self.context.hardware.name}, global batch {self.context.global_batch} x {self.context.seq_len} tokens, {self.context.dtype}, {self.context.optimizer}:
{c.describe()}

    hyper-parallel explain --config {config} --world-size {self.context.world_size} --parallel {parallel} --plan {path} --local-batch {c.local_batch} --seq-len {self.context.seq_len} --dtype {self.context.dtype} --optimizer {self.context.optimizer}

In a training script: ``ns = runpy.run_path(this file)``; ``ns["parallel"]`` are the
ParallelDims degrees, ``ns["plan"](pd.mesh_axes(), config_fields)`` the plan.
"""

from hyper_parallel.tools.presets import build_plan

parallel = {entry.dims!r}
local_batch = {c.local_batch}
micro_batches = {c.micro_batches}
predicted = {predicted!r}
PRESET = {c.plan_name!r}
SETTINGS = {settings!r}


def plan(mesh_axes, config):
    return build_plan(PRESET, mesh_axes, config, **SETTINGS).plan
'''
        with open(path, "w") as f:
            f.write(text)
        return path
