"""The configurations ``auto_plan`` considers: every factorisation of the world into ParallelDims
degrees, with a plan preset, recompute, the pipeline's schedule and micro-batches, and the local
batch the global batch gives each data-parallel rank.

Reads: the world size, the model config's fields, the hardware profile (devices per node bound
``tp``), the global batch and sequence length, the user's ``search`` restrictions. Writes:
:class:`Candidate` values, in a fixed order (the search is deterministic).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping

from ..presets import PIPELINE_SCHEDULES

__all__ = ["AXES", "Candidate", "LONG_SEQUENCE", "RECOMPUTE", "SearchSpace", "candidates", "divisors", "parse_search"]

AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
"""The degrees searched (ParallelDims' names); their product is the world size."""

RECOMPUTE = ("none", "selective", "full")
"""Tried in this order: each adds compute to save memory, so a later one is only compiled when the
one before does not fit (``search.py``)."""

LONG_SEQUENCE = 16384
"""Sequences at least this long also try context parallelism (below it the sequence dimension is
better spent on data parallelism: the same tokens, no ring transfers)."""

_SCHEDULES = ("1F1B", "Interleaved1F1B")  # searched by default; GPipe and ZBH1 when asked for


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: the degrees (``dp_shard`` is what the others leave of the world), the plan
    preset (``"fsdp"``, or ``"fsdp+tp+sp"`` with tensor parallelism), recompute of every decoder
    layer, and with ``pp > 1`` the schedule, micro-batches and stages per pp rank."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    recompute: str = "none"
    local_batch: int = 1
    pp_schedule: str | None = None
    num_microbatches: int | None = None
    stages_per_rank: int | None = None

    @property
    def degrees(self) -> dict[str, int]:
        """ParallelDims' degrees (every axis, 1 where unused)."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def plan_name(self) -> str | None:
        """The preset: FSDP over ``dp_shard`` (with TP and sequence parallelism when ``tp > 1``),
        TP alone without a ``dp_shard`` axis, None when neither applies (pp or cp alone)."""
        sharded = self.dp_shard > 1 or all(size == 1 for size in self.degrees.values())
        if sharded:
            return "fsdp+tp+sp" if self.tp > 1 else "fsdp"
        return "tp+sp" if self.tp > 1 else None

    @property
    def fp32_masters(self) -> bool:
        """FSDP presets keep fp32 master weights under bf16; the TP preset's parameters are bf16."""
        return self.plan_name in ("fsdp", "fsdp+tp+sp")

    @property
    def pipeline(self) -> dict | None:
        """The preset's ``pipeline`` settings (``presets.build_plan``), or None without pp."""
        if self.pp == 1:
            return None
        return {"schedule": self.pp_schedule, "num_microbatches": self.num_microbatches,
                "stages_per_rank": self.stages_per_rank}

    @property
    def micro_batches(self) -> int:
        return self.num_microbatches or 1

    @property
    def degrees_and_pipeline(self) -> tuple:
        """Everything but the recompute mode: one configuration's recompute ladder shares it."""
        return dataclasses.astuple(dataclasses.replace(self, recompute="none"))

    def columns(self) -> tuple[str, str, str, str]:
        """(degrees, recompute, local batch, pipeline) as the ranked table prints them."""
        degrees = " ".join(f"{axis}={size}" for axis, size in self.degrees.items() if size > 1 or axis == "dp_shard")
        pipeline = f"{self.pp_schedule} x{self.stages_per_rank}, {self.num_microbatches} mb" if self.pp_schedule else "-"
        return degrees, self.recompute, str(self.local_batch), pipeline

    def describe(self) -> str:
        """One line: ``dp_shard=32 tp=8 | recompute full | local batch 2`` (and the pipeline)."""
        degrees = " ".join(f"{axis}={size}" for axis, size in self.degrees.items() if size > 1 or axis == "dp_shard")
        text = f"{degrees} | recompute {self.recompute} | local batch {self.local_batch}"
        if self.pp_schedule is not None:
            text += f" | {self.pp_schedule} x{self.stages_per_rank}, {self.num_microbatches} micro-batches"
        return text


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What to enumerate: each axis's allowed degrees (None: every divisor the checks allow),
    recompute modes and schedules."""

    degrees: Mapping[str, tuple[int, ...] | None]
    recompute: tuple[str, ...] = RECOMPUTE
    schedules: tuple[str, ...] = _SCHEDULES


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_search(search: Mapping[str, Any] | None) -> SearchSpace:
    """``search`` as ``auto_plan`` takes it: ``{"pp": 1}``, ``{"tp": [1, 2, 4]}``, ``{"recompute":
    "full"}``, ``{"pp_schedule": ["1F1B"]}``; anything else is a ValueError naming the key."""
    search = dict(search or {})
    degrees: dict[str, tuple[int, ...] | None] = {axis: None for axis in AXES}
    recompute, schedules = RECOMPUTE, _SCHEDULES

    def as_tuple(key, value, kind):
        values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if not values or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise ValueError(f"auto_plan search[{key!r}] = {value!r}: give a {kind.__name__} or a list of them")
        return values

    for key, value in search.items():
        if key in AXES:
            values = as_tuple(key, value, int)
            if any(v < 1 for v in values):
                raise ValueError(f"auto_plan search[{key!r}] = {value!r}: degrees are positive integers")
            degrees[key] = tuple(sorted(set(values)))
        elif key == "recompute":
            values = as_tuple(key, value, str)
            unknown = [v for v in values if v not in RECOMPUTE]
            if unknown:
                raise ValueError(f"auto_plan search['recompute']: {unknown} not in {RECOMPUTE}")
            recompute = tuple(v for v in RECOMPUTE if v in values)
        elif key == "pp_schedule":
            values = as_tuple(key, value, str)
            unknown = [v for v in values if v not in PIPELINE_SCHEDULES]
            if unknown:
                raise ValueError(f"auto_plan search['pp_schedule']: {unknown} not in {PIPELINE_SCHEDULES}")
            schedules = tuple(values)
        else:
            raise ValueError(f"auto_plan search: unknown key {key!r}; use {', '.join(AXES)}, recompute or pp_schedule")
    return SearchSpace(degrees, recompute, schedules)


def _allowed(space: SearchSpace, axis: str, default: list[int]) -> list[int]:
    chosen = space.degrees.get(axis)
    return [d for d in default if chosen is None or d in chosen]


def degree_choices(world_size: int, fields: Mapping[str, Any], seq_len: int, devices_per_node: int,
                   space: SearchSpace) -> Iterator[dict[str, int]]:
    """Every ``{axis: degree}`` whose product is ``world_size`` within the space's restrictions and
    the defaults: ``tp`` within a node, ``cp`` only for sequences of :data:`LONG_SEQUENCE` tokens or
    more, ``ep`` only for a mixture of experts, ``pp`` at most the number of layers, ``dp_replicate``
    1 (HSDP when asked for). Checks that need the model (heads divisible by tp, ...) are not made here."""
    layers = int(fields.get("num_hidden_layers", 1))
    moe = "num_experts" in fields
    # Tensor parallelism's collectives sit on every layer's critical path: within a node unless the
    # user names larger degrees.
    within_node = [d for d in divisors(world_size) if d <= devices_per_node]
    for tp in _allowed(space, "tp", within_node if space.degrees.get("tp") is None else divisors(world_size)):
        rest = world_size // tp
        for pp in _allowed(space, "pp", [d for d in divisors(rest) if d <= layers]):
            rest_pp = rest // pp
            cp_default = divisors(rest_pp) if seq_len >= LONG_SEQUENCE else [1]
            for cp in _allowed(space, "cp", cp_default):
                rest_cp = rest_pp // cp
                ep_default = [d for d in divisors(rest_cp) if d <= int(fields.get("num_experts", 1))] if moe else [1]
                for ep in _allowed(space, "ep", ep_default):
                    rest_ep = rest_cp // ep
                    for dp_replicate in _allowed(space, "dp_replicate",
                                                 divisors(rest_ep) if space.degrees.get("dp_replicate") else [1]):
                        dp_shard = rest_ep // dp_replicate
                        if space.degrees.get("dp_shard") is not None and dp_shard not in space.degrees["dp_shard"]:
                            continue
                        yield {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}


def pipeline_choices(pp: int, local_batch: int, layers: int, space: SearchSpace) -> list[tuple[str, int, int]]:
    """(schedule, stages per rank, micro-batches) for ``pp`` stages: each schedule of the space
    whose stages fit the layers, with ``pp``, ``2 pp`` and ``4 pp`` micro-batches where the local
    batch splits into them (at least one sequence each)."""
    out = []
    for schedule in space.schedules:
        per_rank = 2 if schedule == "Interleaved1F1B" else 1
        if pp * per_rank > layers:
            continue
        for micro in (pp, 2 * pp, 4 * pp):
            if micro <= local_batch and local_batch % micro == 0:
                out.append((schedule, per_rank, micro))
    return out


def dp_degree(degrees: Mapping[str, int]) -> int:
    """Ranks that take different sequences (explain's count: dp_replicate, dp_shard, ep)."""
    return math.prod(degrees[axis] for axis in ("dp_replicate", "dp_shard", "ep"))


def candidates(degrees: Mapping[str, int], local_batch: int, layers: int, space: SearchSpace) -> list[Candidate]:
    """The candidates of one factorisation: each recompute mode, and with pp each pipeline choice."""
    if degrees["pp"] == 1:
        pipelines: list = [(None, None, None)]
    else:
        pipelines = pipeline_choices(degrees["pp"], local_batch, layers, space)
    return [Candidate(**degrees, recompute=recompute, local_batch=local_batch, pp_schedule=schedule,
                      stages_per_rank=per_rank, num_microbatches=micro)
            for schedule, per_rank, micro in pipelines for recompute in space.recompute]
