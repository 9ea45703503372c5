"""Keep every collective's input referenced until the collective is waited for.

A compiled program issues a functional collective (``_c10d_functional.all_gather_into_tensor`` and
the others) and waits for it later (``wait_tensor``); in between, the program's generated code would
drop its last reference to the collective's *input* right after the issue (FX frees each value after
its last use). The memory does not go then: the backend holds the tensor until the collective
completes (gloo's work object keeps it, NCCL's caching allocator records it on the communication
stream). So the graph's liveness, which the memory estimator reads, said an in-flight input was
free when it was not; with prefetch and reductions in flight that is a whole unit's bf16 shard copy
or packed gradient per collective in flight.

After the passes, every collective whose wait is in the same program gets a
:func:`release_after_wait` node right after its wait that reads the collective's tensor inputs: the
generated code then drops them after the wait, on the main thread, and the graph says what really
happens. It changes no value and no collective.

This is *not* the fix for the rare native crashes (heap corruption, SIGSEGV/SIGABRT) seen with
several gloo collectives in flight: it was once believed to be, but
``bench/stress_gloo_prefetch.py`` crashed with these releases as without them (1 of 10 runs and 1
of 19). The trigger is two collectives of one gloo group executing at once
(passes/serialize_collectives.py, which handles it).
"""

from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional


@torch.fx.node.has_side_effect  # no result: fx's dead-code elimination must keep it
def release_after_wait(*inputs) -> None:
    """Placed right after a collective's wait, reading the collective's inputs: their last use, so the
    program drops them here rather than while the backend still holds them (module docstring)."""
    return None


def _is_issue(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"
            and node.target is not c10d.wait_tensor.default)


def hold_collective_inputs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Insert a :func:`release_after_wait` after each wait of a collective issued in ``gm`` (in place;
    idempotent). Collectives waited in another program (none today) are left as they are."""
    if hold_in_graph(gm.graph):
        gm.recompile()
    return gm


def hold_in_graph(graph: torch.fx.Graph) -> bool:
    """:func:`hold_collective_inputs` on a graph not yet in a GraphModule (partition builds the
    module after, which generates its code once); whether it changed anything."""
    changed = False
    for node in list(graph.nodes):
        if not _is_issue(node):
            continue
        inputs = node.all_input_nodes
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        if not inputs or not waits:
            continue
        wait = waits[0]
        if wait.next.op == "call_function" and wait.next.target is release_after_wait:
            continue  # already held
        with graph.inserting_after(wait):
            release = graph.call_function(release_after_wait, tuple(inputs))
        release.meta["val"] = None
        changed = True
    if changed:
        graph.lint()
    return changed
