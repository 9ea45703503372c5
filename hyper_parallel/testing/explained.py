"""``explain`` of a pipelined plan, keeping what the report leaves out (the compiled module, the
replayed schedule's events): what tests compare with the executor."""

from __future__ import annotations

from unittest import mock


def explain_pipelined_kept(**kwargs) -> tuple[dict, dict]:
    """``tools.explain.explain(**kwargs)``'s report, and the whole result of its
    ``explain_pipelined`` call (``pmodel``, ``cost`` with the replay's ``events``, ...)."""
    from ..tools import explain_pipeline
    from ..tools.explain import explain

    kept: dict = {}
    real = explain_pipeline.explain_pipelined

    def keep(*args, **kw):
        kept.update(real(*args, **kw))
        return kept

    with mock.patch.object(explain_pipeline, "explain_pipelined", keep):
        return explain(**kwargs), kept
