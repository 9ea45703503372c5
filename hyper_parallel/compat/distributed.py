"""torch.distributed: device meshes, process groups and functional collectives.

Private names: ``DeviceMesh``'s ``_flatten`` / ``_unflatten`` / ``_get_root_mesh`` /
``_flatten_mapping`` (the meshes ParallelDims, FSDP and context parallelism make from one root,
with their process groups), the current mesh of ``torch.distributed.device_mesh._mesh_resources``,
the flattened mesh DTensor's redistribution looks up for a collective over several axes,
``distributed_c10d``'s process-group registry and timeouts, ``_functional_collectives``'
``AsyncCollectiveTensor``, the work registry of unwaited collectives, torch's ``fake`` store
(``torch.testing._internal``), and c10's fatal-signal stack printer for worker processes.
"""

from __future__ import annotations

import torch

__all__ = [
    "unflatten_mesh_axis",
    "wait_collective",
    "flatten_mesh",
    "mesh_root_dim_names",
    "flattened_mesh_over",
    "flattened_meshes",
    "current_mesh",
    "resolve_process_group",
    "fake_store",
    "set_group_timeout",
    "print_native_stacks_on_fatal_signal",
    "unwaited_collectives",
    "reduce_scatter_single",
    "all_gather_single",
]


def unflatten_mesh_axis(mesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``mesh`` with ``axis`` split row-major into axes ``names`` of ``sizes`` (``DeviceMesh._unflatten``),
    creating the new axes' process groups. Collective: every rank of the mesh calls it."""
    return mesh._unflatten(axis, tuple(sizes), tuple(names))


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind an async functional-collective result (waits for it); other tensors
    are returned as they are. DTensor's ``redistribute(async_op=True)`` gives such results."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def reduce_scatter_single(tensor: torch.Tensor, reduce_op: str, group) -> torch.Tensor:
    """The functional reduce-scatter on dim 0 that DTensor's lowering calls (``group`` is a
    ``(mesh, axis)`` pair); traced, it is ``reduce_scatter_tensor`` then ``wait_tensor``."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.reduce_scatter_single(tensor, reduce_op, scatter_dim=0, group=group)


def all_gather_single(tensor: torch.Tensor, group) -> torch.Tensor:
    """The functional all-gather on dim 0 that DTensor's lowering calls (``group`` is a
    ``(mesh, axis)`` pair); traced, it is ``all_gather_into_tensor`` then ``wait_tensor``."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_single(tensor, gather_dim=0, group=group)


def flatten_mesh(mesh, axes: tuple[str, ...], name: str):
    """The axes ``axes`` of ``mesh`` joined into one 1-D axis called ``name`` (``DeviceMesh._flatten``),
    registered on the root mesh and creating its process group. Collective: every rank calls it."""
    return mesh[tuple(axes)]._flatten(name)


def mesh_root_dim_names(mesh) -> tuple[str, ...]:
    """The axis names of the mesh ``mesh`` was sliced from (itself when it is a root)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return tuple(root.mesh_dim_names or ())


def flattened_mesh_over(mesh, axes: tuple[str, ...]):
    """The mesh already flattened from ``mesh``'s root over exactly the ranks of ``mesh``'s axes
    ``axes`` (in mesh order), or None: the one DTensor's redistribution would find and use to run a
    collective over those axes as one (it compares layouts, so an alias of another name counts)."""
    from torch.distributed.tensor._redistribute import _get_flattened_mesh_by_layout_impl

    names = mesh.mesh_dim_names
    return _get_flattened_mesh_by_layout_impl(mesh, tuple(names.index(a) for a in axes))


def flattened_meshes(mesh) -> dict[str, "torch.distributed.device_mesh.DeviceMesh"]:
    """``{alias: 1-D mesh}`` for every mesh ``DeviceMesh._flatten`` made from ``mesh``'s root
    (``flatten_mesh`` above; ParallelDims' ``dp`` / ``fsdp`` / ``loss``). Empty on a torch that
    keeps no such record."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return dict(getattr(root, "_flatten_mapping", {}))


def current_mesh():
    """The mesh of the innermost ``with mesh:`` block (torch's current mesh), or None."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh() if _mesh_resources.mesh_stack else None


def resolve_process_group(name: str):
    """The ProcessGroup registered under ``name`` (a functional collective's group argument), or
    None when there is none."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:  # unknown name, or a torch without the registry
        return None


def fake_store():
    """A store for torch's ``fake`` process-group backend (one process plays a rank of a large
    world; collectives are not executed)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def set_group_timeout(group, timeout) -> None:
    """Set how long collectives of an existing process group wait (gloo and NCCL)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def print_native_stacks_on_fatal_signal() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE, print every thread's C++ stack to stderr
    (c10's fatal-signal handler) before the handlers installed earlier (faulthandler's Python
    stacks) run. For worker processes, where a native crash (a gloo worker thread, glibc's heap
    checks) otherwise leaves only the Python stack of the thread that was waiting."""
    set_print = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if set_print is not None:
        set_print(True)


def unwaited_collectives() -> int:
    """How many functional collectives this process has issued and not waited for (torch's work
    registry: a collective stays there until its ``wait_tensor``, even once its output is freed)."""
    from torch._C._distributed_c10d import _get_work_registry_size

    return _get_work_registry_size()
