"""Pipeline parallelism: stage split, schedules and the executor.

``ParallelPlan.pipeline = hp.PipelinePlan(...)`` (pipeline/plan.py) cuts the captured program into stages
(passes/pipeline_split.py), compile_stages.py compiles this rank's stages (through the back half
every compile shares, compile/programs.py), step.py runs a step (state.py: what the module keeps
between steps; micro_batches.py: the inputs cut; report.py: collectives and bubbles), runtime.py
runs the stages on a schedule
(schedules/: the built-in ones, or a hand-written ``CustomSchedule`` of ``MetaStep`` lists) over
micro-batches cut along each input's batch dim (``BatchDimSpec`` in plan.py), and auto.py
places the cuts with the cost model when ``split_points="auto"``.
stages.py holds the seed's ``PipelineStage`` / ``Schedule*`` objects for hand-built stages.
"""

from .plan import BatchDimSpec, PipelinePlan
from .schedules import CustomSchedule, MetaStep, MetaStepType
from .stages import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

__all__ = ["BatchDimSpec", "CustomSchedule", "MetaStep", "MetaStepType", "PipelinePlan", "PipelineStage",
           "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]
