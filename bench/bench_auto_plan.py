"""``hp.auto_plan`` checked by measurement: every candidate it ranked, run on 4 gloo ranks here.

``python bench/bench_auto_plan.py`` (a few minutes on 2 cores):

1. plans the model for 4 ranks on the ``cpu`` profile (this machine's calibrated gloo ranks,
   ``bench/calibrate_cost_model.py``) with the 4 ranks on one node sharing its 2 cores
   (``host_cores``: busy ranks beyond the cores time-share them), fp32, AdamW; first without a budget, then with a memory
   budget between the smallest and the largest predicted peak (``--budget-mib`` sets it), so that
   some candidates are rejected for memory;
2. on 4 gloo ranks, runs every candidate that fits and every one rejected as "OOM by ..." after
   compiling: ``hp.parallelize(model, c.plan, c.mesh("cpu"))``, ``--warmup`` then ``--steps``
   steps of forward + backward + ``AdamW(foreach=True).step()`` on the candidate's local batch
   (the slowest rank's median step time) and one step's peak (``MemoryTracker``: tensors through
   the dispatcher, what the estimate counts);
3. reports predicted and measured side by side, and the targets of issue 55: the chosen plan
   within 10% of the measured best, Kendall's tau between the predicted and measured order of the
   fitting candidates >= 0.7, the chosen plan's measured peak within the budget, and each
   candidate rejected for memory measured above it.

Models: ``--model example`` (hyper_parallel's Llama, ``--config`` a JSON of its fields or a preset)
or ``hf:LlamaForCausalLM``; the default shape is the benches' example Llama.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _harness import launch, slowest_rank, step_peak  # noqa: E402

WORLD = 4
DEFAULT_CONFIG = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="example", help="example or hf:<Architecture>")
    p.add_argument("--config", default=None, help="a JSON file of config fields (default: the benches' example Llama)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="memory budget per rank; default: halfway between the smallest and largest predicted peak")
    p.add_argument("--search", default=None, help="auto_plan restrictions as hyper-parallel plan --search takes them")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def plan(args) -> tuple[object, list]:
    """The budgeted search and the candidates to run (fitting ones, then those over the budget)."""
    from hyper_parallel.cost.hardware import get_profile
    from hyper_parallel.tools.cli import parse_search_spec
    from hyper_parallel.tools.planner import auto_plan

    fields = DEFAULT_CONFIG if args.config is None else json.load(open(args.config))
    # The 4 ranks share this host's cores (the profile's host_cores): one node of WORLD ranks.
    profile = dataclasses.replace(get_profile("cpu"), devices_per_node=WORLD)
    common = dict(world_size=WORLD, hardware=profile, global_batch=args.global_batch, seq_len=args.seq_len,
                  dtype="fp32", optimizer="adamw", model=args.model, search=parse_search_spec(args.search),
                  top_k=20, progress=False, max_compiles=None)  # every candidate: the cost model is what is checked
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    if budget is None:
        free = auto_plan(dict(fields), **common)
        peaks = sorted(r.predicted["peak_bytes"] for r in free.ranked if r.rejected is None)
        budget = (peaks[0] + peaks[-1]) // 2
    choice = auto_plan(dict(fields), memory_per_device=budget, **common)
    runs = [r for r in choice.ranked if r.rejected is None] + \
        [r for r in choice.ranked if (r.rejected or "").startswith("OOM by")]
    return choice, runs


def _spec(entry) -> dict:
    c = entry.candidate
    return {"describe": c.describe(), "dims": entry.dims, "plan_name": c.plan_name, "settings": entry.plan_settings(),
            "local_batch": c.local_batch, "cp": c.cp, "pp": c.pp, "fits": entry.rejected is None,
            "predicted": entry.predicted}


def run(args) -> dict | None:
    import hyper_parallel as hp
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.tools.explain import build_model
    from hyper_parallel.tools.presets import build_plan

    results = []
    for spec in args.specs:
        extra = {"ulysses_degree": 1} if spec["cp"] > 1 else {}
        dims = ParallelDims(**spec["dims"], **extra, world_size=WORLD)
        mesh = dims.build_mesh("cpu")
        plan_ = build_plan(spec["plan_name"], dims.mesh_axes(), dict(args.fields), **spec["settings"]).plan
        torch.manual_seed(0)
        net, _ = build_model(args.model, dict(args.fields))
        model = hp.parallelize(net, plan_, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.fields["vocab_size"], (spec["local_batch"], args.seq_len // spec["cp"]), generator=g)

        def one_step():
            if spec["pp"] > 1:
                model.step({"input_ids": ids, "labels": ids})
            else:
                model(input_ids=ids, labels=ids)["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        started = time.perf_counter()
        one_step()  # compiles
        compile_s = time.perf_counter() - started
        for _ in range(args.warmup - 1):
            one_step()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(slowest_rank(times))
        peak = step_peak(one_step, model.parameters(), opt)
        results.append({**spec, "measured": {"step_s": step_s, "peak_bytes": peak, "compile_s": compile_s}})

    if dist.get_rank() != 0:
        return None
    return {"results": results, "summary": summarise(results, args.budget), "search_s": args.search_s}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items (ties count as neither)."""
    n = len(xs)
    concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            s = (xs[i] - xs[j]) * (ys[i] - ys[j])
            concordant += s > 0
            discordant += s < 0
    pairs = n * (n - 1) / 2
    return (concordant - discordant) / pairs if pairs else 1.0


def summarise(results: list[dict], budget: int) -> dict:
    fits = [r for r in results if r["fits"]]
    over = [r for r in results if not r["fits"]]
    best = min(r["measured"]["step_s"] for r in fits)
    chosen = fits[0]  # ranked first by the planner
    return {
        "chosen": chosen["describe"],
        "chosen_over_measured_best": chosen["measured"]["step_s"] / best,
        "kendall_tau": kendall_tau([r["predicted"]["step_s"] for r in fits], [r["measured"]["step_s"] for r in fits]),
        "chosen_peak_within_budget": chosen["measured"]["peak_bytes"] <= budget,
        "rejected_for_memory_measured_over_budget": [r["measured"]["peak_bytes"] > budget for r in over],
        "budget_bytes": budget,
    }


def report(result: dict) -> None:
    MiB = 2**20
    print(f"\nauto_plan on {WORLD} gloo ranks (cpu profile, fp32, AdamW), budget {result['summary']['budget_bytes'] / MiB:.1f} MiB")
    print(f"{'candidate':<70}{'fits':>5}{'pred ms':>9}{'meas ms':>9}{'ratio':>7}{'pred MiB':>10}{'meas MiB':>10}")
    for r in result["results"]:
        p, m = r["predicted"], r["measured"]
        print(f"{r['describe']:<70}{'yes' if r['fits'] else 'no':>5}{p['step_s'] * 1e3:>9.1f}{m['step_s'] * 1e3:>9.1f}"
              f"{p['step_s'] / m['step_s']:>7.2f}{p['peak_bytes'] / MiB:>10.1f}{m['peak_bytes'] / MiB:>10.1f}")
    s = result["summary"]
    print(f"chosen: {s['chosen']}: {s['chosen_over_measured_best']:.2f}x the measured best (target <= 1.10); "
          f"Kendall tau {s['kendall_tau']:.2f} (target >= 0.7); chosen peak within budget: {s['chosen_peak_within_budget']}; "
          f"rejected for memory and measured over it: {sum(s['rejected_for_memory_measured_over_budget'])} of "
          f"{len(s['rejected_for_memory_measured_over_budget'])}")


def main(argv=None) -> None:
    args = parse_args(argv)
    choice, runs = plan(args)
    print(choice.table())
    args.fields = dict(choice.context.fields)
    args.specs = [_spec(r) for r in runs]
    args.budget = choice.context.budget
    args.search_s = choice.search_s
    launch(run, report, args, WORLD)  # rank 0 prints the JSON, the table, and writes --json-out


if __name__ == "__main__":
    main()
