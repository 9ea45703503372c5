"""``get_platform()``: which device this process trains on, and the collective backend for it.

A :class:`Platform` is a small frozen description read from torch: the device type (``"cuda"``,
``"npu"``, ``"cpu"``, or another accelerator torch reports, e.g. ``"xpu"``), the collective backend
``torch.distributed`` uses for it (``"nccl"``, ``"hccl"``, ``"gloo"`` ...), how many devices are
visible and the torch version. What changes while a program runs (current device, free memory) is
asked of torch each time through its methods, never stored.

Detection goes through ``torch.accelerator`` (torch's device-generic API). ``torch_npu`` is never
imported when this module is imported: importing it without the Ascend libraries breaks torch, so
:func:`get_platform` imports it only when ``"npu"`` is asked for, or when it is installed and no
other accelerator is present (then a failed import is a warning and detection carries on).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import warnings

import torch

__all__ = ["Platform", "get_platform"]

# The backends torch_npu and torch itself register; used when torch.distributed is unavailable or
# does not know the device type (torch_npu adds "npu" to torch's map only once it is imported).
_FALLBACK_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl", "mps": "gloo"}


def import_torch_npu() -> None:
    """Import ``torch_npu`` (which registers the ``"npu"`` device with torch), with a clear error.

    Raises ImportError when it is not installed or cannot load (no Ascend libraries).
    """
    if "torch_npu" in sys.modules:
        return
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # torch_npu fails with OSError/RuntimeError without the CANN libraries
        raise ImportError(
            f"device_type 'npu' needs the torch_npu package and the Ascend (CANN) libraries, but "
            f"importing torch_npu failed ({type(exc).__name__}: {exc}); install them, or use "
            "'cpu'/'cuda'"
        ) from exc


def _backend_for(device_type: str) -> str:
    if torch.distributed.is_available():
        mapping = torch.distributed.Backend.default_device_backend_map
        if device_type in mapping:
            return str(mapping[device_type])
    return _FALLBACK_BACKENDS.get(device_type, "gloo")


def _detect_device_type() -> str:
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is not None:
        return acc.type
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
        try:
            import_torch_npu()
        except ImportError as exc:
            warnings.warn(f"{exc}; get_platform() falls back to the CPU", stacklevel=3)
            return "cpu"
        acc = torch.accelerator.current_accelerator(check_available=True)
        if acc is not None:
            return acc.type
    return "cpu"


def _cpu_memory() -> tuple[int, int] | None:
    """(available, total) host RAM in bytes: psutil if installed, else /proc/meminfo, else None."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = {k: int(fields[k].split()[0]) for k in ("MemAvailable", "MemTotal")}
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return kib["MemAvailable"] * 1024, kib["MemTotal"] * 1024


@dataclasses.dataclass(frozen=True)
class Platform:
    """The device and collective backend of this process (see :func:`get_platform`).

    Fields: ``device_type`` (``"cuda"``, ``"npu"``, ``"cpu"`` ...), ``backend`` (the
    ``torch.distributed`` backend for that device), ``device_count`` (visible devices of that
    type; 0 on CPU) and ``torch_version``. The methods ask torch each time they are called.
    """

    device_type: str
    backend: str
    device_count: int
    torch_version: str

    @property
    def is_accelerator(self) -> bool:
        """True unless this platform is the CPU."""
        return self.device_type != "cpu"

    def _module(self):
        # torch.cuda / torch.npu / torch.xpu ...: the per-device module for what torch.accelerator
        # does not cover in every version.
        return getattr(torch, self.device_type)

    def current_device(self) -> torch.device:
        """The device this process uses now (``torch.accelerator.current_device_index()``)."""
        if not self.is_accelerator:
            return torch.device("cpu")
        return torch.device(self.device_type, torch.accelerator.current_device_index())

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device of the process with this node-local rank (default: ``LOCAL_RANK``, else 0):
        ``<type>:<local_rank % device_count>``, or ``cpu``."""
        if not self.is_accelerator:
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise TypeError(f"local_rank must be a non-negative int, got {local_rank!r}")
        return torch.device(self.device_type, local_rank % max(self.device_count, 1))

    def set_device(self, local_rank: int | None = None) -> torch.device:
        """Make :meth:`device` (``local_rank``) this process's current device and return it
        (``torch.accelerator.set_device_index``; nothing to do on CPU)."""
        dev = self.device(local_rank)
        if self.is_accelerator:
            torch.accelerator.set_device_index(dev.index)
        return dev

    def memory_info(self, device: int | None = None) -> tuple[int, int] | None:
        """``(free_bytes, total_bytes)`` of an accelerator (default: the current one), through
        ``torch.accelerator.get_memory_info`` (``torch.cuda.mem_get_info`` for CUDA). On CPU the
        host's available and total RAM (psutil if installed, else ``/proc/meminfo``); None when
        neither can be read (CPU on a system without ``/proc``)."""
        if not self.is_accelerator:
            return _cpu_memory()
        if device is None:
            device = torch.accelerator.current_device_index()
        getter = getattr(torch.accelerator, "get_memory_info", None)
        if getter is None:
            getter = self._module().mem_get_info
        free, total = getter(device)
        return int(free), int(total)

    @property
    def free_memory(self) -> int | None:
        """Free bytes of the current device (host RAM on CPU); see :meth:`memory_info`."""
        info = self.memory_info()
        return None if info is None else info[0]

    @property
    def total_memory(self) -> int | None:
        """Total bytes of the current device (host RAM on CPU); see :meth:`memory_info`."""
        info = self.memory_info()
        return None if info is None else info[1]

    def synchronize(self) -> None:
        """Wait for the current device's queued work (``torch.accelerator.synchronize``); no-op on
        CPU."""
        if self.is_accelerator:
            torch.accelerator.synchronize()

    def empty_cache(self) -> None:
        """Release the caching allocator's unused blocks (``torch.accelerator.empty_cache``);
        no-op on CPU."""
        if self.is_accelerator:
            torch.accelerator.empty_cache()


def get_platform(device_type: str | None = None) -> Platform:
    """Describe this process's device and collective backend as a :class:`Platform`.

    ``device_type=None`` detects it: the accelerator ``torch.accelerator.current_accelerator()``
    reports (CUDA, or NPU once ``torch_npu`` is loaded), else NPU when ``torch_npu`` is installed
    and loads, else ``"cpu"``. Naming ``"cpu"``, ``"cuda"`` or ``"npu"`` checks that it is usable
    (``"npu"`` imports ``torch_npu`` here). Unlike the MindSpore/PyTorch platform object of the
    reference API, this one exposes no tensor operations: use torch directly.
    """
    if device_type is None:
        device_type = _detect_device_type()
    elif not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a string such as 'cuda', 'npu' or 'cpu' (or None to detect it), "
            f"got {type(device_type).__name__} {device_type!r}"
        )
    elif device_type == "npu":
        import_torch_npu()
    if device_type == "cpu":
        count = 0
    else:
        module = getattr(torch, device_type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ValueError(
                f"device_type {device_type!r} is not available in this process "
                f"(torch.{device_type}.is_available() is false or does not exist); use "
                "get_platform() to detect the device, or 'cpu'"
            )
        count = int(module.device_count())
    return Platform(device_type, _backend_for(device_type), count, str(torch.__version__))
