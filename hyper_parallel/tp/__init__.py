"""Tensor parallelism: the parallel styles of a plan's ``tensor_parallel`` entries.

``styles`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``
/ ``Output``, ``parse_style``); the plan resolves them (``hyper_parallel.plan.resolver``). Nothing
is imported here: ``import hyper_parallel`` exports the public names."""
