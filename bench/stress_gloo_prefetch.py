"""Stress of FSDP prefetch on gloo: many short 4-rank runs, each with several collectives in flight.

``python bench/stress_gloo_prefetch.py --runs 20`` starts ``--runs`` independent runs one after
another (``--parallel`` of them at once, for load), each ``--world`` gloo processes training the
example Llama under ``FullyShard`` (one unit per layer, bf16 parameters with fp32 reduction,
``prefetch_depth=--depth``, reduce-scatters in flight) for ``--steps`` steps, and checks every
rank's losses against rank 0's (all ranks compute the same global mean). A run fails if a worker
dies (signal or non-zero exit), hangs past ``--timeout`` seconds, or its losses disagree.

``--disable-serialize`` compiles without serialize_collectives (several collectives of the gloo
group then execute at once on its two worker threads, the cause of the crashes);
``--gloo-threads 1`` builds every gloo group with one worker thread instead; ``--no-hold`` compiles
without the releases of collective inputs after their waits (runtime/collective_inputs.py);
``--fsdp2`` trains the same model, units and policy with PyTorch FSDP2 eager, to tell a fault of
the compiled programs from one of torch's gloo path. What these measured is in
passes/serialize_collectives.py; the harshest setting is ``--layers 8 --hidden 64 --intermediate 128
--depth 4 --steps 1000 --parallel 3`` (without the pass, most runs crash within two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--parallel", type=int, default=1, help="runs at once (load on the machine)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--depth", type=int, default=2, help="prefetch_depth (and reductions_in_flight)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=344)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    p.add_argument("--disable-serialize", action="store_true",
                   help="compile without serialize_collectives (several collectives of the group in flight)")
    p.add_argument("--no-hold", action="store_true", help="drop collective inputs mid-flight (the old code)")
    p.add_argument("--fsdp2", action="store_true",
                   help="train with PyTorch FSDP2 eager (fully_shard, same units and policy) instead of hp")
    p.add_argument("--gloo-threads", type=int, default=None,
                   help="worker threads of each gloo process group (torch's default: 2); 1 runs the "
                   "collectives one at a time, still asynchronous to compute")
    p.add_argument("--worker", nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    rank, port = args.worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(HERE, ".."))
    import hyper_parallel as hp
    from hyper_parallel import compat
    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

    compat.print_native_stacks_on_fatal_signal()  # a crash's C++ stacks land in the rank's log
    if args.no_hold:
        import hyper_parallel.runtime.partition as partition

        partition.hold_collective_inputs = lambda gm: gm
    torch.set_num_threads(1)
    if args.gloo_threads is not None:
        _gloo_threads(args.gloo_threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    mesh = hp.init_device_mesh("cpu", (args.world,), mesh_dim_names=("dp",))
    if args.fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
        disable = ("serialize_collectives",) if args.disable_serialize else ()
        model = hp.parallelize(model, plan, mesh, prefetch_depth=args.depth, reductions_in_flight=args.depth,
                               disable_passes=disable)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, 64), generator=g)
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.fsdp2:  # FSDP2 returns this rank's mean; the global mean to compare across ranks
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss = loss / args.world
        losses.append(loss.item())
    everyone = [None] * args.world
    dist.all_gather_object(everyone, losses)
    dist.destroy_process_group()
    if rank == 0:
        print("LOSSES_AGREE" if all(l == losses for l in everyone) else "LOSSES_DISAGREE", flush=True)


def _gloo_threads(threads: int) -> None:
    """Make every gloo process group torch creates from now on use ``threads`` worker threads
    (``init_process_group`` and ``new_group`` build them with torch's default, 2)."""
    import torch.distributed.distributed_c10d as c10d_module

    base = c10d_module.ProcessGroupGloo

    class Gloo(base):
        def __init__(self, store, rank, size, timeout):
            options = base._Options()
            options._timeout = timeout
            options._devices = [base.create_default_device()]
            options._threads = threads
            super().__init__(store, rank, size, options)

    c10d_module.ProcessGroupGloo = Gloo


def start_run(args: argparse.Namespace, index: int, log_dir: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(rank), str(port),
               "--world", str(args.world), "--steps", str(args.steps), "--depth", str(args.depth),
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
        cmd += ["--no-hold"] if args.no_hold else []
        cmd += ["--disable-serialize"] if args.disable_serialize else []
        cmd += ["--fsdp2"] if args.fsdp2 else []
        cmd += ["--gloo-threads", str(args.gloo_threads)] if args.gloo_threads is not None else []
        log = open(os.path.join(log_dir, f"run{index}_rank{rank}.log"), "w")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    return {"index": index, "procs": procs, "start": time.monotonic()}


def finish_run(run: dict, args: argparse.Namespace, log_dir: str) -> dict | None:
    """The run's outcome once every worker ended (killing all on the first death or the timeout),
    None while it is still going."""
    codes = [p.poll() for p, _ in run["procs"]]
    elapsed = time.monotonic() - run["start"]
    died = any(c not in (None, 0) for c in codes)
    if all(c is not None for c in codes) or died or elapsed > args.timeout:
        if died:
            time.sleep(2)  # the peers' own errors, if any, land in their logs
        for p, log in run["procs"]:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
        final = [p.returncode for p, _ in run["procs"]]
        rank0 = open(os.path.join(log_dir, f"run{run['index']}_rank0.log")).read()
        if elapsed > args.timeout and not died:
            outcome = "hang"
        elif died or any(final):
            outcome = "crash"
        else:
            outcome = "ok" if "LOSSES_AGREE" in rank0 else "wrong"
        return {"run": run["index"], "outcome": outcome, "exit_codes": final, "seconds": round(elapsed, 1)}
    return None


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    suffix = ("_fsdp2" if args.fsdp2 else "") + ("_no_hold" if args.no_hold else "")
    suffix += "_unserialized" if args.disable_serialize else ""
    suffix += f"_threads{args.gloo_threads}" if args.gloo_threads is not None else ""
    log_dir = os.path.abspath(f"stress_gloo_prefetch_logs{suffix}")
    os.makedirs(log_dir, exist_ok=True)
    pending, running, results = list(range(args.runs)), [], []
    while pending or running:
        while pending and len(running) < args.parallel:
            running.append(start_run(args, pending.pop(0), log_dir))
        for run in list(running):
            outcome = finish_run(run, args, log_dir)
            if outcome is not None:
                running.remove(run)
                results.append(outcome)
                print(json.dumps(outcome), flush=True)
        time.sleep(0.5)
    bad = [r for r in results if r["outcome"] != "ok"]
    who = "FSDP2 eager" if args.fsdp2 else (f"hp, serialized={'no' if args.disable_serialize else 'yes'}, "
                                            f"hold={'no' if args.no_hold else 'yes'}")
    who += f", {args.gloo_threads} gloo threads" if args.gloo_threads is not None else ""
    print(f"{len(results) - len(bad)} of {len(results)} runs ok ({who}, "
          f"depth {args.depth}, {args.steps} steps, {args.parallel} at once); logs in {log_dir}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
