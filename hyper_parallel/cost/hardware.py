"""Hardware profiles: the peak rates and efficiencies the cost model turns FLOPs and bytes into time.

A :class:`HardwareProfile` is pure data. Datasheet numbers are *peaks*; each profile also carries
achievable-efficiency factors (what fraction of a peak real kernels and collectives reach), so that
``time = work / (peak * efficiency)``. The efficiencies are deliberately coarse (one per resource,
not per kernel shape): the model is for comparing plans and spotting exposed communication, not for
predicting a step to the percent.

Units: FLOP/s, bytes/s, bytes, seconds. Link bandwidths are per device and per direction, i.e. what
one rank can push into the fabric while it also receives the same amount (the figure ring
collectives are limited by).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

__all__ = ["HardwareProfile", "PROFILES", "get_profile", "dtype_key", "load_profile", "save_profile"]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One device type and the fabric between such devices."""

    name: str
    # Dense (no structured sparsity) peak FLOP/s per dtype key ("bf16", "fp16", "fp32", "tf32").
    peak_flops: Mapping[str, float] = dataclasses.field(hash=False)
    hbm_bandwidth: float  # device memory bytes/s
    memory_bytes: int  # device memory capacity
    devices_per_node: int
    intra_node_bandwidth: float  # bytes/s per device per direction
    intra_node_latency: float  # s per ring step
    inter_node_bandwidth: float  # bytes/s per device per direction
    inter_node_latency: float  # s per ring step
    matmul_efficiency: float  # fraction of peak_flops large GEMMs reach
    memory_efficiency: float  # fraction of hbm_bandwidth memory-bound kernels reach
    link_efficiency: float  # fraction of link bandwidth collectives reach (NCCL "bus bandwidth")
    op_overhead_s: float  # fixed cost of one kernel (launch / dispatch)
    # Host-side costs that serialise with compute only where the host IS the device (CPU); on
    # accelerators the host runs ahead of the device and they are taken as hidden (0).
    view_overhead_s: float = 0.0  # a metadata-only op (view, getitem)
    program_overhead_s: float = 0.0  # one call of a forward / backward program by the runtime
    boundary_overhead_s: float = 0.0  # per tensor crossing a program boundary (DTensor <-> local, autograd)
    optimizer_tensor_overhead_s: float | None = None  # per parameter in optimizer.step (None: op_overhead_s)
    # CPU hosts: the cores the ranks of one node share (None: each device computes on its own).
    # More busy ranks than cores time-share them (host_sharing()).
    host_cores: int | None = None
    # One small message between two ranks' host processes over the control network (gloo over
    # TCP), what the per-call agreement's log2(world) rounds each pay (comm.agreement_time). 30 us
    # on the accelerator profiles: a kernel TCP round trip between hosts of one data centre is
    # typically 20-60 us, one way half of it, plus gloo's own handling (an assumption, unmeasured).
    host_message_latency_s: float = 30e-6
    # Fraction of peak_flops the fused attention kernels (SDPA's flash / memory-efficient / cuDNN
    # kernels and their backwards, counted as torch counts them, masked tiles skipped) reach; None:
    # matmul_efficiency. Lower than a GEMM's where the head dim is small (the CPU flash kernel at
    # head dim 16 reaches about 0.6 of the matmul rate), which matters at long sequences.
    attention_efficiency: float | None = None
    notes: str = ""

    def compute_efficiency(self, attention: bool = False) -> float:
        """The fraction of peak_flops a kernel reaches: :attr:`attention_efficiency` for the fused
        attention kernels when set, else :attr:`matmul_efficiency`."""
        if attention and self.attention_efficiency is not None:
            return self.attention_efficiency
        return self.matmul_efficiency

    def host_sharing(self, ranks_on_node: int, busy_fraction: float = 1.0) -> float:
        """How much slower each rank runs when ``ranks_on_node`` ranks share :attr:`host_cores`
        cores, each busy ``busy_fraction`` of the step (a pipeline's ranks idle in its bubble, and
        their cores go to the others): the average number of busy ranks over the cores, at least 1.
        1.0 on a profile without ``host_cores`` (accelerators)."""
        if not self.host_cores:
            return 1.0
        return max(1.0, ranks_on_node * busy_fraction / self.host_cores)

    def __post_init__(self):
        if not self.peak_flops:
            raise ValueError(f"hardware profile {self.name!r}: peak_flops needs at least one dtype")
        for field in ("matmul_efficiency", "memory_efficiency", "link_efficiency", "attention_efficiency"):
            value = getattr(self, field)
            if field == "attention_efficiency" and value is None:
                continue
            if not 0 < value <= 1:
                raise ValueError(f"hardware profile {self.name!r}: {field}={value} must be in (0, 1]")
        # A private copy, so the caller's dict cannot change a frozen profile (a plain dict, not a
        # read-only proxy, so profiles pickle: test pools send them to worker processes).
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def flops_per_s(self, dtype: str | torch.dtype | None) -> float:
        """Peak dense FLOP/s for ``dtype`` (a key or a torch dtype); fp32 when the profile has no
        entry for it (e.g. integer ops), the slowest reasonable assumption."""
        key = dtype_key(dtype)
        return self.peak_flops.get(key) or self.peak_flops.get("fp32") or min(self.peak_flops.values())


def dtype_key(dtype: str | torch.dtype | None) -> str:
    """``torch.bfloat16`` → ``"bf16"`` and so on; strings pass through."""
    if isinstance(dtype, str):
        return dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "fp32")


T, G = 1e12, 1e9
GB = 10**9  # vendors quote memory in decimal GB

# Efficiencies shared by the NVIDIA profiles. matmul 0.70: cuBLAS reaches ~70-80% of dense peak on
# large bf16 GEMMs (e.g. ~700 of 989 TFLOP/s on H100 SXM in NVIDIA's and third-party GEMM sweeps);
# whole-model kernels mixes are lower, which the roofline of the non-matmul ops accounts for.
# memory 0.80: STREAM-like copies reach ~80-90% of HBM peak. link 0.80: nccl-tests all_reduce bus
# bandwidth is ~360-380 GB/s on 8xH100 NVLink4 (450 GB/s) and ~40-45 GB/s per 400G NDR NIC.
# Latency per ring step: NVLink ~2 us, InfiniBand ~5 us (nccl-tests small-message times / steps).
# op_overhead 4 us: a kernel launch plus the gap to the next kernel, paid by every kernel (no CUDA
# graphs). fp32 matmuls use the fp32 peak; the tf32 entry is there for callers that enable TF32.
_NVIDIA_EFF = dict(matmul_efficiency=0.70, memory_efficiency=0.80, link_efficiency=0.80, op_overhead_s=4e-6)

H100 = HardwareProfile(
    name="h100",
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense (1979 with sparsity), 494 tf32 dense,
    # 67 fp32 (non-tensor-core); 80 GB HBM3 at 3.35 TB/s; NVLink4 900 GB/s bidirectional = 450 GB/s
    # per direction; DGX/HGX H100: 8 GPUs per node, one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s.
    peak_flops={"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T},
    hbm_bandwidth=3.35e12, memory_bytes=80 * GB, devices_per_node=8,
    intra_node_bandwidth=450 * G, intra_node_latency=2e-6,
    inter_node_bandwidth=50 * G, inter_node_latency=5e-6,
    **_NVIDIA_EFF,
    notes="H100 SXM5 80GB, NVLink4, 400G NDR InfiniBand per GPU (vendor datasheets)",
)

H200 = dataclasses.replace(
    H100,
    name="h200",
    # NVIDIA H200 SXM datasheet: same GH100 compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s; NVLink4
    # 900 GB/s bidirectional; HGX H200 8 GPUs per node, 400 Gb/s per GPU.
    hbm_bandwidth=4.8e12, memory_bytes=141 * GB,
    notes="H200 SXM 141GB, NVLink4, 400G NDR InfiniBand per GPU (vendor datasheets)",
)

A100 = HardwareProfile(
    name="a100",
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s bf16/fp16 dense, 156 tf32, 19.5 fp32; HBM2e
    # 2.039 TB/s; NVLink3 600 GB/s bidirectional = 300 GB/s per direction; DGX A100: 8 GPUs per node,
    # one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s.
    peak_flops={"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    hbm_bandwidth=2.039e12, memory_bytes=80 * GB, devices_per_node=8,
    intra_node_bandwidth=300 * G, intra_node_latency=2e-6,
    inter_node_bandwidth=25 * G, inter_node_latency=5e-6,
    **_NVIDIA_EFF,
    notes="A100 SXM4 80GB, NVLink3, 200G HDR InfiniBand per GPU (vendor datasheets)",
)

ASCEND_910B = HardwareProfile(
    name="ascend-910b",
    # UNCERTAIN: Huawei publishes no per-chip datasheet for the 910B; these are the figures commonly
    # reported for the Atlas 800T A2 (8x 910B) server, with a range across 910B variants:
    # fp16/bf16 313 TFLOP/s (910B3; 910B1 is reported at ~376, so +/-20%), fp32 taken as 1/4 of that;
    # 64 GB HBM2e at ~1.6 TB/s; HCCS full mesh of 7 links x 56 GB/s (392 GB/s aggregate) per NPU,
    # taken as 196 GB/s per direction; one 200 Gb/s RoCE port per NPU = 25 GB/s. Latencies and
    # efficiencies are not published: HCCL is assumed to behave like NCCL (ring steps of ~3 / ~8 us)
    # and the Cube units like tensor cores (0.6 of peak on large GEMMs).
    peak_flops={"bf16": 313 * T, "fp16": 313 * T, "fp32": 78 * T},
    hbm_bandwidth=1.6e12, memory_bytes=64 * GB, devices_per_node=8,
    intra_node_bandwidth=196 * G, intra_node_latency=3e-6,
    inter_node_bandwidth=25 * G, inter_node_latency=8e-6,
    matmul_efficiency=0.60, memory_efficiency=0.75, link_efficiency=0.75, op_overhead_s=8e-6,
    notes="Ascend 910B (Atlas 800T A2): unofficial figures, uncertain by ~20% (see hardware.py)",
)

# This machine: a 2-core x86 VM (AMD EPYC, AVX-512), one gloo rank per core with 1 intra-op thread
# each, gloo over loopback TCP. CALIBRATED by ``bench/calibrate_cost_model.py`` (2026-11-23, torch
# 2.13.0+cpu; the 2026-11-22 run on another host of this kind gave 2.4x the copy bandwidth, 3x the
# link bandwidth and a fifth of the runtime overheads: hosts differ, so re-run it on yours),
# measured with both ranks busy at once as in a 2-rank step:
# - peak_flops: best fp32 square GEMM of 128..1024 (1 thread); bf16/fp16 set equal (no CPU tensor
#   cores are modelled; these dtypes are rare on CPU here);
# - hbm_bandwidth: a 64 MiB copy, read + write bytes (it halves when both ranks copy at once);
# - op_overhead_s / view_overhead_s: a tiny aten.add / aten.view called through torch.ops, which is
#   what each node of a compiled fx program pays;
# - program / boundary / optimizer overheads: hyper_parallel's runtime host work, from step times
#   of a model with 8 vs 64 tiny parameters minus the simulated graph (see measure_runtime there);
# - links: alpha/beta fitted by least squares to comm.ring_volume's ring model over all_reduce and
#   all_gather of 4 KiB..16 MiB, each issued after a ~0.3 ms compute burst as in a step. The same
#   collectives back to back fit alpha ~65 us; inside steps the waiting rank must be rescheduled on
#   the 2 shared cores, which is most of the ~0.6 ms alpha, and varies several-fold run to run.
# Efficiencies are 1.0: the peaks are measured achievable rates. Both ranks share one "node" and the
# same loopback, so intra = inter. host_cores=2: more ranks on this host (a profile replaced with
# devices_per_node=4 for 4 gloo ranks) time-share the 2 cores, as HardwareProfile.host_sharing prices.
CPU = HardwareProfile(
    name="cpu",
    peak_flops={"fp32": 131.5 * G, "bf16": 131.5 * G, "fp16": 131.5 * G},
    hbm_bandwidth=10.12 * G, memory_bytes=24105 * 2**20, devices_per_node=2,  # `free`: 23.5 GiB
    intra_node_bandwidth=0.670 * G, intra_node_latency=642.4e-6,
    inter_node_bandwidth=0.670 * G, inter_node_latency=642.4e-6,
    matmul_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
    op_overhead_s=3.71e-6, view_overhead_s=4.40e-6,
    program_overhead_s=319.7e-6, boundary_overhead_s=56.15e-6, optimizer_tensor_overhead_s=18.37e-6,
    host_cores=2,
    # hyper-parallel calibrate, 2026-12-03: one round of the agreement's exchange between 2 ranks,
    # each after a compute burst (the host differed from the 2026-11-23 one: 192 GFLOP/s).
    host_message_latency_s=286e-6,
    # 2026-12-03, one thread: the causal CPU flash kernel at head dim 16 (sequences of 4k-16k),
    # forward and backward together, ran at 0.59 of the 1024^3 matmul's rate (92 vs 155 GFLOP/s).
    attention_efficiency=0.59,
    notes="gloo on this machine's 2 CPU cores, 1 thread per rank (calibrated, see hardware.py)",
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H100, H200, A100, ASCEND_910B, CPU)}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """The profile called ``name`` (case-insensitive), or read from ``name`` when it is a JSON file
    (``hyper-parallel calibrate --out``, :func:`load_profile`); a profile passes through."""
    if isinstance(name, HardwareProfile):
        return name
    if str(name).endswith(".json"):
        return load_profile(str(name))
    profile = PROFILES.get(str(name).lower())
    if profile is None:
        raise ValueError(
            f"unknown hardware profile {name!r}; choose one of {sorted(PROFILES)}, a profile JSON file "
            "(hyper-parallel calibrate --out FILE), or pass a hyper_parallel.cost.HardwareProfile"
        )
    return profile


def save_profile(profile: HardwareProfile, path: str) -> str:
    """Write ``profile`` as JSON (every field) for :func:`load_profile`; returns ``path``."""
    import json

    fields = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    fields["peak_flops"] = dict(profile.peak_flops)
    with open(path, "w") as f:
        json.dump({"hyper_parallel_hardware_profile": 1, **fields}, f, indent=2, sort_keys=True)
    return path


def load_profile(path: str) -> HardwareProfile:
    """The profile :func:`save_profile` (or ``hyper-parallel calibrate``) wrote to ``path``; a
    field it lacks takes the default, an unknown one is an error naming it."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"hardware profile file {path!r} does not exist (hyper-parallel calibrate --out {path} "
                         "writes one)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile file {path!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.pop("hyper_parallel_hardware_profile", None) != 1:
        raise ValueError(f"{path!r} is not a hardware profile written by hyper-parallel calibrate / save_profile")
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"hardware profile file {path!r}: unknown fields {unknown}; known: {sorted(known)}")
    try:
        return HardwareProfile(**data)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"hardware profile file {path!r}: {exc}") from None
