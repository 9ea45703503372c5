"""The FSDP2 / HSDPModule switches that change the compiled program, as one value.

``set_requires_gradient_sync``, ``set_requires_all_reduce``, ``set_reshard_after_forward``,
``set_reshard_after_backward``, ``set_reduce_op_type`` and ``set_reduce_scatter_divide_factor``
each replace the module's :class:`FsdpFlags` (frozen: a new value per change). As in FSDP2 a switch
is set per unit: on the root with ``recurse=True`` (the default) for every unit, else for the unit
the method is called on (and, with ``recurse=True``, the units inside it).
:meth:`FsdpFlags.apply` turns the resolved FSDP plan into the variant the next program compiles
for, and :func:`program_key` is the part of the program cache key that variant contributes; each
combination is compiled once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# field -> (the method that sets it, its default). ``reshard_after_forward`` None: as the plan says.
FIELDS: dict[str, tuple[str, Any]] = {
    "gradient_sync": ("set_requires_gradient_sync", True),  # False: keep gradients unsharded and local
    "all_reduce": ("set_requires_all_reduce", True),  # HSDP: False skips the replicate-axis all-reduce
    "reshard_after_forward": ("set_reshard_after_forward", None),
    "reshard_after_backward": ("set_reshard_after_backward", True),  # False: backward keeps the gathered params
    "reduce_op": ("set_reduce_op_type", "avg"),  # "sum": gradients scaled by the data-parallel degree
    "divide_factor": ("set_reduce_scatter_divide_factor", None),  # the sum divided by this instead
}
# Switches one program applies to every unit alike: gradient accumulation is one program variant
# for the whole model (which gradients are pending, in which layout), so a unit cannot differ.
UNIFORM = ("gradient_sync", "all_reduce")


@dataclasses.dataclass(frozen=True)
class FsdpFlags:
    """Per-unit switch values: ``((field, unit FQN), value)`` pairs, sorted; a unit not listed has
    the field's default."""

    values: tuple = ()

    def set(self, field: str, value: Any, units) -> "FsdpFlags":
        """These flags with ``field`` set to ``value`` on each of ``units`` (unit module FQNs)."""
        values = dict(self.values)
        for unit in units:
            values[(field, unit)] = value
        default = FIELDS[field][1]
        return FsdpFlags(tuple(sorted(((k, v) for k, v in values.items() if v != default or k[0] != field),
                                      key=lambda kv: kv[0])))

    def restored(self, field: str, earlier: "FsdpFlags") -> "FsdpFlags":
        """These flags with ``field`` on every unit as it was in ``earlier`` (the rest as now)."""
        kept = [(k, v) for k, v in self.values if k[0] != field]
        back = [(k, v) for k, v in earlier.values if k[0] == field]
        return FsdpFlags(tuple(sorted(kept + back, key=lambda kv: kv[0])))

    def get(self, field: str, unit: str) -> Any:
        return dict(self.values).get((field, unit), FIELDS[field][1])

    def changed(self) -> list[str]:
        """The setter names of the flags that differ from their defaults on some unit."""
        fields = {field for (field, _), value in self.values if value != FIELDS[field][1]}
        return [FIELDS[f][0] for f in FIELDS if f in fields]

    def apply(self, fsdp, *, accumulated, pregathered: tuple):
        """``fsdp`` (the resolved FsdpPlan) as the next program must see it: these flags, the
        gradients pending from earlier micro-steps (``accumulated``) and the units ``unshard()``
        gathered ahead (``pregathered``). Raises ValueError when a switch that must be the same on
        every unit (``UNIFORM``) differs between units."""
        uniform = {field: self._uniform(field, fsdp) for field in UNIFORM}
        units = []
        for u in fsdp.units:
            change = {f: self.get(f, u.module_fqn) for f in ("reshard_after_backward", "reduce_op", "divide_factor")}
            reshard = self.get("reshard_after_forward", u.module_fqn)
            if reshard is not None:
                change["reshard_after_forward"] = reshard
            units.append(dataclasses.replace(u, **change))
        return dataclasses.replace(
            fsdp, units=tuple(units), accumulated=accumulated, pregathered=pregathered,
            reshard_after_backward=all(u.reshard_after_backward for u in units), **uniform,
        )

    def _uniform(self, field: str, fsdp) -> Any:
        by_value: dict = {}
        for u in fsdp.units:
            by_value.setdefault(self.get(field, u.module_fqn), []).append(u.module_fqn or "<root>")
        if len(by_value) > 1:
            setter = FIELDS[field][0]
            listed = "; ".join(f"{value} on {names}" for value, names in by_value.items())
            raise ValueError(
                f"{setter} differs between FSDP units ({listed}): here it must be the same on every unit, "
                "because gradient accumulation is one compiled program for the whole model (which "
                f"gradients are pending, in which layout). Call {setter}(value) on the root (recurse=True, "
                "the default), or set the same value on every unit before the next forward"
            )
        return next(iter(by_value)) if by_value else FIELDS[field][1]


def program_key(fsdp) -> tuple:
    """What of an applied FsdpPlan changes the compiled program (part of the cache key)."""
    if fsdp is None:
        return ()
    return (
        fsdp.gradient_layout, fsdp.accumulated, fsdp.pregathered,
        tuple((u.reshard_after_forward, u.reshard_after_backward, u.reduce_op, u.divide_factor) for u in fsdp.units),
    )
