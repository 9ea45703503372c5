"""Compile time of hyper_parallel vs model depth: the example Llama at 2, 8 and 32 layers.

``python bench/bench_compile_time.py`` spawns ``--tp`` (default 2) gloo processes on CPU, builds a
1-D ``("tp",)`` mesh and parallelizes the example Llama with ``llama_tp_plan()`` at each depth.
The first call of the parallelized module captures the joint graph, propagates layouts, lowers,
runs the passes and partitions; later calls only run the program. So

    compile time = time(first forward) - time(second forward)

taken as the slowest rank's. The hidden size is small (``--hidden 64``) so the compiler, not compute,
is what is timed. Before the measured depths one throw-away compile (1 layer) absorbs one-time
costs (imports, dispatcher caches), which would otherwise be charged to the first depth.
Each depth is compiled ``--repeats`` times (fresh model each time); the median is reported.

``--codegen inductor`` times what Inductor adds: a timed call is then forward + backward (backward's
regions compile on its first run), the in-process region cache is cleared before each model, and
the regions Inductor compiled and those it reused (a repeated layer) are reported per depth. Give
each depth its own run with ``--fresh-inductor-cache`` (a new ``TORCHINDUCTOR_CACHE_DIR``) so no
depth finds another's kernels on disk.
Prints one JSON object, then a table: seconds per depth, seconds per layer, and the ratio to linear
scaling from the smallest depth (``t(L) / (t(L0) * L / L0)``; 1.0 = linear, > 1 superlinear; below 1
when a fixed per-compile cost dominates the small depth), and the marginal seconds per added layer
between consecutive depths (fixed costs cancel; constant = linear).
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
from _harness import launch  # noqa: E402
from hyper_parallel.codegen.inductor import cache_stats, clear_cache  # noqa: E402
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from hyper_parallel.models.plans import llama_tp_plan  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32], help="depths (default 2 8 32)")
    p.add_argument("--tp", type=int, default=2, help="TP degree = number of processes (default 2)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="compiles per depth (median reported)")
    p.add_argument("--codegen", choices=["eager", "inductor"], default="eager",
                   help="parallelize(codegen=...); inductor: time forward + backward (module docstring)")
    p.add_argument("--fresh-inductor-cache", action="store_true",
                   help="run with a new, empty TORCHINDUCTOR_CACHE_DIR")
    p.add_argument("--repeated-blocks", choices=["off", "auto", "both"], default="off",
                   help="parallelize(repeated_blocks=...): off (None), auto, or both side by side per depth")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def _timed_call(model, ids, backward: bool) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids)["loss"]
    if backward:
        loss.backward()
    return time.perf_counter() - t0


def compile_once(num_layers: int, args: argparse.Namespace, mesh, repeated_blocks: str | None = None) -> dict:
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=num_layers
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))
    inductor = args.codegen == "inductor"
    if inductor:
        clear_cache()
    before = cache_stats()
    pm = hp.parallelize(copy.deepcopy(model), llama_tp_plan(), mesh, codegen=args.codegen,
                        repeated_blocks=repeated_blocks)
    first = _timed_call(pm, ids, inductor)
    second = _timed_call(pm, ids, inductor)
    after = cache_stats()
    t = torch.tensor([first, second], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_step = pm.compile_summary()["collectives_per_step"]
    num_collectives = sum(e["count"] for by_axis in per_step.values() for e in by_axis.values())
    fwd, bwd = pm.compiled_programs()
    return {
        "first_call_s": t[0].item(),
        "second_call_s": t[1].item(),
        "compile_s": t[0].item() - t[1].item(),
        "collectives_per_step": num_collectives,
        "graph_nodes": {"forward": len(fwd.graph.nodes), "backward": len(bwd.graph.nodes)},
        "inductor_regions": {"compiled": after.compiled - before.compiled, "reused": after.reused - before.reused},
    }


def run(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    warm = compile_once(1, args, mesh)  # one-time costs, not reported per depth
    modes = {"off": [None], "auto": ["auto"], "both": [None, "auto"]}[args.repeated_blocks]
    by_mode: dict = {str(m): {} for m in modes}
    for num_layers in args.layers:
        runs: dict = {str(m): [] for m in modes}
        for repeat in range(args.repeats):  # modes side by side, their order alternating per repeat
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                runs[str(mode)].append(compile_once(num_layers, args, mesh, mode))
        for mode, done in runs.items():
            compile_times = [r["compile_s"] for r in done]
            by_mode[mode][num_layers] = dict(done[-1], compile_s=statistics.median(compile_times),
                                             compile_s_all=compile_times)
            if rank == 0:
                print(f"[{num_layers} layers, repeated_blocks={mode}] compile "
                      f"{by_mode[mode][num_layers]['compile_s']:.2f} s", file=sys.stderr, flush=True)
    if rank != 0:
        return None
    return {
        "bench": "compile_time",
        "world_size": world,
        "mesh": {"tp": world},
        "plan": "llama_tp_plan()",
        "codegen": args.codegen,
        "config": {"hidden": args.hidden, "intermediate": args.intermediate, "seq_len": args.seq_len, "batch": args.batch},
        "warmup_compile_1_layer_s": warm["compile_s"],
        "repeats": args.repeats,
        "by_repeated_blocks": {mode: _per_layer(results) for mode, results in by_mode.items()},
    }


def _per_layer(results: dict) -> dict:
    """Seconds per layer, ratio to linear scaling and marginal seconds per layer for each depth."""
    base_layers = min(results)
    base = results[base_layers]["compile_s"]
    prev = None
    for num_layers, r in sorted(results.items()):
        r["s_per_layer"] = r["compile_s"] / num_layers
        r["ratio_to_linear"] = r["compile_s"] / (base * num_layers / base_layers)
        # Cost of one more layer between this depth and the previous one (fixed costs cancel).
        r["marginal_s_per_layer"] = (
            None if prev is None else (r["compile_s"] - results[prev]["compile_s"]) / (num_layers - prev)
        )
        prev = num_layers
    return {str(k): v for k, v in sorted(results.items())}


def print_table(r: dict) -> None:
    for mode, by_layers in r["by_repeated_blocks"].items():
        print(f"\ncompile time (codegen={r['codegen']}, repeated_blocks={mode}), llama_tp_plan on tp={r['world_size']}, "
              f"hidden {r['config']['hidden']} (throw-away 1-layer compile first: {r['warmup_compile_1_layer_s']:.2f} s)")
        _print_depths(by_layers)
    modes = list(r["by_repeated_blocks"])
    if len(modes) == 2:
        off, auto = (r["by_repeated_blocks"][m] for m in modes)
        print("\nrepeated_blocks='auto' vs None, compile seconds: " + ", ".join(
            f"{layers} layers {auto[layers]['compile_s'] / off[layers]['compile_s']:.2f}x" for layers in off))


def _print_depths(by_layers: dict) -> None:
    print(f"{'layers':>6}  {'compile s':>9}  {'s/layer':>7}  {'vs linear':>9}  {'marginal s/layer':>16}  {'collectives':>11}  "
          f"{'fwd+bwd nodes':>13}  {'regions compiled/reused':>23}")
    for layers, e in by_layers.items():
        nodes = e["graph_nodes"]["forward"] + e["graph_nodes"]["backward"]
        marginal = "-" if e["marginal_s_per_layer"] is None else f"{e['marginal_s_per_layer']:.3f}"
        regions = f"{e['inductor_regions']['compiled']}/{e['inductor_regions']['reused']}"
        print(f"{layers:>6}  {e['compile_s']:>9.2f}  {e['s_per_layer']:>7.3f}  {e['ratio_to_linear']:>9.2f}  {marginal:>16}  "
              f"{e['collectives_per_step']:>11}  {nodes:>13}  {regions:>23}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fresh_inductor_cache:  # read by the workers' Inductor (spawned after this)
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cache_")
    launch(run, print_table, args, args.tp)


if __name__ == "__main__":
    main()
