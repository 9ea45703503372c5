"""Device-mesh helpers: creating a mesh and asking questions about its named axes.

Everything here is plain data access on a ``torch.distributed.device_mesh.DeviceMesh`` (or on a
:class:`hyper_parallel.layout.Layout`, which carries a mesh shape and axis names without any process
group, so the plan layer and its tests can run with no distributed backend). Importing this module
creates no process group and imports no vendor extension; ``torch_npu`` is imported only when an
``"npu"`` mesh is requested.

Axis-name convention (docs/architecture.md §1): ``dp_replicate, dp_shard (alias fsdp), dp, ep, cp, tp, pp``;
any axis whose name starts with ``"dp"`` or equals ``"fsdp"`` is a data-parallel axis.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

__all__ = [
    "init_device_mesh",
    "is_data_parallel_axis",
    "data_parallel_axes",
    "axis_size",
    "mesh_axis_names",
    "mesh_shape",
]


def is_data_parallel_axis(name: str) -> bool:
    """Return True if the mesh axis ``name`` is a data-parallel axis (``dp*`` or ``fsdp``)."""
    return isinstance(name, str) and (name.startswith("dp") or name == "fsdp")


def mesh_axis_names(mesh: Any) -> tuple[str, ...]:
    """Return the axis names of ``mesh`` (a ``DeviceMesh`` or a ``Layout``), in mesh order.

    Raises ValueError when the mesh has no names: the plan refers to axes by name, so an unnamed
    mesh cannot be matched against it.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError(
            f"the mesh {mesh!r} has no axis names; hyper_parallel refers to mesh axes by name. "
            "Create it with names, e.g. hp.init_device_mesh('cpu', (2, 2), "
            "mesh_dim_names=('dp', 'tp'))"
        )
    return tuple(names)


def mesh_shape(mesh: Any) -> tuple[int, ...]:
    """Return the shape of ``mesh`` (a ``DeviceMesh`` or a ``Layout``) as a tuple of ints."""
    shape = getattr(mesh, "mesh_shape", None)  # Layout
    if shape is None:
        shape = mesh.shape  # DeviceMesh
    return tuple(int(s) for s in shape)


def data_parallel_axes(mesh: Any) -> tuple[str, ...]:
    """Return the names of the data-parallel axes of ``mesh``, in mesh order."""
    return tuple(name for name in mesh_axis_names(mesh) if is_data_parallel_axis(name))


def axis_size(mesh: Any, name: str) -> int:
    """Return the number of ranks along the mesh axis ``name``.

    Raises ValueError naming the available axes if ``name`` is not an axis of ``mesh``.
    """
    names = mesh_axis_names(mesh)
    if name not in names:
        raise ValueError(
            f"mesh axis {name!r} does not exist; the mesh has axes {list(names)} "
            f"with sizes {list(mesh_shape(mesh))}"
        )
    return mesh_shape(mesh)[names.index(name)]


def _check_world(shape: tuple[int, ...], world_size: int) -> None:
    num_ranks = math.prod(shape)
    if num_ranks != world_size:
        raise ValueError(
            f"mesh {shape} has {num_ranks} ranks but the world size is {world_size}: "
            f"choose a mesh_shape whose product is {world_size}, or launch {num_ranks} processes "
            f"(torchrun --nproc-per-node {num_ranks} ...)"
        )


def _check_launch(device_type: str, shape: tuple[int, ...]) -> None:
    """Before torch creates the default process group from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): a script started with plain ``python``
    would fail inside torch ("environment variable RANK expected"), a mesh that is not the
    launched world only after the group exists. Both get the command that fixes them."""
    num_ranks = math.prod(shape)
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    launch = f"torchrun --nproc-per-node {num_ranks} {script}"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"hp.init_device_mesh({device_type!r}, {shape}) starts one process per rank, but this "
            "process was not started by a launcher (RANK and WORLD_SIZE are not set: run with plain "
            f"python?). Launch it as `{launch}`, or call torch.distributed.init_process_group "
            "yourself before creating the mesh"
        )
    try:
        world_size = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; launch with `{launch}`") from None
    _check_world(shape, world_size)


def _validate_mesh_args(
    mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None
) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """Normalise and check the shape and names given to init_device_mesh / Layout."""
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    try:
        shape = tuple(mesh_shape)
    except TypeError:
        raise TypeError(
            f"mesh_shape must be a tuple of positive ints such as (2, 4), got {mesh_shape!r}"
        ) from None
    if not shape or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape
    ):
        raise ValueError(
            f"mesh_shape must be a non-empty tuple of positive ints such as (2, 4), got {mesh_shape!r}"
        )
    if mesh_dim_names is None:
        return shape, None
    if isinstance(mesh_dim_names, str):
        mesh_dim_names = (mesh_dim_names,)
    names = tuple(mesh_dim_names)
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"mesh_dim_names must be non-empty strings, got {names!r}")
    if len(names) != len(shape):
        raise ValueError(
            f"mesh_dim_names {names} has {len(names)} names but mesh_shape {shape} has "
            f"{len(shape)} axes: give exactly one name per mesh axis"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"mesh_dim_names {names} repeats {duplicates}: every mesh axis needs a unique name"
        )
    return shape, names


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
):
    """Create a ``torch.distributed.device_mesh.DeviceMesh`` after checking the arguments.

    A thin wrapper over ``torch.distributed.device_mesh.init_device_mesh`` that fails early with a
    clear message when the names do not fit the shape or the mesh does not cover the world.
    ``device_type`` is ``"cpu"``, ``"cuda"`` or ``"npu"`` (``torch_npu`` is imported here, lazily).
    """
    shape, names = _validate_mesh_args(mesh_shape, mesh_dim_names)
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ImportError as exc:
            raise ImportError(
                "device_type 'npu' needs the torch_npu package; install it or use 'cpu'/'cuda'"
            ) from exc
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _check_world(shape, dist.get_world_size())
    else:
        _check_launch(device_type, shape)
    from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

    from .. import compat

    # A new mesh must not inherit sharding decisions cached for an older one (see compat).
    compat.clear_sharding_caches()
    return _torch_init_device_mesh(device_type, shape, mesh_dim_names=names)
