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

The modules, in import order: ``steps`` (the vocabulary: MetaStepType, MetaStep, their text forms),
``replay`` (the lock-free replay the checks and the simulator run), ``checks`` (check_schedule),
``builders`` (build_schedule: the built-in schedules), ``custom`` (CustomSchedule) and ``costs``
(simulate, bubbles, peak activations).
"""

from .builders import SCHEDULES, SPLIT_BACKWARD_SCHEDULES, build_schedule
from .checks import check_schedule
from .costs import Timeline, analytic_bubble, equal_stage_bubble, in_flight_per_stage, peak_in_flight, simulate, split_backward_stages
from .custom import CustomSchedule
from .steps import MetaStep, MetaStepType, format_schedule

__all__ = ["SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "CustomSchedule", "MetaStep", "MetaStepType", "Timeline",
           "analytic_bubble", "build_schedule", "check_schedule", "equal_stage_bubble", "format_schedule",
           "in_flight_per_stage", "peak_in_flight", "simulate", "split_backward_stages"]
