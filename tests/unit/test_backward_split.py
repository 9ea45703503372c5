"""Zero-bubble (ZB-H1) pieces that run today: the cut of a backward program into B and W.

The executor does not run ZB-H1 yet (``PipelinePlan`` refuses ``schedule="ZBH1"``); the schedule
itself is tested in ``tests/unit/test_pipeline_schedules.py``. Here: ``runtime/partition.py:
split_backward`` on a backward program, checked numerically against the unsplit program.
"""

import torch

from hyper_parallel.runtime.partition import split_backward


def _backward(x, w, g, bias_g):
    shared = g * 2.0  # read by both the input and the weight gradient: must go to B
    grad_x = shared @ w  # input gradient (sent to the previous stage)
    grad_w = shared.t() @ x  # weight gradient
    grad_b = (bias_g + shared).sum(0)  # weight gradient reading a placeholder only W uses
    return grad_w, grad_x, grad_b, grad_x * 3.0  # (grad, send_bwd, grad, send_bwd)


def test_split_backward_matches_unsplit_program():
    gm = torch.fx.symbolic_trace(_backward)
    b_gm, w_gm, num_b, w_args = split_backward(gm, weight_outputs=(0, 2))
    assert num_b == 2 and w_args == [0, 3]  # x and bias_g: read by W only, straight from the caller
    b_ops = [n.name for n in b_gm.graph.nodes if n.op in ("call_function", "call_method")]
    w_ops = [n.name for n in w_gm.graph.nodes if n.op in ("call_function", "call_method")]
    # The shared product is computed once, in B; the weight products only in W; W reads the
    # shared value and the placeholders only it needs, handed over by B.
    assert b_ops == ["mul", "matmul", "mul_1"]
    assert w_ops == ["t", "matmul_1", "add", "sum_1"]
    assert [n.name for n in w_gm.graph.nodes if n.op == "placeholder"] == ["mul", "x", "bias_g"]
    torch.manual_seed(0)
    args = (torch.randn(4, 3), torch.randn(5, 3), torch.randn(4, 5), torch.randn(4, 5))
    ref = gm(*args)
    b_out = b_gm(*args)
    assert len(b_out) == num_b + 1  # the shared value is B's only hand-off
    w_out = w_gm(*b_out[num_b:], *(args[i] for i in w_args))
    torch.testing.assert_close(b_out[0], ref[1])
    torch.testing.assert_close(b_out[1], ref[3])
    torch.testing.assert_close(w_out[0], ref[0])
    torch.testing.assert_close(w_out[1], ref[2])


def test_split_backward_everything_in_b_when_no_weights():
    gm = torch.fx.symbolic_trace(_backward)
    b_gm, w_gm, num_b, w_args = split_backward(gm, weight_outputs=())
    assert num_b == 4 and not [n for n in w_gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_split_backward_rejects_bad_slots():
    import pytest

    with pytest.raises(ValueError, match="out of range"):
        split_backward(torch.fx.symbolic_trace(_backward), weight_outputs=(4,))
