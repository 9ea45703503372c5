"""Plan resolution of ``context_parallel`` entries: the sequence axis and the attention modules.

Reads ``ParallelPlan.context_parallel`` (glob -> :class:`~hyper_parallel.cp.style.ContextParallel`),
the model's modules and the mesh's axis names and sizes. Returns one :class:`ContextPlan` (or None
without entries), which ``ResolvedPlan.sequence_axes`` and the default input layout read (inputs of
two or more dims ``Shard(1)`` over the axis). Raises ``ValueError`` / ``TypeError`` naming the
entry and module for: entries that disagree, an axis the mesh does not have, and (all-to-all mode)
heads the axis does not divide. A sequence the ring's load balancing cannot cut in ``2·cp`` chunks
is refused at the first call (``cp/load_balance.py``), where its length is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .style import ContextParallel


@dataclass(frozen=True)
class ContextPlan:
    axis: str
    degree: int
    mode: str  # "ring" | "all_to_all"
    load_balance: bool  # ring mode: the sequence in 2·cp chunks, rank r holding r and 2·cp−1−r
    asynchronous: bool  # ring mode: each K/V transfer overlaps the current block (ring_overlap pass)
    modules: tuple[str, ...]  # attention module FQNs the entries matched
    source: str  # the first entry, for messages

    @property
    def balanced(self) -> bool:
        """Whether sequence-sharded values inside the program are in the load-balanced order."""
        return self.mode == "ring" and self.load_balance and self.degree > 1


def _heads(module: nn.Module) -> dict[str, int]:
    """The attention heads a module declares (ours, HF's and torch's attribute names). Key/value
    heads are checked where they reach attention (cp/attention.py): models that repeat them to
    the query heads first (grouped-query attention in eager form) need no more than the heads."""
    config = getattr(module, "config", None)
    names = ("num_heads", "num_attention_heads", "n_heads")
    for owner in (module, config):
        value = next((getattr(owner, n) for n in names if isinstance(getattr(owner, n, None), int)), None)
        if value is not None:
            return {"heads": value}
    return {}


def resolve_context_parallel(
    entries: Mapping[str, ContextParallel], matched, modules: Mapping[str, nn.Module],
    axis_names: tuple[str, ...], mesh_shape: tuple[int, ...],
) -> ContextPlan | None:
    """``matched(where, glob)`` gives the module FQNs a glob names (raising when none)."""
    if not entries:
        return None
    first_glob, first = next(iter(entries.items()))
    source = f"context_parallel[{first_glob!r}]"
    fqns: list[str] = []
    for glob, style in entries.items():
        where = f"context_parallel[{glob!r}]"
        if style != first or type(style) is not type(first):
            raise ValueError(
                f"{where} ({style!r}) differs from {source} ({first!r}): one model shards its sequence "
                "one way; give every entry the same style"
            )
        if style.axis not in axis_names:
            raise ValueError(
                f"{where}: the sequence is sharded over mesh axis {style.axis!r}, which the mesh does "
                f"not have (axes {list(axis_names)}); add it (e.g. hp.ParallelDims(cp=2)) or name "
                "another with ContextParallel(axis=...)"
            )
        fqns.extend(f for f in matched("context_parallel", glob) if f not in fqns)
    degree = mesh_shape[axis_names.index(first.axis)]
    for fqn in fqns if first.mode == "all_to_all" else ():
        for label, count in _heads(modules[fqn]).items():
            if count % degree:
                raise ValueError(
                    f"{source}: module {fqn!r} has {count} {label}, which {first.axis}={degree} does "
                    "not divide; all-to-all context parallelism gives each rank heads / cp of them: "
                    f"use a cp degree that divides {count}"
                )
    return ContextPlan(first.axis, degree, first.mode, first.load_balance, first.asynchronous, tuple(fqns), source)
