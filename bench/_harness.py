"""Shared launcher of the benchmarks: one gloo process per rank on this machine, rank 0 reports.

``launch(run, report, args, world)`` spawns ``world`` processes, runs ``run(args)`` on each inside a
gloo process group (NCCL, one GPU per rank, when ``args.device == "cuda"``), and on the rank that returns a result (rank 0) prints it as JSON, calls
``report(result)`` for the human-readable table, and writes ``args.json_out`` if given. Also the
pieces the step benchmarks share: one training step, a timed one, the slowest rank's times, and a
collective counter that sees both eager c10d calls and compiled functional collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode


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


_C10D_INPUT_ARG = {  # c10d op -> index of the local input tensor(s) in its args
    "_allgather_base_": 1, "_reduce_scatter_base_": 1, "allreduce_": 0, "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_tensor_coalesced_": 1, "allgather_": 1, "reduce_scatter_": 1,
}
_KIND = {
    "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
}


class CommCounter(CommDebugMode):
    """``CommDebugMode`` that records each collective with the bytes of its local input.

    c10d ops (what FSDP2 calls: ``_allgather_base_(out, in)``, ``_reduce_scatter_base_(out, in)``,
    ``allreduce_([t])``) take the output first; functional ones (``_c10d_functional.*``, what a
    compiled graph calls) take the input first. The in-place functional all-reduce
    (``_c10d_functional.all_reduce_``, which a compiled graph uses for gradient buckets) is not in
    ``CommDebugMode``'s table, so it is counted here directly.
    """

    _UNLISTED = {"all_reduce_"}  # functional collectives CommDebugMode does not count

    def __init__(self):
        super().__init__()
        self.calls: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name, namespace = func._overloadpacket.__name__, func.namespace
        unlisted = namespace == "_c10d_functional" and name in self._UNLISTED
        if unlisted or sum(self.comm_counts.values()) != before:
            index = _C10D_INPUT_ARG.get(name, 0) if namespace == "c10d" else 0
            arg = args[index] if len(args) > index else None
            tensors = arg if isinstance(arg, (list, tuple)) else [arg]
            nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            entry = self.calls.setdefault(_KIND.get(name, name), {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        return out


def step(model, opt, batch) -> torch.Tensor:
    # A peer that must run forward and backward inside a context (torch's context_parallel shards
    # its buffers in place there and dispatches attention to ring kernels) says so as
    # ``model.step_context``.
    with getattr(model, "step_context", contextlib.nullcontext)():
        loss = model(**batch)["loss"]
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def add_peak_measure_arg(p) -> None:
    p.add_argument("--peak-measure", choices=["auto", "tracker", "allocator"], default="auto",
                   help="how both sides' peak memory is measured: MemoryTracker (tensors allocated through the "
                        "dispatcher) or the allocator's events (AllocatorPeak); auto: the allocator under "
                        "--codegen inductor, whose buffers MemoryTracker cannot see, else the tracker")


def peak_measure(args) -> str:
    """How a bench measures both sides' peaks (``--peak-measure``): ``MemoryTracker`` (tensors
    allocated through the dispatcher), except under ``--codegen inductor``, whose generated code
    allocates its buffers outside the dispatcher (MemoryTracker read a 1F1B pipeline step as the
    parameters plus 8 KB): then the allocator's own events (``AllocatorPeak``), which also count
    ops' internal workspaces."""
    if args.peak_measure != "auto":
        return args.peak_measure
    return "allocator" if args.codegen == "inductor" else "tracker"


ALLOCATOR_NOTE = ("peaks from the allocator's events on both sides (AllocatorPeak; --codegen inductor's buffers "
                  "bypass MemoryTracker)")


def step_peak(run_step, params, opt, measure: str = "tracker") -> int:
    """Peak live bytes of one step, ``run_step()``, on the rank that holds the most: what exists
    before it (``params``, ``opt``'s state) plus the most the step holds at once, as
    ``hyper_parallel.testing.MemoryTracker`` counts them (``measure="tracker"``: every tensor
    allocated through the dispatcher) or ``AllocatorPeak`` (``"allocator"``: every block the
    allocator hands out); on either side, not what the communication backend allocates itself."""
    from hyper_parallel.testing.memory_tracker import AllocatorPeak, MemoryTracker

    baseline = list(params) + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with (AllocatorPeak if measure == "allocator" else MemoryTracker)(baseline) as tracker:
        run_step()
    peak = torch.tensor([tracker.peak], dtype=torch.float64)  # exact below 2**53 bytes
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def device_sync() -> None:
    """Wait for the GPU's queued kernels (a no-op on CPU), so a step's time is its kernels' too."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_step(model, opt, batch) -> float:
    dist.barrier()
    device_sync()
    t0 = time.perf_counter()
    step(model, opt, batch)
    device_sync()
    return time.perf_counter() - t0


def slowest_rank(times: list[float]) -> list[float]:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def data_parallel_batch(args):
    """This rank's part of one global batch (``args.batch`` sequences, split over the ranks), the
    model of the shape flags (seed 0) and its single-device step-0 loss on the whole batch."""
    import torch

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be a multiple of --world {world}")
    ref = build_model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    local_ids = ids.chunk(world, dim=0)[rank]
    return ref, {"input_ids": local_ids, "labels": local_ids}, ref(input_ids=ids, labels=ids)["loss"].item()


@dataclasses.dataclass
class SideBySide:
    """What :func:`time_side_by_side` measured: step-0 losses (the peer's averaged over ranks, as
    eager DDP/FSDP2 return each rank's local mean), hp's first step (compile + step) and the timed
    steps of both sides, each the slowest rank's."""

    hp_loss0: float
    peer_loss0: float
    hp_first_step_s: float
    hp_times: list
    peer_times: list


def time_side_by_side(hp_side: tuple, peer_side: tuple, batch, warmup: int, steps: int,
                      peer_batch=None) -> SideBySide:
    """hp's first step (it compiles) and the peer's, then ``warmup - 1`` and ``steps`` timed steps
    interleaved hp / peer, so machine noise hits both alike. Each side is (model, optimizer).
    ``peer_batch``: the peer's own local batch where it differs from hp's (default: ``batch``)."""
    world = dist.get_world_size()
    peer_batch = batch if peer_batch is None else peer_batch
    dist.barrier()
    t0 = time.perf_counter()
    hp_loss0 = step(*hp_side, batch).item()
    first = time.perf_counter() - t0
    peer_loss0 = step(*peer_side, peer_batch)
    dist.all_reduce(peer_loss0)
    for _ in range(warmup - 1):
        timed_step(*hp_side, batch)
        timed_step(*peer_side, peer_batch)
    hp_times, peer_times = [], []
    for _ in range(steps):
        hp_times.append(timed_step(*hp_side, batch))
        peer_times.append(timed_step(*peer_side, peer_batch))
    times = slowest_rank([first] + hp_times + peer_times)
    return SideBySide(hp_loss0, peer_loss0.item() / world, times[0], times[1 : 1 + steps], times[1 + steps :])


def count_collectives(sides: dict, batch) -> dict:
    """{name: collectives of one more step of that (model, optimizer)} with :class:`CommCounter`."""
    counted = {}
    for name, (model, opt) in sides.items():
        mode = CommCounter()
        with mode:
            step(model, opt, batch)
        counted[name] = mode.calls
    return counted


def print_time_rows(step_times: dict, peer: str, ratio: float) -> None:
    """The step-time rows of a side-by-side table (median, min / max) of hp and ``peer``."""
    hp, other = step_times["hyper_parallel"], step_times[peer]
    print(f"{'step time (ms)':26}{hp['median'] * 1e3:>16.1f}{other['median'] * 1e3:>16.1f}{ratio:>10.2f}")
    print(f"{'  min / max (ms)':26}{hp['min'] * 1e3:>7.1f} /{hp['max'] * 1e3:>6.1f}"
          f"{other['min'] * 1e3:>8.1f} /{other['max'] * 1e3:>6.1f}")


def print_collective_rows(hp_summary: dict, hp_counted: dict, peer_counted: dict) -> None:
    """Count and bytes per collective kind: hp's compile summary next to the peer's counted calls
    (hp's counted calls noted where they differ: the per-call agreement all-gather)."""
    empty = {"count": 0, "bytes": 0}
    for kind in sorted(set(hp_summary) | set(hp_counted) | set(peer_counted)):
        h, n, p = hp_summary.get(kind, empty), hp_counted.get(kind, empty), peer_counted.get(kind, empty)
        counted = "" if n == h else f"  (hp counted: {n['count']}, {n['bytes']:,} B)"
        print(f"{kind + ' count':26}{h['count']:>16}{p['count']:>16}{counted}")
        print(f"{kind + ' bytes':26}{h['bytes']:>16,}{p['bytes']:>16,}")


def hp_collectives(summary: dict) -> dict:
    return {
        kind: {"count": sum(e["count"] for e in by_axis.values()), "bytes": sum(e["bytes"] for e in by_axis.values())}
        for kind, by_axis in summary["collectives_per_step"].items()
    }


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
