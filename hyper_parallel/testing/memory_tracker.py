"""Measured memory of a region of eager code on any device: the oracle for the memory estimator.

``torch.cuda.max_memory_allocated`` measures an accelerator's peak; the CPU has no such counter, so
:class:`MemoryTracker` keeps one. It is a dispatch mode: every aten op that runs while it is active
(the compiled GraphModules call aten ops, collectives included, and so do autograd and the
optimizers) reports its outputs; an output storage that is not one of the op's inputs' storages is
a new allocation, counted from then until the storage is freed (a finalizer on the storage's Python
object, which torch keeps as long as the storage lives, so views and aliases keep it counted).
Storages are deduplicated, so views, ``wait_tensor``'s returned buffer and in-place results never
count twice. DTensor results count their local shards. A storage resized in place
(``UntypedStorage.resize_``, which no dispatch mode sees: PyTorch FSDP2 frees and re-allocates its
unsharded parameters so, keeping the storage objects) counts by its change in size while the
tracker is active.

Reads the tensors it is given as a baseline (what already exists: parameters, gradients, optimizer
state, the batch); writes nothing. ``peak`` is baseline + the highest tracked live bytes.

What it does not see, like the estimator: memory an op allocates and frees internally, allocator
caching, and buffers of the communication backend outside torch's allocator. Nor, unlike the
estimator, the buffers of Inductor-generated code (``codegen="inductor"``): it allocates them
directly (``empty_strided_cpu``, no dispatcher) and writes into them, so such a program reads as
holding almost nothing; measure it with :class:`AllocatorPeak` (or an accelerator's allocator
counters) instead.
"""

from __future__ import annotations

import weakref

import torch

from ..compat import pytree
from .. import compat
from ..runtime.profiled import ranges_suspended

__all__ = ["AllocatorPeak", "MemoryTracker", "measure_training_memory", "unique_storage_bytes"]


def _locals(value) -> list[torch.Tensor]:
    return [compat.plain_tensor(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def unique_storage_bytes(tensors, device: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen = {}
    for t in _locals(list(tensors)):
        if t.device.type == device:
            storage = t.untyped_storage()
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


class MemoryTracker(compat.TorchDispatchMode):
    """``with MemoryTracker(baseline_tensors) as tracker: step()``, then ``tracker.peak`` (bytes).

    Counts storages on ``device`` (a device type) created by aten ops inside the block.
    ``peak_op`` names the op whose output made the peak, ``at_peak`` the tracked bytes live then
    by the op that allocated them.
    """

    def __init__(self, baseline=(), device: str = "cpu"):
        super().__init__()
        self.device = device
        self.baseline = unique_storage_bytes(baseline, device)
        self.live = 0  # bytes of tracked storages alive now
        self.max_live = 0
        self.peak_op = ""
        self.at_peak: dict[str, int] = {}  # op name -> bytes of its outputs live at the peak
        self._tracked: dict[int, tuple[int, str]] = {}  # id(storage) -> (nbytes, op name)
        self._grown: dict[int, int] = {}  # id(storage) -> bytes an untracked storage grew by in place
        self._resize = None  # UntypedStorage.resize_ while active

    @property
    def peak(self) -> int:
        return self.baseline + self.max_live

    @property
    def current(self) -> int:
        return self.baseline + self.live

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            if storage.device.type == tracker.device:
                tracker._resized(storage, storage.nbytes() - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _resized(self, storage, delta: int) -> None:
        key = id(storage)
        if key in self._tracked:
            nbytes, op = self._tracked[key]
            self._tracked[key] = (nbytes + delta, op)
        else:
            if key not in self._grown:
                self._grown[key] = 0
                weakref.finalize(storage, self._freed_grown, key)
            self._grown[key] += delta
        self._count(delta, "UntypedStorage.resize_")

    def _count(self, delta: int, op: str) -> None:
        self.live += delta
        if self.live > self.max_live:
            self.max_live, self.peak_op = self.live, op
            self.at_peak = {}
            for size, name in self._tracked.values():
                self.at_peak[name] = self.at_peak.get(name, 0) + size
            grown = sum(self._grown.values())
            if grown:
                self.at_peak["UntypedStorage.resize_"] = grown

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in _locals((args, kwargs)) if _has_storage(t)}
        for t in _locals(out):
            if t.device.type != self.device or not _has_storage(t):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked:
                continue
            nbytes = storage.nbytes()
            self._tracked[key] = (nbytes, str(func))
            weakref.finalize(storage, self._freed, key)
            self._count(nbytes, str(func))
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._tracked.pop(key, (0, ""))[0]

    def _freed_grown(self, key: int) -> None:
        self.live -= self._grown.pop(key, 0)


class AllocatorPeak:
    """``with AllocatorPeak(baseline_tensors) as measured: step()``, then ``measured.peak`` (bytes):
    :class:`MemoryTracker`'s measure (the baseline plus the most bytes allocated inside the block and
    alive at once) taken from the allocator's own events (``torch.profiler`` with
    ``profile_memory=True``) instead of a dispatch mode. So it also sees what does not pass the
    dispatcher: the buffers of Inductor-generated code (``codegen="inductor"``, which MemoryTracker
    cannot see) and ops' internal workspaces. Memory that existed before the block and is freed in
    it does not count, as in MemoryTracker. The compiled programs run without their profiler ranges
    meanwhile (``runtime.profiled.ranges_suspended``): the programs measured are those that train.
    The profiler records every op while active: slower, so for one measured step, not for timing.

    ``backend_buffers=False`` leaves out what a process-group backend allocates inside its own ops
    (gloo's copy of a reduce-scatter's input, its all-gather scratch: allocated inside a ``c10d::``
    or ``gloo:`` op). Their frees happen when the backend's worker thread gets to them, sometimes
    after the program's next allocations, so with them a step's peak moves by up to a third from
    step to step (FSDP on gloo). Without them it moves less, not never: a collective's input the
    program made is also freed when gloo's thread lets go of it (under load about one FSDP step in 8
    peaks higher), so take the least of a few steps. Two programs with the same collectives (eager
    vs Inductor codegen) compare fairly that way."""

    def __init__(self, baseline=(), device: str = "cpu", backend_buffers: bool = True):
        self.device = device
        self.backend_buffers = backend_buffers
        self.baseline = unique_storage_bytes(baseline, device)
        self.max_live = 0
        self._profile = self._suspended = None

    @property
    def peak(self) -> int:
        return self.baseline + self.max_live

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._suspended = ranges_suspended()
        self._suspended.__enter__()
        self._profile = profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        self._suspended.__exit__(*exc)
        live, alive = 0, {}  # address -> bytes of the blocks allocated inside the block, alive
        for _, size, address, device, within in compat.allocation_events(self._profile):
            if device != self.device or (size > 0 and not self.backend_buffers and _in_backend(within)):
                continue
            if size > 0:
                alive[address] = size
                live += size
                self.max_live = max(self.max_live, live)
            elif address in alive:
                live -= alive.pop(address)
        self._profile = None
        return False


def least_step_peak(model: torch.nn.Module, batch: dict, steps: int, backend_buffers: bool = True,
                    warmup_steps: int = 2) -> int:
    """The least :class:`AllocatorPeak` of ``steps`` SGD training steps of ``model`` on ``batch``
    (``loss.backward()``, step, ``zero_grad(set_to_none=True)``), after ``warmup_steps`` unmeasured
    ones (compile, optimizer state). The least, because gloo frees some of a step's memory when its
    thread gets to it (AllocatorPeak): a step's own peak is its lowest. Comparing two codegens of a
    program, both sides take it the same way."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        model(**batch)["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup_steps):
        step()
    peaks = []
    for _ in range(steps):
        with AllocatorPeak(list(model.parameters()), backend_buffers=backend_buffers) as peak:
            step()
        peaks.append(peak.peak)
    return min(peaks)


def _in_backend(op_names) -> bool:
    """Whether an allocation happened inside a process-group backend's own op."""
    return any(name.startswith(("c10d::", "gloo:", "nccl:")) for name in op_names)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # e.g. sparse or functional wrappers
        return False
    return True


def measure_training_memory(
    model: str,
    plan,
    mesh_shape: tuple[int, ...],
    mesh_names: tuple[str, ...],
    *,
    optimizer: str = "sgd",
    steps: int = 2,
    batch: int = 8,
    seq_len: int = 128,
    model_overrides: dict | None = None,
) -> dict:
    """Run on every rank of a worker pool: train ``steps`` steps of the parallelized model and
    return the last step's measured peaks next to the estimate for its program (``steps >= 2``).

    A step is ``out = pmodel(**batch); out.loss.backward(); del out; opt.step(); opt.zero_grad()``
    (the caller holds the outputs through backward, the estimator's ``keep_outputs=True``).
    ``measured`` has the forward+backward peak, the optimizer step's peak (each with parameters,
    existing gradients, optimizer state and the batch as baseline) and their maximum;
    ``estimate`` is ``pmodel.memory_report(opt)`` after the step; ``summary_memory`` the compile
    summary's entry; ``tracked_at_peak`` what the tracker saw live at the forward+backward peak.
    """
    if steps < 2:
        raise ValueError("measure_training_memory: steps must be >= 2 (the first step compiles)")
    import contextlib
    import gc

    import hyper_parallel as hp
    from hyper_parallel.testing.parity import build_model, global_batch, local_batch

    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    pmodel = hp.parallelize(build_model(model, **(model_overrides or {})), plan, mesh)
    opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    }[optimizer](pmodel.parameters())

    def existing(batch_tensors):
        tensors = list(pmodel.parameters()) + list(pmodel.buffers()) + list(batch_tensors)
        tensors += [p.grad for p in pmodel.parameters() if p.grad is not None]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    for step in range(steps):
        inputs = local_batch(global_batch(model, batch, seq_len, seed=step + 1), mesh)
        measured = step == steps - 1  # not the first step: it compiles (and creates AdamW's state)
        gc.collect()
        with MemoryTracker(existing(inputs.values())) if measured else contextlib.nullcontext() as step_tracker:
            out = pmodel(**inputs)
            out["loss"].backward()
            del out
        with MemoryTracker(existing(inputs.values())) if measured else contextlib.nullcontext() as opt_tracker:
            opt.step()
        opt.zero_grad()
    return {
        "measured": {
            "forward_backward": step_tracker.peak,
            "optimizer_step": opt_tracker.peak,
            "peak": max(step_tracker.peak, opt_tracker.peak),
        },
        "tracked_at_peak": step_tracker.at_peak,
        "estimate": pmodel.memory_report(opt),
        "summary_memory": pmodel.compile_summary()["memory"],
    }
