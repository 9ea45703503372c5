"""Replaying a model's construction module by module, keeping only this rank's shards.

``_Replay`` runs the steps of a :mod:`.schedule` with only the current module's tensors
materialised (in the :mod:`.arena`), detects tensors no initialiser wrote (sentinel values and
version counters), and splits each tensor into its shard after its last step (:mod:`.sharding`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .arena import _Arena
from .schedule import _Schedule, _has_reset, _module_label
from .sharding import _distribute_real, _shard_locally, _wrap
from .tensors import InitStats, _Entry, _table


def _fill_sentinel(t: torch.Tensor) -> None:
    # Marks values no initialiser wrote: writes through ``.data`` bypass the version counter, so
    # "untouched" is "version unchanged and the sentinel still there".
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _has_sentinel(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all())


def _untouched(t: torch.Tensor, version: int) -> bool:
    return t._version == version and _has_sentinel(t)


class _Replay:
    """Materialises and distributes a model with meta tensors one module at a time (see the
    package docstring, :mod:`hyper_parallel.init`).

    While it runs, every slot of the model holds a meta placeholder (the original meta tensor, or a
    meta twin of a real one) except the tensors of the module being initialised, so init code that
    walks the whole model only touches that module. Results are installed by the caller at the end.
    """

    def __init__(self, entries, schedule: _Schedule, mesh, stats: InitStats):
        self.entries = entries
        self.schedule = schedule
        self.mesh = mesh
        self.stats = stats
        self.arena: Optional[_Arena] = None
        self.hooked_modules = {id(s.module) for s in schedule.steps if s.kind == "hook"}
        self.pre_state: dict[int, torch.Tensor] = {}  # module id -> CPU generator state before its reset
        self.constructed: set = set()  # entries whose construction (first reset) was replayed
        self.hooked: set = set()  # entries whose final value was produced by a hook step
        self.slot_entry: dict[tuple, _Entry] = {}
        for entry in entries:
            for module, name in entry.slots:
                self.slot_entry[(id(module), name, entry.is_param)] = entry

    # -- helpers ---------------------------------------------------------------------------------

    def _direct(self, module: nn.Module) -> list:
        return [
            (name, self.slot_entry[(id(module), name, is_param)])
            for is_param in (True, False)
            for name, t in _table(module, is_param).items()
            if t is not None
        ]

    def _empty(self, entry: _Entry, sentinel: bool) -> torch.Tensor:
        t = self.arena.take(entry.tensor)
        if sentinel:
            _fill_sentinel(t)
        if entry.is_param:
            t = nn.Parameter(t, requires_grad=entry.tensor.requires_grad)
        return t

    def _scratch(self, module: nn.Module, aliases) -> list:
        """Give ``module`` its own throw-away tensor in each tied-alias slot (draws only)."""
        out = []
        for name, entry in aliases:
            t = self._empty(entry, sentinel=False)
            _table(module, entry.is_param)[name] = t
            out.append((name, entry, t))
        return out

    def _drop_scratch(self, module: nn.Module, scratch) -> None:
        for name, entry, _ in scratch:
            self.stats.num_replayed += 1
            _table(module, entry.is_param)[name] = entry.placeholder

    def _drop(self, entry: _Entry) -> None:
        entry.set_slots(entry.placeholder)
        self.stats.num_replayed += 1

    # -- the steps -------------------------------------------------------------------------------

    def run(self) -> None:
        for entry in self.entries:
            if entry.tensor.is_meta:
                entry.placeholder = entry.tensor
            else:
                meta = torch.empty_like(entry.tensor, device="meta")
                entry.placeholder = (
                    nn.Parameter(meta, requires_grad=entry.tensor.requires_grad) if entry.is_param else meta
                )
            entry.set_slots(entry.placeholder)
        self.arena = _Arena(self.stats.largest_module_bytes, self.stats)
        try:
            with torch.no_grad():
                for step in self.schedule.steps:
                    self.arena.reset()  # the previous step's tensors are sharded or dropped
                    if step.kind == "reset":
                        self._reset_step(step.fqn, step.module)
                    else:
                        self._hook_step(step.fqn, step.module, step.call)
        finally:
            self.stats._alloc(-self.arena.nbytes)
            self.arena = None
        for entry in self.entries:
            if not entry.tensor.is_meta:
                entry.result = _distribute_real(entry, self.mesh, self.stats)

    def _reset_step(self, fqn: str, module: nn.Module) -> None:
        direct = self._direct(module)
        if not direct or not _has_reset(module):
            return  # _check_initialisable: real tensors only, or a hook step covers them
        self.pre_state[id(module)] = torch.get_rng_state()
        final = id(module) not in self.hooked_modules
        owned = [(n, e) for n, e in direct if e not in self.constructed]
        aliases = [(n, e) for n, e in direct if e in self.constructed]
        temps = []
        for name, entry in owned:
            self.constructed.add(entry)
            keep = final and entry.tensor.is_meta
            t = self._empty(entry, sentinel=keep)
            entry.set_slots(t)
            temps.append((name, entry, t, keep, t._version))
        # A tied alias had its own tensor while its constructor ran (tying comes after).
        scratch = self._scratch(module, aliases)
        module.reset_parameters()
        self._drop_scratch(module, scratch)
        for name, entry, t, keep, version in temps:
            if not keep:
                self._drop(entry)
                continue
            entry.set_slots(entry.placeholder)
            if _untouched(t, version):
                raise ValueError(
                    f"distribute_parameters: {_module_label(fqn, module)}.reset_parameters() did not "
                    f"initialise its {entry.kind} '{name}' (on the meta device; no model init hook "
                    "covers the module); make reset_parameters() set every parameter and buffer the "
                    "module owns (e.g. recompute a non-persistent buffer), or build the model on a "
                    "real device."
                )
            self._finish(entry, t)

    def _hook_step(self, fqn: str, module: nn.Module, call: Callable[[], None]) -> None:
        direct = self._direct(module)
        todo = [(n, e) for n, e in direct if e not in self.hooked]
        aliases = [(n, e) for n, e in direct if e in self.hooked]
        ties_visible = self.schedule.ties_visible
        if not todo and (ties_visible or not aliases):
            return
        start_state = torch.get_rng_state()
        # With reset_parameters() an unwritten tensor is rebuilt below (version counter unchanged:
        # always correct), so only modules without one need the sentinel fill to detect it.
        can_rebuild = id(module) in self.pre_state
        temps = []
        for name, entry in todo:
            self.hooked.add(entry)
            t = self._empty(entry, sentinel=entry.tensor.is_meta and not can_rebuild)
            entry.set_slots(t)
            temps.append((name, entry, t, t._version))
        # Hooks that run before tying (transformers) see the alias's own tensor; ours see the tie.
        scratch = [] if ties_visible else self._scratch(module, aliases)
        call()
        untouched = [
            (n, e, t) for n, e, t, v in temps
            if e.tensor.is_meta and (t._version == v if can_rebuild else _untouched(t, v))
        ]
        if untouched and can_rebuild:
            # The hook left (part of) a tensor as construction made it: rebuild the construction
            # values from the module's saved generator state, then re-run the hook from its state.
            torch.set_rng_state(start_state)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.pre_state[id(module)])
                construction_scratch = self._scratch(module, aliases) if ties_visible else []
                module.reset_parameters()
                self._drop_scratch(module, construction_scratch)
            call()
            untouched = []
        if untouched:
            names = ", ".join(f"'{n}'" for n, _, _ in untouched)
            raise ValueError(
                f"distribute_parameters: {_module_label(fqn, module)} has {names} on the meta device, "
                f"no reset_parameters(), and the model init hook {self.schedule.hook_name} did not initialise "
                f"{'it' if len(untouched) == 1 else 'them'}; define reset_parameters() on "
                f"{type(module).__name__} initialising its own parameters and buffers, or make the "
                "hook cover this module, or build the model on a real device."
            )
        self._drop_scratch(module, scratch)
        for name, entry, t, _ in temps:
            if entry.tensor.is_meta:
                entry.set_slots(entry.placeholder)
                self._finish(entry, t)
            else:
                self._drop(entry)

    def _finish(self, entry: _Entry, full: torch.Tensor) -> None:
        """Split ``full`` into this rank's shard, keep only the shard, drop ``full``."""
        self.stats.num_materialised += 1
        entry.result = _wrap(entry, _shard_locally(entry.placements, full, self.mesh, self.stats))
