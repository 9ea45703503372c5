"""The parallel plan: what the user asks for, and its resolution into constraints for the compiler.

* match.py: module-FQN glob matching (:func:`fqn_matches`) and the "did you mean" errors.
* values.py: :class:`ParallelPlan`, the mesh-agnostic plan the user writes (or reads from YAML/JSON).
* recorded.py: entries recorded by :func:`shard_module` / :func:`parallelize_module`,
  :func:`collect_recorded_plan` and :func:`merge_plans`.
* resolved.py: :class:`ResolvedPlan`, a plan matched against a model and a mesh.
* resolver.py: :func:`resolve_plan`, which builds it from the layouts of a plan.
* resolution.py: :func:`~hyper_parallel.plan.resolution.resolve`, the one entry point
  ``parallelize`` calls: every resolution stage (pipeline, layouts, recompute/swap, FSDP) in order.
  It imports those stages, which import this package, so it is not imported here.
"""

from .match import fqn_matches, match_module_fqns
from .recorded import collect_recorded_plan, merge_plans, parallelize_module, shard_module
from .resolved import ActivationConstraint, ModuleConstraints, ResolvedPlan, default_input_placements
from .resolver import resolve_plan
from .values import PLAN_KEYS, ParallelPlan, option_from_value

__all__ = [
    "ParallelPlan",
    "ActivationConstraint",
    "ModuleConstraints",
    "ResolvedPlan",
    "resolve_plan",
    "merge_plans",
    "shard_module",
    "parallelize_module",
    "collect_recorded_plan",
    "fqn_matches",
    "match_module_fqns",
    "default_input_placements",
    "option_from_value",
    "PLAN_KEYS",
]
