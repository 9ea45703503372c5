"""Validation: :func:`check_schedule` proves a schedule complete (every forward and backward once,
in order), matched (each send has its receive, both posted in the same order on a rank pair) and
deadlock-free (a replay with zero times runs to the end) before anything runs.
"""

from __future__ import annotations

from .replay import _execute
from .steps import _COMPUTE, _MATCH, _PEER_OFFSET, _RECV, _SEND, MetaStep, T, _comm_key, _flat, _where, format_schedule


def check_schedule(schedule, num_stages, num_microbatches, *, step_index=None):
    """Raise ValueError unless the schedule is complete, matched, ordered and deadlock-free.

    Messages name the rank, the step index and the step; ``step_index(rank, i)`` is the index to
    name for position ``i`` of ``schedule[rank]`` (a :class:`CustomSchedule` whose sends and receives
    were generated names the position in the list its user wrote).
    """
    at = step_index or (lambda rank, i: i)

    def where(rank, i, step):
        return _where(rank, at(rank, i), step)

    p = len(schedule)
    compute_at = _check_compute(schedule, num_stages, num_microbatches, where, at)
    comm_at = {}  # comm key -> (rank, index, step)
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            for sub in _flat(step):
                if sub.step_type in _COMPUTE:
                    continue
                peer = sub.stage + _PEER_OFFSET[sub.step_type]
                if sub.peer_stage != peer:
                    raise ValueError(f"{where(r, i, step)}: a {sub.step_type.name} of stage "
                                     f"{sub.stage} must name peer stage {peer}")
                key = (sub.step_type, *_comm_key(sub))
                if key in comm_at:
                    raise ValueError(f"{where(r, i, step)} duplicates {where(*comm_at[key])}")
                comm_at[key] = (r, i, sub)
    for (kind, *key), (r, i, step) in comm_at.items():
        other = _MATCH[kind]
        if (other, *key) not in comm_at:
            peer = MetaStep(other, step.peer_stage, step.micro_batch, step.stage)
            raise ValueError(f"{where(r, i, step)} has no matching {other.name} {peer!r} "
                             f"on rank {step.peer_stage % p}")
        grad = T.BACKWARD_INPUT if (T.BACKWARD_INPUT, step.stage, step.micro_batch) in compute_at else T.BACKWARD
        compute = compute_at[T.FORWARD if kind.value[0] == "F" else grad, step.stage, step.micro_batch]
        if (kind in _SEND) != (compute[1] < i):  # sends follow the step they send; recvs precede it
            raise ValueError(f"{where(r, i, step)} must come {'after' if kind in _SEND else 'before'} "
                             f"{compute[2]!r} (step {at(r, compute[1])})")
    for (kind, s, mb), (r, i, step) in compute_at.items():
        if kind is T.BACKWARD_WEIGHT:
            continue  # reads only its own stage's values
        src = s - 1 if kind is T.FORWARD else s + 1
        if 0 <= src < num_stages and src % p != r:
            recv = MetaStep(T.FWD_RECV if kind is T.FORWARD else T.BWD_RECV, s, mb, src)
            if (recv.step_type, *_comm_key(recv)) not in comm_at:
                raise ValueError(f"{where(r, i, step)} needs data from stage {src} on rank {src % p} "
                                 f"but no {recv!r} is posted before it")
    _, stuck, _ = _execute(schedule, num_stages, lambda step: 0.0, 0.0)
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(
            f"{where(r, i, step)} waits for {wait}" for r, (i, step, wait) in sorted(stuck.items()))
            + f"\n{format_schedule(schedule)}")
    _check_p2p_order(schedule, where)


def _check_compute(schedule, num_stages, num_microbatches, where, at):
    """The checks that need only the compute steps: step types, ranges, placement, duplicates, every
    (stage, micro-batch) forward and backward present once and in order. Returns (kind, stage,
    micro-batch) -> (rank, index, step) of every compute step."""
    p = len(schedule)
    if p == 0 or sorted(schedule) != list(range(p)):
        raise ValueError(f"schedule must map ranks 0..N-1 to step lists, got ranks {sorted(schedule)}")
    if num_stages < 1 or num_stages % p:
        raise ValueError(f"num_stages={num_stages} must be a positive multiple of the {p} ranks")
    compute_at = {}  # (kind, stage, mb) -> (rank, index, step)
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            if not isinstance(step, MetaStep):
                raise ValueError(f"rank {r} step {at(r, i)} is {step!r}, not a MetaStep")
            for sub in _flat(step):
                if sub.stage >= num_stages or sub.micro_batch >= num_microbatches:
                    raise ValueError(f"{where(r, i, step)}: stage or micro-batch out of range "
                                     f"(num_stages={num_stages}, num_microbatches={num_microbatches})")
                if sub.stage % p != r:
                    raise ValueError(f"{where(r, i, step)}: stage {sub.stage} lives on rank {sub.stage % p}")
                key = (sub.step_type, sub.stage, sub.micro_batch)
                if sub.step_type not in _COMPUTE:
                    continue
                if key in compute_at:
                    raise ValueError(f"{where(r, i, step)} duplicates {where(*compute_at[key])}")
                compute_at[key] = (r, i, sub)
    for s in range(num_stages):
        for mb in range(num_microbatches):
            split = (T.BACKWARD_INPUT, s, mb) in compute_at or (T.BACKWARD_WEIGHT, s, mb) in compute_at
            if split and (T.BACKWARD, s, mb) in compute_at:
                r, i, step = compute_at[T.BACKWARD, s, mb]
                raise ValueError(f"{where(r, i, step)}: micro-batch {mb} of stage {s} has both a full "
                                 f"BACKWARD and a split one (BACKWARD_INPUT / BACKWARD_WEIGHT)")
            kinds = (T.FORWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT) if split else (T.FORWARD, T.BACKWARD)
            for n, kind in enumerate(kinds):
                if (kind, s, mb) not in compute_at:
                    # Where it belongs: after the step before it in its chain, else before the next.
                    present = [j for j, k in enumerate(kinds) if (k, s, mb) in compute_at]
                    earlier, later = [j for j in present if j < n], [j for j in present if j > n]
                    hint = ""
                    if present:
                        j, side = (earlier[-1], "after") if earlier else (later[0], "before")
                        r, i, step = compute_at[kinds[j], s, mb]
                        hint = f" {side} its {kinds[j].name} at {where(r, i, step)}"
                    raise ValueError(f"rank {s % p} has no {kind.name} of micro-batch {mb} for stage {s}; "
                                     f"expected {MetaStep(kind, s, mb)!r}{hint}\n{format_schedule(schedule)}")
            for before, after in zip(kinds, kinds[1:]):  # F before B (or I), I before its W
                a_idx, (r, b_idx, b) = compute_at[before, s, mb][1], compute_at[after, s, mb]
                if b_idx < a_idx:
                    what = "forward" if before is T.FORWARD else before.name
                    raise ValueError(f"{where(r, b_idx, b)} comes before its {what} at step {at(r, a_idx)}")
    return compute_at


def _check_p2p_order(schedule, where):
    """Backends without message tags (NCCL, HCCL) pair a rank pair's sends and receives in posting
    order: each rank must post its receives from a peer in the order that peer posts its sends."""
    p = len(schedule)
    sent, received = {}, {}  # (from rank, to rank) -> [(comm key, rank, index, step)]
    for r, steps in schedule.items():
        for i, step in enumerate(steps):
            for sub in _flat(step):
                if sub.step_type in _SEND and sub.peer_stage % p != r:
                    sent.setdefault((r, sub.peer_stage % p), []).append((_comm_key(sub), r, i, sub))
                elif sub.step_type in _RECV and sub.peer_stage % p != r:
                    received.setdefault((sub.peer_stage % p, r), []).append((_comm_key(sub), r, i, sub))
    for (a, b), sends in sorted(sent.items()):
        for n, (send, recv) in enumerate(zip(sends, received.get((a, b), []))):
            if send[0] != recv[0]:
                raise ValueError(
                    f"{where(*recv[1:])} is receive {n} of rank {b} from rank {a}, but send {n} of rank {a} to "
                    f"rank {b} is {where(*send[1:])}: backends that pair messages in posting order (NCCL, "
                    f"HCCL) would deliver the wrong tensors. Post the receives from a rank in the order it "
                    f"sends (on both ranks, the same micro-batch order for the values crossing between them)"
                )
