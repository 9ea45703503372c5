"""What one blocking collective costs on this host: the price of each synchronisation in a step.

``python bench/bench_sync_cost.py`` spawns ``--world`` (default 4) gloo processes on CPU, one
intra-op thread each. Each round: a barrier, ``--matmuls`` matmuls of 256 x 256 (a few ms of compute,
so the ranks arrive as they would from a training step, not straight out of a barrier), then one
tiny collective, timed on every rank; a round's time is its slowest rank's; medians over
``--rounds``. The collectives are the ones a step holds besides its gradient reductions:

* ``all_gather`` of 2 int64: hyper_parallel's per-call agreement (spmd.agree);
* ``all_reduce`` of 2 fp32: the loss's sum and token count hyper_parallel all-reduces in forward
  (the exact global token mean);
* ``broadcast`` of 2 int64: DDP's buffer broadcast at the start of each forward.

The step benches compare systems whose steps hold different numbers of such synchronisations (hp's
data-parallel step 3-4, DDP's 2-3, bench_dp_step.py counts them), so this is what each one costs
where they run. When the ranks outnumber the cores, a collective waits for every rank to be
scheduled again, which costs far more than its bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import launch, slowest_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="gloo processes (default 4)")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds per collective (median reported)")
    p.add_argument("--matmuls", type=int, default=20, help="256 x 256 matmuls before each collective")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def _all_gather():
    mine = torch.tensor([12345, 0])
    dist.all_gather([torch.empty_like(mine) for _ in range(dist.get_world_size())], mine)


def _all_reduce():
    dist.all_reduce(torch.tensor([1.5, 7.0]))


def _broadcast():
    dist.broadcast(torch.tensor([12345, 0]), src=0)


COLLECTIVES = {"all_gather (hp's agreement)": _all_gather, "all_reduce (hp's loss sum and count)": _all_reduce,
               "broadcast (DDP's buffers)": _broadcast}


def run(args: argparse.Namespace) -> dict | None:
    torch.set_num_threads(1)
    x = torch.randn(256, 256)
    compute_s, medians = [], {}
    for name, collective in COLLECTIVES.items():
        times = []
        for _ in range(args.rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.matmuls):
                x @ x
            t1 = time.perf_counter()
            collective()
            times.append(time.perf_counter() - t1)
            compute_s.append(t1 - t0)
        medians[name] = statistics.median(slowest_rank(times))
    if dist.get_rank() != 0:
        return None
    return {"bench": "sync_cost", "world_size": args.world, "cpu_count": os.cpu_count(), "rounds": args.rounds,
            "compute_before_each_ms (median, rank 0)": statistics.median(compute_s) * 1e3,
            "collective_ms (median of the slowest rank)": {k: v * 1e3 for k, v in medians.items()}}


def print_table(r: dict) -> None:
    print(f"\n{r['world_size']} gloo ranks on {r['cpu_count']} cores, {r['rounds']} rounds, "
          f"{r['compute_before_each_ms (median, rank 0)']:.1f} ms of compute before each collective")
    for name, ms in r["collective_ms (median of the slowest rank)"].items():
        print(f"  {name:40s} {ms:7.2f} ms")


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.world, threads=1)


if __name__ == "__main__":
    main()
