"""A MAX all-reduce of a few int64 over a host process group in O(log n) message rounds: what the
per-call agreement exchanges (``spmd.agree``).

Reads each rank's values and the group's ranks; writes only the reduced copy it returns. Runs on
the group's point-to-point send and receive (c10d ``isend`` / ``irecv``), nothing else.

Why not the backend's all-reduce: gloo's all-reduce is a ring however small the tensor (a
reduce-scatter then an all-gather, 2(n-1) message steps one after another), and its all-gather
too (n-1 steps), so at 1,024 ranks a 24-byte agreement waits through 2,046 or 1,023 hops. Here
every rank exchanges with the rank 1, 2, 4, ... away (recursive doubling) and holds the maximum
after log2(n) exchanges. When n is not a power of two, the ranks from the largest power of two m
up first hand their values to the rank m below them and get the result back at the end: 2 more
steps for everyone (:func:`schedule`). The cost model prices the same count
(``cost.comm.agreement_time``).

The steps depend on each other (a rank sends what it has combined so far), so the exchange is
driven from the host: :class:`MaxAllReduce` posts the first step when created and, with
``background=True``, runs the rest on the process's agreement thread, so the caller computes meanwhile (the
agreement is in flight while a cached program's forward runs, ``runtime/agreement_gate.py``);
``wait()`` joins it. No other collective may be issued on the group before ``wait()`` returns
(the runtime waits before its first), so the thread never races the caller for the group.

A group of at most 4 ranks takes the backend's all-gather instead (n - 1 rounds, at most one more
than doubling's), issued asynchronously: gloo runs a collective on its own C++ worker thread, so it
overlaps the caller's compute with no Python thread woken, and skips send/recv's rendezvous
between a pair (a receiver not yet waiting must announce itself first). On this 2-core machine,
each rank computing before the exchange (``bench/bench_agreement.py``, 2026-12-03): 2 ranks took
0.46 ms by all-gather and 2.0 ms by a send/recv pair; 4 ranks (two per core) 5.4 ms issued and
waited at the gate by all-gather, 7.7 ms by doubling on the thread (woken on a full core); 8 ranks
19.2 ms by all-gather, 13.1 ms by doubling.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.distributed as dist

__all__ = ["MaxAllReduce", "schedule", "rounds", "doubling_rounds"]

GATHER_UP_TO = 4  # groups of at most this many ranks all-gather (module docstring)

# The tag of every message of the exchange: p2p messages match by (source, tag), so one the
# pipeline executor sends on the same group can never be taken for one of these.
TAG = 0x4850  # "HP"


def schedule(n: int, index: int) -> list[tuple[int, bool, str | None]]:
    """The steps of group member ``index`` of ``n``: ``(partner index, sends, receives)`` with
    ``receives`` "combine" (take the maximum with what it has), "replace" (take the result) or None.
    Every member's list has :func:`doubling_rounds` steps at most, and the members' steps pair up."""
    if not 0 <= index < n:
        raise ValueError(f"host_reduce.schedule: member {index} is not in a group of {n}")
    if n <= 1:
        return []
    m = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    if index >= m:  # hands its values down, gets the result back
        return [(index - m, True, None), (index - m, False, "replace")]
    extra = index + m < n
    steps = [(index + m, False, "combine")] if extra else []
    steps += [(index ^ (1 << k), True, "combine") for k in range(m.bit_length() - 1)]
    if extra:
        steps.append((index + m, True, None))
    return steps


def doubling_rounds(n: int) -> int:
    """Message rounds (one latency each) recursive doubling takes over ``n`` ranks: log2(n) for a
    power of two, else floor(log2(n)) + 2."""
    if n <= 1:
        return 0
    m = 1 << (n.bit_length() - 1)
    return m.bit_length() - 1 + (2 if n > m else 0)


def rounds(n: int) -> int:
    """Message rounds the exchange takes over ``n`` ranks: the all-gather's n - 1 up to
    ``GATHER_UP_TO`` ranks, then :func:`doubling_rounds`."""
    return max(0, n - 1) if n <= GATHER_UP_TO else doubling_rounds(n)


class MaxAllReduce:
    """The element-wise maximum over ``group`` (None: the default group) of every member's
    ``values`` (a small CPU int64 tensor, the same shape on all), in flight. ``wait()`` returns it
    (the same tensor on every member) or raises what the transport raised (a RuntimeError: a peer
    timed out or is gone). ``background``: run the steps after the first on the agreement thread
    (see the module docstring); otherwise ``wait()`` runs them."""

    def __init__(self, values: torch.Tensor, group=None, *, background: bool = False):
        self.group = group
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.ranks = ranks  # global ranks, in group order: isend/irecv address global ranks
        self.result = values.clone()
        self.sent = 0  # messages sent (tests count them)
        self._error: BaseException | None = None
        self._next = 0
        self._done = None
        self._gathered = None
        if 1 < len(ranks) <= GATHER_UP_TO:
            self.steps = []
            self._gathered = [torch.empty_like(self.result) for _ in ranks]
            self._posted = None
            self._gather = dist.all_gather(self._gathered, self.result, group=group, async_op=True)
            self.sent = len(ranks) - 1
            return
        self.steps = schedule(len(ranks), ranks.index(dist.get_rank()))
        self._posted = self._post(0) if self.steps else None
        if background and len(self.steps) > 1:
            self._done = threading.Event()  # set by the worker once the steps are done
            _worker().put(self)

    def wait(self) -> torch.Tensor:
        if self._gathered is not None:
            self._gather.wait()
            self.result = torch.stack(self._gathered).amax(dim=0)
            self._gathered = None
            return self.result
        if self._done is not None:
            self._done.wait()
            self._done = None
        else:
            self._finish()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.result

    def _post(self, i: int):
        partner, sends, receives = self.steps[i]
        dst = self.ranks[partner]
        incoming = torch.empty_like(self.result) if receives else None
        # The receive first, so a partner's message never waits for this rank to be ready for it.
        recv = dist.irecv(incoming, src=dst, group=self.group, tag=TAG) if receives else None
        send = None
        if sends:
            send = dist.isend(self.result.clone(), dst=dst, group=self.group, tag=TAG)
            self.sent += 1
        return send, recv, incoming, receives

    def _finish(self) -> None:
        while self._posted is not None:
            send, recv, incoming, receives = self._posted
            self._posted = None
            if recv is not None:
                recv.wait()
                if receives == "combine":
                    torch.maximum(self.result, incoming, out=self.result)
                else:
                    self.result.copy_(incoming)
            if send is not None:
                send.wait()
            self._next += 1
            if self._next < len(self.steps):
                self._posted = self._post(self._next)

    def _finish_recording(self) -> None:
        try:
            self._finish()
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), on the caller's thread
            self._error = exc
        finally:
            self._done.set()


# One worker thread per process runs the background exchanges, started at the first: starting a
# thread per call waits until the new thread is scheduled, milliseconds on a busy host. Keyed by
# process id: a forked child has the parent's queue but not its thread.
_QUEUES: dict[int, queue.SimpleQueue] = {}


def _worker() -> queue.SimpleQueue:
    pid = os.getpid()
    if pid not in _QUEUES:
        jobs: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            while True:
                jobs.get()._finish_recording()

        threading.Thread(target=run, name="hp-agreement", daemon=True).start()
        _QUEUES[pid] = jobs
    return _QUEUES[pid]
