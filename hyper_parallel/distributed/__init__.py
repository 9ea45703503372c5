"""The device mesh, process groups and the platform: what a parallel job runs on.

``mesh`` (axis names and their meaning, ``init_device_mesh``) · ``parallel_dims`` (``ParallelDims``:
the mesh from degrees) · ``process_group`` (group helpers over ``torch.distributed``) · ``platform``
(``get_platform``: device type, backend, device count) · ``dtensor`` (eager DTensor calls taking a
``Layout``) · ``spmd`` (the compile-time check that every rank compiled the same collectives).
Nothing is imported here: ``import hyper_parallel`` exports the public names."""
