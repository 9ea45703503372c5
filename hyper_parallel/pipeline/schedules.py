"""Pipeline-parallel schedules as plain data: which step each pipeline rank runs, in which order.

:func:`build_schedule` turns a schedule name (GPipe, 1F1B, Megatron's interleaved 1F1B, zero-bubble
ZB-H1) into one
ordered list of :class:`MetaStep` per pipeline rank, compute steps with the sends and receives
around them; the executor walks these lists. :func:`check_schedule` proves a schedule complete,
matched and deadlock-free before anything runs, :func:`simulate` replays it with per-stage times to
measure the bubble, and :func:`format_schedule` prints it. A :class:`CustomSchedule` is a
user-written step list per rank, run by the same executor after the same checks. Stage ``s`` of
``S = num_ranks * stages_per_rank`` lives on rank ``s % num_ranks``. Pure Python: no torch, no
process group.
"""

from __future__ import annotations

import dataclasses
import enum
import re

__all__ = ["SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "CustomSchedule", "MetaStep", "MetaStepType", "Timeline",
           "analytic_bubble", "build_schedule", "check_schedule", "equal_stage_bubble", "format_schedule",
           "peak_in_flight", "simulate", "split_backward_stages"]

# The schedules build_schedule makes, the executor runs and PipelinePlan accepts.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1")
# Those among them that split each backward: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism")
# runs BACKWARD_INPUT (input gradients, sent to the previous stage) and BACKWARD_WEIGHT (parameter
# gradients) as two steps, and delays the W steps into the cooldown bubble of 1F1B with 1F1B's
# activation memory bound.
SPLIT_BACKWARD_SCHEDULES = ("ZBH1",)


class MetaStepType(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # zero-bubble: the input-gradient half of a backward
    BACKWARD_WEIGHT = "W"  # zero-bubble: the weight-gradient half, after its BACKWARD_INPUT
    OVERLAP_F_B = "OFB"
    OVERLAP_B_F = "OBF"
    FWD_RECV = "FR"
    BWD_RECV = "BR"
    FWD_SEND = "FS"
    BWD_SEND = "BS"


T = MetaStepType  # short alias: step types appear on most lines below
_COMPUTE = (T.FORWARD, T.BACKWARD, T.OVERLAP_F_B, T.OVERLAP_B_F, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT)
_SENDS_GRAD = (T.BACKWARD, T.BACKWARD_INPUT)  # compute steps that receive and send input gradients
_RECV, _SEND = (T.FWD_RECV, T.BWD_RECV), (T.FWD_SEND, T.BWD_SEND)
# The peer a communication step must name, as an offset from its own stage.
_PEER_OFFSET = {T.FWD_RECV: -1, T.FWD_SEND: +1, T.BWD_RECV: +1, T.BWD_SEND: -1}
_MATCH = {T.FWD_SEND: T.FWD_RECV, T.BWD_SEND: T.BWD_RECV, T.FWD_RECV: T.FWD_SEND, T.BWD_RECV: T.BWD_SEND}
_OVERLAP_ORDER = {T.OVERLAP_F_B: (T.FORWARD, T.BACKWARD), T.OVERLAP_B_F: (T.BACKWARD, T.FORWARD)}
_BY_VALUE = {t.value: t for t in MetaStepType}
_TOKEN = re.compile(r"([A-Z]+)(\d+)@s(\d+)(?:([<>])s(\d+))?")


@dataclasses.dataclass(frozen=True)
class MetaStep:
    """One step of a rank's schedule; ``stage`` is the local stage, ``peer_stage`` the remote one."""

    step_type: MetaStepType
    stage: int
    micro_batch: int
    peer_stage: int | None = None
    sub_steps: tuple[MetaStep, ...] = ()

    def __post_init__(self):
        if not isinstance(self.step_type, MetaStepType):
            raise TypeError(f"MetaStep step_type must be a MetaStepType, got {self.step_type!r}")
        for name in ("stage", "micro_batch", "peer_stage"):
            value = getattr(self, name)
            if (value is not None or name != "peer_stage") and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"MetaStep {name} must be an int, got {value!r}")
        if self.stage < 0 or self.micro_batch < 0:
            raise ValueError(f"MetaStep needs stage >= 0 and micro_batch >= 0, got {self!r}")
        is_comm = self.step_type in _RECV + _SEND
        if is_comm != (self.peer_stage is not None):
            raise ValueError(
                f"MetaStep {self.step_type.name}: peer_stage must be set exactly for sends and "
                f"receives, got peer_stage={self.peer_stage}"
            )
        if self.step_type in _OVERLAP_ORDER:
            kinds = tuple(s.step_type for s in self.sub_steps)
            if kinds != _OVERLAP_ORDER[self.step_type]:
                raise ValueError(
                    f"MetaStep {self.step_type.name} needs sub_steps of types "
                    f"{[k.name for k in _OVERLAP_ORDER[self.step_type]]}, got {[k.name for k in kinds]}"
                )
        elif self.sub_steps:
            raise ValueError(f"only OVERLAP_* steps take sub_steps, not {self.step_type.name}")

    def __repr__(self):
        if self.sub_steps:
            return f"{self.step_type.value}[{'|'.join(map(repr, self.sub_steps))}]"
        text = f"{self.step_type.value}{self.micro_batch}@s{self.stage}"
        if self.peer_stage is not None:
            text += f"{'<' if self.step_type in _RECV else '>'}s{self.peer_stage}"
        return text

    @classmethod
    def from_str(cls, text: str) -> MetaStep:
        """The inverse of ``repr``: ``"F0@s1"`` (forward of micro-batch 0 on stage 1), ``"B0@s1"``,
        ``"I0@s1"`` / ``"W0@s1"`` (split backward), ``"FR0@s1<s0"`` / ``"BS0@s1>s0"`` (receive from /
        send to stage 0)."""
        found = _TOKEN.fullmatch(text.strip()) if isinstance(text, str) else None
        kind = found and _BY_VALUE.get(found[1])
        if kind is None or kind in _OVERLAP_ORDER:
            raise ValueError(
                f"MetaStep.from_str({text!r}): expected <type><micro-batch>@s<stage>, with <s<peer> after a "
                f"receive and >s<peer> after a send, e.g. 'F0@s1', 'B0@s1', 'FR0@s1<s0', 'BS0@s1>s0'; types "
                f"{[t.value for t in MetaStepType if t not in _OVERLAP_ORDER]}"
            )
        arrow = found[4]
        if arrow is not None and arrow != ("<" if kind in _RECV else ">"):
            raise ValueError(f"MetaStep.from_str({text!r}): a {kind.name} names its peer with "
                             f"'{'<' if kind in _RECV else '>'}s<peer>'")
        return cls(kind, int(found[3]), int(found[2]), None if found[5] is None else int(found[5]))


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def build_schedule(name, num_ranks, num_microbatches, stages_per_rank=1, overlap_p2p=False):
    """One ordered step list per pipeline rank 0..num_ranks-1, validated by check_schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule name={name!r}; choose one of {SCHEDULES}")
    for arg, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                       ("stages_per_rank", stages_per_rank)):
        _check_count(arg, value)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if name != "Interleaved1F1B" and v != 1:
        raise ValueError(f"{name} runs one stage per rank, got stages_per_rank={v}; "
                         f"use 'Interleaved1F1B' for several stages per rank")
    if name == "Interleaved1F1B":
        if v < 2:
            raise ValueError(f"Interleaved1F1B needs stages_per_rank >= 2, got stages_per_rank={v}; "
                             f"use '1F1B' for one stage per rank")
        if m % p:
            fits = sorted({max(p, m - m % p), m - m % p + p})
            raise ValueError(
                f"Interleaved1F1B needs num_microbatches to be a multiple of num_ranks (Megatron's "
                f"rule), got num_microbatches={m} with num_ranks={p}; use {' or '.join(map(str, fits))}"
            )
    num_stages = p * v
    schedule = {}
    for r in range(p):
        if name == "GPipe":
            compute = [MetaStep(T.FORWARD, r, i) for i in range(m)] + [MetaStep(T.BACKWARD, r, i) for i in range(m)]
        elif name == "ZBH1":
            compute = _zero_bubble_h1(r, p, m)
        else:
            # Megatron: the extra 2*(p-r-1) + (v-1)*p warmup forwards of interleaving keep the
            # next chunk's input arriving before it is needed; plain 1F1B only fills the pipe.
            warmup = min(p - r - 1, m) if name == "1F1B" else min((p - r - 1) * 2 + (v - 1) * p, m * v)
            compute = _one_f_one_b(r, p, m, v, warmup)
        schedule[r] = _add_p2p(compute, p, num_stages, overlap_p2p)
    check_schedule(schedule, num_stages, m)
    return schedule


def _one_f_one_b(rank, p, m, v, warmup):
    """Megatron's order: warmup forwards, steady (1 forward, 1 backward) pairs, cooldown backwards."""

    def step(kind, k):
        chunk = (k // p) % v
        if kind is T.BACKWARD:
            chunk = v - 1 - chunk  # backward walks the local chunks last-to-first
        return MetaStep(kind, rank + chunk * p, (k // (p * v)) * p + k % p)

    total = m * v
    order = [step(T.FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [step(T.FORWARD, warmup + i), step(T.BACKWARD, i)]
    return order + [step(T.BACKWARD, k) for k in range(total - warmup, total)]


def _zero_bubble_h1(rank, p, m):
    """ZB-H1 on one stage per rank: 1F1B's forwards and input-gradient steps, W steps delayed.

    Rank r runs 1F1B's ``p - r - 1`` warmup forwards, so it holds at most ``p - r`` micro-batches'
    activations after a forward; it may keep ``r`` W steps pending (activations stay alive until
    W) and still hold at most ``p``, the bound of 1F1B's rank 0. Delayed W steps run in the
    cooldown, right after each input-gradient step, where 1F1B waits for the next stage.
    """
    def F(mb):
        return MetaStep(T.FORWARD, rank, mb)

    def I(mb):  # noqa: E743 - the paper's name for the input-gradient step
        return MetaStep(T.BACKWARD_INPUT, rank, mb)

    def W(mb):
        return MetaStep(T.BACKWARD_WEIGHT, rank, mb)

    warmup, delay = min(p - rank - 1, m), rank
    order, next_w = [F(k) for k in range(warmup)], 0
    for i in range(m - warmup):
        order += [F(warmup + i), I(i)]
        while i + 1 - next_w > delay:
            order.append(W(next_w))
            next_w += 1
    for k in range(m - warmup, m):
        order.append(I(k))
        if next_w <= k:  # one delayed W fills the wait for the next input gradient
            order.append(W(next_w))
            next_w += 1
    return order + [W(k) for k in range(next_w, m)]


def _add_p2p(compute, num_ranks, num_stages, overlap_p2p):
    """Surround each compute step with its receives and sends (none for a same-rank hand-off)."""

    def comm(kind, step, peer):
        if 0 <= peer < num_stages and peer % num_ranks != step.stage % num_ranks:
            return [MetaStep(kind, step.stage, step.micro_batch, peer)]
        return []

    recvs, sends = [], []
    for c in compute:
        if c.step_type is T.BACKWARD_WEIGHT:  # parameter gradients stay on the stage
            recvs.append([])
            sends.append([])
            continue
        sign = -1 if c.step_type is T.FORWARD else 1  # forward data flows up the stages, grads down
        recv, send = (T.FWD_RECV, T.FWD_SEND) if sign < 0 else (T.BWD_RECV, T.BWD_SEND)
        recvs.append(comm(recv, c, c.stage + sign))
        sends.append(comm(send, c, c.stage - sign))
    if overlap_p2p and compute:
        # Post each receive while the previous compute step runs so the transfer hides behind it.
        recvs = [recvs[0] + (recvs[1] if len(recvs) > 1 else [])] + recvs[2:] + [[]]
    steps = []
    for r, c, s in zip(recvs, compute, sends):
        steps += r + [c] + s
    return steps


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


def split_backward_stages(schedule) -> set:
    """The stages whose backward the schedule runs split into BACKWARD_INPUT and BACKWARD_WEIGHT."""
    return {sub.stage for steps in schedule.values() for step in steps for sub in _flat(step)
            if sub.step_type is T.BACKWARD_INPUT}


def peak_in_flight(schedule) -> int:
    """Most micro-batches whose activations one stage holds at once (forward run, backward (or
    its weight-gradient step) not yet)."""
    peak = 0
    for steps in schedule.values():
        live = {}
        for step in steps:
            for sub in _flat(step):
                if sub.step_type is T.FORWARD:
                    live[sub.stage] = live.get(sub.stage, 0) + 1
                    peak = max(peak, live[sub.stage])
                elif sub.step_type in (T.BACKWARD, T.BACKWARD_WEIGHT):
                    live[sub.stage] -= 1
    return peak


def equal_stage_bubble(schedule) -> float:
    """The schedule's idle fraction with equal stages: forward 1, backward 2 (input and weight
    gradient 1 each when split); for the built-in schedules, :func:`analytic_bubble`."""
    split = split_backward_stages(schedule)
    stages = {sub.stage for steps in schedule.values() for step in steps for sub in _flat(step)}
    backward = {s: 1 if s in split else 2 for s in range(1 + max(stages, default=0))}
    return simulate(schedule, 1, backward, weight_time=1 if split else None).bubble_fraction()


def _flat(step):
    return step.sub_steps or (step,)


def _comm_key(step):
    """(direction, producer stage, consumer stage, micro-batch): equal for a send and its receive."""
    if step.step_type in _SEND:
        return step.step_type.value[0], step.stage, step.peer_stage, step.micro_batch
    return step.step_type.value[0], step.peer_stage, step.stage, step.micro_batch


def _where(rank, idx, step):
    return f"rank {rank} step {idx} ({step!r})"


def check_schedule(schedule, num_stages, num_microbatches, *, step_index=None):
    """Raise ValueError unless the schedule is complete, matched, ordered and deadlock-free.

    Messages name the rank, the step index and the step; ``step_index(rank, i)`` is the index to
    name for position ``i`` of ``schedule[rank]`` (a :class:`CustomSchedule` whose sends and receives
    were generated names the position in the list its user wrote).
    """
    at = step_index or (lambda rank, i: i)

    def where(rank, i, step):
        return _where(rank, at(rank, i), step)

    p = len(schedule)
    compute_at = _check_compute(schedule, num_stages, num_microbatches, where, at)
    comm_at = {}  # comm key -> (rank, index, step)
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            for sub in _flat(step):
                if sub.step_type in _COMPUTE:
                    continue
                peer = sub.stage + _PEER_OFFSET[sub.step_type]
                if sub.peer_stage != peer:
                    raise ValueError(f"{where(r, i, step)}: a {sub.step_type.name} of stage "
                                     f"{sub.stage} must name peer stage {peer}")
                key = (sub.step_type, *_comm_key(sub))
                if key in comm_at:
                    raise ValueError(f"{where(r, i, step)} duplicates {where(*comm_at[key])}")
                comm_at[key] = (r, i, sub)
    for (kind, *key), (r, i, step) in comm_at.items():
        other = _MATCH[kind]
        if (other, *key) not in comm_at:
            peer = MetaStep(other, step.peer_stage, step.micro_batch, step.stage)
            raise ValueError(f"{where(r, i, step)} has no matching {other.name} {peer!r} "
                             f"on rank {step.peer_stage % p}")
        grad = T.BACKWARD_INPUT if (T.BACKWARD_INPUT, step.stage, step.micro_batch) in compute_at else T.BACKWARD
        compute = compute_at[T.FORWARD if kind.value[0] == "F" else grad, step.stage, step.micro_batch]
        if (kind in _SEND) != (compute[1] < i):  # sends follow the step they send; recvs precede it
            raise ValueError(f"{where(r, i, step)} must come {'after' if kind in _SEND else 'before'} "
                             f"{compute[2]!r} (step {at(r, compute[1])})")
    for (kind, s, mb), (r, i, step) in compute_at.items():
        if kind is T.BACKWARD_WEIGHT:
            continue  # reads only its own stage's values
        src = s - 1 if kind is T.FORWARD else s + 1
        if 0 <= src < num_stages and src % p != r:
            recv = MetaStep(T.FWD_RECV if kind is T.FORWARD else T.BWD_RECV, s, mb, src)
            if (recv.step_type, *_comm_key(recv)) not in comm_at:
                raise ValueError(f"{where(r, i, step)} needs data from stage {src} on rank {src % p} "
                                 f"but no {recv!r} is posted before it")
    _, stuck, _ = _execute(schedule, num_stages, lambda step: 0.0, 0.0)
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(
            f"{where(r, i, step)} waits for {wait}" for r, (i, step, wait) in sorted(stuck.items()))
            + f"\n{format_schedule(schedule)}")
    _check_p2p_order(schedule, where)


def _check_compute(schedule, num_stages, num_microbatches, where, at):
    """The checks that need only the compute steps: step types, ranges, placement, duplicates, every
    (stage, micro-batch) forward and backward present once and in order. Returns (kind, stage,
    micro-batch) -> (rank, index, step) of every compute step."""
    p = len(schedule)
    if p == 0 or sorted(schedule) != list(range(p)):
        raise ValueError(f"schedule must map ranks 0..N-1 to step lists, got ranks {sorted(schedule)}")
    if num_stages < 1 or num_stages % p:
        raise ValueError(f"num_stages={num_stages} must be a positive multiple of the {p} ranks")
    compute_at = {}  # (kind, stage, mb) -> (rank, index, step)
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            if not isinstance(step, MetaStep):
                raise ValueError(f"rank {r} step {at(r, i)} is {step!r}, not a MetaStep")
            for sub in _flat(step):
                if sub.stage >= num_stages or sub.micro_batch >= num_microbatches:
                    raise ValueError(f"{where(r, i, step)}: stage or micro-batch out of range "
                                     f"(num_stages={num_stages}, num_microbatches={num_microbatches})")
                if sub.stage % p != r:
                    raise ValueError(f"{where(r, i, step)}: stage {sub.stage} lives on rank {sub.stage % p}")
                key = (sub.step_type, sub.stage, sub.micro_batch)
                if sub.step_type not in _COMPUTE:
                    continue
                if key in compute_at:
                    raise ValueError(f"{where(r, i, step)} duplicates {where(*compute_at[key])}")
                compute_at[key] = (r, i, sub)
    for s in range(num_stages):
        for mb in range(num_microbatches):
            split = (T.BACKWARD_INPUT, s, mb) in compute_at or (T.BACKWARD_WEIGHT, s, mb) in compute_at
            if split and (T.BACKWARD, s, mb) in compute_at:
                r, i, step = compute_at[T.BACKWARD, s, mb]
                raise ValueError(f"{where(r, i, step)}: micro-batch {mb} of stage {s} has both a full "
                                 f"BACKWARD and a split one (BACKWARD_INPUT / BACKWARD_WEIGHT)")
            kinds = (T.FORWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT) if split else (T.FORWARD, T.BACKWARD)
            for n, kind in enumerate(kinds):
                if (kind, s, mb) not in compute_at:
                    # Where it belongs: after the step before it in its chain, else before the next.
                    present = [j for j, k in enumerate(kinds) if (k, s, mb) in compute_at]
                    earlier, later = [j for j in present if j < n], [j for j in present if j > n]
                    hint = ""
                    if present:
                        j, side = (earlier[-1], "after") if earlier else (later[0], "before")
                        r, i, step = compute_at[kinds[j], s, mb]
                        hint = f" {side} its {kinds[j].name} at {where(r, i, step)}"
                    raise ValueError(f"rank {s % p} has no {kind.name} of micro-batch {mb} for stage {s}; "
                                     f"expected {MetaStep(kind, s, mb)!r}{hint}\n{format_schedule(schedule)}")
            for before, after in zip(kinds, kinds[1:]):  # F before B (or I), I before its W
                a_idx, (r, b_idx, b) = compute_at[before, s, mb][1], compute_at[after, s, mb]
                if b_idx < a_idx:
                    what = "forward" if before is T.FORWARD else before.name
                    raise ValueError(f"{where(r, b_idx, b)} comes before its {what} at step {at(r, a_idx)}")
    return compute_at


def _check_p2p_order(schedule, where):
    """Backends without message tags (NCCL, HCCL) pair a rank pair's sends and receives in posting
    order: each rank must post its receives from a peer in the order that peer posts its sends."""
    p = len(schedule)
    sent, received = {}, {}  # (from rank, to rank) -> [(comm key, rank, index, step)]
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            for sub in _flat(step):
                if sub.step_type in _SEND and sub.peer_stage % p != r:
                    sent.setdefault((r, sub.peer_stage % p), []).append((_comm_key(sub), r, i, sub))
                elif sub.step_type in _RECV and sub.peer_stage % p != r:
                    received.setdefault((sub.peer_stage % p, r), []).append((_comm_key(sub), r, i, sub))
    for (a, b), sends in sorted(sent.items()):
        for n, (send, recv) in enumerate(zip(sends, received.get((a, b), []))):
            if send[0] != recv[0]:
                raise ValueError(
                    f"{where(*recv[1:])} is receive {n} of rank {b} from rank {a}, but send {n} of rank {a} to "
                    f"rank {b} is {where(*send[1:])}: backends that pair messages in posting order (NCCL, "
                    f"HCCL) would deliver the wrong tensors. Post the receives from a rank in the order it "
                    f"sends (on both ranks, the same micro-batch order for the values crossing between them)"
                )


def _deps(step, num_stages, num_ranks):
    """What a compute step waits for: keys of the producing compute step or the remote send."""
    s, mb = step.stage, step.micro_batch
    if step.step_type is T.BACKWARD_WEIGHT:
        return [(T.BACKWARD_INPUT, s, mb)]
    src, kind = (s - 1, T.FORWARD) if step.step_type is T.FORWARD else (s + 1, T.BACKWARD)
    deps = [(T.FORWARD, s, mb)] if step.step_type in _SENDS_GRAD else []
    if 0 <= src < num_stages:
        same_rank = src % num_ranks == s % num_ranks
        deps.append((kind, src, mb) if same_rank else (T.FWD_SEND if kind is T.FORWARD else T.BWD_SEND, src, mb))
    return deps


def _execute(schedule, num_stages, duration, p2p_time):
    """Run all ranks in lock-free order; returns (events, stuck ranks, busy time per rank).

    A rank stops at a compute step whose inputs are not produced yet, so the order in which ranks
    are visited does not change the computed times: every start is max(rank clock, input ready).
    """
    p = len(schedule)
    pos, clock, busy = dict.fromkeys(schedule, 0), dict.fromkeys(schedule, 0.0), dict.fromkeys(schedule, 0.0)
    done, events = {}, []  # done: (kind, stage, mb) -> time the data is available
    progress = True
    while progress:
        progress = False
        for r, steps in schedule.items():
            while pos[r] < len(steps):
                step = steps[pos[r]]
                if step.step_type in _SEND:
                    done[step.step_type, step.stage, step.micro_batch] = clock[r] + p2p_time
                elif step.step_type in _COMPUTE:
                    finished, ready = set(), clock[r]
                    for sub in _flat(step):
                        for dep in _deps(sub, num_stages, p):
                            if dep not in finished:
                                if dep not in done:
                                    break
                                ready = max(ready, done[dep])
                        else:
                            finished.add((sub.step_type, sub.stage, sub.micro_batch))
                            continue
                        break
                    else:
                        # Overlapped sub-steps share one device: their compute times add up.
                        cost = sum(duration(sub) for sub in _flat(step))
                        clock[r], busy[r] = ready + cost, busy[r] + cost
                        done.update(dict.fromkeys(finished, clock[r]))
                        for kind, s, mb in finished:  # an input-gradient step feeds what a BACKWARD does
                            if kind is T.BACKWARD_INPUT:
                                done[T.BACKWARD, s, mb] = clock[r]
                        events.append((r, step, ready, clock[r]))
                        pos[r] += 1
                        progress = True
                        continue
                    break
                pos[r] += 1  # receives only post a buffer
                progress = True
    stuck = {}
    for r, steps in schedule.items():
        if pos[r] < len(steps):
            step = steps[pos[r]]
            missing = [d for sub in _flat(step) for d in _deps(sub, num_stages, p) if d not in done]
            stuck[r] = (pos[r], step, ", ".join(f"{k.value}{mb}@s{s} (rank {s % p})" for k, s, mb in missing))
    return events, stuck, busy


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


def format_schedule(schedule):
    """A grid of compute steps: one column per rank, one row per compute step index."""
    cols = [[repr(s) for s in schedule[r] if s.step_type in _COMPUTE] for r in sorted(schedule)]
    header = ["step"] + [f"rank {r}" for r in sorted(schedule)]
    rows = [header] + [[str(i)] + [c[i] if i < len(c) else "" for c in cols]
                       for i in range(max(map(len, cols), default=0))]
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
