"""Step time and peak memory of data parallelism: hyper_parallel vs PyTorch DDP, side by side.

``python bench/bench_dp_step.py`` spawns ``--world`` (default 4) gloo processes on CPU, one intra-op
thread each. Both sides replicate the same Llama (seed 0) over a 1-D data-parallel mesh and every
rank feeds the same local batch (its slice of one global batch) to both:

* hyper_parallel: ``hp.parallelize(model, {}, mesh)`` on a ``("dp",)`` mesh (an empty plan: every
  parameter replicated, gradients all-reduced in DDP-style buckets, issued as backward produces
  them; compiled on the first call);
* DDP: ``DistributedDataParallel(model)``, run eagerly.

``--codegen inductor`` compiles hp's compute between collectives with Inductor
(``parallelize(codegen="inductor")``; the first step then takes about a minute longer); DDP stays
eager either way.

Both sides bucket alike, by DDP's rule: by default (no ``--bucket-cap-mb``) neither gets the option,
so both cut 25 MB buckets after a 1 MiB first one; ``--bucket-cap-mb X`` passes ``bucket_cap_mb=X``
to both, and then every bucket, the first one too, holds up to X MB (before 2026-11-28 hp kept a
1 MiB first bucket there while DDP did not: one more collective on hp's side).

A step is forward + backward + ``SGD.step`` + ``zero_grad``. Each side gets ``--warmup`` steps
(hyper_parallel's first one compiles), then ``--steps`` timed steps interleaved hp / DDP so machine
noise hits both alike; every step starts after a barrier and takes as long as its slowest rank;
medians are reported. Losses: both sides at step 0 (hp: the global token mean; DDP: each rank's
local mean, averaged over ranks here, outside the timed steps) and after the timed steps.

Peak memory of one more step per side on the rank that holds the most, with ``MemoryTracker`` (live bytes of tensors that
pass through the dispatcher, parameters and gradients included); under ``--codegen inductor`` both
sides from the allocator's events instead (``AllocatorPeak``: Inductor's buffers bypass MemoryTracker). DDP's gradient buckets are
allocated by its C++ reducer when it is built, out of the tracker's sight, and live for the whole
run (one flat copy of every gradient, as ``gradient_as_bucket_view=False``, DDP's default, keeps
them): DDP's peak is reported as the tracked peak plus those bucket bytes, and the tracked peak
alone is in the JSON. hp's buckets are ordinary tensors of its backward program, tracked.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import (ALLOCATOR_NOTE, add_model_args, add_peak_measure_arg, count_collectives,  # noqa: E402
                      data_parallel_batch, hp_collectives, launch, peak_measure, print_collective_rows,
                      print_time_rows, step, step_peak, time_side_by_side)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="data-parallel degree = number of processes (default 4)")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket_cap_mb for both sides (default: not passed, DDP's 25 MB buckets after a 1 MiB first one)")
    p.add_argument("--reductions-in-flight", type=int, default=None,
                   help="hp's buckets in flight while backward goes on (default: hp's choice)")
    p.add_argument("--codegen", choices=["eager", "inductor"], default="eager",
                   help="hp's parallelize(codegen=...): inductor compiles the compute between collectives "
                        "(DDP stays eager: the peer a user would otherwise run)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    add_peak_measure_arg(p)
    return p.parse_args(argv)


def _peak(model, opt, batch, measure: str) -> int:
    return step_peak(lambda: step(model, opt, batch), model.parameters(), opt, measure)


def run(args: argparse.Namespace) -> dict | None:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    ref, batch, ref_loss0 = data_parallel_batch(args)

    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    options = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    if args.reductions_in_flight is not None:
        options["reductions_in_flight"] = args.reductions_in_flight
    hp_model = hp.parallelize(copy.deepcopy(ref), {}, mesh, codegen=args.codegen, **options)
    hp_opt = torch.optim.SGD(hp_model.parameters(), lr=args.lr)
    ddp_options = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    ddp_model = DistributedDataParallel(copy.deepcopy(ref), **ddp_options)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)

    measured = time_side_by_side((hp_model, hp_opt), (ddp_model, ddp_opt), batch, args.warmup, args.steps)
    hp_loss0, ddp_loss0, t_compile = measured.hp_loss0, measured.peer_loss0, measured.hp_first_step_s
    hp_times, ddp_times = measured.hp_times, measured.peer_times
    counted = count_collectives({"hyper_parallel": (hp_model, hp_opt), "ddp": (ddp_model, ddp_opt)}, batch)
    measure = peak_measure(args)
    ddp_tracked = _peak(ddp_model, ddp_opt, batch, measure)
    ddp_buckets = sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad)
    peaks = {"hyper_parallel": _peak(hp_model, hp_opt, batch, measure), "ddp": ddp_tracked + ddp_buckets,
             "ddp_tracked_only": ddp_tracked, "ddp_reducer_buckets": ddp_buckets}
    # Both sides have taken the same number of SGD steps on the same data: equal weights, so equal
    # losses (hp's global mean vs the mean of DDP's equal-sized local means).
    hp_loss_end = step(hp_model, hp_opt, batch).item()
    ddp_loss_end = step(ddp_model, ddp_opt, batch)
    dist.all_reduce(ddp_loss_end)
    ddp_loss_end = ddp_loss_end.item() / world
    if rank != 0:
        return None
    hp_med, ddp_med = statistics.median(hp_times), statistics.median(ddp_times)
    summary = hp_model.compile_summary()
    return {
        "bench": "dp_step",
        "world_size": world,
        "mesh": {"dp": world},
        "config": {
            "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
            "seq_len": args.seq_len, "global_batch": args.batch, "local_batch": args.batch // world,
            "params": ref.num_parameters(), "bucket_cap_mb": args.bucket_cap_mb,
        },
        "codegen": args.codegen,
        "threads_per_rank": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
        "loss_step0": {"single_device": ref_loss0, "hyper_parallel": hp_loss0, "ddp_mean_of_ranks": ddp_loss0},
        "loss_after_steps": {"hyper_parallel": hp_loss_end, "ddp_mean_of_ranks": ddp_loss_end},
        "hp_first_step_s (compile + step)": t_compile,
        "step_time_s": {
            "hyper_parallel": {"median": hp_med, "min": min(hp_times), "max": max(hp_times), "all": hp_times},
            "ddp": {"median": ddp_med, "min": min(ddp_times), "max": max(ddp_times), "all": ddp_times},
        },
        "ratio_hp_over_ddp": hp_med / ddp_med,
        "peak_bytes": peaks,
        "peak_measure": measure,
        "ratio_peak_hp_over_ddp": peaks["hyper_parallel"] / peaks["ddp"],
        "collectives_per_step": {
            "hyper_parallel (compile_summary)": hp_collectives(summary),
            "hyper_parallel (counted)": counted["hyper_parallel"],
            "ddp (counted)": counted["ddp"],
        },
        "fallbacks": summary.get("fallbacks", []),
    }


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nDP dp={r['world_size']} Llama {c['layers']}L h{c['hidden']} ({c['params']:,} params), "
          f"global batch {c['global_batch']} ({c['local_batch']}/rank) x seq {c['seq_len']}, "
          f"buckets {c['bucket_cap_mb'] or 'default (25 MB, 1 MiB first)'}{' MB' if c['bucket_cap_mb'] else ''}, "
          f"hp codegen={r['codegen']}, {r['threads_per_rank']} thread/rank, "
          f"median of {r['steps']} steps (slowest rank)")
    l0, le = r["loss_step0"], r["loss_after_steps"]
    print(f"loss at step 0: single device {l0['single_device']:.6f}, hp {l0['hyper_parallel']:.6f}, "
          f"DDP (mean of ranks) {l0['ddp_mean_of_ranks']:.6f}; after the timed steps hp "
          f"{le['hyper_parallel']:.6f}, DDP {le['ddp_mean_of_ranks']:.6f}; hp first step (compile + step) "
          f"{r['hp_first_step_s (compile + step)']:.1f} s")
    st, peaks = r["step_time_s"], r["peak_bytes"]
    print(f"{'':26}{'hyper_parallel':>16}{'DDP':>16}{'hp/DDP':>10}")
    print_time_rows(st, "ddp", r["ratio_hp_over_ddp"])
    print(f"{'peak MB (largest rank) [1]':26}{peaks['hyper_parallel'] / 1e6:>16.2f}{peaks['ddp'] / 1e6:>16.2f}"
          f"{r['ratio_peak_hp_over_ddp']:>10.2f}")
    if r["peak_measure"] == "allocator":
        print(ALLOCATOR_NOTE)
    print(f"[1] DDP: {peaks['ddp_tracked_only'] / 1e6:.2f} MB tracked + {peaks['ddp_reducer_buckets'] / 1e6:.2f} MB "
          "of reducer buckets (allocated in C++, alive all run)")
    colls = r["collectives_per_step"]
    print_collective_rows(colls["hyper_parallel (compile_summary)"], colls["hyper_parallel (counted)"],
                          colls["ddp (counted)"])


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.world, threads=args.threads)


if __name__ == "__main__":
    main()
