"""Peak memory of a training step under ``codegen="inductor"`` vs ``"eager"``, plan by plan.

``python bench/bench_codegen_memory.py`` spawns ``--world`` (default 2) gloo processes on CPU, one
intra-op thread each. For each plan of ``--plans`` it parallelizes the same Llama (seed 0; 2 layers
of hidden 128 by default) twice, with eager programs and with Inductor kernels between the
collectives, trains two steps on padded labels (ranks count different tokens), then measures
``--steps`` more steps of each for each of the two measures below
(``testing.memory_tracker.least_step_peak``): the peak of a step is the parameters plus the most bytes
allocated inside it and alive at once, from the allocator's own events
(``testing.AllocatorPeak``: Inductor's buffers never pass the dispatcher). Two measures:

* *program*: without what gloo allocates inside its own ops (its copy of a reduce-scatter's input,
  its all-gather scratch). gloo's worker thread frees those when it gets to them, sometimes after
  the program's next allocations, so with them an FSDP step's peak moves by up to a third from
  step to step; without them much less (a collective's input the program made is still freed when
  gloo lets go of it: hence the least of several steps). Both sides run the same collectives, so
  this compares what the code generator does;
* *all*: everything, as a user's allocator sees it.

Each is the least over the measured steps. The ratio inductor / eager is what
``tests/codegen/test_codegen.py::test_inductor_programs_hold_no_more_than_eager`` bounds for DP
and FSDP without resharding after forward.

Plans (``--plans``, comma separated): ``dp``, ``tp``, ``sp``, ``cp``, ``fsdp``, ``fsdp_bf16``
(bf16 parameters / fp32 reduction), ``fsdp_keep`` (no resharding after forward), ``recompute``
(full, every layer), ``swap`` (every layer's activations to host memory), ``fsdp_swap``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import launch  # noqa: E402

FSDP_UNITS = {"units": ["model.layers.*", ""]}


def plan_of(name: str) -> tuple[dict, str]:
    """The plan and the name of the mesh's one axis."""
    from hyper_parallel.models import llama_tp_plan

    bf16 = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plans = {
        "dp": ({}, "dp"),
        "tp": (llama_tp_plan(), "tp"),
        "sp": (llama_tp_plan(sequence_parallel=True), "tp"),
        "cp": ({"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel()}}, "cp"),
        "fsdp": ({"fully_shard": FSDP_UNITS}, "dp"),
        "fsdp_bf16": ({"fully_shard": {**FSDP_UNITS, "mixed_precision": bf16}}, "dp"),
        "fsdp_keep": ({"fully_shard": {**FSDP_UNITS, "reshard_after_forward": False}}, "dp"),
        "recompute": ({"recompute": {"model.layers.*": "full"}}, "dp"),
        "swap": ({"swap": {"model.layers.*": True}}, "dp"),
        "fsdp_swap": ({"fully_shard": FSDP_UNITS, "swap": {"model.layers.*": True}}, "dp"),
    }
    if name not in plans:
        raise SystemExit(f"unknown plan {name!r}; choose from {sorted(plans)}")
    return plans[name]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--plans", default="dp,tp,sp,cp,fsdp,fsdp_bf16,fsdp_keep,recompute,swap,fsdp_swap")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="measured steps per side (the least peak is reported)")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _peaks(model, batch, steps: int) -> dict:
    """The least peak of ``steps`` steps, with gloo's own buffers ("all") and without ("program")."""
    from hyper_parallel.testing.memory_tracker import least_step_peak

    return {measure: least_step_peak(model, batch, steps, backend_buffers=backend_buffers,
                                     warmup_steps=2 if measure == "program" else 0)
            for measure, backend_buffers in (("program", False), ("all", True))}


def run(args) -> dict | None:
    from hyper_parallel.testing.parity import global_batch, local_batch
    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

    world = dist.get_world_size()
    rows = {}
    for name in args.plans.split(","):
        plan, axis = plan_of(name)
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        torch.manual_seed(0)
        reference = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                                 intermediate_size=args.intermediate, vocab_size=args.vocab,
                                                 max_position_embeddings=max(128, args.seq_len)))
        batch = local_batch(global_batch("llama", args.batch, args.seq_len, ignore_fraction=0.3), mesh)
        rows[name] = {codegen: _peaks(hp.parallelize(copy.deepcopy(reference), copy.deepcopy(plan), mesh,
                                                     codegen=codegen), batch, args.steps)
                      for codegen in ("eager", "inductor")}
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() != 0:
        return None
    # The rank that holds the most, per plan and codegen (ranks differ by their token counts).
    worst = {name: {cg: {m: max(r[name][cg][m] for r in everyone) for m in ("program", "all")}
                    for cg in ("eager", "inductor")} for name in rows}
    return {"bench": "codegen_memory", "world_size": world, "torch": torch.__version__,
            "config": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                       "vocab": args.vocab, "global_batch": args.batch, "seq_len": args.seq_len},
            "measured_steps": args.steps, "peak_bytes": worst}


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nLlama {c['layers']}L h{c['hidden']}, global batch {c['global_batch']} x seq {c['seq_len']}, "
          f"{r['world_size']} ranks, least of {r['measured_steps']} steps, the rank that holds the most")
    print(f"{'plan':<12}{'eager (MB)':>12}{'inductor (MB)':>15}{'ratio':>8}{'all: eager':>13}{'inductor':>11}{'ratio':>8}")
    for name, row in r["peak_bytes"].items():
        e, i = row["eager"], row["inductor"]
        print(f"{name:<12}{e['program'] / 1e6:>12.3f}{i['program'] / 1e6:>15.3f}{i['program'] / e['program']:>8.3f}"
              f"{e['all'] / 1e6:>13.3f}{i['all'] / 1e6:>11.3f}{i['all'] / e['all']:>8.3f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HYPER_PARALLEL_LOG", "quiet")
    launch(run, print_table, args, args.world, threads=1)


if __name__ == "__main__":
    main()
