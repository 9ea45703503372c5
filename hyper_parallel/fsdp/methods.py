"""The FSDP2 / HSDPModule methods of a parallelized module (``ParallelModule`` inherits them).

Most of them change what the next program does, so they set flags on the module's state that
``runtime.module.ParallelState.resolved_for_flags`` turns into a program variant (compiled once per combination):
gradient sync and the HSDP all-reduce (accumulation in the graph, propagation/accumulation.py),
reshard after forward / backward, the reduce op, and which units ``unshard()`` gathered ahead
(fsdp/unshard.py).
"""

from __future__ import annotations

import dataclasses

from .unshard import UnshardHandle, gather_unit


class FsdpMethods:
    """Mixin: the HSDPModule / FSDP2 method names on the parallel module (``self._hp`` is its
    ``ParallelState``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate gradients locally without communication (micro-steps); True: the next
        backward reduces everything accumulated once. Numerics equal one large batch."""
        self._require_fsdp("set_requires_gradient_sync")
        self._set_flag(gradient_sync=bool(requires_gradient_sync))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients over the shard axis but skips the all-reduce over
        the replicate axis (accumulation with reduce-scatter only); the next step with True
        all-reduces the accumulated sum once. No effect without a replicate axis."""
        self._require_fsdp("set_requires_all_reduce")
        self._set_flag(all_reduce=bool(requires_all_reduce))

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Override every unit's reshard_after_forward (recompiles once per setting)."""
        self._require_fsdp("set_reshard_after_forward")
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("set_reshard_after_forward takes True or False")
        self._set_flag(reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the gathered parameters, so the next forward (a gradient
        accumulation micro-step) issues no all-gather; more memory, less communication. What is
        already kept stays for the next forward (as in FSDP2); kept values are dropped once an
        optimizer step changes the shards, or by reshard()."""
        self._require_fsdp("set_reshard_after_backward")
        if not isinstance(reshard_after_backward, bool):
            raise ValueError(f"set_reshard_after_backward takes True or False, got {reshard_after_backward!r}")
        self._set_flag(reshard_after_backward=reshard_after_backward)

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """"avg" (default): gradients of the global mean loss, equal to one device's. "sum": the
        data-parallel ranks' gradients summed, i.e. scaled by the data-parallel degree."""
        self._require_fsdp("set_reduce_op_type")
        if reduce_op_type not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op_type takes 'avg' or 'sum', got {reduce_op_type!r}")
        self._set_flag(reduce_op=reduce_op_type)

    def unshard(self, async_op: bool = False, *, recurse: bool = False) -> UnshardHandle | None:
        """All-gather the root unit's parameters now (every unit's with ``recurse=True``), for the
        next forward: it uses them and issues no forward all-gather for those units (a unit that
        reshards after forward still gathers again in backward). ``async_op=True`` returns a
        handle to ``wait()`` on; otherwise this waits."""
        return self._unshard_units(self._units(None, recurse, "unshard"), async_op)

    def reshard(self, *, recurse: bool = False) -> None:
        """Free what :meth:`unshard` gathered and the next forward has not used yet."""
        for unit in self._units(None, recurse, "reshard"):
            self._hp.gathered.drop(unit)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility. Nothing to do: every compiled backward waits for its
        own reductions before it returns, so no gradient reduction is ever left in flight."""
        self._require_fsdp("set_is_last_backward")
        if not isinstance(is_last_backward, bool):
            raise ValueError(f"set_is_last_backward takes True or False, got {is_last_backward!r}")

    def zero_grads(self) -> None:
        """Drop every FSDP gradient: those accumulated without sync (which the optimizer cannot
        see) and the parameters' ``.grad``."""
        self._require_fsdp("zero_grads")
        self._hp.accumulator.buffers.clear()
        for p in self.parameters():
            p.grad = None

    def _units(self, unit: str | None, recurse: bool, method: str) -> list[str]:
        self._require_fsdp(method)
        units = [u.module_fqn for u in self._hp.resolved.fsdp.units]
        if recurse:
            return units if unit is None else [u for u in units if u == unit or u.startswith(unit + ".") or unit == ""]
        unit = "" if unit is None else unit
        if unit not in units:
            raise ValueError(f"{method}: {unit or '<root>'!r} is not an FSDP unit; the units are {units}")
        return [unit]

    def _unshard_units(self, units: list[str], async_op: bool) -> UnshardHandle | None:
        for unit in units:
            self._hp.gathered.put(unit, gather_unit(self, self._hp.resolved.fsdp, unit, async_op))
        handle = UnshardHandle([self._hp.gathered.units[u] for u in units])
        if async_op:
            return handle
        handle.wait()
        return None

    def _set_flag(self, **change) -> None:
        """The next call compiles (or reuses) the program variant for the changed flags."""
        self._hp.fsdp_flags = dataclasses.replace(self._hp.fsdp_flags, **change)

    def _require_fsdp(self, method: str) -> None:
        if self._hp.resolved.fsdp is None:
            raise ValueError(
                f"{method} applies to fully sharded modules: add fully_shard units to the plan "
                "(ParallelPlan(fully_shard=hp.FullyShard(units=[...]))) or call hp.fully_shard"
            )
