"""What the compiled step costs beyond its programs: hyper_parallel on one rank vs eager, side by side.

``python bench/bench_runtime_overhead.py`` runs the example Llama (seed 0; ``--layers``,
``--hidden``... as the other step benches, default 2 layers of hidden 256: 21 parameters) in one
process on a one-rank gloo ``("dp",)`` mesh, where no collective runs and the per-call agreement is
skipped, two ways, step by step interleaved:

* ``hp.parallelize(model, {}, mesh)``: forward, ``loss.backward()``, gradients set to None;
* the same model eager: the same three.

It reports the median step of each, their ratio, and for hyper_parallel the time inside its forward
and backward programs (the GraphModules) against the whole step: the rest is the runtime's own
work per call (the cache key, input checks, the autograd function around the programs, wrapping
each parameter's gradient as a DTensor). That part grows with the number of parameters and calls,
not with the model's FLOPs, so it matters most on small steps and on models with many tensors.
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
import hyper_parallel.runtime.program as program  # noqa: E402
from _harness import add_model_args, build_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(layers=2, seq_len=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="timed steps per side (median reported)")
    return p.parse_args(argv)


def _step(model, batch) -> None:
    model(**batch)["loss"].backward()
    for p in model.parameters():
        p.grad = None


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HYPER_PARALLEL_LOG", "quiet")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        reference = build_model(args)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids}
        compiled, eager = hp.parallelize(copy.deepcopy(reference), {}, mesh), copy.deepcopy(reference)
        for _ in range(args.warmup):
            _step(compiled, batch)
            _step(eager, batch)
        inside = [0.0]
        run_program = program._call

        def timed_program(*a, **kw):  # the time inside the forward and backward GraphModules
            t0 = time.perf_counter()
            try:
                return run_program(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t0

        program._call = timed_program
        hp_times, eager_times = [], []
        try:
            for _ in range(args.steps):
                for model, times in ((compiled, hp_times), (eager, eager_times)):
                    t0 = time.perf_counter()
                    _step(model, batch)
                    times.append(time.perf_counter() - t0)
        finally:
            program._call = run_program
        hp_ms, eager_ms = statistics.median(hp_times) * 1e3, statistics.median(eager_times) * 1e3
        programs_ms, total_ms = inside[0] / args.steps * 1e3, sum(hp_times) / args.steps * 1e3
        params = sum(1 for _ in reference.parameters())
        print(f"Llama {args.layers}L h{args.hidden} ({params} parameters), batch {args.batch} x seq {args.seq_len}, "
              f"1 thread, one rank, median of {args.steps} interleaved steps")
        print(f"step (ms): hyper_parallel {hp_ms:.2f}, eager {eager_ms:.2f}, ratio {hp_ms / eager_ms:.3f}")
        print(f"hyper_parallel per step (mean): programs {programs_ms:.2f} ms of {total_ms:.2f} ms; runtime "
              f"{total_ms - programs_ms:.2f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
