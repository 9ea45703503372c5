"""Collectives a plan adds beyond its own boundaries, found in the compiled programs and warned about.

A tensor-parallel plan says where values change layout: at its entries' module boundaries. When
it shards a dim the model later splits in a way the shard does not fit (one key/value head over
``tp=2``, heads not divisible by the degree), propagation still finds an exact program, but one
that gathers and re-shards inside the module: the step grows from 12 to 22 collectives with no
error. This reads every collective of the forward and backward programs with its reason (analysis/why.py)
and its mesh axes, keeps those an op's sharding rule added on the model-parallel axes (not the
data-parallel, context or expert axes, where the loss, label shifts and routing statistics are
reduced by design; not the vocab-parallel cross-entropy's own reductions), and groups them by the
module they sit in, naming the plan entries that shard that module. Only gathers and all-to-alls
count (``MOVES_SHARDS``).

Read by ``compile/driver.py``: the findings go into the compile summary (``unplanned_collectives``)
and one warning on rank 0.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import torch

from ..ir.collectives import collective_kind
from ..analysis.why import reason
from ..ir.graph import module_fqn_of, source_line

ADDED_BY_RULES = ("op rule:", "no rule:")
# Kinds that move sharded data. A reduction (all-reduce, reduce-scatter) of a Partial value happens
# once wherever it sits: an op rule that reduces inside a module (Gemma's scaled embedding) takes
# the place of the boundary's reduction rather than adding one.
MOVES_SHARDS = ("all_gather", "all_to_all")


def _axes(label: str) -> set[str]:
    """Mesh axis names in a collective's group label ("tp", "dp_shard+cp", "dp/k2", "cp/ring")."""
    return set(re.split(r"[^\w]+", label)) - {""}


def _entries_under(module: str, resolved) -> list[str]:
    """The plan entries (their text, without the input/output index) that shard ``module`` or a
    module or parameter inside it."""
    inside = lambda fqn: not module or fqn == module or fqn.startswith(module + ".")  # noqa: E731
    found = []
    for fqn, constraints in resolved.modules.items():
        if inside(fqn):
            for c in (*constraints.inputs, *constraints.kwarg_inputs.values(), *constraints.outputs):
                if c is not None and c.source:
                    found.append(re.sub(r" (input|output) \w+$", "", c.source))
    found += [source for fqn, source in resolved.param_sources.items() if inside(fqn) and source]
    return sorted(set(found))


def find_unplanned(programs, axis_of_group: dict[str, str], resolved) -> list[dict]:
    """Per module, the collectives per step that op rules added on model-parallel axes:
    ``{"module", "count", "kinds", "axes", "example", "entries"}``, largest count first."""
    quiet = set(resolved.data_parallel_axes) | set(resolved.sequence_axes)
    found: dict[str, list[torch.fx.Node]] = defaultdict(list)
    labels: dict[torch.fx.Node, str] = {}
    for gm in programs:
        for node in gm.graph.nodes:
            if collective_kind(node) not in MOVES_SHARDS:
                continue
            why = reason(node)
            if not why.startswith(ADDED_BY_RULES) or "vocab-parallel" in why:
                continue
            label = axis_of_group.get(node.args[-1], str(node.args[-1]))
            if not _axes(label) - quiet:
                continue
            labels[node] = label
            found[module_fqn_of(node)].append(node)
    out = []
    for module, nodes in found.items():
        first = nodes[0]
        out.append({
            "module": module or "<root>",
            "count": len(nodes),
            "kinds": sorted({collective_kind(n) for n in nodes}),
            "axes": sorted({labels[n] for n in nodes}),
            "example": f"{first.name}: {reason(first)}; {source_line(first) or 'no source line'}",
            "entries": _entries_under(module, resolved),
        })
    return sorted(out, key=lambda f: (-f["count"], f["module"]))


def warn_unplanned(findings: list[dict]) -> None:
    """One warning naming each module, its plan entries and an example node."""
    if not findings:
        return
    total = sum(f["count"] for f in findings)
    lines = [f"the plan adds {total} collective(s) per step beyond its own boundaries (the program is "
             "still exact, but each costs communication):"]
    for f in findings:
        entries = ", ".join(f["entries"]) or "no entry inside it"
        lines.append(f"  {f['count']} x {'/'.join(f['kinds'])} on {'/'.join(f['axes'])} in module {f['module']!r} "
                     f"(plan entries: {entries}); e.g. {f['example']}")
    lines.append("Usually a sharded dim the model then splits in another way: attention or key/value heads "
                 "not divisible by the tensor-parallel degree (leave k_proj/v_proj replicated, or change the "
                 "degree), a fused projection (q, k, v in one weight) split by contiguous columns, or an op "
                 "with no sharding rule running replicated (give it one: hp.register_sharding). Every "
                 "collective's reason is in layouts.tsv's 'why' column and `hyper-parallel report` "
                 "(parallelize(dump_dir=...)).")
    warnings.warn("\n".join(lines), UserWarning, stacklevel=2)
