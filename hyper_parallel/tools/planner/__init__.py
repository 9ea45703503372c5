"""Choosing the parallel configuration: ``hp.auto_plan`` and ``hyper-parallel plan``.

* :mod:`.space`: the candidates, every factorisation of the world with recompute and pipeline choices;
* :mod:`.prune`: what is rejected without compiling (ParallelDims' checks, the batch split, a
  memory lower bound);
* :mod:`.search`: :func:`auto_plan`, compiling the rest on fake ranks with ``explain`` and ranking;
* :mod:`.result`: the :class:`Choice`, its table and plan file.
"""

from .result import Choice, PlanContext, Ranked
from .search import auto_plan, predicted_of
from .space import Candidate

__all__ = ["Candidate", "Choice", "PlanContext", "Ranked", "auto_plan", "predicted_of"]
