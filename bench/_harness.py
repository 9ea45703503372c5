"""Shared launcher of the benchmarks: one gloo process per rank on this machine, rank 0 reports.

``launch(run, report, args, world)`` spawns ``world`` processes, runs ``run(args)`` on each inside a
gloo process group (NCCL, one GPU per rank, when ``args.device == "cuda"``), and on the rank that returns a result (rank 0) prints it as JSON, calls
``report(result)`` for the human-readable table, and writes ``args.json_out`` if given.
"""

from __future__ import annotations

import json
import os
import socket
import warnings

import torch.distributed as dist


def add_model_args(parser) -> None:
    """The example Llama's shape flags, with the defaults both step benchmarks use."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)


def build_model(args):
    """The example Llama of the shape flags, initialised from seed 0 (the same on every rank)."""
    import torch

    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(128, args.seq_len),
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _worker(rank: int, world: int, port: int, run, report, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank != 0:
        warnings.filterwarnings("ignore")
    backend = "gloo"
    if getattr(args, "device", "cpu") == "cuda":  # one GPU per rank, NCCL
        import torch

        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    if result is None:
        return
    extra = result.pop("_profile", None)
    print(json.dumps(result, indent=2))
    report(result)
    if extra:
        print(extra)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


def launch(run, report, args, world: int, threads: int | None = None) -> None:
    import torch.multiprocessing as mp

    if threads is not None:  # set before the workers import torch
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, run, report, args), nprocs=world)
