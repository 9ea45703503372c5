"""How a call gets its compiled program: one path for plain and pipelined modules.

A call of a parallel module (``runtime/module.py:entry_for``) and a step of a pipelined one
(``pipeline/step.py``) both

1. agree with every rank on what picks the program (:func:`begin_agreement`: a digest of the
   input signatures, flags, autocast state and attribute variant, plus any input problem, through
   ``distributed/spmd.agree``). A call that reuses a program waits for the exchange only right
   before its first collective (``agreement_gate.py``); a call that compiles, or that found a
   problem, waits now, since compiling or raising on one rank alone would leave the others blocked;
2. take the program for their cache key, compiling it on a miss (:func:`cached_or_compiled`): the
   attribute values the key stands for are remembered, the caller's accounting runs (recompile
   limits, the log line saying why), the compile runs, and the module attributes it read become
   guards of later calls (``attribute_guards.py``).

What differs between the two paths is only what the key holds (a pipelined step's programs are
compiled for a micro-batch) and how a compile is done; both are the caller's."""

from __future__ import annotations

from typing import Any, Callable

from ..distributed.spmd import agree
from . import agreement_gate


def begin_agreement(state, noun: str, mesh, digest: int, describe: Callable[[], str], problem: str | None,
                    *, reusing: bool) -> str:
    """Count the call on ``state`` (a ``ParallelState``) and start the ranks' agreement on
    ``digest`` over ``mesh``; returns the call's name in errors ("call 3 of LlamaForCausalLM",
    ``noun`` "call" or "step"). ``reusing``: a compiled program will run, so the exchange is waited
    for before its first collective; otherwise (and with a ``problem``) now."""
    state.calls += 1
    what = f"{noun} {state.calls} of {state.original_cls.__name__}"
    agreement_gate.begin(agree(mesh, what, digest, describe, problem, timeout=state.options.timeout,
                               wait=not reusing or problem is not None))
    return what


def cached_or_compiled(state, cache: dict, key, attribute_values, compile: Callable[[], Any],
                       before_compile: Callable[[], None] | None = None):
    """``cache[key]``, or on a miss: remember ``attribute_values`` (the attribute variant ``key``
    holds), run ``before_compile``, ``compile()``, guard later calls on the module attributes the
    compile read (the entry's ``reads``) and cache the entry."""
    entry = cache.get(key)
    if entry is not None:
        return entry
    state.attributes.remember(attribute_values)
    if before_compile is not None:
        before_compile()
    entry = compile()
    state.attributes.add(list(entry.reads))
    cache[key] = entry
    return entry
