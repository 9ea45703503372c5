"""Train the example Llama with hyper_parallel on a dp x tp mesh and check it against one device.

Launch with ``torchrun --nproc-per-node 4 examples/train_llama.py`` (what ``scripts/demo.sh`` does),
or plainly with ``python examples/train_llama.py``, which spawns the dp*tp gloo processes itself.

Every rank builds the model from the same seed, parallelizes one copy with the Megatron TP plan
(``llama_tp_plan()``) on a ``("dp", "tp")`` mesh and keeps a single-device reference copy that it
trains on the whole global batch. Each step feeds the parallel model this rank's dp slice of the
global batch; the loss it returns is the global loss, so rank 0 prints both side by side:

    step 0  loss 5.55991  single-device 5.55991  |diff| 0.0e+00

At the end rank 0 prints the collectives the compiled program issues per step (from
``compile_summary()``) and exits non-zero if the two losses ever differ by more than 1e-4 relative.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from hyper_parallel.models.plans import llama_tp_plan  # noqa: E402

RTOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel degree (default 2)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--layers", type=int, default=LlamaConfig.num_hidden_layers, help="decoder layers")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--batch", type=int, default=4, help="GLOBAL batch size, split over dp (default 4)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-dir", default=None, help="write every pass's graph per rank here")
    p.add_argument("--sequence-parallel", action="store_true", help="llama_tp_plan(sequence_parallel=True)")
    args = p.parse_args(argv)
    if args.batch % args.dp:
        p.error(f"--batch {args.batch} must be divisible by --dp {args.dp}")
    cfg = LlamaConfig()
    for name in ("num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, name) % args.tp:
            p.error(f"--tp {args.tp} must divide the model's {name}={getattr(cfg, name)} (Megatron TP shards it)")
    if args.sequence_parallel and args.seq_len % args.tp:
        p.error(f"--sequence-parallel shards the sequence: --seq-len {args.seq_len} must be divisible by --tp {args.tp}")
    return args


def summary_table(summary: dict) -> str:
    """The compile summary's collectives as a small fixed-width table (forward, backward, per step)."""
    rows = []
    colls = summary.get("collectives", {})
    for phase in ("forward", "backward"):
        for kind, by_axis in sorted(colls.get(phase, {}).items()):
            for axis, e in sorted(by_axis.items()):
                rows.append((phase, kind, axis, e["count"], e["bytes"]))
    for kind, by_axis in sorted(summary.get("collectives_per_step", {}).items()):
        for axis, e in sorted(by_axis.items()):
            rows.append(("per step", kind, axis, e["count"], e["bytes"]))
    header = ("phase", "collective", "axis", "count", "bytes")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def train(args: argparse.Namespace) -> bool:
    """Run on an initialised process group; returns True when every step matched the reference."""
    rank = dist.get_rank()
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(
            f"world size {dist.get_world_size()} != dp*tp = {args.dp}*{args.tp}; "
            f"launch {args.dp * args.tp} processes or change --dp/--tp"
        )
    if rank != 0:
        warnings.filterwarnings("ignore")
    # DTensor's hint that a [P, P] -> [R, R] reduction (norm-weight gradients under sequence
    # parallelism) runs as two all-reduces, one per mesh axis: expected here, noise in a demo.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # several ranks share few cores: one thread each avoids oversubscription

    torch.manual_seed(args.seed)
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(128, args.seq_len))
    ref = LlamaForCausalLM(config)
    # One fixed global batch, drawn from the same seeded RNG on every rank: the loss falls as the
    # model fits it, which makes a divergence between the two copies easy to see.
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))

    mesh = hp.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    plan = llama_tp_plan(sequence_parallel=args.sequence_parallel)
    model = hp.parallelize(copy.deepcopy(ref), plan, mesh, dump_dir=args.dump_dir)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr)

    dp_rank = mesh["dp"].get_local_rank()
    local = args.batch // args.dp
    local_ids = ids[dp_rank * local : (dp_rank + 1) * local]  # this rank's dp slice
    ok = True
    meter = None  # hp.StepMeter: tokens/s, MFU and memory per step, logged on stderr (rank 0)
    if rank == 0:
        print(
            f"Llama: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size}, {ref.num_parameters():,} params | mesh dp={args.dp} x tp={args.tp} "
            f"| global batch {args.batch} x seq {args.seq_len} | "
            f"plan llama_tp_plan(sequence_parallel={args.sequence_parallel})",
            flush=True,
        )
    for step in range(args.steps):
        if meter is not None:
            meter.start()  # the single-device reference below is not part of the step
        loss = model(input_ids=local_ids, labels=local_ids)["loss"]  # the GLOBAL loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if meter is None:  # from the second step on: the first one compiles
            meter = hp.StepMeter(model, optimizer=opt)
        else:
            meter.step(loss, tokens=local_ids.numel())

        ref_loss = ref(input_ids=ids, labels=ids)["loss"]
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        lv, rv = loss.item(), ref_loss.item()
        diff = abs(lv - rv)
        ok = ok and diff <= RTOL * max(abs(rv), 1e-12)
        if rank == 0:
            print(f"step {step}  loss {lv:.5f}  single-device {rv:.5f}  |diff| {diff:.1e}", flush=True)

    # Parameters after training: the gathered shards must equal the reference's.
    max_param_diff = 0.0
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        max_param_diff = max(max_param_diff, (full.detach() - rp.detach()).abs().max().item())

    if rank == 0:
        summary = model.compile_summary()
        print(f"max |param diff| after {args.steps} steps: {max_param_diff:.1e}")
        print("\ncollectives of the compiled program (bytes = local input per rank):")
        print(summary_table(summary))
        if summary.get("fallbacks"):
            print(f"fallbacks (ops replicated for lack of a sharding rule): {summary['fallbacks']}")
        if args.dump_dir:
            print(f"\ngraphs and layouts dumped per rank under {os.path.abspath(args.dump_dir)}")
        print("OK: matches single-device training" if ok else f"FAIL: losses diverged beyond {RTOL} relative")
    return ok


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if rank != 0:
        warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        ok = train(args)
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if int(os.environ["RANK"]) != 0:
            warnings.filterwarnings("ignore")
        dist.init_process_group("gloo")
        try:
            ok = train(args)
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1

    world_size = args.dp * args.tp
    import torch.multiprocessing as mp

    try:
        mp.spawn(_worker, args=(world_size, _free_port(), args), nprocs=world_size)
    except mp.ProcessExitedException as exc:  # a rank exited non-zero (divergence): already reported
        print(f"train_llama: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
