"""Step time with ``codegen="inductor"`` vs ``"eager"`` vs PyTorch FSDP2 eager, side by side.

``python bench/bench_codegen.py`` spawns ``--world`` (default 2) gloo processes on CPU, one
intra-op thread each (Inductor's CPU kernels are OpenMP loops: more threads than cores per host
oversubscribes them). Three programs shard the same Llama (same seed) with one FSDP unit per layer
plus the root, with the same mixed-precision policy, and every rank feeds its slice of one global
batch to each:

* hyper_parallel, ``codegen="eager"``: our per-rank programs run op by op;
* hyper_parallel, ``codegen="inductor"``: the same programs with the compute between collectives as
  Inductor kernels (the collectives in the same places);
* PyTorch FSDP2 (``fully_shard`` per layer and on the root), eager;
* with ``--compiled-peers``: FSDP2 with each layer ``torch.compile``d before ``fully_shard`` (as
  torchtitan applies it), and, on a mesh of one, the unsharded model eager and ``torch.compile``d
  whole (what a one-GPU user would otherwise run).

``--device cuda`` runs one NCCL rank per GPU and times with ``torch.cuda.synchronize``; it also
reports each side's peak ``torch.cuda.max_memory_allocated`` over one step. On a mesh of one our
FSDP programs hold no collectives (a degree-1 axis needs none) while FSDP2 still copies through its
all-gather and reduce-scatter buffers: the one-GPU numbers compare the generated compute.

A step is forward + backward + ``SGD.step`` + ``zero_grad``. Each side's first step is timed apart
(hyper_parallel compiles then; with Inductor its regions compile during that step), then
``--warmup`` untimed and ``--steps`` timed steps, interleaved across the three sides so machine
noise hits all alike; each step starts after a barrier and counts as its slowest rank; medians are
reported, with the ratios to FSDP2 and inductor / eager. The losses of the three at step 0 are
printed too (hyper_parallel's global loss; FSDP2's rank-local means averaged).

``--mixed-precision both`` (default) measures fp32 and bf16 parameters with fp32 reduction in the
same run.
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

import hyper_parallel as hp  # noqa: E402
from _harness import (  # noqa: E402
    add_model_args, data_parallel_batch, device_sync, launch, slowest_rank, step, timed_step,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="data-parallel degree = processes (default 2)")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4, help="global batch, split over the ranks (default 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mixed-precision", choices=["both", "none", "bf16"], default="both")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per rank, NCCL (default cpu: gloo)")
    p.add_argument("--compiled-peers", action="store_true",
                   help="also FSDP2 with torch.compile'd layers and (world 1) the unsharded model eager and compiled")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def _sides(ref, args, bf16: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = hp.init_device_mesh(args.device, (world,), mesh_dim_names=("dp",))
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else None
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    sides = {}
    for name, codegen in (("hp eager", "eager"), ("hp inductor", "inductor")):
        model = hp.parallelize(copy.deepcopy(ref), plan, mesh, codegen=codegen)
        sides[name] = (model, torch.optim.SGD(model.parameters(), lr=args.lr))
    torch_mesh = init_device_mesh(args.device, (world,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())

    def fsdp2(compiled: bool):
        model = copy.deepcopy(ref)
        for i, layer in enumerate(model.model.layers):
            if compiled:  # compile each block, then shard it (torchtitan's order)
                layer = torch.compile(layer, fullgraph=True)
                model.model.layers[i] = layer
            fully_shard(layer, mesh=torch_mesh, mp_policy=mp)
        fully_shard(model, mesh=torch_mesh, mp_policy=mp)
        return model, torch.optim.SGD(model.parameters(), lr=args.lr)

    sides["fsdp2 eager"] = fsdp2(False)
    if args.compiled_peers:
        sides["fsdp2 compiled"] = fsdp2(True)
        if world == 1:  # the unsharded model in the same precision FSDP computes in
            for name, compiled in (("eager unsharded", False), ("compiled unsharded", True)):
                model = copy.deepcopy(ref).to(torch.bfloat16 if bf16 else torch.float32)
                opt = torch.optim.SGD(model.parameters(), lr=args.lr)
                sides[name] = (torch.compile(model) if compiled else model, opt)
    return sides


def measure(ref, batch, args, bf16: bool) -> dict:
    sides = _sides(ref, args, bf16)
    first, loss0 = {}, {}
    for name, side in sides.items():
        dist.barrier()
        device_sync()
        t0 = time.perf_counter()
        loss = step(*side, batch)
        device_sync()
        first[name] = slowest_rank([time.perf_counter() - t0])[0]
        if not name.startswith("hp"):  # FSDP2 returns this rank's local mean
            dist.all_reduce(loss)
            loss = loss / dist.get_world_size()
        loss0[name] = loss.item()
    for _ in range(args.warmup):
        for side in sides.values():
            timed_step(*side, batch)
    times = {name: [] for name in sides}
    for _ in range(args.steps):
        for name, side in sides.items():
            times[name].append(timed_step(*side, batch))
    medians = {}
    for name in sides:
        times[name] = slowest_rank(times[name])
        medians[name] = statistics.median(times[name])
    peaks = {}
    if args.device == "cuda":  # each side's allocator peak over one more step (rank 0)
        for name, side in sides.items():
            device_sync()
            torch.cuda.reset_peak_memory_stats()
            step(*side, batch)
            device_sync()
            peaks[name] = torch.cuda.max_memory_allocated()
    tokens = batch["input_ids"].numel() * dist.get_world_size()
    return {
        "mixed_precision": "bf16 params / fp32 reduce" if bf16 else "fp32",
        "loss_step0": loss0,
        "first_step_s (compile + step)": first,
        "step_time_s": {n: {"median": medians[n], "min": min(t), "max": max(t)} for n, t in times.items()},
        "tokens_per_s": {n: tokens / medians[n] for n in sides},
        "peak_memory_bytes": peaks,
        "ratio_inductor_over_eager": medians["hp inductor"] / medians["hp eager"],
        "ratio_over_fsdp2": {n: medians[n] / medians["fsdp2 eager"] for n in ("hp eager", "hp inductor")},
        "ratio_over_peers": {peer: {n: medians[n] / medians[peer] for n in ("hp eager", "hp inductor")}
                             for peer in sides if not peer.startswith("hp")},
    }


def run(args: argparse.Namespace) -> dict | None:
    if args.device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    ref, batch, ref_loss0 = data_parallel_batch(args)
    ref = ref.to(args.device)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    configs = {"both": (False, True), "none": (False,), "bf16": (True,)}[args.mixed_precision]
    results = [measure(ref, batch, args, bf16) for bf16 in configs]
    if dist.get_rank() != 0:
        return None
    return {
        "bench": "codegen",
        "world_size": dist.get_world_size(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "config": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                   "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "seq_len": args.seq_len,
                   "global_batch": args.batch, "params": ref.num_parameters()},
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "torch": torch.__version__,
        "loss_step0_single_device": ref_loss0,
        "results": results,
    }


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\n{r['device']}: FSDP dp={r['world_size']} Llama {c['layers']}L h{c['hidden']} ({c['params']:,} params), global batch "
          f"{c['global_batch']} x seq {c['seq_len']}, {r['threads_per_rank']} thread/rank, median of {r['steps']} "
          f"steps (slowest rank); single-device loss at step 0 {r['loss_step0_single_device']:.6f}")
    for res in r["results"]:
        sides = list(res["step_time_s"])
        print(f"\n{res['mixed_precision']}:")
        print(f"{'':20}" + "".join(f"{s:>20}" for s in sides))
        print(f"{'step time (ms)':20}" + "".join(f"{res['step_time_s'][s]['median'] * 1e3:>20.2f}" for s in sides))
        print(f"{'tokens/s':20}" + "".join(f"{res['tokens_per_s'][s]:>20,.0f}" for s in sides))
        print(f"{'first step (s)':20}" + "".join(f"{res['first_step_s (compile + step)'][s]:>20.2f}" for s in sides))
        print(f"{'loss at step 0':20}" + "".join(f"{res['loss_step0'][s]:>20.6f}" for s in sides))
        if res["peak_memory_bytes"]:
            print(f"{'peak memory (MiB)':20}" + "".join(f"{res['peak_memory_bytes'][s] / 2**20:>20.0f}" for s in sides))
        print(f"inductor / eager step time {res['ratio_inductor_over_eager']:.2f}")
        for peer, ratios in res["ratio_over_peers"].items():
            print(f"step time over {peer}: hp eager {ratios['hp eager']:.2f}, hp inductor {ratios['hp inductor']:.2f}")


if __name__ == "__main__":
    arguments = parse_args()
    launch(run, print_table, arguments, arguments.world, threads=arguments.threads)
