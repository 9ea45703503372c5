"""Errors for broken compiler invariants.

A user error (a plan, model, input or option hyper_parallel cannot accept) is a ``ValueError`` or
``TypeError`` that names the culprit and the fix. An :class:`InternalError` is a bug in
hyper_parallel itself that some model or plan ran into: its message always says which stage (or
pass) broke, at which node, unit or parameter, the workaround when there is one (for a pass:
``parallelize(..., disable_passes=[<pass>])``; turning an optimisation pass off never changes
numerics), and to report it. It is raised explicitly, never through ``assert``, so ``python -O``
keeps the check. Every check of the compiler and how a user meets it: ``docs/internal_checks.md``.
"""

from __future__ import annotations

import torch

from .ir.graph import describe_node as _describe_node

__all__ = ["InternalError", "REPORT", "describe_node", "internal_error", "pass_workaround"]

REPORT = (
    "This is a bug in hyper_parallel, not in your model or plan: please report it with the model, "
    "plan and mesh (the dumps of parallelize(..., dump_dir=...) help)"
)


class InternalError(RuntimeError):
    """A compiler invariant broke (see the module docstring). Build it with :func:`internal_error`."""


def describe_node(node) -> str:
    """``node 'x' (op) in module 'm' at file:line`` for an fx node; other values as they print."""
    if isinstance(node, torch.fx.Node):
        return _describe_node(node)
    return str(node)


def pass_workaround(pass_name: str) -> str:
    return f"turn the pass off with parallelize(..., disable_passes=[{pass_name!r}])"


def internal_error(stage: str, problem: str, *, node=None, culprit: str | None = None,
                   workaround: str | None = None, pass_name: str | None = None) -> InternalError:
    """An :class:`InternalError` whose message reads: where (``stage``, the pass, the node or
    ``culprit``: a unit, parameter or value), what broke (``problem``), the workaround and "report
    it". ``pass_name``: the pass that broke; its workaround is turning it off."""
    where = f"pass {pass_name!r}" if pass_name and stage == pass_name else stage
    if pass_name and stage != pass_name:
        where += f" (pass {pass_name!r})"
    if node is not None:
        where += f", at {describe_node(node)}"
    if culprit:
        where += f", {culprit}"
    if workaround is None and pass_name:
        workaround = pass_workaround(pass_name)
    text = f"internal error in {where}: {problem.rstrip('.')}. "
    text += f"Workaround: {workaround}. " if workaround else "No workaround is known. "
    return InternalError(text + REPORT + ".")
