"""CPU kernels for the CUDA-only SDPA aten ops, so their code paths can be tested on a CPU machine.

On a GPU, ``torch.nn.functional.scaled_dot_product_attention`` lowers to one of three fused op
families -- ``aten._scaled_dot_product_flash_attention``, ``..._efficient_attention`` and
``..._cudnn_attention`` -- each with its own backward op.  The library has code written for these
ops (context-parallel attention, ``cp/attention_ops.py``; recompute's op lists), but torch ships no
CPU kernel for any of the six, so on a CPU-only machine a graph never contains them and a test
cannot run them.  This module fills the gap for tests only:

* :func:`register_cpu_emulation` registers a CPU kernel for each of the six ops (once per process).
  The numbers are the CPU flash kernel's (``aten._scaled_dot_product_flash_attention_for_cpu`` and
  its backward); every output has the shape, dtype and memory layout the op's Meta kernel gives, so
  a real run and a fake-tensor trace agree.  The logsumexp is what the GPU op returns: natural-log
  log-sum-exp of the scaled scores per query row, float32 (so float64 inputs get float32-accurate
  gradients through it), padded to a multiple of 32 for ``efficient`` and with a trailing dim of 1
  for ``cudnn``.  Dropout and the debug attention mask are refused: tests need exact numbers.
* :func:`sdpa_as` makes ``torch.nn.functional.scaled_dot_product_attention`` call one family's
  forward op while it is active, so a model that looks that function up at call time produces
  that op in a captured graph and, through autograd, its backward op::

      with sdpa_as("efficient"):
          gm = make_fx(train_step, tracing_mode="fake")(*args)

The library itself never imports this module; only tests do.  Registering the kernels changes
nothing for code that does not call the six ops.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional

import torch

__all__ = ["register_cpu_emulation", "sdpa_as", "FAMILIES"]

aten = torch.ops.aten

FAMILIES = ("flash", "efficient", "cudnn")

# The Library object owns the registrations: they are dropped when it is garbage collected, so it
# lives at module level for the life of the process.
_LIB: Optional[torch.library.Library] = None
_LIB_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def _refuse_inexact(op: str, dropout_p: float, return_debug_mask: bool = False) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"aten.{op} on CPU (hyper_parallel.testing.emulated_attention) supports only dropout_p=0.0, "
            f"got {dropout_p}: dropout would draw from an RNG the GPU kernel does not share, and tests "
            "need exact numbers"
        )
    if return_debug_mask:
        raise NotImplementedError(
            f"aten.{op} on CPU (hyper_parallel.testing.emulated_attention) does not support "
            "return_debug_mask=True"
        )


def _check_4d(op: str, **tensors: Optional[torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() != 4:
            raise ValueError(
                f"aten.{op} on CPU (hyper_parallel.testing.emulated_attention) expects 4-D "
                f"[batch, heads, seq, head_dim] tensors; {name} has shape {tuple(t.shape)}"
            )


def _on_rocm_gpu() -> bool:
    # The Meta kernels give some outputs a different form on ROCm; mirror them so that a real run
    # and a fake trace agree on every machine.
    return bool(torch.version.hip) and torch.cuda.is_available()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # The CPU kernel keeps its logsumexp in this dtype and wants it back in the same one.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad_head_dim(t: Optional[torch.Tensor], head_dim: int) -> Optional[torch.Tensor]:
    if t is None or t.size(-1) == head_dim:
        return t
    return torch.nn.functional.pad(t, (0, head_dim - t.size(-1)))


def _cpu_forward(q, k, v, bias, is_causal, scale):
    """(out, lse) from the CPU kernel; lse is [B, H, S_q] in the accumulation dtype."""
    d_qk, d_v = q.size(-1), v.size(-1)
    if d_qk == d_v:
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )
    # The CPU kernel needs one head dim for q, k and v, the GPU ops do not. Zero columns change
    # neither the scores nor the output columns kept; only the default scale must stay q's.
    d = max(d_qk, d_v)
    scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        *(_pad_head_dim(t, d) for t in (q, k, v)), 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return out[..., :d_v], lse


def _cpu_backward(grad_out, q, k, v, out, lse, bias, is_causal, scale):
    """(grad_q, grad_k, grad_v) from the CPU kernel, given the GPU op's [B, H, S_q] float32 lse."""
    lse = lse.to(_accumulation_dtype(q.dtype))
    d_qk, d_v = q.size(-1), v.size(-1)
    if d_qk == d_v:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )
    d = max(d_qk, d_v)  # see _cpu_forward
    scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
    padded = (_pad_head_dim(t, d) for t in (grad_out, q, k, v, out))
    grad_q, grad_k, grad_v = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *padded, lse, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return grad_q[..., :d_qk], grad_k[..., :d_qk], grad_v[..., :d_v]


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each of ``t``'s key/value heads serves ``heads / t.size(1)``
    consecutive query heads (the flash kernel reads them so; the CPU kernel wants them repeated)."""
    groups = heads // t.size(1)
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_heads`: each key/value head collects its query heads'."""
    groups = grad.size(1) // heads
    return grad if groups == 1 else grad.unflatten(1, (heads, groups)).sum(2)


def _float32_lse(lse: torch.Tensor) -> torch.Tensor:
    # The CPU kernel's lse is a [B, H, S] view of [B, S, H] memory in the accumulation dtype; the
    # GPU ops return a contiguous float32 one.
    return torch.empty(lse.shape, dtype=torch.float32, device=lse.device).copy_(lse)


def _empty_ordered_like(query: torch.Tensor, shape) -> torch.Tensor:
    """Empty tensor of ``shape`` whose dims are nested in memory in the same order as ``query``'s
    (the layout the cudnn Meta kernel gives its output)."""
    if tuple(query.shape) == tuple(shape):
        return torch.empty_like(query)
    order = sorted(range(query.dim()), key=lambda d: query.stride(d), reverse=True)
    return torch.empty_permuted(shape, order, dtype=query.dtype, device=query.device)


def _bias_grad(grad_out, q, k, v, bias, out, lse, is_causal, scale) -> torch.Tensor:
    """Gradient of the additive bias, dS = P * (dP - rowsum(dO * O)).

    The CPU kernel does not return it, so it is computed here by hand from the lse the op was given
    (not recomputed: under context parallelism that lse is the merged one of all chunks, and P must
    be normalised by it).
    """
    dtype = _accumulation_dtype(q.dtype)
    q, k, v, grad_out, out = (t.to(dtype) for t in (q, k, v, grad_out, out))
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + bias.to(dtype)
    if is_causal:
        # Top-left aligned, as the CPU kernel (and SDPA's is_causal) does.
        s_q, s_k = scores.shape[-2:]
        hidden = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))
    # A fully masked row has lse = -inf and would give NaN; it attends to nothing.
    probs = probs.masked_fill(scores == float("-inf"), 0.0)
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
    row_dot = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot)
    # A bias broadcast over batch or heads collects the gradient of every row it was added to.
    return grad_scores.sum_to_size(bias.shape)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    op = "_scaled_dot_product_flash_attention"
    _refuse_inexact(op, dropout_p, return_debug_mask)
    _check_4d(op, query=query, key=key, value=value)
    if value.size(-1) != query.size(-1):
        raise ValueError(f"aten.{op} needs query and value with the same head_dim")
    heads = query.size(1)  # fewer key/value heads: grouped-query attention, native in flash
    out_cpu, lse_cpu = _cpu_forward(query, _repeat_heads(key, heads), _repeat_heads(value, heads), None,
                                    is_causal, scale)
    out = torch.empty_like(query).copy_(out_cpu)
    if _on_rocm_gpu():
        rng_state = torch.zeros((), dtype=torch.long)
        unused = torch.zeros((), dtype=torch.long)
    else:
        rng_state = torch.zeros(2, dtype=torch.uint64)
        unused = torch.zeros((), dtype=torch.uint64)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    # cum_seq_q / cum_seq_k are undefined for the dense (non-varlen) op, as on the GPU; a Python
    # kernel's None becomes an undefined Tensor.
    return (
        out, _float32_lse(lse_cpu), None, None, query.size(2), key.size(2), rng_state, unused, debug_mask,
    )


def _flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    dropout_p, is_causal, philox_seed, philox_offset, *, scale=None,
):
    op = "_scaled_dot_product_flash_attention_backward"
    _refuse_inexact(op, dropout_p)
    _check_4d(op, query=query, key=key, value=value)
    heads = query.size(1)
    grad_q, grad_k, grad_v = _cpu_backward(grad_out, query, _repeat_heads(key, heads), _repeat_heads(value, heads),
                                           out, logsumexp, None, is_causal, scale)
    grads = (grad_q, _sum_heads(grad_k, key.size(1)), _sum_heads(grad_v, value.size(1)))
    return tuple(torch.empty_like(x).copy_(g) for x, g in zip((query, key, value), grads))


def _efficient_forward(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None,
):
    op = "_scaled_dot_product_efficient_attention"
    _refuse_inexact(op, dropout_p)
    _check_4d(op, query=query, key=key, value=value)
    out_cpu, lse_cpu = _cpu_forward(query, key, value, attn_bias, is_causal, scale)
    b, h, s_q = query.shape[:3]
    # The GPU kernel writes its output as [B, S, H, D] memory.
    out = torch.empty(b, s_q, h, value.size(-1), dtype=query.dtype, device=query.device).transpose(1, 2)
    out.copy_(out_cpu)
    if not compute_log_sumexp:
        lse_len = 0
    elif _on_rocm_gpu():
        lse_len = s_q
    else:
        lse_len = math.ceil(s_q / 32) * 32  # the CUDA kernel's row tiles of 32 queries
    lse = torch.zeros(b, h, lse_len, dtype=torch.float32, device=query.device)
    if lse_len:
        lse[..., :s_q] = lse_cpu
    seed = torch.zeros((), dtype=torch.long)
    offset = torch.zeros((), dtype=torch.long)
    return out, lse, seed, offset


def _efficient_backward(
    grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
    dropout_p, grad_input_mask, is_causal=False, *, scale=None,
):
    op = "_scaled_dot_product_efficient_attention_backward"
    _refuse_inexact(op, dropout_p)
    _check_4d(op, query=query, key=key, value=value)
    s_q = query.size(2)
    if logsumexp.size(-1) < s_q:
        raise ValueError(
            f"aten.{op} needs the forward's logsumexp; it was run with compute_log_sumexp=False"
        )
    lse = logsumexp[..., :s_q]
    grads = _cpu_backward(grad_out_, query, key, value, out, lse, attn_bias, is_causal, scale)
    # The CPU kernel's gradients are [B, S, H, D] memory already, as the CUDA op's are; copying into
    # a fresh [B, S, H, D] tensor keeps that true should the CPU kernel change.
    grad_q, grad_k, grad_v = (
        torch.empty_permuted(g.shape, (0, 2, 1, 3), dtype=x.dtype, device=x.device).copy_(g)
        for x, g in zip((query, key, value), grads)
    )
    grad_bias = None  # undefined Tensor, as the op returns when the bias needs no gradient
    if attn_bias is not None and grad_input_mask[3]:
        # The CUDA op allocates the bias gradient with its last dim padded to a multiple of 16 and
        # returns a slice of it; keep that stride.
        last = attn_bias.size(-1)
        padded = list(attn_bias.shape[:-1]) + [-(-last // 16) * 16]
        grad_bias = torch.empty(padded, dtype=attn_bias.dtype, device=attn_bias.device)[..., :last]
        grad_bias.copy_(_bias_grad(grad_out_, query, key, value, attn_bias, out, lse, is_causal, scale))
    return grad_q, grad_k, grad_v, grad_bias


def _cudnn_forward(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
    return_debug_mask=False, *, scale=None,
):
    op = "_scaled_dot_product_cudnn_attention"
    _refuse_inexact(op, dropout_p, return_debug_mask)
    _check_4d(op, query=query, key=key, value=value)
    out_cpu, lse_cpu = _cpu_forward(query, key, value, attn_bias, is_causal, scale)
    out = _empty_ordered_like(query, (*query.shape[:3], value.size(-1))).copy_(out_cpu)
    # The cudnn op returns its logsumexp whether or not compute_log_sumexp asks for it.
    lse = _float32_lse(lse_cpu).unsqueeze(-1)
    seed = torch.zeros((), dtype=torch.long)
    offset = torch.zeros((), dtype=torch.long)
    # cum_seq_q / cum_seq_k and the debug mask are undefined Tensors (None), as the Meta kernel gives.
    return out, lse, None, None, query.size(2), key.size(2), seed, offset, None


def _cudnn_backward(
    grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
    cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None,
):
    op = "_scaled_dot_product_cudnn_attention_backward"
    _refuse_inexact(op, dropout_p)
    _check_4d(op, query=query, key=key, value=value)
    lse = logsumexp.squeeze(-1) if logsumexp.dim() == 4 else logsumexp
    grads = _cpu_backward(grad_out, query, key, value, out, lse, attn_bias, is_causal, scale)
    return tuple(torch.empty_like(x).copy_(g) for x, g in zip((query, key, value), grads))


_KERNELS = {
    "_scaled_dot_product_flash_attention": _flash_forward,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient_forward,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cudnn_forward,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
}


def register_cpu_emulation() -> None:
    """Register the CPU kernels of the six CUDA-only SDPA ops; later calls do nothing."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        for name, kernel in _KERNELS.items():
            lib.impl(name, kernel, "CPU")
        _LIB = lib


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention replacement
# ---------------------------------------------------------------------------------------------


def _additive(mask: Optional[torch.Tensor], query: torch.Tensor) -> Optional[torch.Tensor]:
    # The fused ops take an additive bias; SDPA's boolean masks mean "True = may attend".
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=query.dtype, device=query.device))


def _sdpa_for(family: str):
    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if enable_gqa and family != "flash":
            # The flash op takes fewer key/value heads itself; for the others, repeat them first.
            key, value = (_repeat_heads(t, query.size(1)) for t in (key, value))
        if family == "flash":
            if attn_mask is not None:
                raise ValueError(
                    "sdpa_as('flash'): the flash op takes no attn_mask; use is_causal or the "
                    "'efficient' / 'cudnn' family"
                )
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        bias = _additive(attn_mask, query)
        if family == "efficient":
            if bias is not None:
                # As SDPA does before the efficient op: one bias entry per (batch, head, q, k).
                bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]

    scaled_dot_product_attention.__doc__ = (
        "torch.nn.functional.scaled_dot_product_attention through "
        f"aten._scaled_dot_product_{family}_attention (installed by "
        "hyper_parallel.testing.emulated_attention.sdpa_as)."
    )
    return scaled_dot_product_attention


@contextlib.contextmanager
def sdpa_as(family: str) -> Iterator[None]:
    """While active, ``torch.nn.functional.scaled_dot_product_attention`` calls the ``family``
    ("flash", "efficient" or "cudnn") forward op; registers the CPU kernels first.

    Only lookups made at call time see the replacement (``F.scaled_dot_product_attention(...)``),
    not a reference taken earlier (``from torch.nn.functional import scaled_dot_product_attention``).
    """
    if family not in FAMILIES:
        raise ValueError(f"sdpa_as: family must be one of {FAMILIES}, got {family!r}")
    register_cpu_emulation()
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _sdpa_for(family)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
