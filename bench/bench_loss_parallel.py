"""Vocab-parallel cross-entropy (loss parallel): hyper_parallel vs DTensor's ``loss_parallel``, side by side.

``python bench/bench_loss_parallel.py`` spawns ``--tp`` (default 2) gloo processes on CPU, one
intra-op thread each, and runs the part of a language model the loss decides: an embedding (kept
whole: it stands for the decoder, whose output gradient the loss produces), the output projection
column-parallel over the vocabulary, and torchtitan's loss, ``cross_entropy(pred.flatten(0, 1).float(),
labels.flatten(0, 1))`` with some labels ``-100``. Both sides start from the same weights (seed 0)
and compute in ``--dtype`` (bf16 by default, as FSDP's ``param_dtype`` computes in torchtitan):

* hyper_parallel: ``hp.parallelize(model, {"tensor_parallel": {"lm_head": "colwise"}}, mesh)``;
  the model's forward computes the loss and returns it with the logits (a ``DTensor`` sharded over
  the vocabulary, which the caller drops before backward);
* torch: ``parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)})`` and the loss computed on the vocab-sharded ``DTensor`` logits inside
  ``torch.distributed.tensor.parallel.loss_parallel()`` (forward and backward), as torchtitan's
  trainer does; its logits are dropped before backward (torchtitan's ``del pred``).

Neither gathers the logits. What differs is how the loss is lowered: hp compiles the
log-softmax / nll pair into per-token all-reduces of its own rules (``propagation/rules.py``);
DTensor runs its loss-parallel handlers eagerly.

Peak memory: one more step per side from the allocator's events (``AllocatorPeak``: every block
allocated and alive at once, parameters included; ``MemoryTracker``, a dispatch mode, would not see
the temporaries DTensor's op handlers allocate inside one op), on the rank that holds the most,
also printed in units of one
rank's fp32 logits (``tokens × vocab / tp × 4`` bytes) after subtracting the parameters held before
the step: the loss's temporaries come in that unit, so the figure carries to a model of another size (Llama 3 70B at torchtitan's local batch 16 × 8192
tokens, tp 8: 7.83 GiB per unit). Step time: ``--warmup`` steps per side (hp's first compiles), then
``--steps`` timed steps interleaved hp / torch, each after a barrier, the slowest rank's, medians.
Checks: the step-0 losses and every gradient of the two sides agree (relative difference printed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import launch, step, step_peak, time_side_by_side  # noqa: E402

# One rank's fp32 logits in torchtitan's Llama 3.1 70B run (docs/performance.md, Table 4: local batch
# 16, sequence 8192, vocabulary 128256, tp 8), the unit the peaks are carried over in.
LLAMA3_70B_UNIT_BYTES = 16 * 8192 * (128256 // 8) * 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="TP degree = number of processes (default 2)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--ignore-fraction", type=float, default=0.2, help="labels set to -100 (default 0.2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per side (median reported, default 8)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--disable-passes", default="", help="comma-separated passes hp runs without (e.g. inplace_reuse)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss (train.py at the commit of its published runs)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


class Head(nn.Module):
    """The loss's end of a language model: ``embed`` stands for the decoder (it receives the
    gradient of the hidden states), ``lm_head`` projects onto the vocabulary."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.lm_head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = titan_loss(logits, labels)
        return out


class TorchLossParallel(nn.Module):
    """The torch side: ``model`` returns vocab-sharded DTensor logits; the loss runs on them inside
    ``loss_parallel()`` (``step_context``, which the harness's step enters around forward and
    backward); the logits go out of scope when forward returns. The loss is returned as a plain tensor
    (the replicated DTensor's value) for the harness's all-reduce."""

    def __init__(self, model: Head):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        pred = self.model(input_ids)["logits"]
        return {"loss": titan_loss(pred, labels).full_tensor()}  # a replicated DTensor: the same on every rank

    @staticmethod
    def step_context():
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


def _batch(args) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
    labels[torch.rand(labels.shape, generator=g) < args.ignore_fraction] = -100
    return {"input_ids": ids, "labels": labels}


def _local_grads(model) -> dict:
    return {n.removeprefix("model."): (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float()
            for n, p in model.named_parameters()}


def _local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def _max_relative_difference(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def run(args: argparse.Namespace) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    ref = Head(args.vocab, args.hidden).to(dtype)
    batch = _batch(args)

    hp_model = hp.parallelize(copy.deepcopy(ref), {"tensor_parallel": {"lm_head": "colwise"}},
                              hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                              disable_passes=[p for p in args.disable_passes.split(",") if p])
    torch_model = TorchLossParallel(parallelize_module(
        copy.deepcopy(ref), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
        {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}))
    sides = {"hyper_parallel": hp_model, "torch": torch_model}

    # Step 0 without an update: the losses and the gradients of the two sides.
    losses, grads = {}, {}
    for name, model in sides.items():
        with getattr(model, "step_context", contextlib.nullcontext)():
            loss = model(**batch)["loss"]
            loss.backward()
        losses[name] = loss.detach().float().item()
        grads[name] = _local_grads(model)
        model.zero_grad(set_to_none=True)
    grad_diff = _max_relative_difference(grads["hyper_parallel"], grads["torch"])

    opts = {name: torch.optim.SGD(m.parameters(), lr=args.lr) for name, m in sides.items()}
    timed = time_side_by_side((hp_model, opts["hyper_parallel"]), (torch_model, opts["torch"]), batch,
                              args.warmup, args.steps)
    peaks = {name: step_peak(lambda m=m, o=opts[name]: step(m, o, batch), m.parameters(), opts[name],
                             measure="allocator")
             for name, m in sides.items()}
    if rank != 0:
        return None
    unit = args.batch * args.seq_len * (args.vocab // world) * 4
    held = {name: _local_bytes(m.parameters()) for name, m in sides.items()}  # before the step
    hp_ms, torch_ms = statistics.median(timed.hp_times) * 1e3, statistics.median(timed.peer_times) * 1e3
    # The timed run's first step (before any update, as step 0): hp's loss is the global token mean,
    # torch's a replicated DTensor's value, the same on every rank, so time_side_by_side's average
    # over the ranks leaves it unchanged.
    return {
        "config": {k: getattr(args, k) for k in ("tp", "vocab", "hidden", "batch", "seq_len", "dtype",
                                                  "ignore_fraction", "warmup", "steps", "disable_passes")},
        "loss_step0": losses, "max_relative_grad_difference_step0": grad_diff,
        "loss_first_timed_run_step": {"hyper_parallel": timed.hp_loss0, "torch": timed.peer_loss0},
        "step_ms": {"hyper_parallel": hp_ms, "torch": torch_ms}, "step_ratio": hp_ms / torch_ms,
        "peak_bytes": peaks, "peak_ratio": peaks["hyper_parallel"] / peaks["torch"],
        "fp32_logits_unit_bytes": unit, "parameter_bytes": held,
        "step_peak_in_units": {n: (v - held[n]) / unit for n, v in peaks.items()},
        "llama3_70b_unit_gib": LLAMA3_70B_UNIT_BYTES / 2**30,
    }


def report(result: dict) -> None:
    u, gib = result["step_peak_in_units"], result["llama3_70b_unit_gib"]
    print(f"\n{'':30}{'hyper_parallel':>16}{'torch':>16}{'hp/torch':>10}")
    print(f"{'step time (ms)':30}{result['step_ms']['hyper_parallel']:>16.1f}{result['step_ms']['torch']:>16.1f}"
          f"{result['step_ratio']:>10.2f}")
    p = result["peak_bytes"]
    print(f"{'peak (MB)':30}{p['hyper_parallel'] / 1e6:>16.2f}{p['torch'] / 1e6:>16.2f}{result['peak_ratio']:>10.2f}")
    print(f"{'step peak - parameters, units':30}{u['hyper_parallel']:>16.2f}{u['torch']:>16.2f}")
    print(f"{'  at Llama 3 70B (GiB)':30}{u['hyper_parallel'] * gib:>16.1f}{u['torch'] * gib:>16.1f}"
          f"   (one unit = {gib:.2f} GiB)")
    print(f"step-0 loss: hp {result['loss_step0']['hyper_parallel']:.6f}, torch {result['loss_step0']['torch']:.6f}; "
          f"max relative gradient difference {result['max_relative_grad_difference_step0']:.2e}")


if __name__ == "__main__":
    a = parse_args()
    launch(run, report, a, world=a.tp, threads=1)
