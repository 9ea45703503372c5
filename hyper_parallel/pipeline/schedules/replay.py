"""The lock-free replay of a schedule: every rank walks its list, a compute step waiting until the
steps it reads from have run. :func:`~.checks.check_schedule` runs it to find deadlocks and
:func:`~.costs.simulate` to time a schedule with per-stage times.
"""

from __future__ import annotations

from .steps import _COMPUTE, _SEND, _SENDS_GRAD, T, _flat


def _deps(step, num_stages, num_ranks):
    """What a compute step waits for: keys of the producing compute step or the remote send."""
    s, mb = step.stage, step.micro_batch
    if step.step_type is T.BACKWARD_WEIGHT:
        return [(T.BACKWARD_INPUT, s, mb)]
    src, kind = (s - 1, T.FORWARD) if step.step_type is T.FORWARD else (s + 1, T.BACKWARD)
    deps = [(T.FORWARD, s, mb)] if step.step_type in _SENDS_GRAD else []
    if 0 <= src < num_stages:
        same_rank = src % num_ranks == s % num_ranks
        deps.append((kind, src, mb) if same_rank else (T.FWD_SEND if kind is T.FORWARD else T.BWD_SEND, src, mb))
    return deps


def _execute(schedule, num_stages, duration, p2p_time):
    """Run all ranks in lock-free order; returns (events, stuck ranks, busy time per rank).

    A rank stops at a compute step whose inputs are not produced yet, so the order in which ranks
    are visited does not change the computed times: every start is max(rank clock, input ready).
    """
    p = len(schedule)
    pos, clock, busy = dict.fromkeys(schedule, 0), dict.fromkeys(schedule, 0.0), dict.fromkeys(schedule, 0.0)
    done, events = {}, []  # done: (kind, stage, mb) -> time the data is available
    progress = True
    while progress:
        progress = False
        for r, steps in schedule.items():
            while pos[r] < len(steps):
                step = steps[pos[r]]
                if step.step_type in _SEND:
                    done[step.step_type, step.stage, step.micro_batch] = clock[r] + p2p_time
                elif step.step_type in _COMPUTE:
                    finished, ready = set(), clock[r]
                    for sub in _flat(step):
                        for dep in _deps(sub, num_stages, p):
                            if dep not in finished:
                                if dep not in done:
                                    break
                                ready = max(ready, done[dep])
                        else:
                            finished.add((sub.step_type, sub.stage, sub.micro_batch))
                            continue
                        break
                    else:
                        # Overlapped sub-steps share one device: their compute times add up.
                        cost = sum(duration(sub) for sub in _flat(step))
                        clock[r], busy[r] = ready + cost, busy[r] + cost
                        done.update(dict.fromkeys(finished, clock[r]))
                        for kind, s, mb in finished:  # an input-gradient step feeds what a BACKWARD does
                            if kind is T.BACKWARD_INPUT:
                                done[T.BACKWARD, s, mb] = clock[r]
                        events.append((r, step, ready, clock[r]))
                        pos[r] += 1
                        progress = True
                        continue
                    break
                pos[r] += 1  # receives only post a buffer
                progress = True
    stuck = {}
    for r, steps in schedule.items():
        if pos[r] < len(steps):
            step = steps[pos[r]]
            missing = [d for sub in _flat(step) for d in _deps(sub, num_stages, p) if d not in done]
            stuck[r] = (pos[r], step, ", ".join(f"{k.value}{mb}@s{s} (rank {s % p})" for k, s, mb in missing))
    return events, stuck, busy
