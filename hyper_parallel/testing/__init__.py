"""Test helpers for hyper_parallel (multi-process worker pools for distributed tests)."""

from hyper_parallel.testing.distributed import (
    PoolStartError,
    RemoteError,
    WorkerPool,
    close_all_pools,
    get_pool,
    run_on_ranks,
)

__all__ = [
    "WorkerPool",
    "RemoteError",
    "PoolStartError",
    "get_pool",
    "run_on_ranks",
    "close_all_pools",
]
