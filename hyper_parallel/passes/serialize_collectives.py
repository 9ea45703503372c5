"""serialize_collectives: on gloo, one collective in flight per process group.

Prefetch and overlap_reductions leave several collectives of one process group in flight (an
all-gather issued ahead while a reduce-scatter still runs, two units' gathers at depth 2).
ProcessGroupGloo runs its queued works on two worker threads, so two of them then execute at once
on the same gloo context while the main thread computes. With torch 2.13 on CPU that corrupts the
heap now and then: SIGSEGV, or glibc's "malloc(): unaligned tcache chunk" on the main thread inside
the issue of a later collective. Measured with ``bench/stress_gloo_prefetch.py`` on the 2-core
machine, 3 runs at once (2026-11-25):

* 8 layers, hidden 64, prefetch depth 4, 4 reductions in flight, 1000 steps: without this pass 2
  of 3 runs crashed within two minutes; with the process groups built with *one* worker thread
  (``--gloo-threads 1``: works still asynchronous to compute, executed one after another) 0 of 3,
  and with this pass 0 of 3 (every run to its end, about 8 minutes each);
* the default stress (4 layers, depth 2, 400 steps) without this pass: 2 crashes in 29 runs; PyTorch
  FSDP2 eager on the same model, units and policy (at most one all-gather and one reduce-scatter
  outstanding, rarely executing together): 0 in 21.

So the trigger is two collectives of one gloo group executing concurrently; where exactly gloo or
torch then writes freed memory we have not pinned down. With this pass, once since (a fresh-clone CI
run, 2026-11-29): a 2-rank test worker, alive through hundreds of tests, aborted on glibc's
"malloc_consolidate(): unaligned fastbin chunk detected" in the test's own DTensor all-gather, so
the heap had been corrupted earlier in that process. Not reproduced: 21 of 21 runs of the stress
below (depth 2, 3 at once), 1,800 FSDP steps of the failing test's model in the pool, raw gloo
patterns (two collectives of one group in flight, bf16, send/recv beside a collective: 24,000 pairs)
and all of the pool tests under glibc's malloc checks (``glibc.malloc.check=3``) found nothing.
Pool and stress workers now print every thread's C++ stack on a fatal signal
(``compat.print_native_stacks_on_fatal_signal``), so the next one shows what every thread was
doing (gloo's included) when glibc noticed.

This pass keeps each collective overlapping the compute around it, but waits for the previous
collective of the same gloo process group before the next one is issued. Gradient reductions run
on a second group of their axis (the reduction lane, passes/reduction_lanes.py, the pass before),
so a gather and a reduction are still in flight together. NCCL/HCCL (ordered on one stream per
group) and the fake backend (simulations: explain, the pass tests) are left alone.

Reads: the group name of each ``_c10d_functional`` collective and that process group's backend
(every group a program uses, not only the mesh axes'). Writes: node order only (a wait moves
earlier, right before the next issue on its group), so numerics are unchanged. Idempotent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from .. import compat
from ..propagation import recompile

c10d = torch.ops._c10d_functional

_SERIALIZED_BACKENDS = ("gloo",)


def _group_name(node: torch.fx.Node) -> str | None:
    """The process group a functional collective runs on (its ``group_name``: the last string
    argument of every ``_c10d_functional`` collective)."""
    if "group_name" in node.kwargs:
        return node.kwargs["group_name"]
    names = [a for a in node.args if isinstance(a, str)]
    return names[-1] if names else None


def serialized_groups(gm: torch.fx.GraphModule) -> frozenset[str]:
    """Names of the process groups ``gm``'s collectives run on whose backend runs concurrent
    collectives unsafely: every group the program uses, the mesh axes' and the others (a mesh
    flattened over several axes, the groups of ``reshard_after_forward=<k>``, a hybrid context
    parallelism's sub-groups)."""
    if not dist.is_initialized():
        return frozenset()
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            name = _group_name(node)
            group = compat.resolve_process_group(name) if name is not None else None
            if group is not None and dist.get_backend(group) in _SERIALIZED_BACKENDS:
                names.add(name)
    return frozenset(names)


def serialize_collectives(gm: torch.fx.GraphModule, groups: frozenset[str]) -> torch.fx.GraphModule:
    """Move the wait of each collective on one of ``groups`` before the next collective issued on
    the same group, when that comes first (in place)."""
    if not groups:
        return gm
    outstanding: dict[str, torch.fx.Node] = {}  # group name -> wait of its collective in flight
    moved = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is c10d.wait_tensor.default:
            for name, wait in list(outstanding.items()):
                if wait is node:
                    del outstanding[name]
            continue
        if getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        name = _group_name(node)
        if name not in groups:
            continue
        previous = outstanding.pop(name, None)
        if previous is not None:
            node.prepend(previous)  # a wait reads only its collective, issued earlier: always valid
            moved = True
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        if waits:
            outstanding[name] = waits[0]
    if moved:
        gm.graph.lint()
        recompile(gm)
    return gm


def serialize_collectives_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    return serialize_collectives(gm, serialized_groups(gm))
