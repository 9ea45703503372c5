"""The recursive-doubling schedule of the per-call agreement's all-reduce
(``distributed.host_reduce``), run message by message in this process: every member ends with the
maximum, in at most ``doubling_rounds(n)`` messages, for every group size up to 70 (powers of two
and not; the exchange itself all-gathers in groups of up to 4).
The exchange itself, over gloo, is tests/distributed/test_agreement.py."""

import math
import random

import pytest

from hyper_parallel.cost import agreement_time, get_profile
from hyper_parallel.distributed.host_reduce import doubling_rounds, rounds, schedule


def _run(values: list[int]) -> tuple[list[int], list[int]]:
    """Each member's result and messages sent when the members run their schedules as
    MaxAllReduce does: at each step send what it holds, then wait for the partner's message.
    Messages between two members arrive in order (as on one c10d pair with one tag)."""
    n = len(values)
    held = list(values)
    plans = [schedule(n, i) for i in range(n)]
    at, sent_this_step, sent = [0] * n, [False] * n, [0] * n
    channel: dict[tuple[int, int], list[int]] = {}
    while any(at[i] < len(plans[i]) for i in range(n)):
        moved = False
        for i in range(n):
            if at[i] == len(plans[i]):
                continue
            partner, sends, receives = plans[i][at[i]]
            if sends and not sent_this_step[i]:
                channel.setdefault((i, partner), []).append(held[i])
                sent_this_step[i], sent[i], moved = True, sent[i] + 1, True
            if receives:
                queue = channel.get((partner, i))
                if not queue:
                    continue
                incoming = queue.pop(0)
                held[i] = max(held[i], incoming) if receives == "combine" else incoming
            at[i], sent_this_step[i], moved = at[i] + 1, False, True
        assert moved, f"the schedule of {n} members deadlocks at steps {at}"
    assert not any(channel.values()), "a message was sent that nobody received"
    return held, sent


def test_every_member_ends_with_the_maximum_in_at_most_doubling_rounds_messages():
    for n in range(1, 71):
        values = random.Random(n).sample(range(10 * n + 10), n)
        held, sent = _run(values)
        assert held == [max(values)] * n, n
        assert all(len(schedule(n, i)) <= doubling_rounds(n) for i in range(n)), n
        assert max(sent) <= doubling_rounds(n), n


def test_rounds_grow_with_log2_of_the_group():
    assert [rounds(n) for n in (1, 2, 1024, 16384)] == [0, 1, 10, 14]
    assert [rounds(n) for n in (3, 4, 8)] == [2, 3, 3]  # up to 4 ranks all-gather: n - 1
    assert rounds(1000) == doubling_rounds(1000) == 11  # not a power of two: two more
    assert doubling_rounds(3) == 3
    assert all(rounds(n) <= math.floor(math.log2(n)) + 2 for n in range(2, 5000))


def test_a_member_outside_the_group_is_an_error():
    with pytest.raises(ValueError, match="member 4 is not in a group of 4"):
        schedule(4, 4)


def test_the_cost_model_prices_one_host_message_per_round():
    h100 = get_profile("h100")
    assert agreement_time(1, h100) == 0.0
    assert agreement_time(1024, h100) == pytest.approx(10 * h100.host_message_latency_s)
    # A ring (gloo's all-gather, what the agreement was) would take 1,023 rounds at 1,024 ranks.
    assert agreement_time(16384, h100) < 1e-3
