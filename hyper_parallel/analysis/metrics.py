"""Per-step training metrics of a parallelized module: loss, tokens/s, MFU measured and predicted, peak memory.

What torchtitan prints each step, for a module ``hp.parallelize`` returned::

    meter = hp.StepMeter(model)
    for batch in batches:
        loss = model(**batch)["loss"]
        loss.backward(); opt.step(); opt.zero_grad()
        meter.step(loss, tokens=batch["input_ids"].numel())   # this rank's tokens

Each :meth:`StepMeter.step` measures the wall time since the previous one returned (the first:
since the meter was made; on CUDA after a device synchronize; the meter's own work is not
counted; :meth:`StepMeter.start` restarts the clock where a loop does other work between
steps), and returns a :class:`StepMetrics`; rank 0 logs it as one INFO line on
``hyper_parallel.analysis.metrics`` (visible by default, see progress.py).
MFU is the compiled program's model FLOPs on this rank (the cost model's per-node count, without
recomputation) per measured second over the hardware profile's dense peak for the program's
matmul dtype; the prediction is the cost model's simulated step of the same program
(``hyper_parallel.cost``) on the same profile. Peak memory is ``torch.cuda.max_memory_allocated``
on CUDA (reset each step), else the memory estimator's peak for the program (marked estimated);
beside it the caching allocator's reserved peak, ``torch.cuda.max_memory_reserved`` (what
``nvidia-smi`` and torchtitan's logs show), and the reserved peak predicted for the program
(``analysis/allocator_model.py``, for the allocator mode ``PYTORCH_CUDA_ALLOC_CONF`` sets). Pass the
optimizer (``StepMeter(model, optimizer=opt)``) so the estimates count its state and its step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter

import torch

log = logging.getLogger("hyper_parallel.analysis.metrics")

_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float | None
    step_s: float  # measured wall time of the step
    tokens: int  # this rank's tokens in the step
    tokens_per_s: float  # tokens / step_s (per rank, as torchtitan's tps)
    model_flops: float  # this rank's FLOPs per step without recomputation (cost model)
    mfu: float  # measured: model_flops / step_s / peak
    predicted_step_s: float  # the cost model's simulated step
    predicted_mfu: float
    peak_memory_bytes: int
    memory_measured: bool  # False: the estimator's peak (no allocator to read)
    profile: str
    reserved_bytes: int | None = None  # the caching allocator's reserved peak (CUDA only)
    predicted_reserved_bytes: int = 0  # the allocator model's reserved peak for the program

    def __str__(self) -> str:
        loss = f"loss {self.loss:.4f}  " if self.loss is not None else ""
        memory = f"{self.peak_memory_bytes / 2**20:.1f} MiB" + ("" if self.memory_measured else " (estimated)")
        reserved = "" if self.reserved_bytes is None else f"{self.reserved_bytes / 2**20:.1f} MiB, "
        return (f"step {self.step}  {loss}{self.tokens_per_s:,.0f} tok/s  {self.step_s:.3f} s "
                f"(predicted {self.predicted_step_s:.3f} s)  MFU {100 * self.mfu:.2f}% "
                f"(predicted {100 * self.predicted_mfu:.2f}%, {self.profile})  peak {memory}  "
                f"reserved {reserved}predicted {self.predicted_reserved_bytes / 2**20:.1f} MiB")


class StepMeter:
    """Measures the steps of ``model`` (a module ``hp.parallelize`` returned). ``hardware``: the
    cost model's profile name (default: by the mesh's device type, as dumps do: cpu, h100 for
    cuda, ascend-910b for npu). ``optimizer``: the training loop's optimizer (an instance, or a
    name ``memory_report`` takes), counted in the memory estimates; None counts none."""

    def __init__(self, model, hardware: str | None = None, optimizer=None):
        if not hasattr(model, "_hp"):
            raise TypeError(f"StepMeter needs a module returned by hp.parallelize, got {type(model).__name__}")
        from ..cost import get_profile
        from .debug import DEVICE_PROFILES

        self.model = model
        self.optimizer = optimizer
        self.profile = get_profile(hardware or DEVICE_PROFILES.get(model._hp.mesh.device_type, "h100"))
        self.steps = 0
        self._predicted: dict[int, tuple] = {}  # id(program) -> (model flops, step_s, dtype)
        self._cuda = model._hp.mesh.device_type == "cuda" and torch.cuda.is_available()
        self._started = self._now()

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        """The next step starts now (for loops that do other work between steps)."""
        self._started = self._now()

    def step(self, loss=None, *, tokens: int) -> StepMetrics:
        """Close the step that just ran: ``loss`` (a tensor or DTensor, or None) and ``tokens``,
        the tokens this rank processed in it."""
        step_s = self._now() - self._started
        self.steps += 1
        flops, predicted_s, dtype, estimate = self._prediction()
        from ..cost import mfu

        memory_measured = self._cuda
        reserved = None
        if memory_measured:
            peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        else:
            peak = estimate["peak"]
        expandable = "expandable_segments:true" in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + ","
                                                    + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
        metrics = StepMetrics(
            step=self.steps, loss=_scalar(loss), step_s=step_s, tokens=int(tokens),
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0, model_flops=flops,
            mfu=mfu(flops, step_s, self.profile, dtype) if step_s > 0 else 0.0,
            predicted_step_s=predicted_s,
            predicted_mfu=mfu(flops, predicted_s, self.profile, dtype) if predicted_s > 0 else 0.0,
            peak_memory_bytes=peak, memory_measured=memory_measured, profile=self.profile.name,
            reserved_bytes=reserved,
            predicted_reserved_bytes=estimate["reserved_expandable" if expandable else "reserved_default"],
        )
        from ..compile.signature import current_rank

        if current_rank() == 0:
            log.info("%s", metrics)
        self._started = self._now()
        return metrics

    def _prediction(self) -> tuple[float, float, torch.dtype, dict]:
        """(model FLOPs, simulated step seconds, matmul dtype, memory estimate) of the program the
        last call ran, computed once per program."""
        entry = self.model._hp.last
        if entry is None:
            raise RuntimeError("StepMeter.step: the model has not run yet; call it (forward and backward) first")
        key = id(entry.program)
        if key not in self._predicted:
            from .debug import simulate_step

            state = self.model._hp
            est = simulate_step(entry.program, state.mesh, entry.resolved.fsdp, self.profile,
                                context=entry.resolved.context)
            memory = self.model.memory_report(self.optimizer)
            self._predicted[key] = (est.model_flops, est.step_s, _matmul_dtype(entry.program), memory)
        return self._predicted[key]


def _scalar(loss) -> float | None:
    if loss is None:
        return None
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return float(loss.detach())


def _matmul_dtype(program) -> torch.dtype:
    """The dtype most of the program's matmuls compute in (what the MFU peak is for)."""
    counts = Counter(
        node.meta["val"].dtype for gm in (program.forward_gm, program.backward_gm) for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target) in _MATMULS and isinstance(node.meta.get("val"), torch.Tensor)
    )
    return counts.most_common(1)[0][0] if counts else torch.float32
