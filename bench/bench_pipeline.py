"""Step time of pipeline parallelism: hyper_parallel vs ``torch.distributed.pipelining``, side by side.

``python bench/bench_pipeline.py`` runs, for every ``--configs`` entry ``WORLD:SCHEDULE:M`` (SCHEDULE:
GPipe, 1F1B or ZBH1; default pp=2 and pp=4 with GPipe and 1F1B, 4 micro-batches, plus 1F1B with
8; e.g. ``--configs 2:1F1B:4,2:ZBH1:4`` compares zero bubble with 1F1B), ``WORLD`` gloo processes on
CPU (one intra-op thread each), a 1-D ``("pp",)`` mesh, and the example Llama with
``--layers-per-stage`` (default 2) layers per pp rank (pp=2: 4 layers, pp=4: 8 layers), built from
seed 0 on every rank. Both systems cut at the same layer boundaries (stage ``s`` runs layers
``[s * L, (s + 1) * L)``), run the same schedule over the same micro-batches of the same batch:

* hyper_parallel: ``hp.parallelize(model, {"pipeline": hp.PipelinePlan(axis="pp",
  split_points=["model.layers.2", ...], schedule=S, num_microbatches=M)}, mesh)`` then
  ``pmodel.step({"input_ids": ids, "labels": ids})``: the model's own loss
  (``causal_lm_loss``, mean next-token cross-entropy of the micro-batch); the step's loss is the
  mean of the micro-batch losses, each micro-batch's backward is seeded with 1/M.
* torch: stages built by hand as torchtitan's manual split does: deep-copy the model and keep only
  this stage's modules (stage 0: ``embed_tokens`` + its layers; the last stage: its layers +
  ``norm`` + ``lm_head``; every stage keeps the parameter-free ``rotary_emb`` and computes cos/sin
  itself; layers kept in a ``ModuleDict`` under their original index, so FQNs are unchanged).
  ``PipelineStage(stage_module, stage, num_stages, cpu)`` and ``ScheduleGPipe`` /
  ``Schedule1F1B(stage, M, loss_fn=causal_lm_loss)`` (``scale_grads=True``: gradients divided by
  M), ``schedule.step(ids)`` on the first stage, ``schedule.step(target=ids, losses=...)`` on the
  last, ``return_outputs=False``. Its loss = mean of the M micro-batch losses: the same semantics.
  For hp's zero-bubble ``ZBH1`` the torch side is ``ScheduleInterleavedZeroBubble([stage], M, ...)``
  with one stage per rank (the paper's ZB-H1 family: input and weight gradients as separate
  actions, weight gradients filling the bubble; torch's order of the W steps is its own).

A step is the pipeline step (forward + backward over all micro-batches) + ``SGD.step`` +
``zero_grad``. Peak memory: one more step per side under ``MemoryTracker`` (tensors allocated through
the dispatcher, parameters and optimizer state included; torch's stage keeps one receive buffer per
micro-batch and transfer from its first step on, which are counted as held before the step with
the parameters, where hp allocates its receive buffers inside each step), on the rank that holds
the most; under ``--codegen inductor`` both sides from the allocator's events instead
(``AllocatorPeak``: Inductor's buffers bypass MemoryTracker). Each side gets ``--warmup`` steps (hyper_parallel's first compiles, torch's first
infers shapes), then ``--steps`` timed steps interleaved hp / torch, each after a barrier; a
step's time is the slowest rank's; medians reported. hp's ``step`` also broadcasts the loss to every
pp rank (torch leaves it on the last stage): that 4-byte broadcast is inside hp's time.

Checks at step 0 (before any update): the two losses agree within ``--loss-rtol`` (relative, 1e-4)
and every parameter gradient agrees (max relative difference reported); after the timed steps
(``--warmup + --steps`` SGD updates on each side) one more untimed step compares the losses again.
Bubble: hp's
``pipeline_report()`` (outside the timed region) after every timed step: the measured idle
fraction per rank (mean over ranks, median over steps) next to the analytic (p-1)/(m+p-1) (ZBH1:
its own schedule with forward = input gradient = weight gradient time) and the schedule simulated
with hp's measured per-stage times (ZBH1: measured I and W times).

4 ranks on a 2-core machine are oversubscribed: ranks time-share cores, so pp=4 step times and
bubbles measure scheduling on a busy machine as much as the pipeline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import ALLOCATOR_NOTE, add_peak_measure_arg, build_model, launch, peak_measure, step_peak  # noqa: E402
from hyper_parallel.models.llama import causal_lm_loss  # noqa: E402

DEFAULT_CONFIGS = "2:GPipe:4,2:1F1B:4,2:1F1B:8,4:GPipe:4,4:1F1B:4,4:1F1B:8"
QUICK_CONFIGS = "2:GPipe:4,4:1F1B:4"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=None,
                   help=f"comma-separated WORLD:SCHEDULE:MICROBATCHES (default {DEFAULT_CONFIGS})")
    p.add_argument("--layers-per-stage", type=int, default=2, help="decoder layers per pp rank (default 2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="batch per step, split into the micro-batches (default 8)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15, help="timed steps per side and config (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--overlap-p2p", action="store_true",
                   help="hyper_parallel: PipelinePlan(overlap_p2p=True), receives posted one step early")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="step-0 loss agreement required (relative)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: configs {QUICK_CONFIGS}, seq 32, 1 warm-up + 3 timed steps")
    p.add_argument("--codegen", choices=["eager", "inductor"], default="eager",
                   help="hp's parallelize(codegen=...): inductor compiles each stage's compute between its "
                        "transfers and collectives (torch's stages stay eager)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    add_peak_measure_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.configs = args.configs or QUICK_CONFIGS
        args.seq_len, args.warmup, args.steps = 32, 1, 3
    args.configs = args.configs or DEFAULT_CONFIGS
    return args


BENCH_SCHEDULES = ("GPipe", "1F1B", "ZBH1")  # one stage per rank, each with a torch counterpart


def parse_configs(text: str) -> list[tuple[int, str, int]]:
    configs = []
    for item in text.split(","):
        world, schedule, m = item.strip().split(":")
        if schedule not in BENCH_SCHEDULES:
            raise SystemExit(f"--configs {item!r}: schedule must be one of {BENCH_SCHEDULES}")
        configs.append((int(world), schedule, int(m)))
    return configs


# --- the torch side: a torchtitan-style manual split --------------------------------------------------
class LlamaStage(nn.Module):
    """One pipeline stage of ``LlamaForCausalLM``, cut out of a deep copy as torchtitan's manual
    split does: modules of other stages are dropped (set to ``None``), the kept layers stay in a
    ``ModuleDict`` under their original index so every FQN equals the full model's."""

    def __init__(self, model: nn.Module, layer_ids: range, is_first: bool, is_last: bool):
        super().__init__()
        model = copy.deepcopy(model)
        self.model = model.model
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        if not is_first:
            self.model.embed_tokens = None
        if not is_last:
            self.model.norm = None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x
        cos, sin = m.rotary_emb(h, h.shape[1])
        for layer in m.layers.values():
            h = layer(h, cos, sin)
        if m.norm is not None:
            h = self.lm_head(m.norm(h))
        return h  # logits on the last stage; the schedule applies loss_fn(logits, target)


def _split_points(num_stages: int, per_stage: int) -> list[str]:
    return [f"model.layers.{s * per_stage}" for s in range(1, num_stages)]


def _build(ref, args, schedule_name: str, m: int):
    from torch.distributed.pipelining import (
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    plan = hp.PipelinePlan(axis="pp", split_points=_split_points(world, args.layers_per_stage),
                           schedule=schedule_name, num_microbatches=m, overlap_p2p=args.overlap_p2p)
    hp_model = hp.parallelize(copy.deepcopy(ref), {"pipeline": plan}, mesh, codegen=args.codegen)
    hp_opt = torch.optim.SGD(hp_model.parameters(), lr=args.lr)

    per = args.layers_per_stage
    stage_module = LlamaStage(ref, range(rank * per, (rank + 1) * per), rank == 0, rank == world - 1)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    if schedule_name == "ZBH1":  # a multi-stage schedule class, here with this rank's one stage
        torch_schedule = ScheduleInterleavedZeroBubble([stage], m, loss_fn=causal_lm_loss, scale_grads=True)
    else:
        cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule_name]
        torch_schedule = cls(stage, m, loss_fn=causal_lm_loss, scale_grads=True)
    torch_opt = torch.optim.SGD(stage_module.parameters(), lr=args.lr)
    return hp_model, hp_opt, stage_module, stage, torch_schedule, torch_opt


def _receive_buffers(stage) -> list[torch.Tensor]:
    """The buffers a torch ``PipelineStage`` keeps from step to step to receive into: one per
    micro-batch and value, activations (``args_recv_info``) and their gradients (``grad_recv_info``)."""
    infos = [info for recv in (stage.args_recv_info, stage.grad_recv_info) for per_mb in recv.values() for info in per_mb]
    return [info.buffer for info in infos if getattr(info, "buffer", None) is not None]


def _hp_step(model, opt, ids) -> torch.Tensor:
    loss = model.step({"input_ids": ids, "labels": ids})
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _torch_pipeline(schedule, ids) -> torch.Tensor | None:
    """Forward + backward over the micro-batches; the mean micro-batch loss on the last stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        schedule.step(ids, return_outputs=False)
    elif rank == world - 1:
        losses: list = []
        schedule.step(target=ids, losses=losses, return_outputs=False)
        return torch.stack([x.detach() for x in losses]).mean()
    else:
        schedule.step(return_outputs=False)
    return None


def _torch_step(schedule, opt, ids) -> None:
    _torch_pipeline(schedule, ids)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(fn, *a) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def _slowest_rank(times: list[float]) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _grad_rel_diff(hp_model, stage_module) -> tuple[float, str, int]:
    """Max over this rank's parameters of |g_hp - g_torch|_max / |g_torch|_max, with its name."""
    torch_grads = {n: p.grad for n, p in stage_module.named_parameters()}
    worst, worst_name, compared = 0.0, "", 0
    for name, p in hp_model.named_parameters():
        if name not in torch_grads:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        ref = torch_grads[name]
        diff = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        compared += 1
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name, compared


def measure(ref, ids, args, schedule_name: str, m: int) -> dict:
    """Build both pipelines for one (schedule, m), check step 0, then time them interleaved."""
    world = dist.get_world_size()
    hp_model, hp_opt, stage_module, torch_stage, torch_schedule, torch_opt = _build(ref, args, schedule_name, m)

    # Step 0: losses and gradients before any update, then the optimizer steps.
    dist.barrier()
    t0 = time.perf_counter()
    hp_loss0 = hp_model.step({"input_ids": ids, "labels": ids})
    t_compile = time.perf_counter() - t0
    torch_loss0 = _torch_pipeline(torch_schedule, ids)
    torch_loss0 = torch_loss0 if torch_loss0 is not None else torch.zeros(())
    dist.broadcast(torch_loss0, src=world - 1)
    grad_diff, grad_name, compared = _grad_rel_diff(hp_model, stage_module)
    n_hp_params = sum(1 for _ in hp_model.named_parameters())
    n_torch_params = sum(1 for _ in stage_module.named_parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, (grad_diff, grad_name, compared, n_hp_params, n_torch_params))
    for o in (hp_opt, torch_opt):
        o.step()
        o.zero_grad(set_to_none=True)

    for _ in range(args.warmup - 1):
        _timed(_hp_step, hp_model, hp_opt, ids)
        _timed(_torch_step, torch_schedule, torch_opt, ids)
    hp_times, torch_times, bubbles, simulated, hp_internal = [], [], [], [], []
    for _ in range(args.steps):
        hp_times.append(_timed(_hp_step, hp_model, hp_opt, ids))
        report = hp_model.pipeline_report()  # collective over pp; outside the timed region
        bubbles.append(report["measured_bubble_mean"])
        simulated.append(report["simulated_bubble"])
        hp_internal.append(report["step_s"])
        torch_times.append(_timed(_torch_step, torch_schedule, torch_opt, ids))
    # Parity after training: both sides took the same SGD updates; one more (untimed) step each.
    hp_loss_end = _hp_step(hp_model, hp_opt, ids)
    torch_loss_end = _torch_pipeline(torch_schedule, ids)
    torch_loss_end = torch_loss_end if torch_loss_end is not None else torch.zeros(())
    dist.broadcast(torch_loss_end, src=world - 1)
    torch_opt.step()
    torch_opt.zero_grad(set_to_none=True)
    # Peak memory of one more step per side (after the parity check), on the rank holding the most.
    measure = peak_measure(args)
    peaks = {"hyper_parallel": step_peak(lambda: _hp_step(hp_model, hp_opt, ids), hp_model.parameters(), hp_opt,
                                         measure),
             "torch_pipelining": step_peak(lambda: _torch_step(torch_schedule, torch_opt, ids),
                                           [*stage_module.parameters(), *_receive_buffers(torch_stage)], torch_opt,
                                           measure)}
    times = _slowest_rank([t_compile] + hp_times + torch_times)
    t_compile, hp_times, torch_times = times[0], times[1 : 1 + args.steps], times[1 + args.steps :]
    per_rank_bubble = report["measured_bubble"]
    summary = hp_model.compile_summary()

    hp_med, torch_med = statistics.median(hp_times), statistics.median(torch_times)
    loss_hp, loss_torch = hp_loss0.item(), torch_loss0.item()
    rel = abs(loss_hp - loss_torch) / abs(loss_torch)
    return {
        "pp": world,
        "schedule": schedule_name,
        "num_microbatches": m,
        "split_points": summary["split_points"],
        "loss_step0": {"hyper_parallel": loss_hp, "torch_pipelining": loss_torch, "rel_diff": rel,
                       "agree": rel <= args.loss_rtol},
        "loss_after_updates": {"updates": args.warmup + args.steps, "hyper_parallel": hp_loss_end.item(),
                               "torch_pipelining": torch_loss_end.item()},
        "grad_step0_max_rel_diff": max(e[0] for e in everyone),
        "grad_step0_worst_param": max(everyone, key=lambda e: e[0])[1],
        "grad_step0_params_compared": sum(e[2] for e in everyone),
        "params_per_rank": {"hyper_parallel": [e[3] for e in everyone], "torch": [e[4] for e in everyone]},
        "hp_first_step_s (compile + step)": t_compile,
        "step_time_s": {
            "hyper_parallel": {"median": hp_med, "min": min(hp_times), "max": max(hp_times), "all": hp_times},
            "torch_pipelining": {"median": torch_med, "min": min(torch_times), "max": max(torch_times),
                                 "all": torch_times},
        },
        "ratio_hp_over_torch": hp_med / torch_med,
        "peak_bytes": peaks,
        "peak_measure": measure,
        "ratio_peak_hp_over_torch": peaks["hyper_parallel"] / peaks["torch_pipelining"],
        "hp_bubble": {
            "measured_mean_over_ranks (median over steps)": statistics.median(bubbles),
            "measured_per_rank (last step)": per_rank_bubble,
            "simulated (median over steps)": statistics.median(simulated),
            "analytic": report["analytic_bubble"],
        },
        "hp_executor_step_s (median, slowest rank)": statistics.median(hp_internal),
        "hp_transfers_per_microbatch": [
            f"{t['name']} s{t['src']}->s{t['dst']} {t['phase']} {'x'.join(map(str, t['shape']))}"
            for t in summary["transfers"]
        ],
    }


def run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    model_args = argparse.Namespace(**vars(args))
    model_args.layers = args.layers_per_stage * world
    ref = build_model(model_args)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    ref_loss0 = ref(input_ids=ids, labels=ids)["loss"].item()
    results = [measure(ref, ids, args, s, m) for w, s, m in parse_configs(args.configs) if w == world]
    if rank == 0:
        with open(args.result_file, "w") as f:
            json.dump({"world": world, "layers": model_args.layers, "params": ref.num_parameters(),
                       "loss_step0_single_device": ref_loss0, "results": results}, f)


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nPipeline, Llama h{c['hidden']} ({c['layers_per_stage']} layers per stage), batch {c['batch']} x seq "
          f"{c['seq_len']}, hp codegen={r['hp_codegen']}, {r['threads_per_rank']} thread/rank, {r['cpu_count']} CPU cores "
          f"(pp > cores: oversubscribed), median of {r['steps']} steps (slowest rank)")
    for w in r["worlds"]:
        print(f"pp={w['world']}: {w['layers']} layers, {w['params']:,} params, single-device step-0 loss "
              f"{w['loss_step0_single_device']:.6f}")
    print(f"\n{'pp':>3} {'schedule':>8} {'m':>3} {'hp (ms)':>9} {'torch (ms)':>11} {'hp/torch':>9} "
          f"{'hp bubble':>10} {'analytic':>9} {'simulated':>10} {'peak MB hp / torch':>19} {'ratio':>6}")
    for x in r["results"]:
        st, b = x["step_time_s"], x["hp_bubble"]
        print(f"{x['pp']:>3} {x['schedule']:>8} {x['num_microbatches']:>3} "
              f"{st['hyper_parallel']['median'] * 1e3:>9.1f} {st['torch_pipelining']['median'] * 1e3:>11.1f} "
              f"{x['ratio_hp_over_torch']:>9.2f} "
              f"{b['measured_mean_over_ranks (median over steps)']:>10.3f} {b['analytic']:>9.3f} "
              f"{b['simulated (median over steps)']:>10.3f} "
              f"{x['peak_bytes']['hyper_parallel'] / 1e6:>9.2f} / {x['peak_bytes']['torch_pipelining'] / 1e6:<7.2f} "
              f"{x['ratio_peak_hp_over_torch']:>6.2f}")
    if any(x["peak_measure"] == "allocator" for x in r["results"]):
        print(ALLOCATOR_NOTE)
    print(f"\n{'pp':>3} {'schedule':>8} {'m':>3}  {'step-0 loss hp / torch (rel diff)':<38} "
          f"{'grad rel diff':>13}  {'loss after N updates hp / torch':<32}")
    for x in r["results"]:
        l0, le = x["loss_step0"], x["loss_after_updates"]
        flag = "" if l0["agree"] else " MISMATCH"
        print(f"{x['pp']:>3} {x['schedule']:>8} {x['num_microbatches']:>3}  "
              f"{l0['hyper_parallel']:.6f} / {l0['torch_pipelining']:.6f} ({l0['rel_diff']:.1e}){flag:<9} "
              f"{x['grad_step0_max_rel_diff']:>13.1e}  N={le['updates']}: {le['hyper_parallel']:.6f} / "
              f"{le['torch_pipelining']:.6f}")
    bad = [x for x in r["results"] if not x["loss_step0"]["agree"]]
    if bad:
        print(f"\nWARNING: step-0 losses differ by more than {r['loss_rtol']} (relative) in {len(bad)} config(s)")


def _no_report(_result) -> None:  # run() writes its result to a file; main() reports
    pass


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = parse_configs(args.configs)
    worlds = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({w for w, _, _ in configs}):
            args.result_file = os.path.join(tmp, f"pp{world}.json")
            launch(run, _no_report, args, world, threads=args.threads)
            with open(args.result_file) as f:
                worlds.append(json.load(f))
    results = [x for w in worlds for x in w["results"]]
    out = {
        "bench": "pipeline",
        "config": {"hidden": args.hidden, "intermediate": args.intermediate, "layers_per_stage": args.layers_per_stage,
                   "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "seq_len": args.seq_len,
                   "batch": args.batch},
        "hp_overlap_p2p": args.overlap_p2p,
        "hp_codegen": args.codegen,
        "threads_per_rank": args.threads,
        "cpu_count": os.cpu_count(),
        "note": "pp ranks > CPU cores means oversubscribed: ranks time-share cores",
        "warmup": args.warmup,
        "steps": args.steps,
        "loss_rtol": args.loss_rtol,
        "torch": torch.__version__,
        "worlds": [{k: v for k, v in w.items() if k != "results"} for w in worlds],
        "results": results,
    }
    print(json.dumps(out, indent=2))
    print_table(out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
