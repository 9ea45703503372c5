"""``hyper-parallel`` command line (also ``python -m hyper_parallel``).

Subcommands:

- ``explain``: compile a plan for a simulated mesh on the fake process-group backend and print
  one rank's memory, collectives, estimated step time and MFU (``hyper_parallel/tools/explain.py``)::

      hyper-parallel explain --model example --config llama3-70b --parallel dp_shard=-1,tp=8 \\
          --world-size 1024 --plan fsdp+tp --hardware h100

  With a context-parallel axis the sequence is sharded over ``cp`` (ring attention, K/V gathered
  with ``--cp-mode all_gather``, or Ulysses with ``--cp-mode all_to_all``); e.g. Llama 3 8B at 128k tokens, which fits an H100 only with
  cp (the same 64 ranks as ``dp_shard=64`` do not fit)::

      hyper-parallel explain --config llama3-8b --seq-len 131072 --parallel dp_shard=8,cp=8 \\
          --world-size 64 --recompute full

- ``plan``: choose the configuration (``hyper_parallel/tools/planner/``): every factorisation of the
  world compiled as ``explain`` does, ranked by predicted step time, the best written as a plan file::

      hyper-parallel plan --config llama3-70b --world-size 256 --global-batch 512 --out plan_70b.py

- ``report``: one self-contained HTML page about a compile from its dump directory (passes, layouts,
  the estimated timeline, memory over the step) plus the step's Chrome trace
  (``hyper_parallel/tools/report/``)::

      hyper-parallel report /tmp/dump --rank 0 --out report.html
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    from .explain import HARDWARE, OPTIMIZERS
    from .presets import CP_MODES, MODEL_PRESETS, PIPELINE_SCHEDULES, PLAN_PRESETS

    from .. import __version__

    parser = argparse.ArgumentParser(prog="hyper-parallel", description="hyper_parallel command line tools")
    parser.add_argument("--version", action="version", version=f"hyper-parallel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    ex = sub.add_parser(
        "explain", help="compile a plan on a simulated mesh and explain memory, communication and step time",
        description="Compile MODEL with PLAN for a simulated mesh of --world-size ranks (torch's fake "
        "process-group backend, meta tensors: no memory, no hardware) and print one rank's memory, "
        "collectives per step, whether it fits the device, and the cost model's step time and MFU.",
        epilog="Context parallelism: --parallel dp_shard=8,cp=8 shards each sequence over 8 ranks (the presets add "
        "ring attention, all-gather attention with --cp-mode all_gather, or Ulysses with --cp-mode all_to_all). Example: Llama 3 8B at 128k tokens fits an "
        "H100 with cp (--config llama3-8b --seq-len 131072 --parallel dp_shard=8,cp=8 --world-size 64 "
        "--recompute full: peak about 41 GiB) and not without it (--parallel dp_shard=64: about 288 GiB).",
    )
    ex.add_argument("--model", default="example",
                    help="'example' (hyper_parallel.models.LlamaForCausalLM, or models.moe.MoEForCausalLM for a "
                    "config with num_experts) or hf:<Architecture> "
                    "(transformers, e.g. hf:LlamaForCausalLM); default: example")
    ex.add_argument("--config", default="llama3-8b",
                    help=f"model shape: a preset ({', '.join(MODEL_PRESETS)}) or a JSON file of LlamaConfig "
                    "fields (may name a preset under \"base\"); default: llama3-8b")
    ex.add_argument("--parallel", default="dp_shard=-1",
                    help="ParallelDims degrees, e.g. dp_shard=-1,tp=8, dp_shard=8,cp=8 or dp_shard=-1,tp=8,pp=8 "
                    "(dp_replicate, dp_shard, cp, tp, pp, ep, etp; -1 infers dp_shard); default: dp_shard=-1")
    ex.add_argument("--world-size", type=int, default=8, help="number of simulated ranks; default: 8")
    ex.add_argument("--rank", type=int, default=0, help="the rank to simulate and report; default: 0")
    ex.add_argument("--plan", default="fsdp",
                    help=f"a preset ({', '.join(PLAN_PRESETS)}) or a Python file defining `plan` (a "
                    "ParallelPlan/dict or plan(mesh_axes, config)); default: fsdp")
    ex.add_argument("--hardware", default="h100", type=_hardware(HARDWARE), metavar="{%s} or FILE.json" % ",".join(HARDWARE),
                    help="hardware profile for memory capacity and the cost model (cpu: gloo ranks on this "
                         "machine's cores, as calibrated in cost/hardware.py; a .json file: a profile "
                         "hyper-parallel calibrate wrote); default: h100")
    ex.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer state to count; default: adamw")
    ex.add_argument("--local-batch", type=int, default=1,
                    help="sequences per data-parallel rank (per-rank batch); default: 1")
    ex.add_argument("--seq-len", type=int, default=8192,
                    help="tokens per sequence (the whole sequence: with cp=N each rank holds 1/N of it); "
                    "default: 8192")
    ex.add_argument("--cp-mode", default="ring", choices=CP_MODES,
                    help="attention of the plan presets when --parallel has cp > 1: ring (K/V blocks around the "
                    "cp ring, load-balanced causal chunks), all_gather (the same, K/V gathered once per "
                    "attention) or all_to_all (Ulysses: cp must divide the heads); default: ring")
    ex.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                    help="compute dtype (bf16 with FSDP: fp32 master weights, fp32 reduction); default: bf16")
    ex.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                    help="activation recompute of every decoder layer (selective keeps every matmul, "
                         "attention and collective output; another policy: a --plan file that sets recompute, as the "
                         "repository's bench/plans/torchtitan_op_sac.py); default: none")
    ex.add_argument("--pp-schedule", default="1F1B", choices=PIPELINE_SCHEDULES,
                    help="pipeline schedule with pp > 1 (Interleaved1F1B: --stages-per-rank stages per rank, "
                    "default 2; ZBH1: zero bubble, split backward); default: 1F1B")
    ex.add_argument("--microbatches", type=int, default=None,
                    help="micro-batches each step's local batch is cut into with pp > 1 (they must divide "
                    "--local-batch); default: pp")
    ex.add_argument("--stages-per-rank", type=int, default=None,
                    help="pipeline stages per pp rank (virtual stages; 2+ for Interleaved1F1B); default: 2 "
                    "for Interleaved1F1B, else 1")
    ex.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of the config")
    ex.add_argument("--json", action="store_true", help="print the report as JSON")
    ex.add_argument("--trace", default=None, metavar="FILE",
                    help="also write the simulated step as a Chrome trace JSON (open it in Perfetto)")
    ex.add_argument("--dump-dir", default=None, metavar="DIR",
                    help="also write the compile's dumps (graphs per pass, layouts, summary, the step trace "
                    "on --hardware) for `hyper-parallel report DIR`")
    ex.add_argument("--repeated-blocks", default="auto", choices=("auto", "none"),
                    help="auto (default): trace, propagate and lower two layers and copy the others "
                    "(parallelize(repeated_blocks='auto')); none: every layer through every step, the "
                    "same report, Llama 3 70B about six times slower")
    pl = sub.add_parser(
        "plan", help="choose the parallel configuration: every factorisation of the world compiled on fake ranks, ranked",
        description="Enumerate the configurations of --world-size ranks (dp_shard, tp within a node, pp with its "
        "schedule and micro-batches, cp for long sequences, ep for experts, recompute), reject what cannot run or "
        "fit without compiling, compile the rest as explain does and rank what fits by predicted step time. "
        "Prints the ranked table with each rejection's reason and writes the best as a plan file (--out).",
        epilog="Example: hyper-parallel plan --config llama3-70b --world-size 256 --hardware h100 --global-batch 512 "
        "--seq-len 8192 --out plan_70b.py; then hyper-parallel explain --plan plan_70b.py --parallel ... as the "
        "file's docstring says.",
    )
    pl.add_argument("--model", default="example", help="as explain's --model; default: example")
    pl.add_argument("--config", default="llama3-8b", help="as explain's --config; default: llama3-8b")
    pl.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    pl.add_argument("--hardware", default="h100", type=_hardware(HARDWARE), metavar="{%s} or FILE.json" % ",".join(HARDWARE),
                    help="hardware profile (a name, or a .json file hyper-parallel calibrate wrote); default: h100")
    pl.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step, over all ranks")
    pl.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence; default: 8192")
    pl.add_argument("--memory-gib", type=float, default=None,
                    help="memory budget per device in GiB; default: the hardware profile's")
    pl.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="default: adamw")
    pl.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="default: bf16")
    pl.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of the config")
    pl.add_argument("--search", default=None, metavar="SPEC",
                    help="restrictions, e.g. pp=1,tp=1:2:4,recompute=full,pp_schedule=1F1B (values separated by ':')")
    pl.add_argument("--top-k", type=int, default=5, help="fitting candidates shown; default: 5")
    pl.add_argument("--out", default=None, metavar="FILE", help="write the chosen plan as a plan file")
    pl.add_argument("--max-compiles", type=int, default=10, metavar="N",
                    help="compile at most N candidates, the best by the analytic estimate first (0: all); default 10")
    pl.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="start no compile after S seconds of search")
    pl.add_argument("--include", action="append", default=[], metavar="SPEC",
                    help="a configuration to compile and rank whatever the budget (the plan to compare with), e.g. "
                         "dp_shard=32,tp=8,recompute=full or tp=8,pp=8,pp_schedule=Interleaved1F1B,num_microbatches=32;"
                         " repeatable")
    pl.add_argument("--json", action="store_true", help="print every candidate as JSON")
    rep = sub.add_parser(
        "report", help="write an HTML report (and a Chrome trace) of a compile from its dump directory",
        description="Read DUMP_DIR (written by parallelize(..., dump_dir=DUMP_DIR) or HYPER_PARALLEL_DUMP_DIR) "
        "and write one self-contained HTML page for one rank: summary, nodes each pass added and removed, "
        "the layout table with search, collectives on the cost model's estimated timeline, memory over the "
        "step; plus the simulated step as a Chrome trace JSON (open it in Perfetto).",
    )
    rep.add_argument("dump_dir", metavar="DUMP_DIR", help="the dump directory (holds rank<N>/ folders)")
    rep.add_argument("--rank", type=int, default=None, help="the rank to report on; default: the lowest in the dump")
    rep.add_argument("--out", default=None,
                     help="the HTML file to write; default: DUMP_DIR/report.html (the trace goes next to it, "
                     "as <name>.trace.json)")
    cal = sub.add_parser(
        "calibrate", help="measure this machine and write its cost-model profile (for --hardware FILE)",
        description="Measure matmul FLOP/s, copy bandwidth, per-op and runtime overheads, gloo collectives and the "
        "per-call agreement's host message between --ranks processes of this machine (one thread each) and write "
        "the cost model's profile as JSON: explain --hardware FILE and plan --hardware FILE price steps with it.",
    )
    cal.add_argument("--out", required=True, metavar="FILE.json", help="where to write the profile")
    cal.add_argument("--ranks", type=int, default=2, help="gloo processes to measure between; default: 2")
    cal.add_argument("--name", default="cpu-calibrated", help="the profile's name; default: cpu-calibrated")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions: seconds, less precise")
    return parser


def _explain(args) -> int:
    from .explain import explain, format_report

    report = explain(
        model=args.model, config=args.config, parallel=args.parallel, world_size=args.world_size,
        plan=args.plan, hardware=args.hardware, rank=args.rank, optimizer=args.optimizer,
        local_batch=args.local_batch, seq_len=args.seq_len, dtype=args.dtype, recompute=args.recompute,
        num_layers=args.layers, cp_mode=args.cp_mode, trace_path=args.trace, dump_dir=args.dump_dir,
        repeated_blocks=None if args.repeated_blocks == "none" else args.repeated_blocks, pp_schedule=args.pp_schedule, num_microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_report(report))
    return 0


def _plan(args) -> int:
    from .planner import auto_plan

    choice = auto_plan(
        args.config, model=args.model, world_size=args.world_size, hardware=args.hardware,
        global_batch=args.global_batch, seq_len=args.seq_len, optimizer=args.optimizer, dtype=args.dtype,
        memory_per_device=None if args.memory_gib is None else int(args.memory_gib * 2**30),
        top_k=args.top_k, search=parse_search_spec(args.search), num_layers=args.layers,
        max_compiles=args.max_compiles or None, time_budget_s=args.time_budget,
        include=[parse_include_spec(spec) for spec in args.include],
    )
    if args.json:
        rows = [{"dims": r.dims, "recompute": r.candidate.recompute, "local_batch": r.local_batch,
                 "pipeline": r.candidate.pipeline, "predicted": r.predicted, "rejected": r.rejected,
                 "estimate_s": r.estimate_s, "included": r.included} for r in choice.ranked]
        print(json.dumps({"search_s": choice.search_s, "ranked": rows}, indent=2, default=str))
    else:
        print(choice.table())
    if args.out:
        print(f"plan file: {choice.write(args.out)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def parse_search_spec(spec: str | None) -> dict | None:
    """``"pp=1,tp=1:2:4,recompute=full"`` as ``auto_plan``'s ``search`` (degrees as integers)."""
    if not spec:
        return None
    out: dict = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not value:
            raise ValueError(f"--search {spec!r}: each item is key=value[:value...], got {item!r}")
        values = value.split(":")
        if key.strip() not in ("recompute", "pp_schedule"):
            try:
                values = [int(v) for v in values]
            except ValueError:
                raise ValueError(f"--search {spec!r}: {key} takes integers, got {value!r}") from None
        out[key.strip()] = values
    return out


def parse_include_spec(spec: str) -> dict:
    """``"dp_shard=32,tp=8,recompute=full"`` as one of ``auto_plan``'s ``include`` entries."""
    out: dict = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"--include {spec!r}: each item is key=value, got {item!r}")
        if key in ("recompute", "pp_schedule"):
            out[key] = value
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"--include {spec!r}: {key} takes an integer, got {value!r}") from None
    return out


def _hardware(names):
    """argparse type of ``--hardware``: a profile name (case-insensitive) or a .json profile file."""
    def parse(value: str) -> str:
        if value.endswith(".json") or value.lower() in names:
            return value if value.endswith(".json") else value.lower()
        raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(names)} or a profile .json file")
    return parse


def _calibrate(args) -> int:
    from ..cost.hardware import save_profile
    from .calibrate import calibrate

    profile, measured = calibrate(ranks=args.ranks, quick=args.quick, name=args.name)
    save_profile(profile, args.out)
    fit = measured["gloo"]["fit"]["in_step"]
    print(f"{profile.name}: matmul {profile.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, copy "
          f"{profile.hbm_bandwidth / 1e9:.2f} GB/s, op {profile.op_overhead_s * 1e6:.2f} us, program "
          f"{profile.program_overhead_s * 1e6:.1f} us, gloo alpha {fit['alpha_s'] * 1e6:.1f} us, "
          f"{fit['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s, host message {profile.host_message_latency_s * 1e6:.0f} us "
          f"({args.ranks} ranks, {profile.host_cores} cores)")
    print(f"profile: {args.out} (explain --hardware {args.out}, plan --hardware {args.out})")
    return 0


def _report(args) -> int:
    from .report import write_report

    page, trace = write_report(args.dump_dir, rank=args.rank, out=args.out)
    print(f"report: {page}")
    print(f"trace:  {trace}" if trace else "trace:  none (the dump has no trace.json: the cost model was skipped)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hyper-parallel`` console script. User errors (bad degrees, unknown
    presets, plans that do not fit the model) print one ``error:`` line and exit with status 2."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "explain":
            return _explain(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "report":
            return _report(args)
        if args.command == "calibrate":
            return _calibrate(args)
    except (ValueError, TypeError, ImportError) as e:
        parser.exit(2, f"hyper-parallel {args.command}: error: {e}\n")
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
