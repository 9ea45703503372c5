"""Inductor kernels for the compute regions of a per-rank program (``codegen="inductor"``).

Each region (codegen/regions.py) becomes an :class:`InductorRegion` module in the program: on its
first call it compiles its region graph with Inductor for the argument shapes, strides and dtypes
it is called with (exactly those of this program, which the runtime specialised already) and runs
the generated kernels from then on. The collectives, waits, releases, swaps and profiler ranges
around it stay where the passes put them.

Compiling lazily, with the real arguments, rather than from the graph's metadata: the strides
Inductor assumes are those the values really have (a user input may be non-contiguous), and a
program that never runs (a phase a pipeline schedule skips) costs nothing.

Compile cost is bounded by a process-wide cache keyed on the region's code (inputs and nodes renamed
canonically, so the same layer's forward in layers 0 and 31 is the same text) and its arguments'
metadata: a model of N identical blocks compiles each distinct region once, not N times
(:func:`cache_stats`). Inductor's own on-disk cache then serves later processes, and the ranks on a
host: every rank compiles the same regions at the same moment (the programs are SPMD), so each
region compile holds a file lock beside that cache; the first rank compiles, the others find its
result on disk (a cache hit costs a fraction of a compile) instead of all compiling the same
kernels on the host's cores at once.

Numerics: Inductor fuses and vectorises reductions (a different summation order than eager
kernels), so results match eager within float rounding, not bit for bit (docs/codegen.md states the
tolerances the tests use). Random ops never enter a region (regions.py), so dropout draws the same
numbers as eager.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import filelock

import torch

from .. import compat


@dataclasses.dataclass
class CacheStats:
    compiled: int = 0  # regions Inductor compiled in this process
    reused: int = 0  # regions served from the in-process cache (a repeated block)


_CACHE: dict[tuple, object] = {}
_STATS = CacheStats()


def cache_stats() -> CacheStats:
    """This process's Inductor region compiles so far (a copy)."""
    return dataclasses.replace(_STATS)


def clear_cache() -> None:
    """Forget this process's compiled regions (benchmarks timing a cold compile per model; the
    on-disk cache is Inductor's, under ``TORCHINDUCTOR_CACHE_DIR``)."""
    _CACHE.clear()


_TOOLCHAIN_ERRORS = ("CppCompileError", "CUDACompileError", "CalledProcessError")


def _toolchain_problem(exc: BaseException) -> bool:
    """Whether an Inductor failure comes from the toolchain it drives (no C++ compiler, a compile
    that failed, Triton missing) rather than from the region itself: judged along the exception's
    causes (Inductor wraps the original as ``inner_exception``)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (OSError, ImportError)) or type(e).__name__ in _TOOLCHAIN_ERRORS or "triton" in str(e).lower():
            return True
        todo.extend([getattr(e, "inner_exception", None), e.__cause__, e.__context__])
    return False


def _arg_key(args) -> tuple:
    return tuple(
        (tuple(a.shape), a.stride(), a.dtype, a.device, a.storage_offset()) if isinstance(a, torch.Tensor) else repr(a)
        for a in args
    )


def _host_lock(cache_key: tuple) -> filelock.FileLock:
    """A lock shared by the processes of this host compiling the same region (module docstring)."""
    folder = os.path.join(compat.inductor_cache_dir(), "hyper_parallel_locks")
    os.makedirs(folder, exist_ok=True)
    digest = hashlib.sha256(repr(cache_key).encode()).hexdigest()[:24]
    return filelock.FileLock(os.path.join(folder, digest + ".lock"))


class InductorRegion(torch.nn.Module):
    """One compute region of a program, run as Inductor-generated kernels (module docstring).

    ``label``: where it is (``backward.region3``), for dumps and errors; ``on_compile(label,
    region_gm, compiled, seconds, reused)``: told of each compile (the dumps and progress log)."""

    def __init__(self, region_gm: torch.fx.GraphModule, label: str, on_compile=None):
        super().__init__()
        self.region_gm = region_gm
        self.label = label
        self.code = region_gm.code
        self.on_compile = on_compile
        self._compiled: dict[tuple, object] = {}
        self._last: tuple | None = None  # (key, compiled) of the last call: the usual case

    def forward(self, args: list):
        """``args``: the region's inputs in a list (``regions.outline``), emptied by the compiled
        kernels' boxed call so each input can be freed after its last use."""
        key = _arg_key(args)
        last = self._last
        if last is not None and last[0] == key:
            compiled = last[1]
        else:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(key, args)
            self._last = (key, compiled)
        return compiled(args)

    def _compile(self, key: tuple, args) -> object:
        cache_key = (self.code, key)
        compiled = _CACHE.get(cache_key)
        reused = compiled is not None
        started = time.perf_counter()
        if compiled is None:
            try:
                with _host_lock(cache_key):
                    compiled = compat.inductor_compile(self.region_gm, list(args))
            except Exception as exc:  # noqa: BLE001 - any Inductor failure: name the region and the way out
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                why = ("Inductor needs a C++ compiler on CPU and Triton on GPU" if _toolchain_problem(exc) else
                       "this region is one Inductor does not handle: a bug of hyper_parallel's regions or of "
                       "Inductor, please report it with the graph below")
                raise RuntimeError(
                    f"codegen='inductor': Inductor could not compile {self.label} ({type(exc).__name__}: "
                    f"{first_line}). {why}; parallelize(..., codegen='eager') runs the same program op by op. "
                    "The region's graph:\n" + self.region_gm.code.strip()
                ) from exc
            _CACHE[cache_key] = compiled
            _STATS.compiled += 1
        else:
            _STATS.reused += 1
        seconds = time.perf_counter() - started
        self._compiled[key] = compiled
        if self.on_compile is not None:
            self.on_compile(self.label, self.region_gm, compiled, seconds, reused)
        return compiled
