"""Saving and loading parallelized models: state dicts and atomic, verified checkpoints.

``state_dict`` gets and sets a model's or optimizer's state with a sharded or full view; ``io``
(:func:`save_checkpoint` / :func:`load_checkpoint`) writes and reads checkpoints through
``torch.distributed.checkpoint`` (DCP), which reshards on load, with ``files`` (the directory,
checksums, manifest), ``collectives`` (:class:`CheckpointError` on every rank), ``keys`` (which keys
a load reads) and ``layouts`` (strided shards written and read as boxes).

The package is ``checkpoints``, not ``checkpoint``: ``hp.checkpoint`` is activation checkpointing
(recompute.py), and a subpackage ``hyper_parallel.checkpoint`` would replace that attribute once
imported. Nothing is imported here: ``import hyper_parallel`` exports the public names."""
