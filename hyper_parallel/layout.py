"""Tensor layouts: how one tensor is laid out over a named device mesh.

Two ways to write a layout, both converted to torch's own placement types (one placement per mesh
axis, in mesh order; ``S(d)`` / ``R`` / ``P(op)``):

* the seed form, per tensor dim: ``Layout((2, 4), ("dp", "tp"))("dp", "None")`` gives a
  :class:`TensorLayout` whose dim 0 is sharded over ``dp`` and dim 1 is not sharded; a tuple entry
  such as ``("dp", "tp")`` shards one dim over several axes, outer axis first;
* the DTensor form, per mesh axis: ``(Shard(0), Replicate())``.

:func:`to_placements` accepts everything a user may write for a parameter or activation layout
(including the YAML form ``["tp", None]``) and returns the per-axis tuple. Pure data: no process
group is touched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from hyper_parallel import compat

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "Layout",
    "TensorLayout",
    "format_placements",
    "parse_placement",
    "normalize_placements",
    "to_placements",
]

#: Reduce ops a Partial placement may carry (those DTensor's Partial knows how to reduce).
PARTIAL_REDUCE_OPS = ("sum", "avg", "max", "min")

_NONE_STRINGS = ("None", "none", "")


def format_placements(placements: Iterable[Placement | None]) -> str:
    """Return the short text of a placement sequence, e.g. ``[S(0), R]`` (``None`` prints as ``-``)."""
    return "[" + ", ".join("-" if p is None else str(p) for p in placements) + "]"


_PLACEMENT_RE = re.compile(
    r"^\s*(?P<kind>S|Shard|R|Replicate|P|Partial)\s*(?:\(\s*(?P<arg>[^)]*?)\s*\))?\s*$"
)


def parse_placement(spec: Placement | str) -> Placement:
    """Return a Placement from a Placement or its text (``"S(0)"``, ``"Shard(-1)"``, ``"R"``, ``"P(avg)"``).

    The text form lets YAML/JSON plans spell style arguments such as ``output_layouts: "S(1)"``.
    """
    if isinstance(spec, Placement):
        return spec
    if isinstance(spec, str):
        match = _PLACEMENT_RE.match(spec)
        if match:
            kind, arg = match.group("kind"), match.group("arg")
            if kind in ("S", "Shard") and arg is not None:
                arg = arg.removeprefix("dim=")
                if re.fullmatch(r"-?\d+", arg):
                    return Shard(int(arg))
            elif kind in ("R", "Replicate") and not arg:
                return Replicate()
            elif kind in ("P", "Partial"):
                op = (arg or "sum").removeprefix("reduce_op=").strip("'\"")
                if op in PARTIAL_REDUCE_OPS:
                    return Partial(op)
    raise ValueError(
        f"cannot read {spec!r} as a placement; write one of 'S(<dim>)', 'R', "
        f"'P(<op>)' with op in {list(PARTIAL_REDUCE_OPS)}, or pass a "
        "torch.distributed.tensor Shard/Replicate/Partial object"
    )


def normalize_placements(
    placements: Sequence[Placement], ndim: int, what: str = "tensor"
) -> tuple[Placement, ...]:
    """Return ``placements`` with negative ``Shard`` dims made non-negative for an ``ndim``-dim tensor.

    Raises ValueError (naming ``what``) if a Shard dim is out of range.
    """
    result = []
    for placement in placements:
        if isinstance(placement, (Shard, compat.StridedShard)):  # (a strided shard is no Shard subclass)
            dim = placement.dim + ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < ndim:
                raise ValueError(
                    f"{what}: placement {placement} in {format_placements(placements)} shards "
                    f"dim {placement.dim} but the tensor has {ndim} dims"
                )
            if dim != placement.dim:
                placement = with_shard_dim(placement, dim)
        result.append(placement)
    return tuple(result)


def split_per_part(placements: Sequence[Placement]) -> list[int]:
    """The mesh axes whose placement splits each of a dim's parts (``ColwiseParallel(parts=n)``'s
    ``_StridedShard``): a strided shard no plain ``Shard`` of the same dim nests (FSDP's strided
    shard inside tp's ``Shard`` is one box of the dim, not parts)."""
    return [i for i, p in enumerate(placements)
            if isinstance(p, compat.StridedShard)
            and not any(type(q) is Shard and q.dim == p.dim for q in placements)]


def with_shard_dim(placement, dim: int):
    """``placement`` sharding ``dim`` instead: a strided shard keeps its split factor."""
    if isinstance(placement, compat.StridedShard):
        return compat.StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


def _normalize_dim_entry(entry: Any, where: str) -> tuple[str, ...] | None:
    """One tensor-map entry ("dp", "None", None, ("dp", "tp"), ["dp"]) -> None or a tuple of axes."""
    if entry is None or (isinstance(entry, str) and entry in _NONE_STRINGS):
        return None
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and entry and all(
        isinstance(a, str) and a not in _NONE_STRINGS for a in entry
    ):
        return tuple(entry)
    raise TypeError(
        f"{where}: a tensor dim must be an axis name, 'None'/None, or a non-empty tuple of axis "
        f"names (outer axis first); got {entry!r}"
    )


def _format_tensor_map(tensor_map: Sequence[tuple[str, ...] | None]) -> str:
    parts = []
    for axes in tensor_map:
        if axes is None:
            parts.append("None")
        elif len(axes) == 1:
            parts.append(axes[0])
        else:
            parts.append("(" + ", ".join(axes) + ")")
    return ", ".join(parts)


def _check_tensor_map(
    tensor_map: Sequence[tuple[str, ...] | None],
    partial: dict[str, str],
    mesh_dim_names: Sequence[str],
    where: str,
) -> None:
    """Validate a per-dim layout against the mesh axis names; ``where`` names it in errors."""
    names = tuple(mesh_dim_names)
    used: dict[str, int] = {}
    for dim, axes in enumerate(tensor_map):
        if axes is None:
            continue
        for axis in axes:
            if axis not in names:
                raise ValueError(
                    f"{where}: mesh axis {axis!r} (tensor dim {dim}) does not exist; "
                    f"available axes are {list(names)}"
                )
            if axis in used:
                raise ValueError(
                    f"{where}: mesh axis {axis!r} is used twice (tensor dims {used[axis]} and "
                    f"{dim}); an axis can shard at most one tensor dim"
                )
            used[axis] = dim
        order = [names.index(a) for a in axes]
        if order != sorted(order):
            fixed = tuple(sorted(axes, key=names.index))
            raise ValueError(
                f"{where}: tensor dim {dim} is sharded over {axes}, which is not mesh order "
                f"{names}; sharding a dim inner-axis-first needs a strided shard, which is not "
                f"supported. Reorder the axes outer first: {fixed}"
            )
    for axis, op in partial.items():
        if axis not in names:
            raise ValueError(
                f"{where}: partial mesh axis {axis!r} does not exist; available axes are {list(names)}"
            )
        if axis in used:
            raise ValueError(
                f"{where}: mesh axis {axis!r} both shards tensor dim {used[axis]} and is partial; "
                "a tensor is either sharded or partial along one axis"
            )
        if op not in PARTIAL_REDUCE_OPS:
            raise ValueError(
                f"{where}: partial reduce op {op!r} on axis {axis!r} is not one of "
                f"{list(PARTIAL_REDUCE_OPS)}"
            )


def _tensor_map_to_placements(
    tensor_map: Sequence[tuple[str, ...] | None],
    partial: dict[str, str],
    mesh_dim_names: Sequence[str],
    ndim: int | None,
    where: str,
) -> tuple[Placement, ...]:
    """Per-dim layout (already checked) -> one placement per mesh axis."""
    names = tuple(mesh_dim_names)
    if ndim is not None and len(tensor_map) > ndim:
        raise ValueError(
            f"{where}: the layout names {len(tensor_map)} tensor dims but the tensor has {ndim} "
            f"dims; give at most {ndim} entries"
        )
    result: list[Placement] = [Replicate()] * len(names)
    for dim, axes in enumerate(tensor_map):
        for axis in axes or ():
            result[names.index(axis)] = Shard(dim)
    for axis, op in partial.items():
        result[names.index(axis)] = Partial(op)
    return tuple(result)


@dataclass(frozen=True)
class TensorLayout:
    """The layout of one tensor over a named mesh, per tensor dim (seed ``Layout(...)(...)`` result).

    ``tensor_map[d]`` is ``None`` (dim ``d`` not sharded) or the tuple of mesh axes sharding dim
    ``d``, outer axis first. ``partial`` maps mesh axes on which the tensor holds partial values to
    their reduce op. Dims beyond ``len(tensor_map)`` are not sharded. Validated on construction.
    """

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    tensor_map: tuple[tuple[str, ...] | None, ...]
    # Left out of the hash (a dict is unhashable); equality still compares it.
    partial: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
        object.__setattr__(self, "mesh_dim_names", tuple(self.mesh_dim_names))
        where = f"layout {tuple(self.tensor_map)!r} on mesh {self.mesh_dim_names}"
        tensor_map = tuple(_normalize_dim_entry(e, where) for e in self.tensor_map)
        object.__setattr__(self, "tensor_map", tensor_map)
        object.__setattr__(self, "partial", dict(self.partial))
        if len(self.mesh_shape) != len(self.mesh_dim_names):
            raise ValueError(
                f"{where}: mesh_shape {self.mesh_shape} and mesh_dim_names {self.mesh_dim_names} "
                "differ in length"
            )
        _check_tensor_map(self.tensor_map, self.partial, self.mesh_dim_names, repr(self))

    def placements(self, ndim: int | None = None) -> tuple[Placement, ...]:
        """Return one placement per mesh axis (mesh order): ``Shard(d)``, ``Partial(op)`` or ``Replicate()``.

        If ``ndim`` is given, a layout naming more than ``ndim`` tensor dims raises ValueError.
        """
        return _tensor_map_to_placements(
            self.tensor_map, self.partial, self.mesh_dim_names, ndim, repr(self)
        )

    def with_partial(self, axis: str, op: str = "sum") -> "TensorLayout":
        """Return a copy of this layout that is also partial (reduce op ``op``) along mesh axis ``axis``."""
        return replace(self, partial={**self.partial, axis: op})

    @property
    def ndim(self) -> int:
        """Number of tensor dims this layout names (trailing dims are unsharded)."""
        return len(self.tensor_map)

    def __repr__(self) -> str:
        text = "Layout[" + _format_tensor_map(self.tensor_map)
        if self.partial:
            text += "; " + ", ".join(f"{Partial(op)}@{axis}" for axis, op in self.partial.items())
        return text + "]"


@dataclass(frozen=True)
class Layout:
    """A named mesh description used to build tensor layouts (seed API).

    ``Layout((2, 4), ("dp", "tp"))`` describes a 2x4 mesh; calling it with one entry per tensor dim
    (``"dp"``, ``"None"``/None, or a tuple of axes such as ``("dp", "tp")``) returns a
    :class:`TensorLayout`; ``layout()`` is fully replicated. ``rank_list`` optionally lists the
    global ranks of the mesh in row-major order. It carries no process group, so it also serves as a
    mesh stand-in for the pure-data plan layer (``mesh_shape`` / ``mesh_dim_names``).
    """

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    rank_list: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        from hyper_parallel.distributed.mesh import _validate_mesh_args

        shape, names = _validate_mesh_args(self.mesh_shape, self.mesh_dim_names)
        if names is None:
            raise ValueError("Layout needs mesh_dim_names, one name per mesh axis")
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "mesh_dim_names", names)
        if self.rank_list is not None:
            ranks = tuple(int(r) for r in self.rank_list)
            if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks):
                raise ValueError(
                    f"rank_list {ranks} must list {math.prod(shape)} distinct ranks for mesh {shape}"
                )
            object.__setattr__(self, "rank_list", ranks)

    def __call__(self, *tensor_map: Any) -> TensorLayout:
        """Return the :class:`TensorLayout` with one entry per tensor dim (see the class doc)."""
        return TensorLayout(self.mesh_shape, self.mesh_dim_names, tuple(tensor_map))

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.mesh_shape)

    def axis_size(self, name: str) -> int:
        """Number of ranks along mesh axis ``name`` (ValueError naming the axes if unknown)."""
        from hyper_parallel.distributed.mesh import axis_size

        return axis_size(self, name)

    def __repr__(self) -> str:
        return f"Layout({self.mesh_shape}, {self.mesh_dim_names})"


def _is_axis_entry(entry: Any) -> bool:
    """True for what may stand for one tensor dim in the per-dim (YAML) form."""
    if entry is None or isinstance(entry, str):
        return True
    return (
        isinstance(entry, (tuple, list))
        and len(entry) > 0
        and all(isinstance(a, str) for a in entry)
    )


def to_placements(
    spec: Any,
    mesh_dim_names: Sequence[str],
    ndim: int | None = None,
    *,
    axis: str | None = None,
    mesh_shape: Sequence[int] | None = None,
    where: str = "layout",
) -> tuple[Placement, ...]:
    """Normalise a user-written layout into one placement per mesh axis (mesh order).

    Accepts a :class:`TensorLayout`; a single Placement (put on ``axis``, Replicate elsewhere; on a
    1-D mesh ``axis`` may be omitted); a tuple/list of Placements, one per mesh axis; a dict
    ``{axis: Placement}`` (axes not named are Replicate); or a tuple/list with one entry per tensor
    dim of axis names / None (the YAML form ``["tp", None]``; an empty one is fully replicated).
    Placement texts such as ``"S(0)"`` are accepted wherever a Placement is. ``ndim`` (the tensor's
    rank) turns on a rank check and makes negative Shard dims non-negative. ``mesh_shape``, when
    given, must match a TensorLayout's. ``where`` prefixes error messages (e.g. the plan key).
    """
    names = tuple(mesh_dim_names)

    def finish(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        if ndim is None:
            return placements
        return normalize_placements(placements, ndim, where)

    if isinstance(spec, TensorLayout):
        if spec.mesh_dim_names != names or (
            mesh_shape is not None and spec.mesh_shape != tuple(mesh_shape)
        ):
            shape_text = "" if mesh_shape is None else f" of shape {tuple(mesh_shape)}"
            raise ValueError(
                f"{where}: {spec!r} was built for mesh {spec.mesh_dim_names} of shape "
                f"{spec.mesh_shape} but the mesh is {names}{shape_text}; build it with "
                f"Layout(<mesh shape>, {names})"
            )
        return finish(spec.placements(ndim))
    if isinstance(spec, Placement):
        if axis is None:
            if len(names) != 1:
                raise ValueError(
                    f"{where}: a single placement {spec} is ambiguous on mesh {names}; give one "
                    "placement per mesh axis, e.g. "
                    f"{format_placements([spec] + [Replicate()] * (len(names) - 1))}, or a layout"
                )
            axis = names[0]
        if axis not in names:
            raise ValueError(
                f"{where}: mesh axis {axis!r} does not exist; available axes are {list(names)}"
            )
        return finish(tuple(spec if a == axis else Replicate() for a in names))
    if isinstance(spec, dict):
        unknown = [a for a in spec if a not in names]
        if unknown:
            raise ValueError(
                f"{where}: mesh axis {unknown[0]!r} in {spec!r} does not exist; available axes "
                f"are {list(names)}"
            )
        by_axis = {a: parse_placement(p) for a, p in spec.items()}
        return finish(tuple(by_axis.get(a, Replicate()) for a in names))
    if isinstance(spec, (tuple, list)):
        entries = list(spec)
        if entries and all(isinstance(e, Placement) for e in entries):
            if len(entries) != len(names):
                raise ValueError(
                    f"{where}: {format_placements(entries)} has {len(entries)} placements but the "
                    f"mesh {names} has {len(names)} axes; give one placement per mesh axis"
                )
            return finish(tuple(entries))
        if (
            entries
            and all(isinstance(e, str) and e not in names for e in entries)
            and all(_PLACEMENT_RE.match(e) for e in entries)
        ):
            # Placement texts, one per mesh axis (e.g. ["S(0)", "R"] from YAML).
            return to_placements(
                tuple(parse_placement(e) for e in entries), names, ndim, where=where
            )
        if all(_is_axis_entry(e) for e in entries):
            tensor_map = tuple(_normalize_dim_entry(e, where) for e in entries)
            layout_text = f"{where} Layout[{_format_tensor_map(tensor_map)}]"
            _check_tensor_map(tensor_map, {}, names, layout_text)
            return finish(_tensor_map_to_placements(tensor_map, {}, names, ndim, layout_text))
        raise TypeError(
            f"{where}: cannot read {spec!r} as a layout: a list must hold either one Placement per "
            "mesh axis or one axis-name-or-None per tensor dim, not a mix"
        )
    if isinstance(spec, str):
        try:
            return to_placements(
                parse_placement(spec), names, ndim, axis=axis, mesh_shape=mesh_shape, where=where
            )
        except ValueError:
            pass
        raise TypeError(
            f"{where}: cannot read the string {spec!r} as a layout; for a tensor whose dim 0 is "
            f"sharded on an axis write a list per tensor dim such as [{spec!r}, None], or a "
            "placement such as 'S(0)'"
        )
    raise TypeError(
        f"{where}: cannot read {spec!r} (type {type(spec).__name__}) as a layout; use a "
        "TensorLayout (Layout(...)(...)), Placements (one per mesh axis), or a list of axis "
        "names / None per tensor dim"
    )


def dims_by_stride(stride, shape) -> list[int]:
    """The dims of more than one element, outermost in memory first (a tensor's memory order)."""
    return [d for d in sorted(range(len(shape)), key=lambda d: (-stride[d], d)) if shape[d] > 1]
