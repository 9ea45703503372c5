"""How a checkpoint error reaches every rank: :class:`CheckpointError` and the collective steps.

Part of :mod:`hyper_parallel.checkpoints.io`. Every check of a save or load runs in a step whose
verdicts are exchanged (all-gather / broadcast) before any rank goes on, so when one rank fails all
of them raise the same :class:`CheckpointError` instead of the others waiting in a collective.
DCP's own ``CheckpointException`` (a ``BaseException``) is re-raised as a :class:`CheckpointError`,
and reads go one file at a time so that an error names its file. Without a process group every
step runs in the one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.futures import Future


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: incomplete, corrupt, or not matching the model.

    The message names the directory (and the file or key) and says what to do. Raised on every rank.
    """


# --------------------------------------------------------------------------------------------
# Collective helpers: every rank takes part in every exchange, failed or not
# --------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _combined(errors: Mapping[int, str]) -> str:
    """One message for the errors of several ranks; ranks that failed alike are named together."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(errors.items()):
        by_text.setdefault(text, []).append(rank)
    if len(by_text) == 1 and len(errors) == _world()[1]:
        return next(iter(by_text))  # the same verdict on every rank: say it once
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                     for text, ranks in by_text.items())


def _exchange(fn: Callable[[], Any], share: bool) -> Any:
    """Run ``fn`` on this rank, then all-gather the verdicts (and with ``share`` the results): if
    it failed on any rank, every rank raises the same CheckpointError. Returns all ranks' results
    (``share``) or this rank's."""
    result, error, cause = None, None, None
    try:
        result = fn()
    except Exception as exc:  # not BaseException: a KeyboardInterrupt or kill is not a verdict
        error, cause = _error_text(exc), exc
    gathered = _all_gather((result, error) if share else (None, error))
    errors = {rank: e for rank, (_, e) in enumerate(gathered) if e is not None}
    if errors:
        raise CheckpointError(_combined(errors)) from cause
    return [r for r, _ in gathered] if share else result


def _agreed(fn: Callable[[], Any]) -> Any:
    """``fn()`` on this rank; raises on every rank if it failed on any."""
    return _exchange(fn, share=False)


def _gathered(fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on every rank, every rank's result on every rank; raises on all if any failed."""
    return _exchange(fn, share=True)


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result (or raise its error everywhere)."""
    rank, world = _world()
    box: list[Any] = [None]
    cause = None
    if rank == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:
            box[0], cause = (False, _error_text(exc)), exc
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise CheckpointError(value) from cause
    return value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: we chose that."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextlib.contextmanager
def _dcp_errors(action: str, directory: str, hint: str = "") -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a BaseException) as a CheckpointError naming the
    directory and each rank's error. DCP raises it on every rank (its steps exchange failures)."""
    try:
        yield
    except dcp.CheckpointException as exc:
        failures = {}
        for rank, (err, _) in exc.failures.items():
            text = _error_text(err)
            failures[rank] = text if len(text) <= 800 else text[:800] + " [...]"  # torch.load's run long
        raise CheckpointError(
            f"{action} of checkpoint {directory} failed in torch.distributed.checkpoint on rank(s) "
            f"{sorted(exc.failures)}: {_combined(failures)}{hint}"
        ) from None  # the CheckpointException's own text is the same per-rank errors, with tracebacks


class _Reader(dcp.FileSystemReader):
    """DCP's FileSystemReader, reading one file at a time so that an error names its file (DCP's
    own say only what failed, e.g. an unpickling error, not where)."""

    def read_data(self, plan: dcp.LoadPlan, planner: dcp.LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:  # storage_data: FileSystemReader's records of where each item lies
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise CheckpointError(f"reading {name}: {_error_text(exc)}") from exc
        done: Future = Future()
        done.set_result(None)
        return done
