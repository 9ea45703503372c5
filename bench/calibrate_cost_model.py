"""Calibrate the cost model's "cpu" profile on this machine, then check it against measured steps.

The measurements are ``hyper-parallel calibrate``'s (``hyper_parallel/tools/calibrate.py``, which
writes the profile as JSON for ``--hardware FILE``); this script adds the validation below.

``python bench/calibrate_cost_model.py`` (about 30 s on 2 cores) measures, with one intra-op thread
per process (how the benches and tests run gloo ranks):

1. fp32 matmul FLOP/s (square GEMMs of 128..1024; the best is the profile's peak), a 64 MiB copy's
   bandwidth (read + write bytes), and the per-node overhead of a tiny aten op and of a view op
   called through ``torch.ops``: once alone, and once in each of 2 processes at the same time (the
   profile uses the latter, the condition of a 2-rank step on 2 cores);
2. hyper_parallel's runtime host overheads (1-rank world): steps of a model of 8 vs 64 tiny
   parameters minus the simulated graph give the cost per boundary tensor, per program call and
   per parameter in ``SGD.step`` (``measure_runtime``);
3. gloo between 2 local processes: ``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` +
   ``wait_tensor`` (the ops compiled programs run), 4 KiB..16 MiB, back to back ("isolated") and
   each after a short compute burst ("in_step"); alpha (s per ring step) and beta (s per byte)
   fitted by least squares to ``comm.ring_volume``'s ring model. The in-step fit goes into the
   profile.

Then it validates: the example Llama (``LlamaForCausalLM(LlamaConfig())``, and the benches' wider
shape) with a DP plan (``{}``) on 1 rank and with DP and TP (``llama_tp_plan()``) on 2 gloo ranks:
the measured median step time (forward + backward + ``SGD.step`` + ``zero_grad``, slowest rank)
against ``simulate(...)`` with (a) the profile measured in this run and (b) the "cpu" profile in
``hyper_parallel/cost/hardware.py``. Ratios are reported as they come out: nothing is fitted to
the validation cases. Prints one JSON object, a table, and the constants to paste into hardware.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyper_parallel.tools.calibrate import (  # noqa: E402
    join_local_world, measure_gloo, measure_local, measure_runtime, profile_from,
)
from hyper_parallel.cost.hardware import HardwareProfile  # noqa: E402

MODELS = {
    "example": {},  # LlamaConfig() defaults: hidden 64, 4 layers, vocab 256
    "bench": {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4},
}


def _step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids)["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def validate(args, measured: HardwareProfile, plans=("dp", "tp")) -> list[dict]:
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel.cost import axis_infos, get_profile, optimizer_traffic, simulate
    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
    from hyper_parallel.models.plans import llama_dp_plan, llama_tp_plan

    world = dist.get_world_size()
    rows = []
    for model_name, overrides in MODELS.items():
        for plan_name in plans:
            plan = llama_dp_plan() if plan_name == "dp" else llama_tp_plan()
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**overrides))
            mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(plan_name,))
            pmodel = hp.parallelize(model, plan, mesh)
            opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
            for _ in range(args.warmup):  # the first compiles
                _step(pmodel, opt, ids)
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                _step(pmodel, opt, ids)
                times.append(time.perf_counter() - t0)
            times = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            measured_s = statistics.median(times.tolist())
            programs = pmodel.compiled_programs()
            opt_bytes, opt_tensors = optimizer_traffic(programs[1], state_per_param=0)
            row = {"model": model_name, "plan": plan_name, "world": world, "params": model.num_parameters(),
                   "batch_per_rank": [args.batch, args.seq_len], "measured_step_s": measured_s}
            for label, profile in (("this_run", measured), ("hardware_py", get_profile("cpu"))):
                est = simulate(programs, axis_infos(mesh), profile, opt_bytes, opt_tensors)
                row[label] = {**{k: v for k, v in est.as_dict().items() if k.endswith("_s") or k == "flops"},
                              "ratio_predicted_over_measured": est.step_s / measured_s}
            rows.append(row)
    return rows


def _worker(rank: int, world: int, port: int, args, runtime: dict, out_path: str) -> None:
    import torch.distributed as dist

    join_local_world(rank, world, port)
    try:
        # Compute rates with both ranks busy, as during a 2-rank step (they share 2 cores, caches
        # and memory bandwidth): the profile uses these.
        dist.barrier()
        local = measure_local()
        gloo = measure_gloo()
        rows = [] if args.skip_validation else validate(args, profile_from(local, gloo, runtime))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"local_concurrent": local, "gloo": gloo, "validation": rows}, f)


def _one_rank(args, alone: dict) -> tuple[dict, list[dict]]:
    """In a 1-rank world (no collectives, no second process competing): the runtime overheads,
    then the validation steps, which separates the compute model's error from communication and
    contention."""
    import warnings

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        runtime = measure_runtime(alone)
        rows = [] if args.skip_validation else validate(args, profile_from(alone, None, runtime), plans=("dp",))
        return runtime, rows
    finally:
        dist.destroy_process_group()


def constants_block(profile: HardwareProfile) -> str:
    g = 1e9
    fl = profile.peak_flops["fp32"] / g
    return "\n".join([
        f'    peak_flops={{"fp32": {fl:.1f} * G, "bf16": {fl:.1f} * G, "fp16": {fl:.1f} * G}},',
        f"    hbm_bandwidth={profile.hbm_bandwidth / g:.2f} * G,",
        f"    intra_node_bandwidth={profile.intra_node_bandwidth / g:.3f} * G, "
        f"intra_node_latency={profile.intra_node_latency * 1e6:.1f}e-6,",
        f"    inter_node_bandwidth={profile.inter_node_bandwidth / g:.3f} * G, "
        f"inter_node_latency={profile.inter_node_latency * 1e6:.1f}e-6,",
        f"    op_overhead_s={profile.op_overhead_s * 1e6:.2f}e-6, "
        f"view_overhead_s={profile.view_overhead_s * 1e6:.2f}e-6,",
        f"    program_overhead_s={profile.program_overhead_s * 1e6:.1f}e-6, "
        f"boundary_overhead_s={profile.boundary_overhead_s * 1e6:.2f}e-6,",
        f"    optimizer_tensor_overhead_s={profile.optimizer_tensor_overhead_s * 1e6:.2f}e-6,",
    ])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--skip-validation", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    alone = measure_local()
    runtime, one_rank_rows = _one_rank(args, alone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(2, port, args, runtime, out_path), nprocs=2)
        with open(out_path) as f:
            remote = json.load(f)
    local = remote["local_concurrent"]
    profile = profile_from(local, remote["gloo"], runtime)
    remote["validation"] = one_rank_rows + remote["validation"]
    result = {"bench": "calibrate_cost_model", "torch": torch.__version__, "threads_per_process": 1,
              "local_alone": alone, "runtime": runtime, **remote}
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)

    for label, m in (("alone", alone), ("2 ranks busy", local)):
        print("{:<13} matmul {:.1f} GFLOP/s (best), copy {:.2f} GB/s, op {:.2f} us, view {:.2f} us".format(
            label, max(m["matmul_flops_per_s"].values()) / 1e9, m["copy_bytes_per_s"] / 1e9,
            m["op_overhead_s"] * 1e6, m["view_overhead_s"] * 1e6))
    print(f"runtime       boundary {runtime['boundary_overhead_s'] * 1e6:.2f} us/tensor, program "
          f"{runtime['program_overhead_s'] * 1e6:.1f} us/call, optimizer "
          f"{runtime['optimizer_tensor_overhead_s'] * 1e6:.2f} us/param")
    for kind, fit in remote["gloo"]["fit"].items():
        print(f"gloo {kind:<10}: alpha {fit['alpha_s'] * 1e6:8.1f} us/step, bandwidth "
              f"{fit['bandwidth_bytes_per_s'] / 1e9:6.3f} GB/s")
    if remote["validation"]:
        print(f"\n{'model':<8}{'plan':<5}{'ranks':>6}{'measured ms':>12}{'pred ms (run)':>15}{'ratio':>7}"
              f"{'pred ms (hw.py)':>17}{'ratio':>7}   predicted compute / comm / exposed (run)")
        for r in remote["validation"]:
            a, b = r["this_run"], r["hardware_py"]
            print(f"{r['model']:<8}{r['plan']:<5}{r['world']:>6}{r['measured_step_s'] * 1e3:>12.2f}"
                  f"{a['step_s'] * 1e3:>15.2f}"
                  f"{a['ratio_predicted_over_measured']:>7.2f}{b['step_s'] * 1e3:>17.2f}"
                  f"{b['ratio_predicted_over_measured']:>7.2f}   {a['compute_s'] * 1e3:.2f} / {a['comm_s'] * 1e3:.2f}"
                  f" / {a['exposed_comm_s'] * 1e3:.2f} ms")
    print("\nconstants for the cpu profile in hyper_parallel/cost/hardware.py:")
    print(constants_block(profile))


if __name__ == "__main__":
    main()
