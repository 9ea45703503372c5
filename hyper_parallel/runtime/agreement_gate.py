"""The per-call agreement, waited for where the program first needs it.

Before every call the ranks exchange a digest of what they are about to run (spmd.agree), so a rank
that would run another program than its peers raises a ValueError instead of hanging in a
collective. The exchange is a MAX all-reduce of 24 bytes per rank over a gloo group, by recursive
doubling (distributed/host_reduce.py: log2(world) host message rounds), and its cost is a
synchronisation: every rank waits for the slowest to reach it (``bench/bench_agreement.py``). It
is only needed before the first collective the call issues. So a call that reuses a cached program
issues the exchange without waiting (:func:`begin`; its rounds after the first run on a thread),
and the compile driver puts an :func:`await_agreement` node right before the forward program's
first collective (:func:`insert_gate`): the exchange is in flight while the forward computes up to
there (data parallelism's whole forward, up to the loss's all-reduce). The cost model prices the
exchange and the wait at the gate (cost/simulate.py). The runtime also waits before any collective
it issues itself (the shared dropout state, random_state.py) and when the forward returns, so no
call leaves with the exchange pending. A call that compiles, or that found a problem with its
inputs, waits at once (compiling runs collectives of its own). A pipeline step likewise
(pipeline/step.py): each stage's forward program has its gate, and the executor waits before its
first transfer and before any backward program. A disagreement raises the same AgreementError on
every rank from where it is waited: on a rank that runs a cached program that is the gate, before
any collective of it.

One call at a time per process (the runtime is not re-entrant across modules mid-call: a module's
forward runs to the end before the next call begins), so the pending exchange is a module global.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from ..ir import meta
from ..ir.collectives import collective_kind

_pending: list = []  # at most one spmd.PendingAgreement


def begin(pending) -> None:
    """Hold ``pending`` (an spmd.PendingAgreement, or None) until the next :func:`await_agreement`.
    One still held from an earlier call (compiled for inspection, never run) is waited first."""
    await_agreement()
    if pending is not None:
        _pending.append(pending)


@has_side_effect
def await_agreement() -> None:
    """Wait for the pending agreement, if any: AgreementError on every rank when ranks disagree.
    A node of the forward program (kept by dead-code elimination and placed by :func:`insert_gate`),
    also called by the runtime; nothing to do once waited."""
    if _pending:
        _pending.pop().wait()


def insert_gate(gm: torch.fx.GraphModule) -> bool:
    """Put an :func:`await_agreement` call right before ``gm``'s first collective; returns whether
    there was one (without, the runtime waits when the program returns)."""
    first = next((n for n in gm.graph.nodes if collective_kind(n) is not None
                  or getattr(n.target, "namespace", None) == "_c10d_functional"), None)
    if first is None:
        return False
    with gm.graph.inserting_before(first):
        gate = gm.graph.call_function(await_agreement)
    gate.meta[meta.AGREEMENT_GATE] = True  # where the cost model's step waits for the exchange
    gm.recompile()
    return True
