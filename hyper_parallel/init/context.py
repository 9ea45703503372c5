"""Where a model is built and from which seed: the device context managers and :func:`manual_seed`.

Building under :func:`init_empty_weights` puts every parameter and buffer on the meta device (no
memory, no random numbers drawn); :func:`~hyper_parallel.init.distribute_parameters` later
materialises only each rank's shards from the generator state :func:`manual_seed` set.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def init_on_device(device: Any) -> Iterator[torch.device]:
    """Create tensors (module parameters and buffers included) on ``device`` inside the block.

    ``device`` is anything ``torch.device`` accepts (``"cpu"``, ``"cuda:0"``, ``"meta"``,
    ``torch.device(...)``). Uses torch's own device context manager, so every factory call in a
    constructor (``torch.empty``, ``torch.arange`` ...) lands on ``device``; an explicit ``device=``
    argument still wins. Yields the ``torch.device``.
    """
    dev = torch.device(device)
    with dev:
        yield dev


@contextlib.contextmanager
def init_empty_weights() -> Iterator[torch.device]:
    """Build modules with every parameter and buffer on the meta device: no memory, no RNG draws.

    ``parallelize`` (through :func:`distribute_parameters`) then materialises only each rank's
    shards, with the values the same constructor would have produced on CPU from the generator
    state at that point. Seed with :func:`manual_seed` (same seed on every rank) first.
    """
    with init_on_device("meta") as dev:
        yield dev


def manual_seed(seed: int) -> None:
    """Seed torch's CPU generator and every accelerator's (CUDA, XPU, MPS, NPU) with ``seed``.

    Call it on every rank with the same seed (SPMD), as :func:`distribute_parameters` replays the
    model's initialisation from this state on each rank and checks that the states agree.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
    # torch.manual_seed covers CPU, CUDA (all devices), MPS, XPU and the privateuse1 backend,
    # which is where torch_npu registers NPU.
    torch.manual_seed(seed)
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "manual_seed_all"):
        npu.manual_seed_all(seed)
