"""Step time of FSDP: hyper_parallel vs PyTorch FSDP2 eager (``fully_shard``), side by side.

``python bench/bench_fsdp_step.py`` spawns ``--world`` (default 4) gloo processes on CPU, one
intra-op thread each. Both programs shard the same Llama (same seed) with the same units, each
``model.layers[i]`` then the root, over a 1-D data-parallel mesh, and every rank feeds the same
local batch (its slice of one global batch) to both:

* hyper_parallel: ``hp.parallelize(model, {"fully_shard": hp.FullyShard(units=("model.layers.*",
  ""), reshard_after_forward=R)}, mesh)`` (compiled on the first call);
* PyTorch FSDP2: ``fully_shard(layer, mesh=mesh, reshard_after_forward=R)`` for every layer, then on
  the root, run eagerly.

Both configurations R = True and R = False are measured in the same run. A step is forward +
backward + ``SGD.step`` + ``zero_grad``. Each side gets ``--warmup`` steps (hyper_parallel's first
one compiles), then ``--steps`` timed steps, interleaved hp / FSDP2 so machine noise hits both
alike; every step starts after a barrier and takes as long as its slowest rank; medians are
reported.

Collectives per step: hyper_parallel's from ``compile_summary()["collectives_per_step"]``; both
sides are also *counted* with a ``CommDebugMode`` subclass around one step after warm-up (it sees
every c10d / functional collective dispatched on the calling thread; bytes = each rank's local
input tensor, as ``compile_summary`` counts them: the shard for an all-gather, the full buffer for
a reduce-scatter).

Peak memory: one more step per side under ``MemoryTracker`` (live bytes of every tensor allocated
through the dispatcher, parameters and optimizer state included), on the rank that holds the most.

Losses: FSDP2 returns the rank's local mean; hyper_parallel the global loss. The JSON reports
hyper_parallel's loss and FSDP2's ``all_reduce(sum) / world`` (outside the timed steps) at step 0.

``--profile-hp N`` additionally profiles N hyper_parallel steps on rank 0 with cProfile (after the
timed steps) and prints the top functions by cumulative and by self time, plus a torch.profiler
table of the aten / c10d ops.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import (add_model_args, count_collectives, data_parallel_batch, hp_collectives, launch,  # noqa: E402
                      print_collective_rows, print_time_rows, step, step_peak, time_side_by_side)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="data-parallel degree = number of processes (default 4)")
    add_model_args(p)
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help="FSDP units gathered ahead (default: hyper_parallel's, 1)")
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side and config (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--reshard", choices=["both", "true", "false"], default="both",
                   help="reshard_after_forward configurations to measure (default both)")
    p.add_argument("--profile-hp", type=int, default=0, metavar="N",
                   help="after timing, profile N hyper_parallel steps on rank 0 (cProfile + torch.profiler)")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="bf16: parameters in bf16, gradients reduced in fp32 on both sides (hp's "
                   "mixed_precision and FSDP2's MixedPrecisionPolicy); default none (fp32)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def _build(ref, args, reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    hp_mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.mixed_precision == "bf16" else MixedPrecisionPolicy())
    hp_policy = ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
                 if args.mixed_precision == "bf16" else None)
    units = hp.FullyShard(units=("model.layers.*", ""), reshard_after_forward=reshard, mixed_precision=hp_policy)
    hp_model = hp.parallelize(copy.deepcopy(ref), {"fully_shard": units}, hp_mesh, prefetch_depth=args.prefetch_depth)

    torch_mesh = init_device_mesh("cpu", (world,))
    fsdp2_model = copy.deepcopy(ref)
    for layer in fsdp2_model.model.layers:
        fully_shard(layer, mesh=torch_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(fsdp2_model, mesh=torch_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return (hp_model, torch.optim.SGD(hp_model.parameters(), lr=args.lr),
            fsdp2_model, torch.optim.SGD(fsdp2_model.parameters(), lr=args.lr))


def measure(ref, batch, args, reshard: bool) -> dict:
    """Warm up and time hyper_parallel and FSDP2 interleaved for one ``reshard_after_forward``."""
    hp_model, hp_opt, fsdp2_model, fsdp2_opt = _build(ref, args, reshard)

    # Step 0 (hp compiles): the losses, before any update.
    measured = time_side_by_side((hp_model, hp_opt), (fsdp2_model, fsdp2_opt), batch, args.warmup, args.steps)
    hp_loss0, fsdp2_loss0, t_compile = measured.hp_loss0, measured.peer_loss0, measured.hp_first_step_s
    hp_times, fsdp2_times = measured.hp_times, measured.peer_times
    counted = count_collectives({"hyper_parallel": (hp_model, hp_opt), "fsdp2": (fsdp2_model, fsdp2_opt)}, batch)
    peaks = {name: step_peak(lambda m=m, o=o: step(m, o, batch), m.parameters(), o)
             for name, (m, o) in (("hyper_parallel", (hp_model, hp_opt)), ("fsdp2", (fsdp2_model, fsdp2_opt)))}

    hp_med, fsdp2_med = statistics.median(hp_times), statistics.median(fsdp2_times)
    summary = hp_model.compile_summary()
    return {
        "reshard_after_forward": reshard,
        "loss_step0": {"hyper_parallel": hp_loss0, "fsdp2_global": fsdp2_loss0},
        "hp_first_step_s (compile + step)": t_compile,
        "step_time_s": {
            "hyper_parallel": {"median": hp_med, "min": min(hp_times), "max": max(hp_times), "all": hp_times},
            "fsdp2": {"median": fsdp2_med, "min": min(fsdp2_times), "max": max(fsdp2_times), "all": fsdp2_times},
        },
        "ratio_hp_over_fsdp2": hp_med / fsdp2_med,
        "peak_bytes": peaks,
        "ratio_peak_hp_over_fsdp2": peaks["hyper_parallel"] / peaks["fsdp2"],
        "collectives_per_step": {
            "hyper_parallel (compile_summary)": hp_collectives(summary),
            "hyper_parallel (counted)": counted["hyper_parallel"],
            "fsdp2 (counted)": counted["fsdp2"],
        },
        "hp_saved_for_backward": summary.get("saved_for_backward"),
        "fallbacks": summary.get("fallbacks", []),
        "_models": (hp_model, hp_opt),
    }


def profile_hp(hp_model, hp_opt, batch, steps: int) -> str:
    """cProfile + torch.profiler of ``steps`` hyper_parallel steps on this rank; returns the report."""
    out = io.StringIO()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step(hp_model, hp_opt, batch)
    prof.disable()
    wall = time.perf_counter() - t0
    out.write(f"\n=== cProfile, rank 0, {steps} hyper_parallel steps, {wall / steps * 1e3:.1f} ms/step "
              "(under the profiler) ===\n")
    for key in ("cumulative", "tottime"):
        s = pstats.Stats(prof, stream=out)
        s.sort_stats(key).print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            step(hp_model, hp_opt, batch)
    out.write(f"\n=== torch.profiler, rank 0, {steps} hyper_parallel steps ===\n")
    out.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return out.getvalue()


def run(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, batch, ref_loss0 = data_parallel_batch(args)

    reshards = {"both": (True, False), "true": (True,), "false": (False,)}[args.reshard]
    results = [measure(ref, batch, args, r) for r in reshards]
    profile = None
    if args.profile_hp:
        hp_model, hp_opt = results[0]["_models"]
        # Every rank steps (collectives need all of them); rank 0 reports.
        profile = profile_hp(hp_model, hp_opt, batch, args.profile_hp)
    for r in results:
        del r["_models"]
    if rank != 0:
        return None
    return {
        "bench": "fsdp_step",
        "world_size": world,
        "mesh": {"dp": world},
        "units": ["model.layers.*", ""],
        "config": {
            "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
            "seq_len": args.seq_len, "global_batch": args.batch, "local_batch": args.batch // world,
            "params": ref.num_parameters(),
        },
        "threads_per_rank": args.threads,
        "mixed_precision": args.mixed_precision,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
        "loss_step0_single_device": ref_loss0,
        "results": results,
        "_profile": profile,
    }


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nFSDP dp={r['world_size']} Llama {c['layers']}L h{c['hidden']} ({c['params']:,} params), "
          f"global batch {c['global_batch']} ({c['local_batch']}/rank) x seq {c['seq_len']}, "
          f"{r['threads_per_rank']} thread/rank, mixed precision {r['mixed_precision']}, "
          f"median of {r['steps']} steps (slowest rank)")
    print(f"single-device loss at step 0: {r['loss_step0_single_device']:.6f}")
    for res in r["results"]:
        st = res["step_time_s"]
        colls = res["collectives_per_step"]
        hp_c = colls["hyper_parallel (compile_summary)"]
        hp_n, fs_c = colls["hyper_parallel (counted)"], colls["fsdp2 (counted)"]
        l0 = res["loss_step0"]
        print(f"\nreshard_after_forward={res['reshard_after_forward']}: loss at step 0 hp "
              f"{l0['hyper_parallel']:.6f}, FSDP2 (global) {l0['fsdp2_global']:.6f}; "
              f"hp first step (compile + step) {res['hp_first_step_s (compile + step)']:.1f} s")
        print(f"{'':26}{'hyper_parallel':>16}{'FSDP2 eager':>16}{'hp/FSDP2':>10}")
        print_time_rows(st, "fsdp2", res["ratio_hp_over_fsdp2"])
        peaks = res["peak_bytes"]
        print(f"{'peak MB (largest rank)':26}{peaks['hyper_parallel'] / 1e6:>16.2f}{peaks['fsdp2'] / 1e6:>16.2f}"
              f"{res['ratio_peak_hp_over_fsdp2']:>10.2f}")
        print_collective_rows(hp_c, hp_n, fs_c)


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.world, threads=args.threads)


if __name__ == "__main__":
    main()
