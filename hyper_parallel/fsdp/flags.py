"""The FSDP2 / HSDPModule switches that change the compiled program, as one value.

``set_requires_gradient_sync``, ``set_requires_all_reduce``, ``set_reshard_after_forward``,
``set_reshard_after_backward`` and ``set_reduce_op_type`` each replace the module's
:class:`FsdpFlags` (frozen: a new value per change). :meth:`FsdpFlags.apply` turns the resolved
FSDP plan into the variant the next program compiles for, and :func:`program_key` is the part of
the program cache key that variant contributes; each combination is compiled once.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FsdpFlags:
    gradient_sync: bool = True  # False: keep gradients unsharded and local (micro-steps)
    all_reduce: bool = True  # HSDP: False skips the replicate-axis all-reduce
    reshard_after_forward: bool | None = None  # None: as each unit's plan says
    reshard_after_backward: bool = True  # False: backward keeps the gathered parameters
    reduce_op: str = "avg"  # "sum": gradients scaled by the data-parallel degree

    # (method that sets it, field): what an error names when a flag is not supported.
    SETTERS = (
        ("set_requires_gradient_sync", "gradient_sync"), ("set_requires_all_reduce", "all_reduce"),
        ("set_reshard_after_forward", "reshard_after_forward"),
        ("set_reshard_after_backward", "reshard_after_backward"), ("set_reduce_op_type", "reduce_op"),
    )

    def changed(self) -> list[str]:
        """The setter names of the flags that differ from their defaults."""
        default = FsdpFlags()
        return [setter for setter, field in self.SETTERS if getattr(self, field) != getattr(default, field)]

    def apply(self, fsdp, *, accumulated, pregathered: tuple):
        """``fsdp`` (the resolved FsdpPlan) as the next program must see it: these flags, the
        gradients pending from earlier micro-steps (``accumulated``) and the units ``unshard()``
        gathered ahead (``pregathered``)."""
        units = fsdp.units
        if self.reshard_after_forward is not None:
            units = tuple(dataclasses.replace(u, reshard_after_forward=self.reshard_after_forward) for u in units)
        return dataclasses.replace(
            fsdp, units=units, gradient_sync=self.gradient_sync, all_reduce=self.all_reduce,
            accumulated=accumulated, reduce_op=self.reduce_op, pregathered=pregathered,
            reshard_after_backward=self.reshard_after_backward,
        )


def program_key(fsdp) -> tuple:
    """What of an applied FsdpPlan changes the compiled program (part of the cache key)."""
    if fsdp is None:
        return ()
    return (
        fsdp.gradient_layout, fsdp.accumulated, fsdp.reduce_op, fsdp.pregathered, fsdp.reshard_after_backward,
        tuple(u.reshard_after_forward for u in fsdp.units),
    )
