"""Check an SDPA kernel family's block interface against whole-sequence attention, in one process.

Context-parallel attention (``cp/ring.py``) computes attention block by block through
``cp/attention_ops.py``: each family's ``block_forward`` returns an output and a ``[B, H, S]``
log-sum-exp that blocks merge by, and ``block_backward`` takes the merged ones. Whether that holds
for a family is a property of its kernels (the efficient kernel's padded log-sum-exp, cuDNN's
trailing dim, flash's arguments), so :func:`blockwise_errors` checks it without any collective: the
sequence in two chunks, computed as ring attention on two ranks would (the diagonal blocks with the
causal mask, the later queries against the earlier keys without it, or every block with its slice
of an additive mask), merged, and compared with the math kernel on the whole sequence, output and
gradients. On CPU it runs the GPU families through their emulation (``emulated_attention``); on a
GPU (tests/gpu) through the real kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cp.attention_ops import FAMILIES


def _family(name: str):
    return next(f for f in FAMILIES if f.name == name)


def blockwise_errors(family: str, device: str, dtype: torch.dtype, masked: bool, seed: int = 0) -> dict:
    """Largest absolute differences (output, dq, dk, dv) between two-chunk blockwise attention with
    ``family``'s kernels and the math kernel on the whole sequence (computed in fp32). Causal
    unless ``masked`` (then an additive mask with some keys hidden from some queries)."""
    ops = _family(family)
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, h, s, d = 2, 4, 48, 32  # 24 tokens per chunk: not a multiple of 32 (the efficient kernel pads)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # [B, S, H, D] memory viewed as [B, H, S, D], as models make them.
    q, k, v, grad = (make(b, s, h, d).transpose(1, 2) for _ in range(4))
    mask = None
    if masked:
        mask = torch.zeros(b, h, s, s)
        mask[:, 1, :, 30:] = float("-inf")  # head 1 sees the first 30 keys only
        mask[:, :, :, :2] += torch.randn(b, h, s, 2, generator=g)
        mask = mask.to(device=device, dtype=dtype)

    half = s // 2
    chunks = [slice(0, half), slice(half, s)]
    # (query chunk, key chunk, causal) as the ring computes them; without a mask the earlier queries
    # never read later keys.
    calls = [(0, 0, not masked), (1, 0, False), (1, 1, not masked)] + ([(0, 1, False)] if masked else [])

    def rows(x, c, dim=2):
        return x[:, :, chunks[c]] if dim == 2 else x[..., chunks[c]]

    out = [None, None]
    lse = [None, None]
    extras = None
    for qc, kc, causal in calls:
        m = None if mask is None else rows(rows(mask, qc), kc, dim=3)
        o, l, other = ops.block_forward(rows(q, qc), rows(k, kc), rows(v, kc), causal, m, None)
        o, l = o.float(), l.float()
        extras = extras if extras is not None else other
        if out[qc] is None:
            out[qc], lse[qc] = o, l
        else:
            merged = torch.logaddexp(lse[qc], l)
            out[qc] = out[qc] * torch.exp(lse[qc] - merged).unsqueeze(-1) + o * torch.exp(l - merged).unsqueeze(-1)
            lse[qc] = merged
    rng = tuple(extras[:2]) if family != "cpu_flash" else ()
    out_local = [o.to(dtype) for o in out]
    dq = torch.zeros(b, h, s, d, device=device)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    for qc, kc, causal in calls:
        m = None if mask is None else rows(rows(mask, qc), kc, dim=3)
        gq, gk, gv = ops.block_backward(rows(grad, qc), rows(q, qc), rows(k, kc), rows(v, kc), out_local[qc],
                                        lse[qc], causal, m, None, rng)
        dq[:, :, chunks[qc]] += gq.float()
        dk[:, :, chunks[kc]] += gk.float()
        dv[:, :, chunks[kc]] += gv.float()

    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.float(),
                                             is_causal=not masked)
    ref_grads = torch.autograd.grad(ref, leaves, grad.float())
    mine = (torch.cat(out, dim=2), dq, dk, dv)
    expected = (ref.detach(), *ref_grads)
    return {name: (a - e).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), mine, expected)}
