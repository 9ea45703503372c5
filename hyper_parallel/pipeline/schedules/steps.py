"""The schedule vocabulary: :class:`MetaStepType` and :class:`MetaStep` (one step of one pipeline
rank's list), their text forms (``repr`` / :meth:`MetaStep.from_str`, :func:`format_schedule`'s
grid), and the step-type tables and small helpers the builders, checks and replay share.
"""

from __future__ import annotations

import dataclasses
import enum
import re


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


def _flat(step):
    return step.sub_steps or (step,)


def _comm_key(step):
    """(direction, producer stage, consumer stage, micro-batch): equal for a send and its receive."""
    if step.step_type in _SEND:
        return step.step_type.value[0], step.stage, step.peer_stage, step.micro_batch
    return step.step_type.value[0], step.peer_stage, step.stage, step.micro_batch


def _where(rank, idx, step):
    return f"rank {rank} step {idx} ({step!r})"


def format_schedule(schedule):
    """A grid of compute steps: one column per rank, one row per compute step index."""
    cols = [[repr(s) for s in schedule[r] if s.step_type in _COMPUTE] for r in sorted(schedule)]
    header = ["step"] + [f"rank {r}" for r in sorted(schedule)]
    rows = [header] + [[str(i)] + [c[i] if i < len(c) else "" for c in cols]
                       for i in range(max(map(len, cols), default=0))]
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
