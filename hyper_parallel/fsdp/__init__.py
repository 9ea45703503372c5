"""Fully sharded data parallelism (FSDP / HSDP).

* plan.py: the values: :class:`FullyShard` (the ``ParallelPlan.fully_shard`` entry), its
  :class:`MixedPrecisionPolicy` and :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`, and the
  resolved :class:`FsdpPlan` of :class:`FsdpUnit` entries the compiler reads (``ResolvedPlan.fsdp``).
* fully_shard.py: the FSDP2-style API, :func:`fully_shard` called on each layer then on the root,
  which records a ``FullyShard`` entry on the model and adds :class:`FullyShardedModule`'s methods.
* resolve.py: :func:`resolve_fully_shard` (units, storage layouts) and
  :func:`attach_post_forward_groups` (the process groups of ``reshard_after_forward=<k>`` units).
* flags.py: :class:`FsdpFlags`, the FSDP2 / HSDPModule switches that change the compiled program.
* methods.py: :class:`FsdpMethods`, those switches and ``unshard()`` on the parallelized module.
* unshard.py: gathered parameters kept between programs (``unshard()`` / ``reshard()``,
  ``set_reshard_after_backward(False)``).
* grad_accumulation.py: :class:`GradientAccumulator`, gradients kept between the micro-steps of
  gradient accumulation.
"""

from .flags import FsdpFlags
from .fully_shard import fully_shard
from .plan import CPUOffloadPolicy, FsdpPlan, FsdpUnit, FullyShard, MixedPrecisionPolicy, OffloadPolicy
from .resolve import resolve_fully_shard

__all__ = [
    "fully_shard",
    "FullyShard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "FsdpPlan",
    "FsdpUnit",
    "FsdpFlags",
    "resolve_fully_shard",
]
