"""Context parallelism: activations sharded on the sequence dim over a ``cp`` mesh axis.

``style`` (the ``ContextParallel`` plan entry), ``resolve`` (entries -> the sequence axis),
``attention`` (the local kernels for sequence-sharded attention: all-to-all here, ring in
``ring``), ``load_balance`` (the balanced causal order and :func:`shard_sequence`), ``check``
(attention that would gather the sequence is refused).
"""

from .load_balance import shard_sequence
from .style import AsyncContextParallel, ContextParallel

__all__ = ["AsyncContextParallel", "ContextParallel", "shard_sequence"]
