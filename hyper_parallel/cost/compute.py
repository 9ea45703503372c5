"""Per-node work of a lowered program (FLOPs, bytes moved) and its roofline time on a profile.

Reads only ``node.target``, the node's arguments and ``meta["val"]`` (local FakeTensor / meta
shapes); runs nothing. FLOPs come from torch's own formula registry
(``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode`` uses: mm, addmm, bmm,
baddbmm, convolutions and the GPU SDPA / flash / efficient / cudnn attention ops with their
backwards), plus formulas for the CPU flash-attention ops torch does not cover, built from torch's
own SDPA counting functions. Ops with no formula (elementwise, reductions, softmax, norms, custom
``hyper_parallel`` ops) count 0 FLOPs and cost their memory traffic: on every profile here they are
memory-bound, and MFU conventionally counts matmul FLOPs only. Like torch, attention FLOPs ignore
causal masking (the full S x S score matrix is counted).
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch.utils import flop_counter

from .. import compat
from ..compat import pytree
from ..ir.ops import VIEWS_WITHOUT_ANNOTATION
from .hardware import HardwareProfile

__all__ = ["NodeWork", "node_work", "roofline_time", "tensor_bytes", "COLLECTIVE_KIND", "WAIT_TARGET"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Collectives (issued at their node, finished at their wait) -> the kind ``comm.collective_time``
# prices; and the wait itself.
COLLECTIVE_KIND = {
    getattr(c10d, name).default: kind
    for name, kind in (
        ("all_reduce", "all_reduce"), ("all_reduce_", "all_reduce"), ("all_reduce_coalesced", "all_reduce"),
        ("all_gather_into_tensor", "all_gather"), ("all_gather_into_tensor_coalesced", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
        ("all_to_all_single", "all_to_all"), ("broadcast", "broadcast"),
    )
    if hasattr(c10d, name)
}
WAIT_TARGET = c10d.wait_tensor.default
# Schema says it allocates, but the kernel returns a view (as in analysis/memory.py).


def _causal_fraction(query, key, is_causal) -> float:
    """Share of the query-key pairs a causal mask leaves (flash kernels skip masked tiles): the
    lower triangle with its diagonal, top-left aligned as the CPU kernel masks."""
    if not is_causal:
        return 1.0
    q, k = query.shape[-2], key.shape[-2]
    if not q or not k:
        return 1.0
    visible = q * (q + 1) // 2 if q <= k else k * (k + 1) // 2 + (q - k) * k  # sum of min(i + 1, k)
    return visible / (q * k)


def _cpu_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    full = flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
    return int(full * _causal_fraction(query, key, is_causal))


def _cpu_flash_backward(grad_out, query, key, value, out=None, lse=None, dropout_p=0.0, is_causal=False,
                        *args, out_val=None, **kwargs) -> int:
    full = flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    return int(full * _causal_fraction(query, key, is_causal))


# Ops torch's registry lacks (checked for torch 2.13): the CPU flash-attention kernels SDPA
# dispatches to on CPU. Same math as the GPU flash kernels, so the same counts. torch's registry
# wins if a later version adds them.
_EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


@dataclasses.dataclass(frozen=True)
class NodeWork:
    """What one node asks of the device.

    ``kind``: "compute" (a kernel), "view" (metadata only: views, ``getitem``), "comm" (a collective;
    ``bytes`` is its local input), "wait" (``wait_tensor``) or "none" (placeholders, outputs).
    ``dtype``: the dtype whose peak FLOP/s applies (the first floating input's). ``attention``: one
    of the fused attention kernels, priced at the profile's attention efficiency."""

    kind: str
    flops: int = 0
    bytes: int = 0
    dtype: torch.dtype | None = None
    attention: bool = False  # a fused attention kernel (HardwareProfile.attention_efficiency)


_NONE = NodeWork("none")
_VIEW = NodeWork("view")
_WAIT = NodeWork("wait")


def tensor_bytes(value) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or a tuple/list of them), numel x itemsize."""
    return sum(compat.size_hint(t.numel()) * t.element_size()
               for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _arg_vals(node: torch.fx.Node):
    # fx's own map_arg: a fraction of pytree.tree_map_only's time, on every node of every program
    return torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))


def _is_view(target) -> bool:
    if target is operator.getitem or target in VIEWS_WITHOUT_ANNOTATION:
        return True
    if isinstance(target, compat.OpOverload):
        # A view aliases its input and writes nothing; in-place ops also alias but do move memory.
        return target.is_view
    return False


# The fused attention kernels and their backwards (torch's FLOP registry counts the GPU ones,
# _EXTRA_FORMULAS the CPU flash kernel): priced at HardwareProfile.attention_efficiency.
ATTENTION_PACKETS = frozenset(
    getattr(aten, name) for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    ) if hasattr(aten, name)
)


def _flops(target, args, kwargs, out_val) -> int:
    if not isinstance(target, compat.OpOverload):
        return 0
    packet = target.overloadpacket
    formula = flop_counter.flop_registry.get(packet) or _EXTRA_FORMULAS.get(packet)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out_val))
    except Exception as exc:  # a formula that cannot read these shapes: count the traffic only
        log.debug("no FLOP count for %s: %s", target, exc)
        return 0


def _first_float_dtype(values) -> torch.dtype | None:
    for t in pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


def node_work(node: torch.fx.Node) -> NodeWork:
    """The :class:`NodeWork` of one node of a lowered program."""
    if node.op != "call_function":
        return _NONE
    target = node.target
    if target == WAIT_TARGET:
        return _WAIT
    if _is_view(target):  # before reading the arguments' values: most nodes of a program are views
        return _VIEW
    args, kwargs = _arg_vals(node)
    if target in COLLECTIVE_KIND:
        return NodeWork("comm", bytes=tensor_bytes(args[0]), dtype=_first_float_dtype(args[0]))
    out_val = node.meta.get("val")
    if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out_val)):
        # Host-side arithmetic (sym sizes) or an op whose value was not recorded: no kernel.
        return _VIEW if out_val is not None or not isinstance(target, compat.OpOverload) else _NONE
    moved = tensor_bytes((args, kwargs)) + tensor_bytes(out_val)
    return NodeWork("compute", flops=_flops(target, args, kwargs, out_val), bytes=moved,
                    dtype=_first_float_dtype((args, kwargs)),
                    attention=getattr(target, "overloadpacket", None) in ATTENTION_PACKETS)


def roofline_time(work: NodeWork, profile: HardwareProfile) -> float:
    """Seconds ``work`` takes on ``profile``: the slower of its FLOPs at the dtype's achievable peak
    and its bytes at achievable memory bandwidth, plus the fixed per-kernel overhead. Views cost the
    profile's host overhead for a metadata op; comm, wait and none cost nothing here (see
    ``comm.collective_time`` and ``simulate``)."""
    if work.kind == "view":
        return profile.view_overhead_s
    if work.kind != "compute":
        return 0.0
    efficiency = profile.compute_efficiency(work.attention)
    compute = work.flops / (profile.flops_per_s(work.dtype) * efficiency) if work.flops else 0.0
    memory = work.bytes / (profile.hbm_bandwidth * profile.memory_efficiency)
    return max(compute, memory) + profile.op_overhead_s
