"""Hand-written schedules: :class:`CustomSchedule`, a user's step list per rank, normalized and
built into the schedule the executor runs after the same checks as a built-in one.
"""

from __future__ import annotations

import dataclasses

from .builders import _add_p2p
from .checks import _check_compute, check_schedule
from .steps import _COMPUTE, _OVERLAP_ORDER, _RECV, _SEND, MetaStep, T, _where


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class CustomSchedule:
    """A hand-written pipeline schedule: the ordered :class:`MetaStep` list of every pp rank, run by
    the executor like a built-in schedule after the same checks (:meth:`build`).

    ``steps``: ``{pp_rank: [MetaStep, ...]}`` for ranks 0..N-1, or a list indexed by rank. A step
    may be written as its repr (``"F0@s1"``, see :meth:`MetaStep.from_str`) and a rank's whole list
    as one string of them separated by spaces. Stage ``s`` runs on rank ``s % N``. Write only the
    compute steps (FORWARD with BACKWARD, or with BACKWARD_INPUT and BACKWARD_WEIGHT) and each
    rank's sends and receives are added around them as for the built-in schedules
    (``PipelinePlan(overlap_p2p=True)`` included); or write every step yourself, sends and receives
    included. ``name``: what compile summaries and reports call the schedule.
    """

    steps: tuple  # per pp rank: a tuple of MetaStep
    name: str

    def __init__(self, steps, name: str = "custom"):
        if isinstance(steps, CustomSchedule):
            steps = steps.steps
        if isinstance(steps, dict):
            ranks = list(steps)
            if (any(isinstance(r, bool) or not isinstance(r, int) for r in ranks)
                    or sorted(ranks) != list(range(len(ranks)))):
                raise ValueError(f"CustomSchedule needs the pp ranks 0..N-1 as keys, got {ranks!r}")
            per_rank = [steps[r] for r in range(len(ranks))]
        elif isinstance(steps, (list, tuple)):
            per_rank = list(steps)
        else:
            raise TypeError(f"CustomSchedule takes {{pp_rank: [MetaStep, ...]}} (or a list per rank), "
                            f"got {type(steps).__name__}")
        if not per_rank:
            raise ValueError("CustomSchedule needs the steps of at least one pp rank")
        normalized = []
        for r, listed in enumerate(per_rank):
            if isinstance(listed, str):
                listed = listed.split()
            if not isinstance(listed, (list, tuple)):
                raise TypeError(f"CustomSchedule rank {r}: expected a list of MetaStep, got {listed!r}")
            out = []
            for i, step in enumerate(listed):
                if isinstance(step, str):
                    try:
                        step = MetaStep.from_str(step)
                    except ValueError as exc:
                        raise ValueError(f"CustomSchedule rank {r} step {i}: {exc}") from None
                elif not isinstance(step, MetaStep):
                    raise TypeError(f"CustomSchedule rank {r} step {i} is {step!r}, not a MetaStep")
                out.append(step)
            normalized.append(tuple(out))
        if not isinstance(name, str) or not name:
            raise TypeError(f"CustomSchedule(name={name!r}) must be a non-empty string")
        object.__setattr__(self, "steps", tuple(normalized))
        object.__setattr__(self, "name", name)

    @property
    def num_ranks(self) -> int:
        return len(self.steps)

    @property
    def writes_p2p(self) -> bool:
        """Whether the schedule has its own sends and receives (else :meth:`build` adds them)."""
        return any(step.step_type in _RECV + _SEND for steps in self.steps for step in steps)

    def as_dict(self) -> dict:
        """``{pp_rank: [MetaStep, ...]}`` as written."""
        return {r: list(steps) for r, steps in enumerate(self.steps)}

    def __repr__(self):
        ranks = ", ".join(f"{r}: {' '.join(map(repr, steps))!r}" for r, steps in enumerate(self.steps))
        return f"CustomSchedule({{{ranks}}}, name={self.name!r})"

    def build(self, num_stages: int, num_microbatches: int, overlap_p2p: bool = False) -> dict:
        """The schedule the executor runs, ``{pp_rank: [MetaStep, ...]}``, checked like a built one:
        every (stage, micro-batch) forward and backward exactly once, each backward after its
        forward, sends and receives matched between neighbouring stages (and posted in the same
        order on both ranks of a pair), and no deadlock. A ValueError names the rank, the index of
        the step in the list as written and the step."""
        try:
            return self._build(num_stages, num_microbatches, overlap_p2p)
        except ValueError as exc:
            raise ValueError(f"CustomSchedule {self.name!r}: {exc}") from None

    def _build(self, num_stages, num_microbatches, overlap_p2p):
        written = self.as_dict()
        p = self.num_ranks
        for r, steps in written.items():
            for i, step in enumerate(steps):
                if step.step_type in _OVERLAP_ORDER:
                    raise ValueError(f"{_where(r, i, step)}: the pipeline executor does not run "
                                     f"{step.step_type.name} steps; write its two sub-steps one after the other")
        if self.writes_p2p:
            if overlap_p2p:
                raise ValueError("overlap_p2p=True moves the sends and receives it adds, and this schedule "
                                 "writes its own: place its receives where you want them and leave overlap_p2p "
                                 "False, or write only the compute steps")
            check_schedule(written, num_stages, num_microbatches)
            full = written
        else:
            # The compute steps first, so that their errors name the steps as written; then the
            # schedule with its sends and receives (p2p order, deadlock) names a generated send or
            # receive by the index of the compute step it serves.
            _check_compute(written, num_stages, num_microbatches, _where, lambda r, i: i)
            full = {r: _add_p2p(steps, p, num_stages, overlap_p2p) for r, steps in written.items()}
            check_schedule(full, num_stages, num_microbatches, step_index=_written_index(written, full))
        _check_whole_or_split_per_stage(written)
        return full


def _written_index(written, full):
    """step_index for check_schedule: position in ``full[rank]`` -> index in ``written[rank]`` of
    the compute step (a send or receive: the compute step it serves)."""
    table = {}
    for r, steps in full.items():
        own = {(s.step_type, s.stage, s.micro_batch): i for i, s in enumerate(written[r])}
        positions = []
        for step in steps:
            kind, s, mb = step.step_type, step.stage, step.micro_batch
            if kind not in _COMPUTE:
                kind = T.FORWARD if kind.value[0] == "F" else (
                    T.BACKWARD_INPUT if (T.BACKWARD_INPUT, s, mb) in own else T.BACKWARD)
            positions.append(own[kind, s, mb])
        table[r] = positions
    return lambda rank, i: table[rank][i]


def _check_whole_or_split_per_stage(schedule):
    """A stage compiles one backward (whole, or split into input- and weight-gradient programs)."""
    for r, steps in schedule.items():
        first = {}  # stage -> (whole?, index, step)
        for i, step in enumerate(steps):
            if step.step_type not in (T.BACKWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT):
                continue
            whole = step.step_type is T.BACKWARD
            seen = first.setdefault(step.stage, (whole, i, step))
            if seen[0] != whole:
                raise ValueError(f"{_where(r, i, step)}: stage {step.stage} already runs "
                                 f"{seen[2].step_type.name} at step {seen[1]}; a stage's backward is whole "
                                 f"(BACKWARD) or split (BACKWARD_INPUT + BACKWARD_WEIGHT) for every micro-batch")
