"""The SDPA kernel families context-parallel attention computes with, behind one interface.

``torch.nn.functional.scaled_dot_product_attention`` reaches a captured graph as one of four
kernel pairs, chosen by torch for the device, dtype and mask: the CPU flash kernel, and on GPUs
the flash, memory-efficient and cuDNN kernels. They compute the same thing (softmax attention,
with the per-row log-sum-exp of the scaled scores saved for backward) but differ in their
arguments (a mask or not, ``compute_log_sumexp``, sequence lengths, the dropout RNG state) and
outputs (how many, the log-sum-exp's shape: ``[B, H, S]``; the efficient kernel's padded to a
multiple of 32 tokens; cuDNN's ``[B, H, S, 1]``).

:class:`AttentionOps` gives the context-parallel kernels (``cp/attention.py``, ``cp/ring.py``,
``cp/hybrid.py``) what they need from a family, so they are written once:

* :meth:`~AttentionOps.bind`: a node's arguments by meaning (:class:`Bound`);
* :meth:`~AttentionOps.block_forward` / :meth:`~AttentionOps.block_backward`: the family's own
  kernel on one block of queries and keys, with the log-sum-exp always ``[B, H, S]``;
* :meth:`~AttentionOps.forward_outputs` / :meth:`~AttentionOps.backward_outputs`: results put
  back in the op's own output form, which the rest of the graph reads.

:func:`family_of` maps an op (forward or backward) to its family. Attention dropout needs the
kernel's own random stream: the ring refuses it; the all-to-all mode runs the kernel on whole
sequences and passes the forward's RNG state to backward, as the op pair does on one device.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

aten = torch.ops.aten


@dataclasses.dataclass
class Bound:
    """One attention node's arguments by meaning. ``grad_out``, ``out``, ``lse`` are set for a
    backward op only (``lse`` in the op's own form: :meth:`AttentionOps.lse_tokens`). ``rng`` holds the
    dropout RNG state tensors a backward op was given (forwarded to the family's backward)."""

    query: object
    key: object
    value: object
    mask: object = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    grad_out: object = None
    out: object = None
    lse: object = None
    rng: tuple = ()
    mask_needs_grad: bool = False
    compute_lse: bool = True


def arguments_by_name(op, args: tuple, kwargs: dict) -> dict:
    """``op``'s arguments by schema name: positional, keyword, then defaults."""
    bound = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        else:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


def with_arguments(op, args: tuple, kwargs: dict, **updates) -> tuple:
    """``op``'s (args, kwargs) with the arguments in ``updates`` replaced (``mask`` names the
    family's ``attn_mask`` or ``attn_bias``): positional ones positional, keyword-only ones keywords."""
    a = arguments_by_name(op, args, kwargs)
    updates = {("attn_mask" if "attn_mask" in a else "attn_bias") if k == "mask" else k: v for k, v in updates.items()}
    a.update(updates)
    schema = op._schema.arguments
    positional = tuple(a[s.name] for s in schema if not s.kwarg_only)
    keywords = {s.name: a[s.name] for s in schema if s.kwarg_only and (s.name in kwargs or s.name in updates)}
    return positional, keywords


class AttentionOps:
    """One SDPA kernel family (subclasses below). ``forward`` / ``backward``: its op pair."""

    name = ""
    forward = backward = None

    def bind(self, op, args: tuple, kwargs: dict) -> Bound:
        a = arguments_by_name(op, args, kwargs)
        if op is self.forward and a.get("return_debug_mask"):
            raise ValueError(f"context-parallel attention does not return the {self.name} attention kernel's "
                             "debug mask (return_debug_mask=True); call it without")
        bound = Bound(a["query"], a["key"], a["value"], self._mask(a), float(a.get("dropout_p") or 0.0),
                      bool(a.get("is_causal")), a.get("scale"))
        if "compute_log_sumexp" in a:
            bound.compute_lse = bool(a["compute_log_sumexp"])
        if op is self.backward:
            bound.grad_out = a.get("grad_out", a.get("grad_out_"))
            bound.out = a["out"]
            bound.lse = a["logsumexp"]
            bound.rng = tuple(a[n] for n in ("philox_seed", "philox_offset") if n in a)
            mask_grad = a.get("grad_input_mask")
            bound.mask_needs_grad = bool(mask_grad is not None and len(mask_grad) > 3 and mask_grad[3])
        return bound

    def _mask(self, a: dict):
        return a.get("attn_mask", a.get("attn_bias"))

    def lse_tokens(self, lse, length: int):
        """The op's log-sum-exp as ``[B, H, length]``."""
        return lse

    def lse_output(self, lse):
        """``[B, H, S]`` log-sum-exp in the op's own form."""
        return lse

    def block_forward(self, q, k, v, causal: bool, mask, scale, dropout_p: float = 0.0):
        """(output, log-sum-exp ``[B, H, S]``, the op's other outputs) of ``q`` against ``k``/``v``."""
        raise NotImplementedError

    def block_backward(self, grad_out, q, k, v, out, lse, causal: bool, mask, scale, rng=(), dropout_p: float = 0.0):
        """(dq, dk, dv) of one block; ``lse`` is ``[B, H, S]``."""
        raise NotImplementedError

    def forward_outputs(self, out, lse, others: tuple, lengths: tuple[int, int], compute_lse: bool = True) -> tuple:
        """The op's output tuple from the output, the ``[B, H, S]`` log-sum-exp, the first block
        call's other outputs and the (query, key) sequence lengths the kernel saw."""
        return (out, self.lse_output(lse), *others)

    def backward_outputs(self, dq, dk, dv) -> tuple:
        return dq, dk, dv


class CpuFlash(AttentionOps):
    """``_scaled_dot_product_flash_attention_for_cpu``: an additive or boolean ``attn_mask``."""

    name = "cpu_flash"
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def block_forward(self, q, k, v, causal, mask, scale, dropout_p=0.0):
        out, lse = self.forward(q, k, v, dropout_p, causal, attn_mask=mask, scale=scale)
        return out, lse, ()

    def block_backward(self, grad_out, q, k, v, out, lse, causal, mask, scale, rng=(), dropout_p=0.0):
        return self.backward(grad_out, q, k, v, out, lse, dropout_p, causal, attn_mask=mask, scale=scale)


class CudaFlash(AttentionOps):
    """``_scaled_dot_product_flash_attention``: no mask; the output tuple carries the (unused)
    varlen offsets, the sequence lengths, the dropout RNG state and a debug mask."""

    name = "flash"
    forward = aten._scaled_dot_product_flash_attention.default
    backward = aten._scaled_dot_product_flash_attention_backward.default

    def block_forward(self, q, k, v, causal, mask, scale, dropout_p=0.0):
        out, lse, _, _, _, _, seed, offset, debug = self.forward(q, k, v, dropout_p, causal, False, scale=scale)
        return out, lse, (seed, offset, debug)

    def block_backward(self, grad_out, q, k, v, out, lse, causal, mask, scale, rng=(), dropout_p=0.0):
        seed, offset = rng
        # The flash backward reads the log-sum-exp rows contiguously.
        return self.backward(grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
                             dropout_p, causal, seed, offset, scale=scale)

    def forward_outputs(self, out, lse, others, lengths, compute_lse=True):
        seed, offset, debug = others
        return (out, lse, None, None, *lengths, seed, offset, debug)


def _aligned(mask, multiple: int = 16):
    """An additive mask block in memory whose rows start aligned, as the GPU kernels require
    (``scaled_dot_product_attention`` pads the mask the same way before calling them)."""
    if mask is None:
        return None
    width = mask.shape[-1]
    pad = -width % multiple
    return F.pad(mask, (0, pad))[..., :width] if pad else mask.contiguous()


class CudaEfficient(AttentionOps):
    """``_scaled_dot_product_efficient_attention``: an additive ``attn_bias``; the log-sum-exp is
    ``[B, H, ceil(S / 32) · 32]`` (empty unless ``compute_log_sumexp``)."""

    name = "efficient"
    forward = aten._scaled_dot_product_efficient_attention.default
    backward = aten._scaled_dot_product_efficient_attention_backward.default

    def lse_tokens(self, lse, length):
        return lse.narrow(-1, 0, length)

    def block_forward(self, q, k, v, causal, mask, scale, dropout_p=0.0):
        out, lse, seed, offset = self.forward(q, k, v, _aligned(mask), True, dropout_p, causal, scale=scale)
        return out, self.lse_tokens(lse, q.shape[2]), (seed, offset)

    def block_backward(self, grad_out, q, k, v, out, lse, causal, mask, scale, rng=(), dropout_p=0.0):
        seed, offset = rng
        length = lse.shape[-1]
        padded = F.pad(lse, (0, math.ceil(length / 32) * 32 - length)).contiguous()
        dq, dk, dv, _ = self.backward(grad_out, q, k, v, _aligned(mask), out, padded, seed, offset, dropout_p,
                                      [True, True, True, False], causal, scale=scale)
        return dq, dk, dv

    def forward_outputs(self, out, lse, others, lengths, compute_lse=True):
        seed, offset = others
        if not compute_lse:  # the op's contract: an empty log-sum-exp
            lse = lse.new_empty((*lse.shape[:-1], 0))
        return (out, lse, seed, offset)

    def backward_outputs(self, dq, dk, dv):
        return dq, dk, dv, None


class CudaCudnn(AttentionOps):
    """``_scaled_dot_product_cudnn_attention``: an additive ``attn_bias``; the log-sum-exp is
    ``[B, H, S, 1]``."""

    name = "cudnn"
    forward = aten._scaled_dot_product_cudnn_attention.default
    backward = aten._scaled_dot_product_cudnn_attention_backward.default

    def lse_tokens(self, lse, length):
        return lse.squeeze(-1)

    def lse_output(self, lse):
        return lse.unsqueeze(-1)

    def block_forward(self, q, k, v, causal, mask, scale, dropout_p=0.0):
        out, lse, _, _, _, _, seed, offset, debug = self.forward(
            q, k, v, _aligned(mask), True, dropout_p, causal, False, scale=scale)
        return out, lse.squeeze(-1), (seed, offset, debug)

    def block_backward(self, grad_out, q, k, v, out, lse, causal, mask, scale, rng=(), dropout_p=0.0):
        seed, offset = rng
        return self.backward(grad_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, _aligned(mask),
                             None, None, q.shape[2], k.shape[2], dropout_p, causal, scale=scale)

    def forward_outputs(self, out, lse, others, lengths, compute_lse=True):
        seed, offset, debug = others
        return (out, lse.unsqueeze(-1), None, None, *lengths, seed, offset, debug)


FAMILIES = (CpuFlash(), CudaFlash(), CudaEfficient(), CudaCudnn())
_BY_OP = {op: f for f in FAMILIES for op in (f.forward, f.backward)}
ATTENTION_OPS = tuple(_BY_OP)


def local_rng(rng: tuple) -> tuple:
    """The RNG-state arguments of a backward op as local values (plain tensors, or DTensors when
    propagation gave them a layout)."""
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in rng)


def family_of(op) -> AttentionOps | None:
    """The family of an SDPA forward or backward op, None for any other op."""
    return _BY_OP.get(op)
