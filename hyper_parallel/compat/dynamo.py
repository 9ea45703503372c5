"""torch.compile's Dynamo: what it knows while it calls a backend (backend.py).

Private names: ``torch._dynamo``'s instruction translator of the frame being compiled (its
compile reason, value stack and variable trackers: which tensors the frame returns), guard
installation (``GuardBuilder.ID_MATCH`` on a local), ``ShortenTraceback``, the ``eval_frame``
wrapper through which compiled code is entered, and ``torch._C._dynamo``'s count of compiled
frames that ``fullgraph=True`` checks (the parallel module's program runs outside Dynamo).
"""

from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback  # noqa: F401

__all__ = [
    "ShortenTraceback",
    "dynamo_translator",
    "dynamo_compile_reason",
    "dynamo_return_tensors",
    "dynamo_guard_identity",
    "is_dynamo_entry_frame",
    "count_as_compiled_frame",
]


def dynamo_translator():
    """The Dynamo instruction translator of the frame being compiled (None outside a backend call):
    its ``f_code``, ``f_locals``, value stack and output graph."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # thread-local not set: no frame is being compiled
        return None


def dynamo_compile_reason(tx) -> tuple[str, bool, list]:
    """Why Dynamo compiles the current graph: (reason text, whether it is a graph break, the user
    frames (``traceback.FrameSummary``) where it happened)."""
    reason = tx.output.compile_subgraph_reason
    return str(reason.reason), bool(reason.graph_break), list(reason.user_stack or ())


def dynamo_return_tensors(tx) -> list[tuple[tuple, str]]:
    """The tensors of the value the frame returns (the top of the translator's stack while Dynamo
    compiles at ``return``): one (path, graph node name) per tensor, where a path is the keys and
    indices that reach it (``("loss",)``, ``(0, 1)``, ``()`` for a bare tensor). Tuples, lists,
    dicts and dict subclasses (HF ``ModelOutput``) are walked; constants are skipped (Dynamo
    rebuilds them itself). Raises ``TypeError`` naming any other kind of value."""
    from torch._dynamo.variables import (
        BaseListVariable, ConstDictVariable, TensorVariable, UserDefinedDictVariable,
    )

    out: list[tuple[tuple, str]] = []

    def walk(vt, path):
        if isinstance(vt, TensorVariable):
            out.append((path, vt.as_proxy().node.name))
        elif isinstance(vt, UserDefinedDictVariable):
            walk(vt._base_vt, path)
        elif isinstance(vt, ConstDictVariable):
            for key, value in vt.items.items():
                walk(value, path + (key.vt.as_python_constant(),))
        elif isinstance(vt, BaseListVariable):
            for i, value in enumerate(vt.items):
                walk(value, path + (i,))
        elif not vt.is_python_constant():
            where = "".join(f"[{k!r}]" for k in path) or "the return value"
            raise TypeError(f"{where} is a {vt.python_type().__name__}")

    walk(tx.stack[-1], ())
    return out


def dynamo_guard_identity(local_name: str, index: int | None = None) -> None:
    """Make the graph being compiled valid only for the very object now bound to the frame's local
    ``local_name`` (item ``index`` of it when given: a wrapper's ``args``), an ``ID_MATCH`` guard;
    Dynamo also counts recompilations per such object."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import GetItemSource, LocalSource

    source = LocalSource(local_name)
    if index is not None:
        source = GetItemSource(source, index)
    install_guard(source.make_guard(GuardBuilder.ID_MATCH))


def is_dynamo_entry_frame(frame) -> bool:
    """Whether a Python frame is the wrapper through which ``torch.compile``'d code is entered."""
    code = frame.f_code
    return code.co_name == "compile_wrapper" and code.co_filename.endswith(
        ("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")
    )


def count_as_compiled_frame() -> None:
    """Tell ``torch.compile(fullgraph=True)`` that this call ran compiled code: it raises when a call
    ran no compiled frame, and the parallel module's program runs outside Dynamo (backend.py)."""
    try:
        from torch._C._dynamo.eval_frame import set_fullgraph_compiled_frame_count
    except ImportError:  # torch < 2.13 (the GPU machines' 2.11) keeps no such count: nothing to tell
        return
    count = set_fullgraph_compiled_frame_count(-1)  # -1: not counting (no fullgraph call active)
    set_fullgraph_compiled_frame_count(count + 1 if count >= 0 else count)
