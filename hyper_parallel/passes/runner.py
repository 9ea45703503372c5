"""The one pass runner: an ordered list of named steps over a graph, each timed, observed and
(unless required) disabled by name.

Two lists use it (passes/__init__.py): the *rewrites* on the captured joint graph before
propagation (required: single-device numerics depend on them, so they cannot be disabled) and the
*passes* on the lowered local joint graph (optimisations and memory features: disabling one never
changes numerics). For each step the runner records its seconds in ``ctx.timings[name]``, hands
its output to ``ctx.on_pass(name, gm)`` (the dumps), and turns a broken invariant (an
``AssertionError``) into an :class:`~hyper_parallel.errors.InternalError` naming the step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from ..errors import internal_error
from ..propagation import deferred_recompiles
from .context import PassContext

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # what disable_passes, dumps, timings and errors call it
    fn: Callable  # fn(target, ctx) -> target (a GraphModule, or a CapturedGraph for rewrites)
    required: bool = False  # cannot be disabled: numerics depend on it


def run_steps(steps: list[Step], target, ctx: PassContext, graph_of=lambda t: t):
    """Run ``steps`` in order on ``target``; ``graph_of(target)`` is the GraphModule observers see.
    The steps' ``recompile`` calls (hyper_parallel/propagation/__init__.py) take effect once, at the end."""
    with deferred_recompiles():
        for step in steps:
            if step.name in ctx.disable_passes and not step.required:
                continue
            gm = graph_of(target)
            before = len(gm.graph.nodes)
            start = time.perf_counter()
            try:
                target = step.fn(target, ctx)
            except AssertionError as exc:  # an invariant broke: name the step and the workaround
                raise internal_error(step.name, str(exc) or type(exc).__name__,
                                     pass_name=None if step.required else step.name) from exc
            ctx.timings[step.name] = ctx.timings.get(step.name, 0.0) + time.perf_counter() - start
            gm = graph_of(target)
            log.debug("[%s] %d nodes -> %d", step.name, before, len(gm.graph.nodes))
            if ctx.on_pass is not None:
                ctx.on_pass(step.name, gm)
    return target


def check_disabled(names, steps: list[Step], rewrites: list[Step]) -> None:
    """``disable_passes`` names only optional passes; a ValueError says what each bad name is."""
    optional = [s.name for s in steps if not s.required]
    required = sorted(set(names) & {s.name for s in rewrites + steps if s.required})
    if required:
        raise ValueError(
            f"disable_passes names {required}, which single-device numerics depend on (rewrites before "
            f"propagation); they cannot be disabled. The passes that can: {optional}"
        )
    unknown = sorted(set(names) - set(optional))
    if unknown:
        raise ValueError(f"disable_passes names unknown passes {unknown}; the passes are {optional}")
