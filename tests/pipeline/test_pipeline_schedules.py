"""Unit tests for hyper_parallel.pipeline.schedules: orders, validation, simulation, bubbles."""

import itertools
import re

import pytest

from hyper_parallel.pipeline.schedules import (
    SCHEDULES,
    MetaStep,
    MetaStepType,
    analytic_bubble,
    build_schedule,
    check_schedule,
    format_schedule,
    simulate,
)

_KINDS = {t.value: t for t in MetaStepType}


def parse(text):
    """'F0@s1 FS0@s1>s2 BR0@s1<s2' -> [MetaStep, ...], the inverse of MetaStep's repr."""
    steps = []
    for token in text.split():
        kind, mb, stage, peer = re.fullmatch(r"([A-Z]+)(\d+)@s(\d+)(?:[<>]s(\d+))?", token).groups()
        steps.append(MetaStep(_KINDS[kind], int(stage), int(mb), None if peer is None else int(peer)))
    return steps


def compute_order(steps):
    return " ".join(repr(s) for s in steps if s.step_type in (MetaStepType.FORWARD, MetaStepType.BACKWARD))


def valid_cases():
    for name, p, m, v in itertools.product(SCHEDULES, range(1, 5), range(1, 9), range(1, 4)):
        if name == "Interleaved1F1B" and (v < 2 or m % p):
            continue
        if name != "Interleaved1F1B" and v != 1:
            continue
        yield name, p, m, v


def test_repr_and_validation():
    assert repr(MetaStep(MetaStepType.FORWARD, 1, 3)) == "F3@s1"
    assert repr(MetaStep(MetaStepType.BACKWARD, 2, 0)) == "B0@s2"
    assert repr(MetaStep(MetaStepType.FWD_RECV, 1, 1, peer_stage=0)) == "FR1@s1<s0"
    assert repr(MetaStep(MetaStepType.BWD_SEND, 1, 1, peer_stage=0)) == "BS1@s1>s0"
    ofb = MetaStep(MetaStepType.OVERLAP_F_B, 1, 3, sub_steps=tuple(parse("F3@s1 B0@s1")))
    assert repr(ofb) == "OFB[F3@s1|B0@s1]"
    with pytest.raises(ValueError, match="peer_stage"):
        MetaStep(MetaStepType.FWD_SEND, 0, 0)
    with pytest.raises(ValueError, match="sub_steps"):
        MetaStep(MetaStepType.OVERLAP_B_F, 0, 0, sub_steps=tuple(parse("F0@s0 B0@s0")))


@pytest.mark.parametrize("overlap", [False, True])
def test_every_valid_combination_builds_and_checks(overlap):
    cases = set(valid_cases())
    assert len(cases) == 128  # GPipe, 1F1B, ZBH1: 32 each; Interleaved1F1B: 32
    for name, p, m, v in itertools.product(SCHEDULES, range(1, 5), range(1, 9), range(1, 4)):
        if (name, p, m, v) not in cases:
            with pytest.raises(ValueError, match="stages_per_rank|multiple of num_ranks"):
                build_schedule(name, p, m, v, overlap_p2p=overlap)
            continue
        schedule = build_schedule(name, p, m, v, overlap_p2p=overlap)
        assert sorted(schedule) == list(range(p))
        check_schedule(schedule, p * v, m)  # build already checks; re-check the returned object


def test_p2p_order_matches_per_rank_pair():
    # Backends without tags (NCCL, HCCL) match a pair's sends and receives in posting order, so
    # each rank must post its receives from a peer in the order that peer posts its sends.
    def key(s):
        return s.step_type.value[0], s.micro_batch, min(s.stage, s.peer_stage)

    for (name, p, m, v), overlap in itertools.product(valid_cases(), (False, True)):
        schedule = build_schedule(name, p, m, v, overlap_p2p=overlap)
        for a, b in itertools.permutations(range(p), 2):
            sends = [key(s) for s in schedule[a] if s.step_type.value in ("FS", "BS") and s.peer_stage % p == b]
            recvs = [key(s) for s in schedule[b] if s.step_type.value in ("FR", "BR") and s.peer_stage % p == a]
            assert sends == recvs, (name, p, m, v, overlap, a, b)


def test_gpipe_order():
    schedule = build_schedule("GPipe", 2, 3)
    assert compute_order(schedule[0]) == "F0@s0 F1@s0 F2@s0 B0@s0 B1@s0 B2@s0"
    assert schedule[1] == parse(
        "FR0@s1<s0 F0@s1 FR1@s1<s0 F1@s1 FR2@s1<s0 F2@s1 B0@s1 BS0@s1>s0 B1@s1 BS1@s1>s0 B2@s1 BS2@s1>s0"
    )
    assert schedule[0][:2] == parse("F0@s0 FS0@s0>s1")


def test_1f1b_order_warmup_and_memory():
    assert compute_order(build_schedule("1F1B", 4, 6)[1]) == (
        "F0@s1 F1@s1 F2@s1 B0@s1 F3@s1 B1@s1 F4@s1 B2@s1 F5@s1 B3@s1 B4@s1 B5@s1"
    )
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        schedule = build_schedule("1F1B", p, m)
        for r, steps in schedule.items():
            kinds = [s.step_type for s in steps if s.step_type.value in ("F", "B")]
            warmup = kinds.index(MetaStepType.BACKWARD) - 1 if m > p - r - 1 else kinds.index(MetaStepType.BACKWARD)
            assert warmup == min(p - r - 1, m), (p, m, r)
            in_flight = peak = 0
            for kind in kinds:
                in_flight += 1 if kind is MetaStepType.FORWARD else -1
                peak = max(peak, in_flight)
            assert peak <= p - r and in_flight == 0, (p, m, r)
            assert [s.micro_batch for s in steps if s.step_type is MetaStepType.FORWARD] == list(range(m))
            assert [s.micro_batch for s in steps if s.step_type is MetaStepType.BACKWARD] == list(range(m))


def test_interleaved_order_matches_megatron():
    # Worked out by hand from Megatron's interleaved schedule for P=2, M=4, v=2 (rank 0 owns stages
    # 0 and 2, rank 1 owns 1 and 3); warmup = 2*(P-r-1) + (v-1)*P = 4 forwards on rank 0, 2 on rank 1.
    schedule = build_schedule("Interleaved1F1B", 2, 4, stages_per_rank=2)
    assert compute_order(schedule[0]) == (
        "F0@s0 F1@s0 F0@s2 F1@s2 "
        "F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 "
        "B2@s2 B3@s2 B2@s0 B3@s0"
    )
    assert compute_order(schedule[1]) == (
        "F0@s1 F1@s1 "
        "F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 "
        "B2@s1 B3@s1"
    )
    # Rank 0 both receives stage 2's gradient from rank 1 and sends stage 1's to it.
    i = schedule[0].index(parse("B0@s2")[0])
    assert schedule[0][i - 1:i + 2] == parse("BR0@s2<s3 B0@s2 BS0@s2>s1")
    i = schedule[1].index(parse("F0@s3")[0])
    assert schedule[1][i - 1:i + 1] == parse("FR0@s3<s2 F0@s3")


def test_single_rank_interleaved_has_no_p2p():
    schedule = build_schedule("Interleaved1F1B", 1, 2, stages_per_rank=3)
    assert all(s.step_type.value in ("F", "B") for s in schedule[0])
    assert compute_order(schedule[0]) == "F0@s0 F0@s1 F0@s2 B0@s2 F1@s0 B0@s1 F1@s1 B0@s0 F1@s2 B1@s2 B1@s1 B1@s0"


@pytest.mark.parametrize(("name", "p", "m", "v"), [("GPipe", 4, 8, 1), ("1F1B", 4, 8, 1), ("1F1B", 4, 3, 1),
                                                   ("1F1B", 3, 5, 1), ("GPipe", 1, 4, 1)])
def test_simulated_bubble_matches_analytic(name, p, m, v):
    for tb in (1.0, 2.0):
        timeline = simulate(build_schedule(name, p, m, v), forward_time=1.0, backward_time=tb)
        assert timeline.bubble_fraction() == analytic_bubble(p, m, v)
        assert timeline.makespan == (m + p - 1) * (1.0 + tb)
        assert timeline.busy == dict.fromkeys(range(p), m * (1.0 + tb))


def test_interleaved_bubble_is_lower_than_1f1b():
    for p, m in [(2, 4), (4, 8), (4, 4), (3, 6)]:
        plain = simulate(build_schedule("1F1B", p, m), 1.0, 2.0).bubble_fraction()
        # Same work per rank: each of the v chunks takes 1/v of a full stage's time.
        inter = simulate(build_schedule("Interleaved1F1B", p, m, 2), 0.5, 1.0).bubble_fraction()
        assert inter < plain, (p, m)
        assert inter == pytest.approx(analytic_bubble(p, m, 2))


def test_simulate_per_stage_times_and_p2p():
    schedule = build_schedule("GPipe", 2, 1)
    timeline = simulate(schedule, {0: 1.0, 1: 3.0}, {0: 2.0, 1: 4.0}, p2p_time=0.5)
    assert [(r, repr(s), start, end) for r, s, start, end in timeline.events] == [
        (0, "F0@s0", 0.0, 1.0), (1, "F0@s1", 1.5, 4.5), (1, "B0@s1", 4.5, 8.5), (0, "B0@s0", 9.0, 11.0)]
    assert timeline.makespan == 11.0 and timeline.busy == {0: 3.0, 1: 7.0}
    with pytest.raises(ValueError, match="forward_time.*stage 1"):
        simulate(schedule, {0: 1.0}, 1.0)
    with pytest.raises(ValueError, match="p2p_time"):
        simulate(schedule, 1.0, 1.0, p2p_time=-1)


def test_overlap_p2p_posts_receives_one_step_earlier():
    plain = build_schedule("1F1B", 3, 4)
    early = build_schedule("1F1B", 3, 4, overlap_p2p=True)
    check_schedule(early, 3, 4)
    assert simulate(early, 1.0, 2.0).makespan == simulate(plain, 1.0, 2.0).makespan == 18.0
    assert early[1][:3] == parse("FR0@s1<s0 FR1@s1<s0 F0@s1")  # the first compute's receive stays
    for r in range(3):
        assert compute_order(plain[r]) == compute_order(early[r])
        assert sorted(map(repr, plain[r])) == sorted(map(repr, early[r]))
        pos = [i for i, s in enumerate(plain[r]) if s.step_type.value in ("F", "B")]
        where = {s: i for i, s in enumerate(early[r])}
        for n in range(1, len(pos)):
            # Compute n's receives sit between compute n-1 and n without overlap; with it they move
            # to between compute n-2 and n-1 (one compute step earlier).
            for recv in plain[r][pos[n - 1] + 1:pos[n]]:
                if recv.step_type.value in ("FR", "BR"):
                    assert where[recv] < where[plain[r][pos[n - 1]]], (r, recv)
                    if n >= 2:
                        assert where[plain[r][pos[n - 2]]] < where[recv], (r, recv)


def two_rank_1f1b():
    return {
        0: parse("F0@s0 FS0@s0>s1 F1@s0 FS1@s0>s1 BR0@s0<s1 B0@s0 BR1@s0<s1 B1@s0"),
        1: parse("FR0@s1<s0 F0@s1 B0@s1 BS0@s1>s0 FR1@s1<s0 F1@s1 B1@s1 BS1@s1>s0"),
    }


def test_check_accepts_hand_built_schedule():
    check_schedule(two_rank_1f1b(), 2, 2)


def test_check_catches_missing_backward():
    schedule = two_rank_1f1b()
    schedule[1] = [s for s in schedule[1] if repr(s) not in ("B1@s1", "BS1@s1>s0")]
    schedule[0] = [s for s in schedule[0] if repr(s) != "BR1@s0<s1"]
    with pytest.raises(ValueError, match=r"rank 1 has no BACKWARD of micro-batch 1 for stage 1; expected B1@s1"):
        check_schedule(schedule, 2, 2)


def test_check_catches_backward_before_its_forward():
    schedule = two_rank_1f1b()
    schedule[1] = parse("FR0@s1<s0 FR1@s1<s0 B0@s1 BS0@s1>s0 F0@s1 F1@s1 B1@s1 BS1@s1>s0")
    with pytest.raises(ValueError, match=r"rank 1 step 2 \(B0@s1\) comes before its forward at step 4"):
        check_schedule(schedule, 2, 2)


def test_check_catches_deadlock():
    # Rank 0 waits for B0's gradient before it sends F1; rank 1 wants F1 before it runs B0.
    schedule = {
        0: parse("F0@s0 FS0@s0>s1 BR0@s0<s1 B0@s0 F1@s0 FS1@s0>s1 BR1@s0<s1 B1@s0"),
        1: parse("FR0@s1<s0 F0@s1 FR1@s1<s0 F1@s1 B0@s1 BS0@s1>s0 B1@s1 BS1@s1>s0"),
    }
    with pytest.raises(ValueError, match="deadlock") as err:
        check_schedule(schedule, 2, 2)
    msg = str(err.value)
    assert "rank 0 step 3 (B0@s0) waits for BS0@s1 (rank 1)" in msg
    assert "rank 1 step 3 (F1@s1) waits for FS1@s0 (rank 0)" in msg


def test_check_catches_unmatched_and_misplaced_p2p():
    schedule = two_rank_1f1b()
    schedule[1] = [s for s in schedule[1] if repr(s) != "FR1@s1<s0"]
    with pytest.raises(ValueError, match=r"rank 0 step 3 \(FS1@s0>s1\) has no matching FWD_RECV FR1@s1<s0 on rank 1"):
        check_schedule(schedule, 2, 2)
    schedule = two_rank_1f1b()
    schedule[0] = [s for s in schedule[0] if repr(s) != "FS1@s0>s1"]
    with pytest.raises(ValueError, match=r"rank 1 step 4 \(FR1@s1<s0\) has no matching FWD_SEND FS1@s0>s1 on rank 0"):
        check_schedule(schedule, 2, 2)
    schedule = two_rank_1f1b()
    schedule[1] = parse("F0@s1 FR0@s1<s0 B0@s1 BS0@s1>s0 FR1@s1<s0 F1@s1 B1@s1 BS1@s1>s0")
    with pytest.raises(ValueError, match=r"rank 1 step 1 \(FR0@s1<s0\) must come before F0@s1 \(step 0\)"):
        check_schedule(schedule, 2, 2)
    schedule = two_rank_1f1b()
    schedule[1] = [s for s in schedule[1] if repr(s) not in ("FR1@s1<s0",)]
    schedule[0] = [s for s in schedule[0] if repr(s) != "FS1@s0>s1"]
    with pytest.raises(ValueError, match=r"rank 1 step 4 \(F1@s1\) needs data from stage 0 on rank 0 but no FR1@s1<s0"):
        check_schedule(schedule, 2, 2)


def test_check_catches_wrong_rank_and_duplicates():
    schedule = two_rank_1f1b()
    schedule[0] = schedule[0] + parse("F0@s1")
    with pytest.raises(ValueError, match=r"rank 0 step 8 \(F0@s1\): stage 1 lives on rank 1"):
        check_schedule(schedule, 2, 2)
    schedule = two_rank_1f1b()
    schedule[0] = schedule[0] + parse("B1@s0")
    with pytest.raises(ValueError, match=r"rank 0 step 8 \(B1@s0\) duplicates rank 0 step 7"):
        check_schedule(schedule, 2, 2)


def test_format_schedule():
    text = format_schedule(build_schedule("1F1B", 2, 2))
    assert text.splitlines() == [
        "step | rank 0 | rank 1",
        "0    | F0@s0  | F0@s1",
        "1    | F1@s0  | B0@s1",
        "2    | B0@s0  | F1@s1",
        "3    | B1@s0  | B1@s1",
    ]


@pytest.mark.parametrize(("kwargs", "pattern"), [
    (dict(name="PipeDream"), r"name='PipeDream'.*GPipe.*1F1B.*Interleaved1F1B.*ZBH1"),
    (dict(num_ranks=0), r"num_ranks must be an int >= 1, got 0"),
    (dict(num_microbatches=0), r"num_microbatches must be an int >= 1, got 0"),
    (dict(num_microbatches=2.0), r"num_microbatches must be an int >= 1, got 2.0"),
    (dict(stages_per_rank=0), r"stages_per_rank must be an int >= 1, got 0"),
    (dict(stages_per_rank=2), r"1F1B runs one stage per rank, got stages_per_rank=2; use 'Interleaved1F1B'"),
    (dict(name="GPipe", stages_per_rank=2), r"GPipe runs one stage per rank, got stages_per_rank=2"),
    (dict(name="Interleaved1F1B"), r"Interleaved1F1B needs stages_per_rank >= 2, got stages_per_rank=1; use '1F1B'"),
    (dict(name="Interleaved1F1B", stages_per_rank=2, num_microbatches=6),
     r"num_microbatches to be a multiple of num_ranks \(Megatron's rule\), got num_microbatches=6 with "
     r"num_ranks=4; use 4 or 8"),
])
def test_build_schedule_bad_arguments(kwargs, pattern):
    args = dict(name="1F1B", num_ranks=4, num_microbatches=8) | kwargs
    with pytest.raises(ValueError, match=pattern):
        build_schedule(**args)


def test_analytic_bubble():
    assert analytic_bubble(4, 8) == 3 / 11
    assert analytic_bubble(4, 8, 2) == 3 / 19
    assert analytic_bubble(1, 5) == 0.0
    with pytest.raises(ValueError, match="num_microbatches"):
        analytic_bubble(4, 0)


# --- ZB-H1 (zero bubble, Qi et al. 2023): backward split into input (I) and weight (W) steps ---

def test_zbh1_builds_checks_and_keeps_every_w_after_its_i():
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        schedule = build_schedule("ZBH1", p, m)
        check_schedule(schedule, p, m)
        for r, steps in schedule.items():
            kinds = [s.step_type for s in steps]
            assert MetaStepType.BACKWARD not in kinds
            for kind in (MetaStepType.FORWARD, MetaStepType.BACKWARD_INPUT, MetaStepType.BACKWARD_WEIGHT):
                assert sorted(s.micro_batch for s in steps if s.step_type is kind) == list(range(m)), (p, m, r)
            # W steps never touch the network.
            idx = {(s.step_type, s.micro_batch): i for i, s in enumerate(steps)}
            for mb in range(m):
                assert idx[MetaStepType.BACKWARD_INPUT, mb] < idx[MetaStepType.BACKWARD_WEIGHT, mb]


def test_zbh1_order_on_two_ranks():
    schedule = build_schedule("ZBH1", 2, 4)
    assert " ".join(map(repr, schedule[0])) == (
        "F0@s0 FS0@s0>s1 F1@s0 FS1@s0>s1 BR0@s0<s1 I0@s0 W0@s0 F2@s0 FS2@s0>s1 BR1@s0<s1 I1@s0 W1@s0 "
        "F3@s0 FS3@s0>s1 BR2@s0<s1 I2@s0 W2@s0 BR3@s0<s1 I3@s0 W3@s0")
    assert " ".join(map(repr, schedule[1])) == (
        "FR0@s1<s0 F0@s1 I0@s1 BS0@s1>s0 FR1@s1<s0 F1@s1 I1@s1 BS1@s1>s0 W0@s1 FR2@s1<s0 F2@s1 I2@s1 "
        "BS2@s1>s0 W1@s1 FR3@s1<s0 F3@s1 I3@s1 BS3@s1>s0 W2@s1 W3@s1")


def test_zbh1_memory_bound_matches_1f1b():
    """Activations live from F to W: at most p micro-batches in flight on any rank, as on 1F1B's rank 0."""
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        one_f_one_b = build_schedule("1F1B", p, m)
        for r, steps in build_schedule("ZBH1", p, m).items():
            in_flight = peak = 0
            for s in steps:
                in_flight += {MetaStepType.FORWARD: 1, MetaStepType.BACKWARD_WEIGHT: -1}.get(s.step_type, 0)
                peak = max(peak, in_flight)
            assert in_flight == 0 and peak <= min(p, m), (p, m, r)
            if r == 0:  # rank 0 holds exactly as many as under 1F1B
                ref = peak_1f1b = 0
                for s in one_f_one_b[0]:
                    ref += {MetaStepType.FORWARD: 1, MetaStepType.BACKWARD: -1}.get(s.step_type, 0)
                    peak_1f1b = max(peak_1f1b, ref)
                assert peak == peak_1f1b, (p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 8), (4, 2)])
def test_zbh1_bubble_smaller_than_1f1b(p, m):
    """Equal F = B = W = 1: 1F1B's B step is B + W = 2. The makespan drops from
    (m + p - 1)(F + B + W) to m(F + B + W) + (p - 1)(F + B - W) when m >= p."""
    zb = simulate(build_schedule("ZBH1", p, m), 1.0, 1.0, weight_time=1.0)
    ref = simulate(build_schedule("1F1B", p, m), 1.0, 2.0)
    assert ref.makespan == (m + p - 1) * 3
    assert zb.makespan < ref.makespan and zb.bubble_fraction() < ref.bubble_fraction()
    if m >= p:
        assert zb.makespan == m * 3 + (p - 1) * 1
    assert sum(zb.busy.values()) == sum(ref.busy.values()) == p * m * 3


def test_zbh1_simulate_needs_weight_time_and_per_stage_times():
    schedule = build_schedule("ZBH1", 2, 2)
    with pytest.raises(ValueError, match="weight_time"):
        simulate(schedule, 1.0, 1.0)
    with pytest.raises(ValueError, match="weight_time must give a number"):
        simulate(schedule, 1.0, 1.0, weight_time={0: 1.0})
    tl = simulate(schedule, {0: 1.0, 1: 2.0}, 1.0, weight_time={0: 0.5, 1: 3.0})
    assert tl.busy == {0: 2 * (1.0 + 1.0 + 0.5), 1: 2 * (2.0 + 1.0 + 3.0)}


def test_zbh1_check_catches_w_before_i_and_mixed_backward():
    schedule = build_schedule("ZBH1", 2, 2)
    bad = dict(schedule)
    bad[1] = parse("FR0@s1<s0 F0@s1 W0@s1 I0@s1 BS0@s1>s0 FR1@s1<s0 F1@s1 I1@s1 BS1@s1>s0 W1@s1")
    with pytest.raises(ValueError, match=r"rank 1 step 2 \(W0@s1\) comes before its BACKWARD_INPUT at step 3"):
        check_schedule(bad, 2, 2)
    missing = dict(schedule)
    missing[1] = [s for s in schedule[1] if repr(s) != "W1@s1"]
    with pytest.raises(ValueError, match=r"rank 1 has no BACKWARD_WEIGHT of micro-batch 1 for stage 1"):
        check_schedule(missing, 2, 2)
    mixed = dict(schedule)
    mixed[1] = schedule[1] + parse("B1@s1")
    with pytest.raises(ValueError, match="both a full BACKWARD and a split one"):
        check_schedule(mixed, 2, 2)


def test_zbh1_format_schedule_shows_i_and_w():
    text = format_schedule(build_schedule("ZBH1", 2, 2))
    assert text.splitlines()[0].split() == ["step", "|", "rank", "0", "|", "rank", "1"]
    assert "I0@s0" in text and "W1@s1" in text


def test_zbh1_is_a_plan_schedule_with_one_stage_per_rank():
    """The executor runs split backwards: PipelinePlan accepts ZBH1, with one stage per rank."""
    from hyper_parallel.pipeline.plan import PipelinePlan
    from hyper_parallel.pipeline.schedules import SPLIT_BACKWARD_SCHEDULES

    assert "ZBH1" in SCHEDULES and SPLIT_BACKWARD_SCHEDULES == ("ZBH1",)
    assert PipelinePlan(schedule="ZBH1").schedule == "ZBH1"
    with pytest.raises(ValueError, match=r"PipelinePlan\(schedule='ZBH1'\) runs one stage per rank"):
        PipelinePlan(schedule="ZBH1", stages_per_rank=2)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("ZBH1", 2, 4, stages_per_rank=2)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 8), (4, 2), (1, 3)])
def test_zbh1_analytic_bubble_is_its_schedule_with_equal_f_i_w(p, m):
    """F = I = W (a backward of two forwards, split half and half): (p-1) / (3m + p-1) once m >= p,
    below 1F1B's (p-1) / (m + p-1)."""
    bubble = analytic_bubble(p, m, schedule="ZBH1")
    assert bubble == simulate(build_schedule("ZBH1", p, m), 1.0, 1.0, weight_time=1.0).bubble_fraction()
    if m >= p:
        assert bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble <= analytic_bubble(p, m) and (p == 1) == (bubble == 0)
