"""What the per-call agreement costs a step: ``spmd.agree`` and the exchanges it could be built on.

``python bench/bench_agreement.py`` spawns ``--world`` (default 4) gloo processes on CPU, one
intra-op thread each. Each round: a barrier, ``--matmuls`` matmuls of 256 x 256 (a few ms of
compute, so the ranks arrive as from a training step), then the exchange, timed on every rank; a
round's time is its slowest rank's; medians over ``--rounds``. Timed:

* the exchanges alone, on 3 int64 per rank: ``all_gather`` (what the agreement issued up to
  88216a4, and still does up to 4 ranks), gloo's ``all_reduce`` (MAX; a ring: 2(n-1) steps), and
  ``host_reduce.MaxAllReduce`` (recursive doubling over send/recv beyond 4 ranks: log2(n) steps),
  each blocking;
* ``spmd.agree`` as a call that compiles runs it (``wait=True``: blocking);
* ``spmd.agree`` as a call that reuses a cached program runs it (``wait=False`` before the
  compute, ``wait()`` after it, as the forward's gate does): the time the step spends issuing and
  waiting for it (what is left of it once it overlaps the compute).

Runs against whichever ``hyper_parallel`` is first on ``PYTHONPATH`` (the exchanges it lacks are
left out), so an older checkout can be measured with the same script. Results:
docs/benchmarks.md, "The per-call agreement's exchange".
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
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per exchange (median reported)")
    p.add_argument("--matmuls", type=int, default=20, help="256 x 256 matmuls before each exchange")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def _exchanges(mesh) -> dict:
    from hyper_parallel.distributed import spmd

    mine = torch.tensor([12345, -12345, 0])
    world = dist.get_world_size()
    out = {
        "all_gather (3 int64)": lambda: dist.all_gather([torch.empty_like(mine) for _ in range(world)], mine),
        "gloo all_reduce MAX (3 int64, ring)": lambda: dist.all_reduce(mine.clone(), op=dist.ReduceOp.MAX),
    }
    try:
        from hyper_parallel.distributed.host_reduce import MaxAllReduce
    except ImportError:
        pass
    else:
        out["recursive doubling MAX (3 int64)"] = lambda: MaxAllReduce(mine).wait()
    out["spmd.agree, blocking"] = lambda: spmd.agree(mesh, "bench", 12345, lambda: "")
    return out


def run(args: argparse.Namespace) -> dict | None:
    import hyper_parallel as hp
    from hyper_parallel.distributed import spmd

    torch.set_num_threads(1)
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    x = torch.randn(256, 256)

    def compute():
        for _ in range(args.matmuls):
            x @ x

    medians = {}
    for name, exchange in _exchanges(mesh).items():
        times = []
        for _ in range(args.rounds):
            dist.barrier()
            compute()
            t0 = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - t0)
        medians[name] = statistics.median(slowest_rank(times))
    # As a cached program's call: issued, the forward computes, the gate waits.
    issue, waited, total = [], [], []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        pending = spmd.agree(mesh, "bench", 12345, lambda: "", wait=False)
        t1 = time.perf_counter()
        compute()
        t2 = time.perf_counter()
        pending.wait()
        t3 = time.perf_counter()
        issue.append(t1 - t0)
        waited.append(t3 - t2)
        total.append((t1 - t0) + (t3 - t2))
    medians["spmd.agree overlapped: issue"] = statistics.median(slowest_rank(issue))
    medians["spmd.agree overlapped: wait at the gate"] = statistics.median(slowest_rank(waited))
    medians["spmd.agree overlapped: issue + wait"] = statistics.median(slowest_rank(total))
    if dist.get_rank() != 0:
        return None
    return {"bench": "agreement", "world_size": args.world, "cpu_count": os.cpu_count(), "rounds": args.rounds,
            "matmuls": args.matmuls, "exchange_ms (median of the slowest rank)": {k: v * 1e3 for k, v in medians.items()}}


def print_table(r: dict) -> None:
    print(f"\n{r['world_size']} gloo ranks on {r['cpu_count']} cores, {r['rounds']} rounds, "
          f"{r['matmuls']} matmuls of 256 x 256 before each exchange")
    for name, ms in r["exchange_ms (median of the slowest rank)"].items():
        print(f"  {name:45s} {ms:7.3f} ms")


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.world, threads=1)


if __name__ == "__main__":
    main()
