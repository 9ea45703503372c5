"""Pipeline parallelism: stage split, schedules and the executor.

``ParallelPlan.pipeline = hp.PipelinePlan(...)`` (pipeline/plan.py) cuts the captured program into stages
(passes/pipeline_split.py), api.py compiles this rank's stages, runtime.py runs them on a schedule
(schedules.py) and auto.py places the cuts with the cost model when ``split_points="auto"``.
stages.py holds the seed's ``PipelineStage`` / ``Schedule*`` objects for hand-built stages.
"""

from .plan import PipelinePlan
from .schedules import MetaStep, MetaStepType
from .stages import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

__all__ = ["MetaStep", "MetaStepType", "PipelinePlan", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B"]
