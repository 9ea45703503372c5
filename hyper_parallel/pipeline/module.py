"""``PipelinedModule``: the module ``parallelize`` returns for a plan with a pipeline.

The same object as the plain path's :class:`~hyper_parallel.runtime.module.ParallelModule` (the
user's model with its class swapped), with the methods a pipeline changes: training goes through
``step`` over all micro-batches on the schedule (pipeline/step.py), calling the model directly is
refused, and the summary is the last step's stages'. The plain class has no pipeline branch.
"""

from __future__ import annotations

import torch

from ..runtime.module import ParallelModule
from .report import pipeline_report
from .step import pipeline_step


class PipelinedModule(ParallelModule):
    """Mixin added to the user's model class by :func:`parallelize` with a pipeline plan."""

    def forward(self, *args, **kwargs):  # noqa: D401 - same signature as the user's model
        raise RuntimeError(
            "a pipelined model trains through pmodel.step(inputs, targets) (forward and backward "
            "over all micro-batches); calling it directly is not supported"
        )

    def step(self, inputs, targets=None) -> torch.Tensor:
        """Forward and backward of all micro-batches of this rank's local batch on the schedule;
        returns the global (detached) loss on every pp rank and leaves the gradients in ``.grad``.
        ``targets``: the second argument of ``parallelize(loss_fn=...)``."""
        return pipeline_step(self, inputs, targets)

    def pipeline_report(self) -> dict:
        """The last pipeline step: schedule, split points, the bubble fraction measured on every pp
        rank next to the schedule's analytic one, and each pp rank's collectives per step (gradient
        reductions apart). Collective over the pp axis."""
        return pipeline_report(self)

    def compile_summary(self) -> dict:
        """The last step's stages: split points, transfers, collectives per stage program (one
        run), runs of each program per step, and this rank's collectives and gradient reductions
        per step (``collectives_per_step``, ``gradient_reductions_per_step``)."""
        if self._hp.pipeline.last is None:
            raise RuntimeError("the module has not been compiled yet: run pmodel.step(...) once")
        return self._hp.pipeline.last.summary

    def _last_entry(self):
        raise RuntimeError("a pipelined model has one program per stage: see pipeline_report() and its dumps")
