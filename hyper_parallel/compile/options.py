"""``CompileOptions``: the options of ``parallelize`` that shape every compile and call of a module.

Built once by ``api.parallelize`` after validation (options.py) and the ranks' agreement, then
frozen: changing one means parallelizing again. The program-changing FSDP switches, which users
flip between steps, are a separate value (fsdp/flags.py).
"""

from __future__ import annotations

import dataclasses
import datetime

from ..passes.context import (DEFAULT_FIRST_GRADIENT_BUCKET_BYTES, DEFAULT_GRADIENT_BUCKET_BYTES, DEFAULT_PREFETCH_DEPTH,
                             DEFAULT_REDUCTIONS_IN_FLIGHT)


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    dump_dir: str | None = None  # per-rank dumps of every stage, or None
    disable_passes: frozenset[str] = frozenset()  # optional passes to skip (passes/__init__.py)
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH  # FSDP units whose all-gather is issued ahead
    reductions_in_flight: int = DEFAULT_REDUCTIONS_IN_FLIGHT  # gradient reductions of a kind in flight
    gradient_bucket_bytes: int = DEFAULT_GRADIENT_BUCKET_BYTES  # DDP-style gradient all-reduce buckets
    first_gradient_bucket_bytes: int = DEFAULT_FIRST_GRADIENT_BUCKET_BYTES  # options.gradient_bucket_sizes
    memory_budget_bytes: int | None = None  # the per-rank peak recompute="auto" must fit
    check_inputs: bool | None = None  # None: ids and labels checked on the CPU only (runtime/input_check.py)
    timeout: datetime.timedelta | None = None  # how long this module's collectives wait for peers
    recompile_limit: int = 8  # programs compiled for one module before warning (runtime/recompiles.py)
    fail_on_recompile_limit: bool = False  # past the limit: a ValueError instead of a warning
    codegen: str = "eager"  # "inductor": compute regions as Inductor kernels (hyper_parallel/codegen)
    # "auto", a ModuleList FQN (trace two of its blocks, copy the rest: compile/repeated/) or None
    repeated_blocks: str | None = "auto"
