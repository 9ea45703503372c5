"""Activation memory: peak memory and step time of recompute / swap, hyper_parallel vs eager torch.

``python bench/bench_recompute.py`` spawns ``--world`` (default 2) gloo processes on CPU
(``--device cuda --world 1``: NCCL on GPUs, peaks from ``torch.cuda.max_memory_allocated``). Each rank
trains the example Llama data-parallel on its slice of one global batch, once per mode:

* none: activations saved (hp: no plan entry; eager: plain DDP);
* full: every decoder layer recomputed in backward (hp: ``recompute={"model.layers.*": "full"}``;
  eager: each layer under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``);
* selective: matmul and attention outputs kept, the rest recomputed (hp: ``"selective"``; eager:
  torch's selective checkpointing with the same op set);
* swap: activations saved by the layers kept in host memory (hp: ``swap={"model.layers.*": True}``;
  eager: ``torch.autograd.graph.save_on_cpu``). On a CPU machine both copy host to host: the row
  shows the cost of the copies, not a memory saving.

Eager runs under DDP (bucketed gradient all-reduce), the peer a user would otherwise pick. A step
is forward + backward + ``SGD.step`` + ``zero_grad``; ``--steps`` timed steps after ``--warmup``,
hp and eager interleaved, median of the slowest rank. Peak memory is measured on one more step with
``hyper_parallel.testing.memory_tracker.MemoryTracker`` (bytes of live tensors: parameters,
gradients, activations, temporaries), rank 0; on CPU the eager side's peak adds DDP's reducer
buckets, allocated in C++ when DDP is built and alive all run, which the tracker does not see
(``eager_tracked_peak_bytes`` in the JSON is the tracked part alone).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _harness import add_model_args, build_model, launch  # noqa: E402

MODES = ("none", "selective", "full", "swap")


def _eager_layers(model, mode: str) -> None:
    """Wrap each decoder layer's forward the way a torch user would for ``mode``."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    save = {
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    for layer in model.model.layers:
        inner = layer.forward
        if mode == "full":
            layer.forward = lambda *a, inner=inner: checkpoint(inner, *a, use_reentrant=False)
        elif mode == "selective":
            layer.forward = lambda *a, inner=inner: checkpoint(
                inner, *a, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy)
            )
        elif mode == "swap":
            def swapped(*a, inner=inner):
                with torch.autograd.graph.save_on_cpu():
                    return inner(*a)
            layer.forward = swapped


def _hp_plan(mode: str) -> dict:
    return {
        "none": {},
        "full": {"recompute": {"model.layers.*": "full"}},
        "selective": {"recompute": {"model.layers.*": "selective"}},
        "swap": {"swap": {"model.layers.*": True}},
    }[mode]


def run(args):
    import hyper_parallel as hp
    from hyper_parallel.testing.memory_tracker import MemoryTracker
    from hyper_parallel.testing.parity import local_batch

    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh(args.device, (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
    batch = {k: v.to(args.device) for k, v in local_batch({"input_ids": ids, "labels": ids}, mesh).items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = {}
    for mode in args.modes:
        base = build_model(args).to(args.device)
        hp_model = hp.parallelize(copy.deepcopy(base), _hp_plan(mode), mesh,
                                  reductions_in_flight=args.reductions_in_flight)
        eager = copy.deepcopy(base)
        _eager_layers(eager, mode)
        eager = torch.nn.parallel.DistributedDataParallel(eager)
        sides = {"hp": hp_model, "eager": eager}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in sides.items()}

        def step(name):
            out = sides[name](**batch)
            out["loss"].backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)

        times = {k: [] for k in sides}
        for i in range(args.warmup + args.steps):
            for name in sides:
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                step(name)
                sync()
                elapsed = torch.tensor(time.perf_counter() - t0, device=args.device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    times[name].append(elapsed.item() * 1e3)
        peaks = {}
        for name, model in sides.items():
            if cuda:  # the allocator's peak over one step (both sides count the same workspaces)
                sync()
                torch.cuda.reset_peak_memory_stats()
                step(name)
                sync()
                peaks[name] = torch.cuda.max_memory_allocated()
                continue
            baseline = [*model.parameters(), *batch.values()]
            with MemoryTracker(baseline) as tracker:
                step(name)
            peaks[name] = tracker.peak
        # DDP's reducer allocates its flat gradient buckets (one copy of every gradient, as its
        # default gradient_as_bucket_view=False keeps them) in C++ when it is built, out of the
        # tracker's sight, and they live all run: added here (the CUDA peak counts them itself).
        ddp_buckets = 0 if cuda else sum(p.numel() * p.element_size() for p in eager.parameters() if p.requires_grad)
        results[mode] = {
            "hp_ms": statistics.median(times["hp"]), "eager_ms": statistics.median(times["eager"]),
            "hp_peak_bytes": peaks["hp"], "eager_peak_bytes": peaks["eager"] + ddp_buckets,
            "eager_tracked_peak_bytes": peaks["eager"], "eager_ddp_bucket_bytes": ddp_buckets,
            "hp_saved_bytes": hp_model.compile_summary()["saved_for_backward"]["bytes"],
        }
    if rank == 0:
        return {"world": world, "device": args.device, "batch": args.batch, "seq_len": args.seq_len,
                "layers": args.layers, "hidden": args.hidden, "steps": args.steps, "modes": results}
    return None


def report(result):
    print(
        f"\nDP={result['world']} Llama {result['layers']}L h{result['hidden']}, global batch "
        f"{result['batch']} x seq {result['seq_len']} on {result.get('device', 'cpu')}, median of "
        f"{result['steps']} steps; peak = "
        + ("torch.cuda.max_memory_allocated() over one step, rank 0" if result.get("device") == "cuda" else
           "live tensor bytes on rank 0 (parameters, gradients, activations, temporaries)")
    )
    print(f"{'mode':<10}{'hp ms':>9}{'eager ms':>10}{'ratio':>7}{'hp peak MB':>12}{'eager peak MB':>15}{'ratio':>7}")
    for mode, r in result["modes"].items():
        print(
            f"{mode:<10}{r['hp_ms']:>9.1f}{r['eager_ms']:>10.1f}{r['hp_ms'] / r['eager_ms']:>7.2f}"
            f"{r['hp_peak_bytes'] / 1e6:>12.2f}{r['eager_peak_bytes'] / 1e6:>15.2f}"
            f"{r['hp_peak_bytes'] / r['eager_peak_bytes']:>7.2f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: one GPU per rank, NCCL, peaks from torch.cuda.max_memory_allocated")
    parser.add_argument("--reductions-in-flight", type=int, default=None,
                        help="hp's gradient buckets in flight during backward (default: hyper_parallel's "
                        "choice, 1; 0 waits for each at once)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    launch(run, report, args, args.world, threads=1)


if __name__ == "__main__":
    main()
