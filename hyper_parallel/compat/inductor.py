"""Inductor: kernels for the compute regions of a per-rank program (codegen/inductor.py).

Private names: ``torch._inductor``'s ``compile_fx_inner`` (compiles a graph already past
autograd, without torch.compile's second trace), its decomposition table and config, its on-disk
cache directory, and ``torch._guards``' tracing context (what Inductor's graph cache needs to
serve later processes).
"""

from __future__ import annotations

import torch

from .fake_tensor import FakeTensorMode, ShapeEnv, make_fx

__all__ = ["inductor_compile", "inductor_source", "inductor_cache_dir"]


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list):
    """Inductor's compiled form of ``gm``, an aten graph of functional ops already past autograd
    (no second trace, no decomposition of what our capture kept): a callable taking its inputs as
    one list. Random ops fall back to eager kernels (the same draws as eager).

    Inductor lowers only the op forms its decomposition table leaves (``arange.start_step``, not
    ``arange``): the graph is first re-traced through that table on fake copies of the inputs, as
    torch.compile's own autograd step would have done. The tracing context with a shape
    environment is what Inductor's on-disk graph cache needs to serve later processes."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
             for x in example_inputs]
    with fake_mode:
        decomposed = make_fx(gm, decomposition_table=select_decomp_table())(*fakes)
    with config.patch(fallback_random=True), tracing(TracingContext(fake_mode)):
        return compile_fx_inner(decomposed, fakes)


def inductor_source(compiled) -> str | None:
    """The Python module Inductor generated for a compiled graph (kernels and wrapper), if kept."""
    return getattr(compiled, "source_code", None)


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
