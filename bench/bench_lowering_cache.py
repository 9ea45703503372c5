"""Compile time on a 2-D mesh with lowering's cached sharding decisions on and off, side by side.

``python bench/bench_lowering_cache.py`` compiles the example Llama (``--layers``, default 8;
batch 4 x 256 tokens) for rank 1 of a fake 2 x 2 mesh in this one process (torch's ``fake``
process-group backend: nothing runs, the programs are built), for three plans that put strided
shards or two sharded axes in front of DTensor's redistribution planner:

* ``cp_x_tp``: ``AsyncContextParallel`` ring attention over ``cp`` x the Llama TP plan over ``tp``;
* ``fsdp_x_cp``: FSDP over ``dp_shard`` x ``cp``, ring attention over ``cp``;
* ``fsdp_x_tp``: FSDP over ``dp`` x the Llama TP plan.

Each plan is compiled ``--repeats`` times (default 2) both ways, alternating: as shipped, and with
``decision_cache.cached_sharding_decisions`` replaced by a no-op (DTensor deciding every op afresh under
tracing, as before). It prints the seconds of each and the median ratio. The programs are the same
either way (``tests/propagation/test_cached_sharding_decisions.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from hyper_parallel.propagation import decision_cache  # noqa: E402
from hyper_parallel.tools.explain import compile_for_explain, fake_world  # noqa: E402
from hyper_parallel.models.plans import llama_tp_plan  # noqa: E402
from hyper_parallel.testing.parity import build_model, global_batch, local_batch  # noqa: E402

ATTENTION = "model.layers.*.self_attn"
UNITS = {"fully_shard": {"units": ["model.layers.*", ""]}}
PLANS = {
    "cp_x_tp": ({"context_parallel": {ATTENTION: hp.AsyncContextParallel()}, **llama_tp_plan()}, ("cp", "tp")),
    "fsdp_x_cp": ({"context_parallel": {ATTENTION: hp.ContextParallel(mode="ring")}, **UNITS}, ("dp_shard", "cp")),
    "fsdp_x_tp": ({**UNITS, **llama_tp_plan()}, ("dp", "tp")),
}


def compile_seconds(plan, names, layers: int) -> float:
    with fake_world(4, 1):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        model = build_model("llama", num_hidden_layers=layers)
        batch = local_batch(global_batch("llama", 4, 256), mesh)
        start = time.perf_counter()
        compile_for_explain(model, plan, mesh, (), batch)
        return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args(argv)
    shipped = decision_cache.cached_sharding_decisions
    off = lambda *a, **k: contextlib.nullcontext()  # noqa: E731
    print(f"example Llama, {args.layers} layers, rank 1 of a fake 2 x 2 mesh, batch 4 x 256")
    print(f"{'plan':<10} {'cached (s)':>22} {'afresh (s)':>22} {'ratio':>6}")
    for name in args.plans:
        plan, names = PLANS[name]
        times = {"cached": [], "afresh": []}
        for _ in range(args.repeats):
            for mode, context in (("cached", shipped), ("afresh", off)):
                decision_cache.cached_sharding_decisions = context
                try:
                    times[mode].append(compile_seconds(plan, names, args.layers))
                finally:
                    decision_cache.cached_sharding_decisions = shipped
        cached, afresh = (statistics.median(times[m]) for m in ("cached", "afresh"))
        shown = {m: ", ".join(f"{t:.2f}" for t in times[m]) for m in times}
        print(f"{name:<10} {shown['cached']:>22} {shown['afresh']:>22} {cached / afresh:6.2f}")


if __name__ == "__main__":
    main()
