"""A transformers-Trainer-style loop, written as for one device, under FSDP on 2 ranks.

HF Llama with ``gradient_checkpointing_enable()`` (non-reentrant torch.utils.checkpoint, the
installed transformers' default), the loss computed by the caller from the returned logits on its own
rows, ``clip_grad_norm_``, AdamW, then ``save_pretrained``. Each piece had its own defect: the
checkpoint was traced through (every activation kept; the reentrant one broke capture), the
caller's per-rank loss trained with twice the gradient, and ``save_pretrained`` failed on the
sharded weights. Checked here together against one device
running the same loop: every gradient and the clipped norm at each step, and the saved weights."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

STEPS = 3


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _trainer_style_loop(directory: str) -> list[float]:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    reference = build_model("hf_llama")
    reference.gradient_checkpointing_enable()
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    norms = []
    for step in range(STEPS):
        full = global_batch("llama", 4, 16, seed=step + 1)
        mine = local_batch(full, mesh)
        _next_token_loss(reference(input_ids=full["input_ids"]).logits, full["labels"]).backward()
        _next_token_loss(model(input_ids=mine["input_ids"]).logits, mine["labels"]).backward()
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"step {step} grad of {n}: {m}")
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {step} clipped norm: {m}")
        norms.append(norm.item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    model.save_pretrained(directory)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    saved = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(saved[name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"saved {n}: {m}")
    return norms


def test_trainer_style_loop_matches_one_device(dist2, tmp_path):
    pytest.importorskip("transformers")
    norms = dist2.run(_trainer_style_loop, str(tmp_path))
    assert norms[0] == norms[1] and all(n > 1.0 for n in norms[0]), norms  # clipping was active
