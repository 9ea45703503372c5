"""Autograd: activation checkpointing, saved-tensor hooks and the running graph task.

Private names: ``torch.utils.checkpoint``'s ``CheckpointFunction`` and
``_checkpoint_without_reentrant_generator`` (replaced while capturing, so a checkpointed region is
marked instead of traced as-is), and ``torch._C._autograd``'s innermost saved-tensor hooks and
current graph task (whether a backward keeps the graph, so a program must not write into its
saved tensors).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["torch_checkpoint_calls_marked", "graph_task_keeps_graph"]


@contextlib.contextmanager
def torch_checkpoint_calls_marked(mark_region):
    """While active, ``torch.utils.checkpoint.checkpoint`` (either variant, however the caller
    imported it: transformers' ``gradient_checkpointing_enable`` binds it in a partial) runs the
    checkpointed function eagerly inside ``mark_region(selective, offload)``, a context manager
    factory; ``selective`` is True when the caller passed a ``context_fn`` (torch's selective
    checkpointing), ``offload`` when the call sits inside ``torch.autograd.graph.save_on_cpu``
    (transformers' ``activation_checkpointing_enable(offload=True)``: the inputs it saves go to host).

    ``checkpoint`` looks up ``CheckpointFunction`` (reentrant) and
    ``_checkpoint_without_reentrant_generator`` (non-reentrant: a generator resumed before and after
    the function runs) in its module at every call, so those two are what is replaced. Traced
    as-is, the non-reentrant one keeps every activation (no recompute in the joint graph) and the
    reentrant one runs the function under no_grad, which breaks capture."""
    from torch.utils import checkpoint as tc

    class _Reentrant:
        @staticmethod
        def apply(function, _preserve_rng_state, *args):
            with mark_region(False, _saved_tensors_go_to_host()):
                return function(*args)

    def _non_reentrant(_function, _preserve_rng_state=True, context_fn=tc.noop_context_fn, *_rest, **_kwargs):
        with mark_region(context_fn is not tc.noop_context_fn, _saved_tensors_go_to_host()):
            yield

    saved = tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator
    tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = _Reentrant, _non_reentrant
    try:
        yield
    finally:
        tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = saved


def _saved_tensors_go_to_host() -> bool:
    """Whether the innermost saved-tensor hooks are ``save_on_cpu``'s (read while tracing too)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and "save_on_cpu" in getattr(top[0], "__qualname__", "")


def graph_task_keeps_graph() -> bool:
    """Inside a backward: whether autograd keeps the graph's saved tensors for another backward
    (``retain_graph=True``), so a backward program must not write into them."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())
