"""Plan resolution of ``context_parallel`` entries: the sequence axis and the attention modules.

Reads ``ParallelPlan.context_parallel`` (glob -> :class:`~hyper_parallel.cp.style.ContextParallel`),
the model's modules and the mesh's axis names and sizes. Returns one :class:`ContextPlan` (or None
without entries), which ``ResolvedPlan.sequence_axes`` and the default input layout read (inputs of
two or more dims ``Shard(1)`` over the axis). Raises ``ValueError`` / ``TypeError`` naming the
entry and module for: entries that disagree, an axis the mesh does not have, a ``ulysses_degree``
that does not divide it, and heads the Ulysses degree does not divide.
:func:`attach_context_groups` creates the two sub-groups of the ring × all-to-all hybrid (every
rank calls it). A sequence the ring's load balancing cannot cut in ``2·cp`` chunks is refused at
the first call (``cp/load_balance.py``), where its length is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .. import compat
from .style import ContextParallel


@dataclass(frozen=True)
class ContextPlan:
    axis: str
    degree: int
    mode: str  # "ring" | "all_gather" | "all_to_all" | "hybrid" (ring attention over groups of Ulysses ranks)
    load_balance: bool  # ring part: the sequence in 2·ring chunks, ring rank i holding i and 2·ring−1−i
    asynchronous: bool  # ring part: each K/V transfer overlaps the current block (ring_overlap pass)
    modules: tuple[str, ...]  # attention module FQNs the entries matched
    source: str  # the first entry, for messages
    ulysses: int = 1  # cp ranks that swap heads and sequence (degree: all-to-all; 1: ring)
    # The hybrid's process groups (attach_context_groups): consecutive cp ranks swap heads,
    # ranks ``ulysses`` apart form the ring.
    ulysses_group: str | None = None
    ring_group: str | None = None
    # How the ring part's K/V blocks reach every rank: "ring" (passed on, cp − 1 transfers) or
    # "all_gather" (one gather; dK/dV home in one reduce-scatter).
    kv_exchange: str = "ring"

    @property
    def gathers(self) -> bool:
        """Whether the ring part all-gathers K/V instead of passing blocks around."""
        return self.kv_exchange == "all_gather"

    @property
    def ring(self) -> int:
        """Ranks on each K/V ring: ``degree // ulysses``."""
        return self.degree // self.ulysses

    @property
    def balanced(self) -> bool:
        """Whether sequence-sharded values inside the program are in the load-balanced order."""
        return self.load_balance and self.ring > 1


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
    ulysses = _ulysses_degree(first, degree, source)
    for fqn in fqns if ulysses > 1 else ():
        for label, count in _heads(modules[fqn]).items():
            if count % ulysses:
                raise ValueError(
                    f"{source}: module {fqn!r} has {count} {label}, which "
                    + (f"{first.axis}={degree}" if ulysses == degree else f"ulysses_degree={ulysses}")
                    + " does not divide; all-to-all context parallelism gives each rank heads / "
                    f"{'cp' if ulysses == degree else 'ulysses_degree'} of them: use a degree that divides "
                    f"{count}, or ring attention (mode='ring' or 'all_gather', or a smaller ulysses_degree)"
                )
    kv_exchange = "all_gather" if first.mode == "all_gather" else "ring"
    mode = "all_to_all" if ulysses == degree else kv_exchange if ulysses == 1 else "hybrid"
    if degree == 1:
        mode = first.mode
    return ContextPlan(first.axis, degree, mode, first.load_balance, first.asynchronous, tuple(fqns), source,
                       ulysses=ulysses, kv_exchange=kv_exchange)


def _ulysses_degree(style: ContextParallel, degree: int, source: str) -> int:
    """The ranks of the cp axis that swap heads and sequence: the style's ``ulysses_degree``, else
    all of them (all-to-all mode) or none (ring and all-gather modes)."""
    if style.ulysses_degree is None:
        return degree if style.mode == "all_to_all" else 1
    if degree % style.ulysses_degree:
        divisors = [d for d in range(1, degree + 1) if degree % d == 0]
        raise ValueError(
            f"{source}: ulysses_degree={style.ulysses_degree} does not divide {style.axis}={degree}; "
            f"the ring part of context parallelism is cp / ulysses_degree: pick one of {divisors}"
        )
    return style.ulysses_degree


def attach_context_groups(context: ContextPlan | None, mesh) -> ContextPlan | None:
    """``context`` with the hybrid's two process groups: the cp axis split row-major into
    ``(ring, ulysses)``, so each Ulysses group is ``ulysses`` consecutive cp ranks (the fast
    links of one node, where the all-to-alls are) and each ring the ranks ``ulysses`` apart.
    Creates process groups, so every rank calls it; pure modes need none."""
    if context is None or context.mode != "hybrid":
        return context
    names = (f"{context.axis}_ring", f"{context.axis}_ulysses")
    split = compat.unflatten_mesh_axis(mesh, context.axis, (context.ring, context.ulysses), names)
    return dataclasses.replace(context, ring_group=split.get_group(names[0]).group_name,
                               ulysses_group=split.get_group(names[1]).group_name)
