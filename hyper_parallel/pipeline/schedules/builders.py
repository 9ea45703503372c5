"""The built-in schedules: :func:`build_schedule` turns a name (GPipe, 1F1B, Megatron's interleaved
1F1B, zero-bubble ZB-H1) into each rank's compute order and adds the sends and receives around it
(:func:`_add_p2p`, also used for a :class:`~.custom.CustomSchedule` written without them).
"""

from __future__ import annotations

from .checks import check_schedule
from .steps import MetaStep, T, _check_count


# The schedules build_schedule makes, the executor runs and PipelinePlan accepts.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1")
# Those among them that split each backward: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism")
# runs BACKWARD_INPUT (input gradients, sent to the previous stage) and BACKWARD_WEIGHT (parameter
# gradients) as two steps, and delays the W steps into the cooldown bubble of 1F1B with 1F1B's
# activation memory bound.
SPLIT_BACKWARD_SCHEDULES = ("ZBH1",)


def build_schedule(name, num_ranks, num_microbatches, stages_per_rank=1, overlap_p2p=False):
    """One ordered step list per pipeline rank 0..num_ranks-1, validated by check_schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule name={name!r}; choose one of {SCHEDULES}")
    for arg, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                       ("stages_per_rank", stages_per_rank)):
        _check_count(arg, value)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if name != "Interleaved1F1B" and v != 1:
        raise ValueError(f"{name} runs one stage per rank, got stages_per_rank={v}; "
                         f"use 'Interleaved1F1B' for several stages per rank")
    if name == "Interleaved1F1B":
        if v < 2:
            raise ValueError(f"Interleaved1F1B needs stages_per_rank >= 2, got stages_per_rank={v}; "
                             f"use '1F1B' for one stage per rank")
        if m % p:
            fits = sorted({max(p, m - m % p), m - m % p + p})
            raise ValueError(
                f"Interleaved1F1B needs num_microbatches to be a multiple of num_ranks (Megatron's "
                f"rule), got num_microbatches={m} with num_ranks={p}; use {' or '.join(map(str, fits))}"
            )
    num_stages = p * v
    schedule = {}
    for r in range(p):
        if name == "GPipe":
            compute = [MetaStep(T.FORWARD, r, i) for i in range(m)] + [MetaStep(T.BACKWARD, r, i) for i in range(m)]
        elif name == "ZBH1":
            compute = _zero_bubble_h1(r, p, m)
        else:
            # Megatron: the extra 2*(p-r-1) + (v-1)*p warmup forwards of interleaving keep the
            # next chunk's input arriving before it is needed; plain 1F1B only fills the pipe.
            warmup = min(p - r - 1, m) if name == "1F1B" else min((p - r - 1) * 2 + (v - 1) * p, m * v)
            compute = _one_f_one_b(r, p, m, v, warmup)
        schedule[r] = _add_p2p(compute, p, num_stages, overlap_p2p)
    check_schedule(schedule, num_stages, m)
    return schedule


def _one_f_one_b(rank, p, m, v, warmup):
    """Megatron's order: warmup forwards, steady (1 forward, 1 backward) pairs, cooldown backwards."""

    def step(kind, k):
        chunk = (k // p) % v
        if kind is T.BACKWARD:
            chunk = v - 1 - chunk  # backward walks the local chunks last-to-first
        return MetaStep(kind, rank + chunk * p, (k // (p * v)) * p + k % p)

    total = m * v
    order = [step(T.FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [step(T.FORWARD, warmup + i), step(T.BACKWARD, i)]
    return order + [step(T.BACKWARD, k) for k in range(total - warmup, total)]


def _zero_bubble_h1(rank, p, m):
    """ZB-H1 on one stage per rank: 1F1B's forwards and input-gradient steps, W steps delayed.

    Rank r runs 1F1B's ``p - r - 1`` warmup forwards, so it holds at most ``p - r`` micro-batches'
    activations after a forward; it may keep ``r`` W steps pending (activations stay alive until
    W) and still hold at most ``p``, the bound of 1F1B's rank 0. Delayed W steps run in the
    cooldown, right after each input-gradient step, where 1F1B waits for the next stage.
    """
    def F(mb):
        return MetaStep(T.FORWARD, rank, mb)

    def I(mb):  # noqa: E743 - the paper's name for the input-gradient step
        return MetaStep(T.BACKWARD_INPUT, rank, mb)

    def W(mb):
        return MetaStep(T.BACKWARD_WEIGHT, rank, mb)

    warmup, delay = min(p - rank - 1, m), rank
    order, next_w = [F(k) for k in range(warmup)], 0
    for i in range(m - warmup):
        order += [F(warmup + i), I(i)]
        while i + 1 - next_w > delay:
            order.append(W(next_w))
            next_w += 1
    for k in range(m - warmup, m):
        order.append(I(k))
        if next_w <= k:  # one delayed W fills the wait for the next input gradient
            order.append(W(next_w))
            next_w += 1
    return order + [W(k) for k in range(next_w, m)]


def _add_p2p(compute, num_ranks, num_stages, overlap_p2p):
    """Surround each compute step with its receives and sends (none for a same-rank hand-off)."""

    def comm(kind, step, peer):
        if 0 <= peer < num_stages and peer % num_ranks != step.stage % num_ranks:
            return [MetaStep(kind, step.stage, step.micro_batch, peer)]
        return []

    recvs, sends = [], []
    for c in compute:
        if c.step_type is T.BACKWARD_WEIGHT:  # parameter gradients stay on the stage
            recvs.append([])
            sends.append([])
            continue
        sign = -1 if c.step_type is T.FORWARD else 1  # forward data flows up the stages, grads down
        recv, send = (T.FWD_RECV, T.FWD_SEND) if sign < 0 else (T.BWD_RECV, T.BWD_SEND)
        recvs.append(comm(recv, c, c.stage + sign))
        sends.append(comm(send, c, c.stage - sign))
    if overlap_p2p and compute:
        # Post each receive while the previous compute step runs so the transfer hides behind it.
        recvs = [recvs[0] + (recvs[1] if len(recvs) > 1 else [])] + recvs[2:] + [[]]
    steps = []
    for r, c, s in zip(recvs, compute, sends):
        steps += r + [c] + s
    return steps
