"""What a schedule costs: :func:`simulate` (a :class:`Timeline` from per-stage times), the bubble
with equal stages (:func:`analytic_bubble` for the built-in schedules, :func:`equal_stage_bubble` for
any), the activation memory bound (:func:`peak_in_flight`) and which stages split their backward.
"""

from __future__ import annotations

import dataclasses

from .builders import SPLIT_BACKWARD_SCHEDULES, build_schedule
from .checks import check_schedule
from .replay import _execute
from .steps import T, _check_count, _flat


@dataclasses.dataclass
class Timeline:
    """A simulated run: (rank, step, start, end) per compute step, total time, busy time per rank."""

    events: list
    makespan: float
    busy: dict

    def bubble_fraction(self):
        total = len(self.busy) * self.makespan
        # (total - busy) / total rather than 1 - busy / total: exact for integer-valued times.
        return (total - sum(self.busy.values())) / total if total else 0.0


def simulate(schedule, forward_time, backward_time, p2p_time=0.0, weight_time=None):
    """Replay a schedule with per-stage times (a float, or a dict stage -> float) and return its Timeline.

    ``backward_time`` is a full BACKWARD's time, and a BACKWARD_INPUT's in a zero-bubble schedule;
    ``weight_time`` (required when the schedule has BACKWARD_WEIGHT steps) is a W step's time.
    """
    steps = [sub for lst in schedule.values() for step in lst for sub in _flat(step)]
    num_stages = 1 + max((s.stage for s in steps), default=0)
    check_schedule(schedule, num_stages, 1 + max((s.micro_batch for s in steps), default=0))
    times = {}
    named = [("forward_time", forward_time), ("backward_time", backward_time)]
    if any(s.step_type is T.BACKWARD_WEIGHT for s in steps):
        if weight_time is None:
            raise ValueError("the schedule has BACKWARD_WEIGHT steps: give simulate(..., weight_time=...)")
        named.append(("weight_time", weight_time))
    for name, value in named:
        per_stage = value if isinstance(value, dict) else dict.fromkeys(range(num_stages), value)
        for s in range(num_stages):
            if not isinstance(per_stage.get(s), (int, float)) or per_stage[s] < 0:
                raise ValueError(f"{name} must give a number >= 0 for every stage 0..{num_stages - 1}, "
                                 f"got {per_stage.get(s)!r} for stage {s}")
        times[name[0].upper()] = per_stage
    times["I"] = times["B"]
    if not isinstance(p2p_time, (int, float)) or p2p_time < 0:
        raise ValueError(f"p2p_time must be a number >= 0, got {p2p_time!r}")
    events, _, busy = _execute(
        schedule, num_stages, lambda step: times[step.step_type.value][step.stage], p2p_time)
    return Timeline(events, max((e[3] for e in events), default=0.0), busy)


def analytic_bubble(num_ranks, num_microbatches, stages_per_rank=1, schedule="1F1B"):
    """Idle fraction of a pipeline with equal stage times: (p-1) / (v*m + p-1) for the 1F1B family.

    For a split-backward schedule (ZB-H1) it is the schedule's own idle fraction with forward =
    input gradient = weight gradient, i.e. a backward costing two forwards split half and half
    (per linear layer the input and the weight gradient are each one matmul of the forward's size):
    (p-1) / (3m + p-1) once m >= p, simulated exactly (integer times) for any m."""
    for arg, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                       ("stages_per_rank", stages_per_rank)):
        _check_count(arg, value)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return simulate(build_schedule(schedule, num_ranks, num_microbatches, stages_per_rank), 1, 1,
                        weight_time=1).bubble_fraction()
    return (num_ranks - 1) / (stages_per_rank * num_microbatches + num_ranks - 1)


def split_backward_stages(schedule) -> set:
    """The stages whose backward the schedule runs split into BACKWARD_INPUT and BACKWARD_WEIGHT."""
    return {sub.stage for steps in schedule.values() for step in steps for sub in _flat(step)
            if sub.step_type is T.BACKWARD_INPUT}


def in_flight_per_stage(schedule) -> dict[int, int]:
    """Stage -> most of its micro-batches whose activations it holds at once (forward run,
    backward (or its weight-gradient step) not yet)."""
    peak: dict[int, int] = {}
    for steps in schedule.values():
        live: dict[int, int] = {}
        for step in steps:
            for sub in _flat(step):
                if sub.step_type is T.FORWARD:
                    live[sub.stage] = live.get(sub.stage, 0) + 1
                    peak[sub.stage] = max(peak.get(sub.stage, 0), live[sub.stage])
                elif sub.step_type in (T.BACKWARD, T.BACKWARD_WEIGHT):
                    live[sub.stage] -= 1
    return peak


def peak_in_flight(schedule) -> int:
    """Most micro-batches whose activations one stage holds at once (the first stage's, under the
    built-in schedules)."""
    return max(in_flight_per_stage(schedule).values(), default=0)


def equal_stage_bubble(schedule) -> float:
    """The schedule's idle fraction with equal stages: forward 1, backward 2 (input and weight
    gradient 1 each when split); for the built-in schedules, :func:`analytic_bubble`."""
    split = split_backward_stages(schedule)
    stages = {sub.stage for steps in schedule.values() for step in steps for sub in _flat(step)}
    backward = {s: 1 if s in split else 2 for s in range(1 + max(stages, default=0))}
    return simulate(schedule, 1, backward, weight_time=1 if split else None).bubble_fraction()
