"""CPU emulation of the CUDA-only SDPA ops (hyper_parallel/testing/emulated_attention.py).

The emulated ops must give the math backend's numbers, the GPU op's logsumexp, and outputs laid
out exactly as the ops' Meta kernels say (a fake-tensor trace and a real run must agree, or code
written against traced graphs breaks on the real tensors). ``sdpa_as`` must put the family's
forward and backward ops into a traced graph and always restore ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from hyper_parallel.testing import emulated_attention as ea
from hyper_parallel.testing.emulated_attention import register_cpu_emulation, sdpa_as

aten = torch.ops.aten
B, S, H, D = 2, 5, 3, 4  # S = 5: not a multiple of 32, so the efficient lse has padding

FORWARD = {
    "flash": aten._scaled_dot_product_flash_attention.default,
    "efficient": aten._scaled_dot_product_efficient_attention.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention.default,
}
BACKWARD = {
    "flash": aten._scaled_dot_product_flash_attention_backward.default,
    "efficient": aten._scaled_dot_product_efficient_attention_backward.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
}
# float64 gradients go through the ops' float32 logsumexp, so they are float32-accurate only.
TOL = {
    torch.float32: dict(out=(1e-5, 1e-5), grad=(1e-5, 1e-5)),
    torch.float64: dict(out=(1e-12, 1e-12), grad=(1e-6, 1e-6)),
}


def _leaf(dtype, seq=S, head_dim=D):
    return torch.randn(B, seq, H * head_dim, dtype=dtype, requires_grad=True)


def _heads(x, head_dim=D):
    """[B, S, H*D] -> [B, H, S, D] the way the models do it (a transposed view)."""
    return x.view(x.size(0), x.size(1), H, head_dim).transpose(1, 2)


def _causal_bias(dtype, s_q=S, s_k=S):
    return torch.zeros(s_q, s_k, dtype=dtype).masked_fill(
        torch.ones(s_q, s_k, dtype=torch.bool).triu(1), float("-inf")
    )


def _inputs(dtype, masked):
    torch.manual_seed(0)
    xs = [_leaf(dtype) for _ in range(3)]
    mask = torch.randn(B, 1, S, S, dtype=dtype) if masked else None
    return xs, mask


def _hand_lse(q, k, mask, is_causal):
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores + mask.double()
    if is_causal:
        scores = scores + _causal_bias(torch.float64)
    return torch.logsumexp(scores, -1)


CASES = [
    (family, dtype, causal, masked)
    for family in ea.FAMILIES
    for dtype in (torch.float32, torch.float64)
    for causal in (False, True)
    for masked in ((False,) if family == "flash" else (False, True))
]


@pytest.mark.parametrize("family,dtype,causal,masked", CASES)
def test_matches_math_backend(family, dtype, causal, masked):
    xs, mask = _inputs(dtype, masked)
    # The efficient op returns a gradient for its bias; cudnn's has no derivative for it.
    bias_grad = masked and family == "efficient"
    if bias_grad:
        mask.requires_grad_(True)
    wrt = xs + ([mask] if bias_grad else [])
    grad_out = torch.randn(B, H, S, D, dtype=dtype)

    with sdpa_as(family):
        out = F.scaled_dot_product_attention(*map(_heads, xs), attn_mask=mask, is_causal=causal)
    grads = torch.autograd.grad(out, wrt, grad_out)

    # The math backend refuses a mask together with is_causal: fold the causal part into the mask.
    ref_mask = mask
    if masked and causal:
        ref_mask = mask + _causal_bias(dtype)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(
            *map(_heads, xs), attn_mask=ref_mask, is_causal=causal and not masked
        )
    ref_grads = torch.autograd.grad(ref, wrt, grad_out)

    rtol, atol = TOL[dtype]["out"]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    rtol, atol = TOL[dtype]["grad"]
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol)

    # The logsumexp, as the GPU op returns it.
    q, k, v = (_heads(x.detach()) for x in xs)
    m = None if mask is None else mask.detach()
    bias = () if family == "flash" else (m, True)
    lse = FORWARD[family](q, k, v, *bias, is_causal=causal)[1]
    assert lse.dtype == torch.float32
    if family == "efficient":
        assert lse.shape == (B, H, 32)
        assert torch.all(lse[..., S:] == 0)
        lse = lse[..., :S]
    elif family == "cudnn":
        assert lse.shape == (B, H, S, 1)
        lse = lse.squeeze(-1)
    torch.testing.assert_close(lse.double(), _hand_lse(q, k, m, causal), rtol=1e-6, atol=1e-6)


def _assert_same_layout(real, fake, what):
    assert len(real) == len(fake), what
    for i, (r, f) in enumerate(zip(real, fake)):
        where = f"{what} output {i}"
        if f is None:
            assert r is None, where
        elif isinstance(f, torch.Tensor):
            assert isinstance(r, torch.Tensor), where
            assert (r.shape, r.dtype) == (f.shape, f.dtype), where
            # The Meta kernels give the RNG seed/offset on device "meta", for shape and dtype only.
            if f.device.type != "meta":
                assert r.stride() == f.stride(), f"{where}: {r.stride()} != {f.stride()}"
        else:
            assert r == f, where


def _forward_args(family, q, k, v, bias, causal, compute_lse=True):
    if family == "flash":
        return (q, k, v, 0.0, causal)
    return (q, k, v, bias, compute_lse, 0.0, causal)


def _backward_args(family, fwd_args, outs, grad_out, bias_grad):
    q, k, v = fwd_args[:3]
    causal = fwd_args[-1]
    if family == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = outs
        return (grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
    bias = fwd_args[3]
    if family == "efficient":
        out, lse, seed, offset = outs
        mask = [True, True, True, bias_grad]
        return (grad_out, q, k, v, bias, out, lse, seed, offset, 0.0, mask, causal)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = outs
    return (grad_out, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, 0.0, causal)


def _fake_run(op, args):
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        return op(*fake_args)


LAYOUTS = {
    # name: (query, key, value) builders
    "model": lambda dt: tuple(_heads(_leaf(dt).detach()) for _ in range(3)),
    "contiguous": lambda dt: tuple(torch.randn(B, H, S, D, dtype=dt) for _ in range(3)),
    # value head dim != query head dim: the output cannot be empty_like(query)
    "wide_value": lambda dt: (
        _heads(_leaf(dt).detach()), _heads(_leaf(dt).detach()), _heads(_leaf(dt, head_dim=2 * D).detach(), 2 * D)
    ),
}


LAYOUT_CASES = [
    (family, layout, dtype, masked)
    for family in ea.FAMILIES
    for layout in sorted(LAYOUTS)
    for dtype in (torch.float32, torch.float64)
    for masked in (False, True)
    # flash takes no bias, and needs value's head dim = query's
    if family != "flash" or not (masked or layout == "wide_value")
]


@pytest.mark.parametrize("family,layout,dtype,masked", LAYOUT_CASES)
def test_layouts_match_meta(family, layout, dtype, masked):
    register_cpu_emulation()
    torch.manual_seed(0)
    q, k, v = LAYOUTS[layout](dtype)
    bias = torch.randn(B, H, S, S, dtype=dtype) if masked else None
    for causal in (False, True):
        fwd = _forward_args(family, q, k, v, bias, causal)
        outs = FORWARD[family](*fwd)
        _assert_same_layout(outs, _fake_run(FORWARD[family], fwd), f"{family} forward")
        grad_out = torch.randn_like(outs[0])
        for bias_grad in (False, True) if family == "efficient" else (False,):
            bwd = _backward_args(family, fwd, outs, grad_out, bias_grad and masked)
            grads = BACKWARD[family](*bwd)
            _assert_same_layout(grads, _fake_run(BACKWARD[family], bwd), f"{family} backward")


def test_efficient_without_logsumexp_matches_meta():
    register_cpu_emulation()
    q, k, v = LAYOUTS["model"](torch.float32)
    fwd = (q, k, v, None, False)
    outs = FORWARD["efficient"](*fwd)
    assert outs[1].shape == (B, H, 0)
    _assert_same_layout(outs, _fake_run(FORWARD["efficient"], fwd), "efficient forward")


def test_efficient_bool_mask_and_broadcast_bias():
    """A boolean mask becomes an additive bias; a bias broadcast over heads gets a summed gradient."""
    torch.manual_seed(0)
    xs = [_leaf(torch.float64) for _ in range(3)]
    keep = torch.rand(B, 1, S, S) > 0.3
    keep[..., 0] = True  # no fully masked row: the math backend gives NaN there
    grad_out = torch.randn(B, H, S, D, dtype=torch.float64)
    with sdpa_as("efficient"):
        out = F.scaled_dot_product_attention(*map(_heads, xs), attn_mask=keep)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*map(_heads, xs), attn_mask=keep)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    bias = torch.randn(B, 1, S, S, dtype=torch.float64, requires_grad=True)
    with sdpa_as("efficient"):
        out = F.scaled_dot_product_attention(*map(_heads, xs), attn_mask=bias)
    (g,) = torch.autograd.grad(out, bias, grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*map(_heads, xs), attn_mask=bias)
    (r,) = torch.autograd.grad(ref, bias, grad_out)
    torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["efficient", "cudnn"])
def test_value_head_dim_differs(family):
    """The GPU ops allow value's head dim to differ from query's; the CPU kernel does not, so the
    emulation pads: the numbers must not notice."""
    torch.manual_seed(0)
    xq, xk = _leaf(torch.float64), _leaf(torch.float64)
    xv = _leaf(torch.float64, head_dim=2 * D)
    heads = (_heads(xq), _heads(xk), _heads(xv, 2 * D))
    grad_out = torch.randn(B, H, S, 2 * D, dtype=torch.float64)
    with sdpa_as(family):
        out = F.scaled_dot_product_attention(*heads, is_causal=True)
    grads = torch.autograd.grad(out, (xq, xk, xv), grad_out)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*heads, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (xq, xk, xv), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ea.FAMILIES)
def test_trace_has_family_ops(family):
    torch.manual_seed(0)
    xs = [_leaf(torch.float32) for _ in range(3)]
    mask = None if family == "flash" else torch.randn(B, 1, S, S)

    def step(xq, xk, xv, mask):
        out = F.scaled_dot_product_attention(_heads(xq), _heads(xk), _heads(xv), attn_mask=mask, is_causal=True)
        return (out, *torch.autograd.grad(out.sum(), (xq, xk, xv)))

    with sdpa_as(family):
        gm = make_fx(step, tracing_mode="fake")(*xs, mask)
        expected = step(*xs, mask)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert FORWARD[family] in targets
    assert BACKWARD[family] in targets
    # The traced graph runs on CPU too, through the emulated kernels.
    got = gm(*xs, mask)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_sdpa_as_restores_original():
    original = F.scaled_dot_product_attention
    with sdpa_as("cudnn"):
        assert F.scaled_dot_product_attention is not original
        assert torch.nn.functional.scaled_dot_product_attention is F.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="boom"):
        with sdpa_as("flash"):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original
    with pytest.raises(ValueError, match="family"):
        with sdpa_as("math"):
            pass
    assert F.scaled_dot_product_attention is original


def test_refusals():
    q, k, v = LAYOUTS["model"](torch.float32)
    with sdpa_as("flash"):
        with pytest.raises(ValueError, match="attn_mask"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(S, S))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.1)
    with pytest.raises(NotImplementedError, match="return_debug_mask"):
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)


@pytest.mark.parametrize("family", ea.FAMILIES)
def test_grouped_query_attention(family):
    """Fewer key/value heads with enable_gqa=True (what transformers passes when there is no
    mask): the flash op takes them as they are, the others after repeating them; the output and
    the gradients of the un-repeated key/value equal the math backend's."""
    torch.manual_seed(0)
    q = torch.randn(B, 4, S, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, 4, S, D, dtype=torch.float64)
    with sdpa_as(family):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mine = (out, *torch.autograd.grad(out, (q, k, v), grad))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    for a, b in zip(mine, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_register_is_idempotent():
    register_cpu_emulation()
    lib = ea._LIB
    register_cpu_emulation()
    assert ea._LIB is lib
    for op in (*FORWARD.values(), *BACKWARD.values()):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")
