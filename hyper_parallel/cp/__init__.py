"""Context parallelism: activations sharded on the sequence dim over a ``cp`` mesh axis.

``style`` (the ``ContextParallel`` plan entry), ``resolve`` (entries -> the sequence axis),
``attention`` (the sharding rule's local kernels for sequence-sharded attention).
"""

from .style import AsyncContextParallel, ContextParallel

__all__ = ["AsyncContextParallel", "ContextParallel"]
