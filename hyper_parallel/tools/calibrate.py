"""``hyper-parallel calibrate``: measure this machine and write its cost-model profile.

What a gloo rank on this host costs, one intra-op thread per process (how the tests and benches
run ranks): matmul FLOP/s, copy bandwidth and the per-op overheads, alone and with ``ranks``
processes busy at once (the profile takes the latter, the condition of a multi-rank step);
hyper_parallel's runtime host overheads (per program call, boundary tensor and optimizer
parameter, in a 1-rank world); gloo collectives between the ranks, fitted to the ring model's
alpha and beta (``cost.comm.ring_volume``); and one host message of the per-call agreement
(``host_message_latency_s``). :func:`calibrate` returns the profile and every measurement;
``hyper-parallel calibrate --out cpu.json`` writes the profile for ``--hardware cpu.json`` of
``explain`` and ``plan`` (``cost.hardware.load_profile``). ``bench/calibrate_cost_model.py``
checks such a profile against measured steps.

Each ``measure_*`` function measures on the calling process (and, for ``measure_gloo`` and
``measure_host_message``, the ranks of the default group) with whatever threads torch has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import statistics
import tempfile
import time

import torch

from ..cost import comm as cost_comm
from ..cost.hardware import CPU, HardwareProfile

__all__ = ["calibrate", "join_local_world", "measure_gloo", "measure_host_message", "measure_local", "measure_runtime", "profile_from"]

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [16 << 10, 1 << 20]


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_local(quick: bool = False) -> dict:
    """Matmul FLOP/s, copy bandwidth and op overheads in this process (1 thread)."""
    torch.set_num_threads(1)
    matmul = {}
    for n in (128, 512) if quick else (128, 256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        reps = max(3, int(2e8 / n**3))
        matmul[n] = 2 * n**3 / _median_time(lambda: torch.mm(a, b), reps)
    src = torch.ones(16 << 20)  # 64 MiB fp32
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), 9)
    x, y = torch.ones(16), torch.ones(16)
    add, view = torch.ops.aten.add.Tensor, torch.ops.aten.view.default
    n_ops = 2000

    def many_adds():
        for _ in range(n_ops):
            add(x, y)

    def many_views():
        for _ in range(n_ops):
            view(x, [4, 4])

    return {
        "matmul_flops_per_s": {str(k): v for k, v in matmul.items()},
        "attention_flops_per_s": measure_attention(quick),
        "copy_bytes_per_s": copy_bw,
        "op_overhead_s": _median_time(many_adds, 7) / n_ops,
        "view_overhead_s": _median_time(many_views, 7) / n_ops,
    }


def _fit(samples: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares t = steps * alpha + moved * beta over (steps, moved_bytes, seconds), with
    relative residuals (each row scaled by 1/t, so 4 KiB and 16 MiB points weigh alike) and both
    constants kept non-negative (noise can make an unconstrained fit go below 0)."""
    rows = [(s, m, max(t, 1e-7)) for s, m, t in samples]
    a = torch.tensor([[s / t, m / t] for s, m, t in rows], dtype=torch.float64)
    ones = torch.ones(len(rows), 1, dtype=torch.float64)
    alpha, beta = torch.linalg.lstsq(a, ones).solution.flatten().tolist()
    if alpha < 0:
        alpha, beta = 0.0, torch.linalg.lstsq(a[:, 1:], ones).solution.item()
    elif beta <= 0:
        alpha, beta = torch.linalg.lstsq(a[:, :1], ones).solution.item(), 1e-12
    return alpha, beta


def measure_gloo(reps: int = 20, sizes=SIZES) -> dict:
    """Collective times between the ranks of the default group, two ways: "isolated" (median of
    back-to-back calls) and "in_step" (each call after a ~0.3 ms compute burst, as in a training
    step, minus the burst alone; mean, since a step's time is the sum of its collectives'). On a
    loaded 2-core machine the second is several times the first: the waiting rank's threads have to
    be scheduled again. The profile uses the in-step fit."""
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    n = dist.get_world_size()
    a = torch.randn(128, 128)

    def burst():
        for _ in range(8):  # ~0.3 ms of matmuls
            torch.mm(a, a)

    def mean_time(fn, count: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - t0) / count

    dist.barrier()
    burst_s = mean_time(burst, 50)
    raw: dict = {mode: {"all_reduce": {}, "all_gather": {}} for mode in ("isolated", "in_step")}
    samples: dict = {mode: [] for mode in raw}
    for size in sizes:
        x = torch.ones(size // 4)
        shard = torch.ones(size // 4 // n)
        count = max(5, min(reps, int(reps * (1 << 20) / size)))
        calls = {
            "all_reduce": lambda: c10d.wait_tensor(c10d.all_reduce(x, "sum", group)),
            "all_gather": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, n, group)),
        }
        for kind, call in calls.items():
            dist.barrier()
            iso = _median_time(call, count)
            dist.barrier()
            in_step = max(mean_time(lambda: (burst(), call()), count) - burst_s, 0.0)
            # A collective ends when the slower rank's does.
            times = torch.tensor([iso, in_step], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            local = size if kind == "all_reduce" else size // n
            steps, moved = cost_comm.ring_volume(kind, local, n)
            for mode, t in zip(("isolated", "in_step"), times.tolist()):
                raw[mode][kind][str(size)] = t
                samples[mode].append((steps, moved, t))
    fits = {mode: _fit(v) for mode, v in samples.items()}
    return {
        "seconds": raw,
        "fit": {mode: {"alpha_s": al, "bandwidth_bytes_per_s": 1 / be} for mode, (al, be) in fits.items()},
    }


def measure_host_message(reps: int = 50) -> float:
    """Seconds of one round of the per-call agreement's exchange between the ranks of the default
    group (``distributed.host_reduce``: a 24-byte all-gather, each after a short compute burst as
    in a step), over its rounds; the slowest rank's median."""
    import torch.distributed as dist

    from ..distributed.host_reduce import MaxAllReduce, rounds

    a, values = torch.randn(128, 128), torch.zeros(3, dtype=torch.int64)
    times = []
    for _ in range(reps):
        dist.barrier()
        for _ in range(8):
            torch.mm(a, a)
        t0 = time.perf_counter()
        MaxAllReduce(values).wait()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist()) / max(1, rounds(dist.get_world_size()))


def measure_attention(quick: bool = False) -> float:
    """FLOP/s of causal SDPA forward + backward (the CPU flash kernel, head dim 16, one long
    sequence), counted as the cost model counts it (torch's formula, masked tiles skipped)."""
    from torch.utils import flop_counter

    seq, heads, head_dim = (2048, 2, 16) if quick else (8192, 2, 16)
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grad = torch.randn(1, heads, seq, head_dim)

    def step():
        sdpa(q, k, v, is_causal=True).backward(grad)

    flops = (flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
             + flop_counter.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))
    visible = seq * (seq + 1) / 2 / seq**2  # the causal mask's share of query-key pairs
    return flops * visible / _median_time(step, 3 if quick else 5, warmup=1)


def profile_from(local: dict, gloo: dict | None = None, runtime: dict | None = None,
                 host_message_s: float | None = None, *, name: str = "cpu-measured",
                 ranks: int | None = None) -> HardwareProfile:
    """The cpu profile with this run's measurements in place of hardware.py's; ``ranks``: one node
    of that many ranks sharing this host's cores (default: the cpu profile's)."""
    peak = max(local["matmul_flops_per_s"].values())
    changes = dict(
        name=name, peak_flops={"fp32": peak, "bf16": peak, "fp16": peak},
        hbm_bandwidth=local["copy_bytes_per_s"],
        op_overhead_s=local["op_overhead_s"], view_overhead_s=local["view_overhead_s"],
        notes=f"calibrated by hyper-parallel calibrate on {os.uname().nodename}, torch {torch.__version__}",
    )
    if "attention_flops_per_s" in local:  # the fused attention kernel's rate against the matmul's
        changes["attention_efficiency"] = min(1.0, local["attention_flops_per_s"] / peak)
    if ranks is not None:
        changes.update(devices_per_node=ranks, host_cores=os.cpu_count() or 1)
    if host_message_s is not None:
        changes["host_message_latency_s"] = host_message_s
    if gloo is not None:
        fit = gloo["fit"]["in_step"]
        bandwidth, latency = fit["bandwidth_bytes_per_s"], fit["alpha_s"]
        changes.update(intra_node_bandwidth=bandwidth, intra_node_latency=latency,
                       inter_node_bandwidth=bandwidth, inter_node_latency=latency)
    if runtime is not None:
        changes.update({k: runtime[k] for k in ("program_overhead_s", "boundary_overhead_s",
                                                "optimizer_tensor_overhead_s")})
    return dataclasses.replace(CPU, **changes)


class _ManyParams(torch.nn.Module):
    """``n`` tiny parameters and almost no compute: what is left of a step is the runtime's host
    work per parameter (DTensor <-> local at the program boundary, autograd, the optimizer loop)."""

    def __init__(self, n: int):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4)) for _ in range(n)])

    def forward(self, x):
        for p in self.ps:
            x = x * p
        return x.sum()


def measure_runtime(local: dict) -> dict:
    """Host overheads of hyper_parallel's runtime, on a 1-rank world: the step time of
    ``_ManyParams(n)`` for two ``n`` minus what ``simulate`` predicts for its graph ops; the slope
    over boundary tensors (forward inputs + backward gradients) is ``boundary_overhead_s``, the
    intercept split over the two programs ``program_overhead_s``; the optimizer's slope over
    parameters is ``optimizer_tensor_overhead_s``."""
    import torch.distributed as dist

    import hyper_parallel as hp
    from ..cost import optimizer_traffic, simulate

    graph_only = dataclasses.replace(profile_from(local), program_overhead_s=0.0, boundary_overhead_s=0.0,
                                     optimizer_tensor_overhead_s=0.0)
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    points = []
    for n in (8, 64):
        pmodel = hp.parallelize(_ManyParams(n), {}, mesh)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
        x = torch.ones(2, 4)
        fwd_bwd = lambda: pmodel(x).backward()  # noqa: E731
        for _ in range(3):
            fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=True)
        fb_s = _median_time(fwd_bwd, 30)
        opt_times = []
        for _ in range(30):
            fwd_bwd()
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt_times.append(time.perf_counter() - t0)
        programs = pmodel.compiled_programs()
        fwd, bwd = programs
        boundary = len(fwd.graph.find_nodes(op="placeholder")) + optimizer_traffic(bwd)[1]
        predicted = simulate(programs, {}, graph_only).step_s
        points.append((n, boundary, fb_s - predicted, statistics.median(opt_times)))
    (n0, b0, r0, o0), (n1, b1, r1, o1) = points
    per_boundary = max((r1 - r0) / (b1 - b0), 0.0)
    return {
        "points": [{"params": n, "boundary_tensors": b, "unexplained_fwd_bwd_s": r, "optimizer_step_s": o}
                   for n, b, r, o in points],
        "boundary_overhead_s": per_boundary,
        "program_overhead_s": max((r0 - per_boundary * b0) / 2, 0.0),
        "optimizer_tensor_overhead_s": max((o1 - o0) / (n1 - n0), 0.0),
    }


def join_local_world(rank: int, world: int, port: int) -> None:
    """In a spawned process: one intra-op thread, then rank ``rank`` of a gloo world of ``world``
    processes of this machine meeting on ``port`` (how the measurements run)."""
    import warnings

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _spawned(rank: int, world: int, port: int, quick: bool, out_path: str) -> None:
    import torch.distributed as dist

    join_local_world(rank, world, port)
    try:
        dist.barrier()
        # Compute rates with every rank busy, as during a step (they share cores, caches and
        # memory bandwidth): the profile uses these.
        local = measure_local(quick)
        gloo = measure_gloo(reps=5 if quick else 20, sizes=QUICK_SIZES if quick else SIZES)
        host = measure_host_message(10 if quick else 50)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        import json

        with open(out_path, "w") as f:
            json.dump({"local_concurrent": local, "gloo": gloo, "host_message_s": host}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(ranks: int = 2, quick: bool = False, name: str = "cpu-calibrated") -> tuple[HardwareProfile, dict]:
    """Measure this machine (module docstring): the profile of ``ranks`` gloo ranks on it, and the
    measurements. ``quick``: fewer sizes and repetitions (seconds, for a smoke test). Runs the
    runtime's overheads in a 1-rank world of this process (which must have no process group) and
    the rest in ``ranks`` spawned processes."""
    import json
    import warnings

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"calibrate: ranks must be at least 2 (collectives are measured between them), got {ranks}")
    if dist.is_initialized():
        raise ValueError("calibrate: run it outside a process group (it creates a 1-rank world of its own)")
    threads = torch.get_num_threads()
    alone = measure_local(quick)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    from ..progress import enable_default_logging

    enable_default_logging()  # once per process: set up now, so the level below is not reset at parallelize
    package = logging.getLogger("hyper_parallel")
    level = package.level
    package.setLevel(logging.WARNING)  # the runtime measurement's compiles log their phases at INFO
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            runtime = measure_runtime(alone)
        finally:
            dist.destroy_process_group()
            torch.set_num_threads(threads)
            package.setLevel(level)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(_spawned, args=(ranks, _free_port(), quick, out_path), nprocs=ranks)
        with open(out_path) as f:
            remote = json.load(f)
    profile = profile_from(remote["local_concurrent"], remote["gloo"], runtime, remote["host_message_s"], name=name,
                           ranks=ranks)
    return profile, {"local_alone": alone, "runtime": runtime, "ranks": ranks, "quick": quick,
                     "threads_per_process": 1, "torch": torch.__version__, **remote}
