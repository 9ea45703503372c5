"""Unit tests for hyper_parallel.optim.lr_scheduler: every decay style against closed forms written
here, warmup_ratio and lr_decay_ratio, resuming from a mid-run checkpoint, chained optimizers, errors."""

import io
import json
import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from hyper_parallel.optim.lr_scheduler import HyperLRScheduler, get_hyper_lr_scheduler

TOTAL, WARM, WSD = 100, 10, 30
LR, LR_MIN, LR_START = 1e-3, 1e-5, 1e-6


def expected_lr(step, style, wsd_style=None, warm=WARM, end=TOTAL, wsd=WSD, lr=LR):
    """The schedule, written piecewise from its definition (clamped progress fractions)."""
    if step < warm:
        return LR_START + (lr - LR_START) * step / warm
    if style == "constant":
        return lr
    span = lr - LR_MIN
    if style in ("linear", "cosine"):
        p = min(max((step - warm) / (end - warm), 0.0), 1.0)  # 0 at the end of warmup, 1 at `end`
        shape = 1 - p if style == "linear" else math.cos(math.pi * p / 2) ** 2
        return LR_MIN + span * shape
    q = min(max((step - (end - wsd)) / wsd, 0.0), 1.0)  # 0 through the stable phase, 1 at `end`
    return {
        "linear": lr - span * q,
        "cosine": LR_MIN + span * math.cos(math.pi * q / 2) ** 2,
        "exponential": LR_MIN + span * (2 ** (1 - q) - 1),
        "minus_sqrt": lr - span * math.sqrt(q),
    }[wsd_style]


def sgd(lr=0.5, n=2):
    params = [nn.Parameter(torch.zeros(3)) for _ in range(n)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def collect(opt, sched, steps):
    """Every group's lr at steps 0..steps, checking get_last_lr() agrees."""
    out = []
    for _ in range(steps + 1):
        lrs = [g["lr"] for g in opt.param_groups]
        assert sched.get_last_lr() == lrs
        out.append(lrs)
        opt.step()
        sched.step()
    return out


def check(got, want):
    for step, (lrs, w) in enumerate(zip(got, want)):
        assert lrs == pytest.approx([w] * len(lrs), rel=1e-12, abs=1e-15), f"step {step}"


def make(opt, **kw):
    args = dict(total_steps=TOTAL, warmup_steps=WARM, lr=LR, lr_min=LR_MIN, lr_start=LR_START)
    args.update(kw)
    return get_hyper_lr_scheduler(opt, **args)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_decay_styles_match_closed_form(style):
    opt = sgd()
    got = collect(opt, make(opt, decay_style=style), TOTAL + 5)
    check(got, [expected_lr(s, style) for s in range(TOTAL + 6)])
    assert got[0][0] == LR_START and got[WARM][0] == pytest.approx(LR)
    assert got[TOTAL + 5][0] == pytest.approx(LR if style == "constant" else LR_MIN)


@pytest.mark.parametrize("wsd_style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_styles_match_closed_form(wsd_style):
    opt = sgd()
    sched = make(opt, decay_style="WSD", wsd_decay_steps=WSD, lr_wsd_decay_style=wsd_style)
    got = collect(opt, sched, TOTAL + 5)
    check(got, [expected_lr(s, "WSD", wsd_style) for s in range(TOTAL + 6)])
    assert all(lrs[0] == pytest.approx(LR) for lrs in got[WARM:TOTAL - WSD + 1])  # the stable phase
    assert got[TOTAL - WSD + 1][0] < LR and got[TOTAL][0] == pytest.approx(LR_MIN)


def test_cosine_midpoint_and_default_style():
    opt = sgd()
    sched = make(opt)  # decay_style defaults to cosine
    got = collect(opt, sched, TOTAL)
    assert sched.decay_style == "cosine"
    assert got[(WARM + TOTAL) // 2][0] == pytest.approx((LR + LR_MIN) / 2, rel=1e-12)


def test_lr_decay_ratio_ends_the_decay_early():
    opt = sgd()
    got = collect(opt, make(opt, decay_style="linear", lr_decay_ratio=0.8), TOTAL)
    check(got, [expected_lr(s, "linear", end=80) for s in range(TOTAL + 1)])
    assert all(lrs[0] == LR_MIN for lrs in got[80:])


def test_lr_decay_ratio_with_wsd():
    opt = sgd()
    sched = make(opt, decay_style="WSD", lr_decay_ratio=0.5, wsd_decay_steps=20, lr_wsd_decay_style="cosine")
    got = collect(opt, sched, TOTAL)
    check(got, [expected_lr(s, "WSD", "cosine", end=50, wsd=20) for s in range(TOTAL + 1)])


def test_warmup_ratio_is_a_share_of_total_steps():
    opt_a, opt_b = sgd(), sgd()
    by_ratio = make(opt_a, warmup_steps=0, warmup_ratio=0.15, decay_style="linear")
    assert by_ratio.warmup_steps == 15
    got = collect(opt_a, by_ratio, TOTAL)
    check(got, [expected_lr(s, "linear", warm=15) for s in range(TOTAL + 1)])
    assert got == collect(opt_b, make(opt_b, warmup_steps=15, decay_style="linear"), TOTAL)


def test_no_warmup_starts_at_peak():
    opt = sgd()
    got = collect(opt, make(opt, warmup_steps=0, decay_style="cosine"), TOTAL)
    check(got, [expected_lr(s, "cosine", warm=0) for s in range(TOTAL + 1)])
    assert got[0][0] == LR


def test_is_a_torch_scheduler():
    opt = sgd()
    sched = make(opt, decay_style="linear")
    assert isinstance(sched, (HyperLRScheduler, LRScheduler))
    assert opt.param_groups[0]["lr"] == LR_START  # construction sets step 0's lr, as torch schedulers do
    sched.step(50)  # torch's explicit-step form jumps there
    assert sched.last_epoch == 50 and sched.get_last_lr()[0] == pytest.approx(expected_lr(50, "linear"))


def test_tensor_lr_is_filled_in_place():
    p = nn.Parameter(torch.zeros(3))
    lr = torch.tensor(0.5)
    opt = torch.optim.SGD([p], lr=lr)
    sched = make(opt, decay_style="linear")
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(expected_lr(1, "linear"))


class Chained:
    """A chained optimizer: several torch optimizers behind one param_groups list."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()


def test_chained_optimizer_gets_one_lr_on_all_groups():
    w, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    first = torch.optim.SGD([{"params": [w]}, {"params": [b]}], lr=0.1)
    second = torch.optim.AdamW([c], lr=0.02)
    chained = Chained(first, second)
    got = collect(chained, make(chained, decay_style="cosine"), TOTAL)
    assert all(len(lrs) == 3 for lrs in got)
    check(got, [expected_lr(s, "cosine") for s in range(TOTAL + 1)])
    assert second.param_groups[0]["lr"] == first.param_groups[1]["lr"]  # written through to the optimizers


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="param_groups"):
        get_hyper_lr_scheduler(object(), total_steps=10)


def _train(model, opt, sched, start, stop, lrs):
    """Steps start..stop-1 of a run whose batch depends only on the step; records each step's lr."""
    for step in range(start, stop):
        lrs.append(opt.param_groups[0]["lr"])
        x = torch.sin(torch.arange(12.0) + step).view(4, 3)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        sched.step()


def _setup(**kw):
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=7.0)  # overwritten by the schedule
    args = dict(decay_style="WSD", wsd_decay_steps=WSD, lr_wsd_decay_style="minus_sqrt")
    args.update(kw)
    return model, opt, make(opt, **args)


def _checkpoint(model, opt, sched):
    """Round-trip through torch.save/torch.load(weights_only=True), as a real checkpoint does."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_resume_mid_run_gives_the_same_lrs_and_weights(scheduler_first):
    model, opt, sched = _setup()
    straight = []
    _train(model, opt, sched, 0, TOTAL, straight)
    check([[v] for v in straight], [expected_lr(s, "WSD", "minus_sqrt") for s in range(TOTAL)])

    first, opt_1, sched_1 = _setup()
    resumed = []
    _train(first, opt_1, sched_1, 0, 40, resumed)
    assert json.loads(json.dumps(sched_1.state_dict())) == sched_1.state_dict()  # plain Python values
    ckpt = _checkpoint(first, opt_1, sched_1)

    second, opt_2, sched_2 = _setup()
    second.load_state_dict(ckpt["model"])
    if scheduler_first:
        sched_2.load_state_dict(ckpt["sched"])
        opt_2.load_state_dict(ckpt["opt"])
    else:
        opt_2.load_state_dict(ckpt["opt"])
        sched_2.load_state_dict(ckpt["sched"])
    assert sched_2.last_epoch == 40 and sched_2.get_last_lr() == [expected_lr(40, "WSD", "minus_sqrt")]
    _train(second, opt_2, sched_2, 40, TOTAL, resumed)
    assert resumed == straight
    for a, b in zip(model.parameters(), second.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("override", [False, True])
def test_override_opt_param_scheduler_picks_constructor_or_checkpoint(override):
    model, opt, sched = _setup()
    _train(model, opt, sched, 0, 40, [])
    state = sched.state_dict()

    _, opt_2, sched_2 = _setup(decay_style="linear", lr=2 * LR, override_opt_param_scheduler=override)
    sched_2.load_state_dict(state)
    got = collect(opt_2, sched_2, TOTAL - 40)
    if override:  # the new arguments win; only the step count comes from the checkpoint
        want = [expected_lr(s, "linear", lr=2 * LR) for s in range(40, TOTAL + 1)]
    else:  # the checkpoint's schedule goes on unchanged
        want = [expected_lr(s, "WSD", "minus_sqrt") for s in range(40, TOTAL + 1)]
    check(got, want)
    assert (sched_2.decay_style, sched_2.lr) == (("linear", 2 * LR) if override else ("WSD", LR))


@pytest.mark.parametrize("kwargs, match", [
    (dict(total_steps=0), r"total_steps must be a positive int"),
    (dict(total_steps=10.5), r"total_steps must be a positive int"),
    (dict(total_steps=10, warmup_steps=-1), r"warmup_steps must be an int >= 0"),
    (dict(total_steps=10, warmup_steps=11), r"warmup_steps \(11\) exceeds .*lower warmup_steps"),
    (dict(total_steps=10, warmup_steps=6, lr_decay_ratio=0.5), r"warmup_steps \(6\) exceeds .* = 5"),
    (dict(total_steps=10, warmup_ratio=1.5), r"warmup_ratio must be in \[0, 1\]"),
    (dict(total_steps=10, warmup_steps=2, warmup_ratio=0.1), r"either warmup_steps .* or warmup_ratio"),
    (dict(total_steps=10, decay_style="step"),
     r"decay_style 'step' is unknown; use one of constant, linear, cosine, WSD"),
    (dict(total_steps=10, decay_style="WSD", wsd_decay_steps=2, lr_wsd_decay_style="sqrt"),
     r"lr_wsd_decay_style 'sqrt' is unknown; use one of linear, cosine, exponential, minus_sqrt"),
    (dict(total_steps=10, lr=1e-4, lr_min=1e-3), r"lr_min \(0.001\) is larger than the peak lr \(0.0001\)"),
    (dict(total_steps=10, lr_start=-1.0), r"must all be >= 0"),
    (dict(total_steps=10, lr_decay_ratio=0.0), r"lr_decay_ratio \(0.0\) must be > 0"),
    (dict(total_steps=10, decay_style="WSD"), r"decay_style='WSD' needs wsd_decay_steps"),
    (dict(total_steps=10, warmup_steps=4, decay_style="WSD", wsd_decay_steps=7),
     r"wsd_decay_steps \(7\) must be an int in \[1, 6\]"),
])
def test_bad_arguments_are_named(kwargs, match):
    opt = sgd()
    before = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        get_hyper_lr_scheduler(opt, **kwargs)
    assert [g["lr"] for g in opt.param_groups] == before  # a rejected schedule leaves the optimizer alone
