"""What one training step of a compiled pipeline costs, and what each pipeline rank holds.

Every stage's programs (each variant its micro-batches run: first, middle, sync; a split backward's
input- and weight-gradient programs) are simulated by the cost model (``cost/simulate.py``). The
schedule the executor runs (``PipelineEntry.schedule``, one step list per pp rank) is then replayed
with those times (``schedules/replay.py``): a step starts when its rank is free and its input has
arrived, a send takes the boundary tensor's time over the pp axis. A rank's step ends with its
optimizer step over its own stages' parameters; the pipeline's step ends with the last rank.

Memory per pp rank: a stage's estimate for one micro-batch (``analysis/memory.py``) holds its
parameters, gradients, optimizer state and one micro-batch's saved activations. The schedule keeps
several micro-batches in flight (forward run, backward not yet: the first stage of 1F1B holds one
per pp rank, GPipe every micro-batch), so the rank's peak is its stages' persistent bytes, plus the
most saved activations its in-flight micro-batches hold at once, plus the largest temporary bytes of
one of its programs on top (``rank_memory``).

Reads: a :class:`~.state.PipelineEntry` compiled with every stage (``compile_step(...,
every_stage=True)``: on a fake mesh one process compiles them all, since a stage's programs differ
between its ranks only in their rank-dependent offsets). Writes: nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..analysis.memory import estimate, optimizer_model
from ..cost import AxisInfo, HardwareProfile, agreement_time, collective_time, get_profile, optimizer_time, optimizer_traffic
from ..cost.simulate import simulate_program
from .runtime import StageProgram, first_microbatches, flat_steps, program_for, sync_microbatches, variants_of
from .schedules.costs import in_flight_per_stage
from .schedules.replay import _execute
from .schedules.steps import T

__all__ = ["StageCost", "PipelineCost", "pipeline_cost"]


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One stage: seconds per micro-batch of its middle variant, its one-micro-batch memory."""

    stage: int
    rank: int  # pp rank that runs it
    forward_s: float
    backward_s: float  # the whole backward (input and weight gradients; split: their sum)
    saved_bytes: int  # what one micro-batch keeps from forward to backward (its inputs and saved activations)
    persistent_bytes: int  # parameters, buffers, gradients and optimizer state
    temporary_bytes: int  # the most its programs hold at once above those and the saved activations
    in_flight: int  # most of its micro-batches in flight at once
    flops_per_microbatch: int
    memory: dict = dataclasses.field(default_factory=dict, compare=False)  # the one-micro-batch estimate


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """The simulated step: its time, the bubble, per stage and per pp rank."""

    step_s: float
    makespan_s: float  # the schedule alone, without the optimizer steps
    bubble_fraction: float  # idle time of the pp ranks during the schedule
    p2p_s: float  # one boundary send
    stages: tuple[StageCost, ...]
    rank_end_s: dict  # pp rank -> when its last step (optimizer included) ends
    rank_peak_bytes: dict  # pp rank -> estimated peak
    rank_totals: dict  # pp rank -> its steps' summed seconds and FLOPs (RANK_TOTALS), optimizer_s
    events: list  # (pp rank, MetaStep, start, end) per compute step, in the replay's order
    agreement_s: float = 0.0  # the step's per-call agreement exchange (once per step, not per micro-batch)
    agreement_exposed_s: float = 0.0  # what the first stage's first forward waits for it at its gate

    def as_dict(self) -> dict:
        return {
            "step_s": self.step_s, "makespan_s": self.makespan_s, "bubble_fraction": self.bubble_fraction,
            "p2p_s": self.p2p_s, "agreement_s": self.agreement_s, "agreement_exposed_s": self.agreement_exposed_s,
            "stages": [{k: v for k, v in dataclasses.asdict(s).items() if k != "memory"} for s in self.stages],
            "ranks": [{"rank": r, "end_s": self.rank_end_s[r], "peak_bytes": self.rank_peak_bytes[r],
                       "stages": [s.stage for s in self.stages if s.rank == r], **self.rank_totals[r]}
                      for r in sorted(self.rank_end_s)],
        }


# What a pp rank's steps add up to (from each program's StepEstimate): forward_s and backward_s are
# the time its forward and backward steps compute, not wall-clock spans.
RANK_TOTALS = ("forward_s", "backward_s", "compute_s", "comm_s", "exposed_comm_s", "flops", "recompute_flops")


def pipeline_cost(entry, num_ranks: int, axes: Mapping[str, AxisInfo], pp_axis: AxisInfo,
                  profile: HardwareProfile | str, optimizer="adamw", agreement_ranks: int = 1) -> PipelineCost:
    """Simulate one training step of ``entry`` (a PipelineEntry holding every stage's programs) on
    ``profile``. ``axes``: the stage mesh's process groups (``cost.axis_infos``); ``pp_axis``: the
    pipeline axis, over which each boundary tensor is sent; ``optimizer``: the optimizer model
    (what ``analysis.memory.optimizer_model`` takes: "adamw", "sgd", an OptimizerModel, ...; "none":
    no optimizer step and no state); ``agreement_ranks``: the ranks the step's agreement spans
    (the world; 1: not priced). The agreement is issued as the step starts; the first stage's first
    forward waits for it at its gate, and the whole schedule is taken as delayed by that wait (the
    later stages wait for their input longer than that anyway)."""
    profile = get_profile(profile)
    programs: dict[int, StageProgram] = entry.programs
    schedule = entry.schedule
    num_stages = len(entry.stages)
    missing = sorted(set(range(num_stages)) - set(programs))
    if missing:
        raise ValueError(f"pipeline_cost: the entry has no programs for stages {missing}; compile it with "
                         "every stage (pipeline.step.compile_step(..., every_stage=True))")
    times: dict = {}

    def seconds(program: StageProgram, kind: T) -> float:
        key = (id(program), kind)
        if key not in times:
            if kind is T.FORWARD:
                gm, phase = program.forward_gm, "forward"
            elif kind is T.BACKWARD:
                gm, phase = program.backward_gm, "backward"
            elif kind is T.BACKWARD_INPUT:
                gm, phase = program.split.input_gm, "backward"
            else:
                gm, phase = program.split.weight_gm, "backward"
            times[key] = simulate_program(gm, phase, axes, profile)
        return times[key]

    firsts = {r: first_microbatches(steps) for r, steps in schedule.items()}
    syncs = {r: sync_microbatches(steps) for r, steps in schedule.items()}
    totals = {r: dict.fromkeys(RANK_TOTALS, 0) for r in schedule}

    def duration(step) -> float:
        rank = step.stage % num_ranks
        program = program_for(programs[step.stage], step.micro_batch, firsts[rank], syncs[rank])
        est = seconds(program, step.step_type)
        total = totals[rank]
        total["forward_s" if step.step_type is T.FORWARD else "backward_s"] += est.step_s
        for name in RANK_TOTALS[2:]:
            total[name] += getattr(est, name)
        return est.step_s

    p2p = max((collective_time("send_recv", _bytes(t), pp_axis, profile) for g in entry.stages for t in g.sends),
              default=0.0)
    events, stuck, busy = _execute(schedule, num_stages, duration, p2p)
    agreement_s = agreement_time(agreement_ranks, profile)
    exposed = 0.0
    if agreement_s > 0 and schedule.get(0):
        first = program_for(programs[0], 0, firsts[0], syncs[0])
        exposed = simulate_program(first.forward_gm, "forward", axes, profile, agreement_ranks).agreement_exposed_s
    if stuck:  # the schedule's own checks refuse such a schedule before it compiles
        raise ValueError(f"pipeline_cost: the schedule does not run to its end: {stuck}")
    makespan = max((e[3] for e in events), default=0.0)
    optimizer = optimizer_model(optimizer)
    state = None if optimizer.name == "none" else optimizer.state
    ends, peaks = {}, {}
    stage_costs = []
    in_flight = in_flight_per_stage(schedule)
    for s in range(num_stages):
        stage_costs.append(_stage_cost(s, s % num_ranks, programs[s], axes, profile, optimizer,
                                       in_flight.get(s, 0), seconds))
    for r, steps in schedule.items():
        own = [c for c in stage_costs if c.rank == r]
        opt_s = 0.0
        if state is not None:
            traffic = [optimizer_traffic(_gradient_program(programs[c.stage]), state) for c in own]
            opt_s = optimizer_time(sum(b for b, _ in traffic), sum(n for _, n in traffic), profile)
        last = exposed + max((e[3] for e in events if e[0] == r), default=0.0)
        ends[r] = last + opt_s
        totals[r]["optimizer_s"] = opt_s
        peaks[r] = rank_memory(own, _held_at_once(steps, {c.stage: c.saved_bytes for c in own}))
    total = len(busy) * makespan
    bubble = (total - sum(busy.values())) / total if total else 0.0
    return PipelineCost(max(ends.values(), default=0.0), makespan, bubble, p2p, tuple(stage_costs), ends, peaks,
                        totals, events, agreement_s, exposed)


def rank_memory(stages: list[StageCost], held_saved_bytes: int) -> int:
    """A pp rank's estimated peak: its stages' persistent bytes, the saved activations its
    in-flight micro-batches hold at once, and the largest temporary bytes on top."""
    return (sum(s.persistent_bytes for s in stages) + held_saved_bytes
            + max((s.temporary_bytes for s in stages), default=0))


def _stage_cost(stage: int, rank: int, program: StageProgram, axes, profile, optimizer, in_flight: int,
                seconds) -> StageCost:
    # A received activation counts as an input (any kind but a parameter's or a buffer's does).
    kinds = [info.kind for info in program.primal_infos]
    est = estimate(_AsEstimated(program.forward_gm, program.backward_gm, program.num_forward_outputs), kinds,
                   optimizer=optimizer, keep_outputs=False)
    persistent = est.params + est.buffers + est.grads + est.optimizer_state
    forward = seconds(program, T.FORWARD)
    backward = ([seconds(program, T.BACKWARD_INPUT), seconds(program, T.BACKWARD_WEIGHT)] if program.split is not None
                else [seconds(program, T.BACKWARD)])
    # A micro-batch in flight keeps its inputs (ids, the received activation) and what forward saved.
    held = est.saved_activations + est.inputs
    temporary = max(0, est.peak - persistent - held)
    return StageCost(stage, rank, forward.step_s, sum(b.step_s for b in backward), held, persistent,
                     temporary, in_flight, forward.flops + sum(b.flops for b in backward), est.as_dict())


@dataclasses.dataclass(frozen=True)
class _AsEstimated:
    """A stage program as the memory estimate reads a program: forward's first outputs are what it
    returns or sends (the rest it saves for backward); backward's inputs after the saved tensors (a
    gradient received, the running gradient sums) each come fresh."""

    forward_gm: object
    backward_gm: object
    num_user_outputs: int


def _gradient_program(program: StageProgram):
    """The program returning the stage's parameter gradients (the weight-gradient step when split)."""
    return program.split.weight_gm if program.split is not None else program.backward_gm


def _held_at_once(steps, saved: dict[int, int]) -> int:
    """Most saved-activation bytes one rank's in-flight micro-batches hold at once (over its stages)."""
    live = dict.fromkeys(saved, 0)
    most = 0
    for step in flat_steps(steps):
        if step.step_type is T.FORWARD:
            live[step.stage] += 1
            most = max(most, sum(live[s] * saved[s] for s in live))
        elif step.step_type in (T.BACKWARD, T.BACKWARD_WEIGHT):
            live[step.stage] -= 1
    return most


def _bytes(transfer) -> int:
    n = 1
    for d in transfer.shape:
        n *= int(d)
    return n * transfer.dtype.itemsize


def stage_programs(entry) -> list[StageProgram]:
    """Every program variant of every stage ``entry`` holds."""
    return [p for program in entry.programs.values() for p in variants_of(program)]
