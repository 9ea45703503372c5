"""Errors raised inside a compiled program, reworded to say where the program was.

When a peer is stuck or gone, a collective's wait fails after the process group's timeout with a
backend message ("Timed out waiting 5000ms for recv operation", "Connection closed by peer") that
names no program, collective or step. The generated code of every program is a GraphModule; the
traceback's frame in that code gives its line, the line gives the node, and the node's meta says
which collective it waits for, on which mesh axis, for which joint-graph node and source line.
"""

from __future__ import annotations

import re
import types

import torch

from ..ir.graph import source_line
from ..ir import meta

_c10d = torch.ops._c10d_functional
_ASSIGNED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s*:\s*[^=]+)?\s*=")


def failing_node(exc: BaseException, gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The node of ``gm`` whose generated line raised ``exc`` (the innermost frame in its code)."""
    code = getattr(type(gm).forward, "__code__", None)
    filename = code.co_filename if code is not None else None
    line = None
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    lines = gm.code.splitlines()
    if not 0 < line <= len(lines):
        return None
    match = _ASSIGNED.match(lines[line - 1])
    if match is None:
        return None
    return next((n for n in gm.graph.nodes if n.name == match.group(1)), None)


def describe_collective(node: torch.fx.Node, axis_of_group: dict[str, str]) -> str:
    """"the all_reduce over 'dp' of node 'nll_loss_forward' (llama.py:402: ...)" for a collective or
    its wait."""
    collective = node.args[0] if node.target is _c10d.wait_tensor.default else node
    if not isinstance(collective, torch.fx.Node):
        return f"node '{node.name}'"
    # "all_reduce_.default" (in place, the bucketing pass's gradient buckets) reads as all_reduce.
    kind = getattr(collective.target, "__name__", str(collective.target)).split(".")[0].rstrip("_")
    group = collective.args[-1] if collective.args else None
    axis = axis_of_group.get(group, group)
    text = f"the {kind} over mesh axis '{axis}' (node '{collective.name}'"
    source = collective.meta.get(meta.SOURCE)
    if source:
        text += f", for joint-graph node '{source}'"
    where = source_line(collective)
    return text + (f", {where})" if where else ")")


def reworded(exc: Exception, gm: torch.fx.GraphModule, program: str, call: str,
             axis_of_group: dict[str, str]) -> Exception | None:
    """A RuntimeError saying which program, node and call failed, wrapping ``exc``; None when
    ``exc`` did not come from a collective of ``gm`` (then it is re-raised as it is)."""
    node = failing_node(exc, gm)
    if node is None or not str(node.target).startswith("_c10d_functional."):
        return None
    return RuntimeError(
        f"{call}, {program} program: waiting for {describe_collective(node, axis_of_group)} failed: "
        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}. A peer rank did "
        "not join this collective in time: it raised an error, exited or is stuck (see its output); "
        "parallelize(..., timeout=seconds) sets how long to wait."
    )
