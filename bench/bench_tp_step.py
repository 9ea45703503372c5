"""Step time of Megatron TP: hyper_parallel vs PyTorch eager DTensor ``parallelize_module``, side by side.

``python bench/bench_tp_step.py`` spawns ``--tp`` (default 4) gloo processes on CPU. Both programs
run the same Llama config, weights (same seed) and inputs on a 1-D ``("tp",)`` mesh:

* hyper_parallel: ``hp.parallelize(model, {**llama_tp_plan(), "outputs": {"logits": Replicate()}}, mesh)``
  (compiled on the first call; the loss runs vocab-parallel, the returned logits are gathered);
* torch eager: ``torch.distributed.tensor.parallel.parallelize_module`` with the equivalent plan
  (q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, embedding
  ``RowwiseParallel(input_layouts=Replicate())``, lm_head ``ColwiseParallel(output_layouts=Replicate())``),
  so both return whole logits and the model computes the loss in both.

A step is forward + backward + ``SGD.step`` + ``zero_grad``. Each side gets ``--warmup`` steps
(hyper_parallel's first one compiles), then ``--steps`` timed steps, interleaved hp/eager so
machine noise hits both alike. A step's time is the slowest rank's; the median is reported.
Collectives per step: hyper_parallel's from ``compile_summary()``, eager's counted with
``CommDebugMode`` around one eager step (bytes = local input tensor per rank, as hyper_parallel
counts them). Prints one JSON object, then a short table with the ratio hp/eager.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import add_model_args, build_model, launch  # noqa: E402
from hyper_parallel.models.plans import llama_tp_plan  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=4, help="TP degree = number of processes (default 4)")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per side (median reported, default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def torch_tp_plan():
    """The torch ``parallelize_module`` plan equivalent to ``llama_tp_plan()`` (logits gathered)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` that also sums the bytes of each collective's local input tensor(s)."""

    def __init__(self):
        super().__init__()
        self.comm_bytes: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.comm_counts)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # A collective was counted iff comm_counts changed (keys as CommDebugMode normalises them).
        changed = [k for k in self.comm_counts if self.comm_counts[k] != before.get(k, 0)]
        if changed:
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.comm_bytes[changed[0]] = self.comm_bytes.get(changed[0], 0) + nbytes
        return out


def _op_name(op) -> str:
    name = str(getattr(op, "__name__", op)).split(".")[-1]
    return {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}.get(name, name)


def _step(model, opt, ids) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids)["loss"]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _timed_step(model, opt, ids) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = _step(model, opt, ids)
    return time.perf_counter() - t0, loss.item()


def run(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ref = build_model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))

    hp_mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    from torch.distributed.tensor import Replicate

    # Whole logits returned, as eager's lm_head gives them (hp's default keeps them vocab-sharded).
    hp_plan = {**llama_tp_plan(), "outputs": {"logits": Replicate()}}
    hp_model = hp.parallelize(copy.deepcopy(ref), hp_plan, hp_mesh)
    hp_opt = torch.optim.SGD(hp_model.parameters(), lr=args.lr)

    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    eager_model = parallelize_module(copy.deepcopy(ref), torch_mesh, torch_tp_plan())
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=args.lr)

    # Step 0 of each (hp's compiles): check both give the single-device loss.
    t_compile, hp_loss0 = _timed_step(hp_model, hp_opt, ids)
    mode = CommBytesMode()
    with mode:
        _, eager_loss0 = _timed_step(eager_model, eager_opt, ids)
    ref_loss0 = ref(input_ids=ids, labels=ids)["loss"].item()

    for _ in range(args.warmup - 1):
        _timed_step(hp_model, hp_opt, ids)
        _timed_step(eager_model, eager_opt, ids)
    hp_times, eager_times = [], []
    for _ in range(args.steps):
        hp_times.append(_timed_step(hp_model, hp_opt, ids)[0])
        eager_times.append(_timed_step(eager_model, eager_opt, ids)[0])
    # A step takes as long as its slowest rank.
    times = torch.tensor([t_compile] + hp_times + eager_times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t_compile = times[0].item()
    hp_times = times[1 : 1 + args.steps].tolist()
    eager_times = times[1 + args.steps :].tolist()
    hp_loss_last, eager_loss_last = _step(hp_model, hp_opt, ids).item(), _step(eager_model, eager_opt, ids).item()

    if rank != 0:
        return None
    summary = hp_model.compile_summary()
    hp_colls = {
        kind: {"count": sum(e["count"] for e in by_axis.values()), "bytes": sum(e["bytes"] for e in by_axis.values())}
        for kind, by_axis in summary["collectives_per_step"].items()
    }
    eager_colls = {}
    for op, count in mode.get_comm_counts().items():
        name = _op_name(op)
        entry = eager_colls.setdefault(name, {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += mode.comm_bytes.get(op, 0)
    hp_med, eager_med = statistics.median(hp_times), statistics.median(eager_times)
    return {
        "bench": "tp_step",
        "world_size": world,
        "mesh": {"tp": world},
        "config": {
            "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
            "seq_len": args.seq_len, "batch": args.batch, "params": ref.num_parameters(),
        },
        "threads_per_rank": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "loss_step0": {"single_device": ref_loss0, "hyper_parallel": hp_loss0, "torch_eager": eager_loss0},
        "loss_after": {"hyper_parallel": hp_loss_last, "torch_eager": eager_loss_last},
        "hp_first_step_s (compile + step)": t_compile,
        "step_time_s": {
            "hyper_parallel": {"median": hp_med, "min": min(hp_times), "max": max(hp_times)},
            "torch_eager": {"median": eager_med, "min": min(eager_times), "max": max(eager_times)},
        },
        "ratio_hp_over_eager": hp_med / eager_med,
        "collectives_per_step": {"hyper_parallel": hp_colls, "torch_eager": eager_colls},
        "fallbacks": summary.get("fallbacks", []),
    }


def print_table(r: dict) -> None:
    st = r["step_time_s"]
    hp_c, eg_c = r["collectives_per_step"]["hyper_parallel"], r["collectives_per_step"]["torch_eager"]
    l0 = r["loss_step0"]
    print(f"\nTP={r['world_size']} Llama {r['config']['layers']}L h{r['config']['hidden']} "
          f"({r['config']['params']:,} params), batch {r['config']['batch']} x seq {r['config']['seq_len']}, "
          f"median of {r['steps']} steps")
    print(f"loss at step 0: single-device {l0['single_device']:.6f}  hp {l0['hyper_parallel']:.6f}  "
          f"eager {l0['torch_eager']:.6f}")
    print(f"{'':24}{'hyper_parallel':>16}{'torch eager':>16}{'hp/eager':>10}")
    print(f"{'step time (ms)':24}{st['hyper_parallel']['median'] * 1e3:>16.1f}"
          f"{st['torch_eager']['median'] * 1e3:>16.1f}{r['ratio_hp_over_eager']:>10.2f}")
    for kind in sorted(set(hp_c) | set(eg_c)):
        h, e = hp_c.get(kind, {"count": 0, "bytes": 0}), eg_c.get(kind, {"count": 0, "bytes": 0})
        print(f"{kind + ' count':24}{h['count']:>16}{e['count']:>16}")
        print(f"{kind + ' bytes':24}{h['bytes']:>16,}{e['bytes']:>16,}")
    print(f"hp first step (compile + step): {r['hp_first_step_s (compile + step)']:.1f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.tp)


if __name__ == "__main__":
    main()
