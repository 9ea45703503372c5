"""Sharding rules of the attention kernels the models' SDPA calls lower to (propagation/rules.py).

On CUDA, ``F.scaled_dot_product_attention`` with a mask (transformers' Llama passes its causal mask)
runs the memory-efficient kernel, whose backward takes the mask as ``attn_bias`` and returns no
gradient for it when ``grad_input_mask`` says so. torch 2.11's DTensor still gave that output a
layout and its tensor-meta check then failed on the missing tensor (seen on a lent H200, whose image
has torch 2.11: HF Llama with any plan failed to compile on CUDA); torch 2.13, which we require,
propagates it. These tests run the rule on a fake mesh of two (the kernel itself is CUDA-only, its
meta function is not), so a torch that breaks it again fails here on CPU.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.propagation.engine import make_spec
from hyper_parallel.propagation.rules import propagate_op

aten = torch.ops.aten
B, H, S, D = 4, 2, 8, 16


def _backward_args(mesh, bias_grad: bool) -> tuple:
    """The op's arguments as our engine gives them: batch-sharded activations (data parallel), a
    replicated mask, the RNG state scalars replicated."""
    def spec(shape, placement, dtype=torch.float32):
        return make_spec(mesh, (placement,), torch.empty(shape, dtype=dtype, device="meta"))

    act = (B, H, S, D)
    return (
        spec(act, Shard(0)), spec(act, Shard(0)), spec(act, Shard(0)), spec(act, Shard(0)),  # grad_out, q, k, v
        spec((B, H, S, S), Replicate()),  # attn_bias: the expanded causal mask
        spec(act, Shard(0)),  # out
        spec((B, H, 32), Shard(0)),  # logsumexp, padded to 32 on the sequence
        spec((), Replicate(), torch.int64), spec((), Replicate(), torch.int64),  # philox seed, offset
        0.0, [True, True, True, bias_grad], False,  # dropout_p, grad_input_mask, is_causal
    )


def test_efficient_attention_backward_without_a_bias_gradient():
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        out, _ = propagate_op(aten._scaled_dot_product_efficient_attention_backward.default,
                              _backward_args(mesh, bias_grad=False), {})
    assert len(out) == 4 and out[3] is None, out
    assert all(s.placements == (Shard(0),) for s in out[:3]), out


def test_efficient_attention_backward_with_a_bias_gradient():
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        out, _ = propagate_op(aten._scaled_dot_product_efficient_attention_backward.default,
                              _backward_args(mesh, bias_grad=True), {})
    assert out[3] is not None, out
