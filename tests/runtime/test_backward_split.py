"""Zero-bubble (ZB-H1): ``runtime/partition.py:split_backward`` cuts a backward program into an
input-gradient program I and a weight-gradient program W, checked numerically against the unsplit
program. The executor runs them (``tests/pipeline/test_pipeline_zero_bubble.py``); the schedule
itself is tested in ``tests/pipeline/test_pipeline_schedules.py``.
"""

import pytest
import torch

from hyper_parallel.runtime.partition import BackwardSplit, split_backward


def _backward(x, w, g, bias_g):
    shared = g * 2.0  # read by both the input and the weight gradient: must go to I
    grad_x = shared @ w  # input gradient (sent to the previous stage)
    grad_w = shared.t() @ x  # weight gradient
    grad_b = (bias_g + shared).sum(0)  # weight gradient reading a placeholder only W uses
    return grad_w, grad_x, grad_b, grad_x * 3.0  # (grad, send_bwd, grad, send_bwd)


def _ops(gm):
    return [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _args():
    torch.manual_seed(0)
    return (torch.randn(4, 3), torch.randn(5, 3), torch.randn(4, 5), torch.randn(4, 5))


def test_split_backward_matches_unsplit_program():
    gm = torch.fx.symbolic_trace(_backward)
    split = split_backward(gm, weight_outputs=(2, 0))
    assert isinstance(split, BackwardSplit)
    assert split.input_outputs == (1, 3) and split.weight_outputs == (0, 2)
    # I reads w and g only; x and bias_g are read by W only, straight from the caller (they need
    # not exist yet when I runs).
    assert split.input_args == (1, 2) and split.weight_args == (0, 3)
    # The shared product is computed once, in I; the weight products only in W; W reads the
    # shared value (the hand-off) and the placeholders only it needs.
    assert _ops(split.input_gm) == ["mul", "matmul", "mul_1"]
    assert _ops(split.weight_gm) == ["t", "matmul_1", "add", "sum_1"]
    assert [n.name for n in split.input_gm.graph.nodes if n.op == "placeholder"] == ["w", "g"]
    assert [n.name for n in split.weight_gm.graph.nodes if n.op == "placeholder"] == ["mul", "x", "bias_g"]
    args = _args()
    ref = gm(*args)
    i_out = split.input_gm(*(args[i] for i in split.input_args))
    num_i = len(split.input_outputs)
    assert len(i_out) == num_i + 1  # the shared value is I's only hand-off
    w_out = split.weight_gm(*i_out[num_i:], *(args[i] for i in split.weight_args))
    for slot, value in zip(split.input_outputs, i_out):
        torch.testing.assert_close(value, ref[slot])
    for slot, value in zip(split.weight_outputs, w_out):
        torch.testing.assert_close(value, ref[slot])


def test_split_backward_everything_in_i_when_no_weights():
    """A stage without parameters: W computes nothing, takes nothing and returns nothing."""
    gm = torch.fx.symbolic_trace(_backward)
    split = split_backward(gm, weight_outputs=())
    assert split.input_outputs == (0, 1, 2, 3) and split.weight_outputs == () and split.weight_args == ()
    assert not _ops(split.weight_gm) and not [n for n in split.weight_gm.graph.nodes if n.op == "placeholder"]
    assert split.weight_gm() == ()
    args = _args()
    for a, b in zip(split.input_gm(*(args[i] for i in split.input_args)), gm(*args)):
        torch.testing.assert_close(a, b)


def test_split_backward_weight_slot_that_is_a_placeholder_or_shared():
    """A weight gradient that is a backward input itself goes to W as a direct input; one that I
    also returns (the same node in two slots) is handed over."""

    def backward(g, h):
        grad_x = g * 2.0
        return h, grad_x, grad_x

    gm = torch.fx.symbolic_trace(backward)
    split = split_backward(gm, weight_outputs=(0, 2))
    assert split.input_args == (0,) and split.weight_args == (1,) and not _ops(split.weight_gm)
    g, h = torch.randn(3), torch.randn(3)
    i_out = split.input_gm(g)
    w_out = split.weight_gm(*i_out[1:], h)
    torch.testing.assert_close(w_out[0], h)
    torch.testing.assert_close(w_out[1], g * 2.0)


def test_split_backward_rejects_bad_slots():
    with pytest.raises(ValueError, match="out of range"):
        split_backward(torch.fx.symbolic_trace(_backward), weight_outputs=(4,))
