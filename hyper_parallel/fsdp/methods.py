"""The FSDP2 / HSDPModule methods of a parallelized module (``ParallelModule`` inherits them).

Most of them change what the next program does, so they set flags on the module's state that
``runtime.module.ParallelState.resolved_for_flags`` turns into a program variant (compiled once per combination):
gradient sync and the HSDP all-reduce (accumulation in the graph, propagation/accumulation.py),
reshard after forward / backward, the reduce op, and which units ``unshard()`` gathered ahead
(fsdp/unshard.py). ``no_sync()`` (DDP's name) also covers the parameters no FSDP unit owns.
"""

from __future__ import annotations

import contextlib

from .unshard import UnshardHandle, gather_unit


class FsdpMethods:
    """Mixin: the HSDPModule / FSDP2 method names on the parallel module (``self._hp`` is its
    ``ParallelState``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate gradients locally without communication (micro-steps); True: the next
        backward reduces everything accumulated once. Numerics equal one large batch. Here every
        unit must have the same value when the next forward runs (one program for the model)."""
        _check_bool("set_requires_gradient_sync", requires_gradient_sync)
        self._set_flag("gradient_sync", requires_gradient_sync, self._flag_units("set_requires_gradient_sync", recurse))

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's and FSDP1's context manager: forward and backward passes inside it accumulate
        gradients without communication, and the first backward after it reduces their sum with its
        own (in its bucketed, overlapped reductions). Gradients no FSDP unit owns (every gradient of
        a data-parallel plan) are kept unreduced as DDP keeps them; FSDP units' as
        ``set_requires_gradient_sync(False)`` inside and ``True`` after it (one reduce-scatter per
        unit for the whole accumulation). Reductions over non-data axes (a sequence-parallel norm
        weight's over the tensor-parallel axis) still run. Numerics equal reducing every
        micro-step. The previous setting returns on exit (nesting is fine)."""
        state = self._hp
        if state.pipeline is not None:
            raise ValueError(
                "no_sync() does not apply to a pipeline plan: pmodel.step() already reduces the gradients "
                "once per step, over all of its micro-batches"
            )
        before = state.replicated_sync, state.fsdp_flags
        state.replicated_sync = False
        if state.resolved.fsdp is not None:
            self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            state.replicated_sync = before[0]
            state.fsdp_flags = state.fsdp_flags.restored("gradient_sync", before[1])

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients over the shard axis but skips the all-reduce over
        the replicate axis (accumulation with reduce-scatter only); the next step with True
        all-reduces the accumulated sum once. No effect without a replicate axis. The same on
        every unit, as set_requires_gradient_sync."""
        _check_bool("set_requires_all_reduce", requires_all_reduce)
        self._set_flag("all_reduce", requires_all_reduce, self._flag_units("set_requires_all_reduce", recurse))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Override reshard_after_forward of every unit (``recurse=False``: the root unit only);
        recompiles once per setting."""
        _check_bool("set_reshard_after_forward", reshard_after_forward)
        self._set_flag("reshard_after_forward", reshard_after_forward,
                       self._flag_units("set_reshard_after_forward", recurse))

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the gathered parameters, so the next forward (a gradient
        accumulation micro-step) issues no all-gather; more memory, less communication. What is
        already kept stays for the next forward (as in FSDP2); kept values are dropped once an
        optimizer step changes the shards, or by reshard()."""
        _check_bool("set_reshard_after_backward", reshard_after_backward)
        self._set_flag("reshard_after_backward", reshard_after_backward,
                       self._flag_units("set_reshard_after_backward", recurse))

    def set_reduce_op_type(self, reduce_op_type: str, *, recurse: bool = True) -> None:
        """"avg" (default): gradients of the global mean loss, equal to one device's. "sum": the
        data-parallel ranks' gradients summed, i.e. scaled by the data-parallel degree."""
        if reduce_op_type not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op_type takes 'avg' or 'sum', got {reduce_op_type!r}")
        self._set_flag("reduce_op", reduce_op_type, self._flag_units("set_reduce_op_type", recurse))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's custom divide factor, for the root unit (not recursive, as in FSDP2): its
        gradients are the data-parallel ranks' gradients summed and divided by ``factor`` instead
        of by the data-parallel degree, i.e. ``degree / factor`` times one device's gradients."""
        self._set_flag("divide_factor", _check_factor(factor),
                       self._flag_units("set_reduce_scatter_divide_factor", recurse=False))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's newer name of :meth:`set_reduce_scatter_divide_factor`."""
        self.set_reduce_scatter_divide_factor(factor)

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
        _check_bool("set_is_last_backward", is_last_backward)

    def zero_grads(self) -> None:
        """Drop every FSDP gradient: those accumulated without sync (which the optimizer cannot
        see) and the parameters' ``.grad``."""
        self._require_fsdp("zero_grads")
        self._hp.accumulator.buffers.clear()
        self._hp.replicated_accumulator.buffers.clear()
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

    def _set_flag(self, field: str, value, units: list[str]) -> None:
        """The next call compiles (or reuses) the program variant for the changed flags."""
        self._hp.fsdp_flags = self._hp.fsdp_flags.set(field, value, units)

    def _flag_units(self, method: str, recurse: bool, module_fqn: str = "") -> list[str]:
        """The units a switch called on module ``module_fqn`` ("" the root) acts on, as FSDP2:
        with ``recurse`` every unit inside that module (its own included), else its own unit."""
        self._require_fsdp(method)
        _check_bool(f"{method}(recurse=)", recurse)
        units = self._hp.resolved.fsdp.units
        own = [u.module_fqn for u in units if module_fqn in u.modules]
        if recurse:
            inside = [u.module_fqn for u in units
                      if any(module_fqn == "" or m == module_fqn or m.startswith(module_fqn + ".") for m in u.modules)]
            return list(dict.fromkeys(own + inside))
        if not own:
            where = f"module {module_fqn!r}" if module_fqn else "the root module"
            raise ValueError(
                f"{method}: {where} is not an FSDP unit, and this call acts on its own unit only "
                "(recurse=False, or a switch FSDP2 does not apply recursively), so it would change "
                f"nothing; the units are {[u.module_fqn or '<root>' for u in units]}: call it on one of them"
            )
        return own

    def _require_fsdp(self, method: str) -> None:
        if self._hp.resolved.fsdp is None:
            raise ValueError(
                f"{method} applies to fully sharded modules: add fully_shard units to the plan "
                "(ParallelPlan(fully_shard=hp.FullyShard(units=[...]))) or call hp.fully_shard"
            )


def _check_bool(method: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method} takes True or False, got {value!r}")


def _check_factor(factor) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"set_reduce_scatter_divide_factor takes a positive number, got {factor!r}")
    return float(factor)
