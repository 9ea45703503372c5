"""The model's tensors as :func:`~hyper_parallel.init.distribute_parameters` sees them.

Each distinct tensor (by identity) is one ``_Entry`` with every slot it is registered in (tied
aliases) and its placements; :class:`InitStats` counts the bytes a call held on this rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn


@dataclasses.dataclass
class InitStats:
    """What one :func:`distribute_parameters` call held on this rank (pass one as ``stats=``).

    Bytes are those this code path allocated and kept alive (full tensors being initialised, scratch
    tensors of the replay, the local shards), counted by storage size, on any device.

    * ``peak_bytes`` / ``final_bytes``: the maximum, and what is left (the local shards).
    * ``total_bytes``: the whole model (distinct tensors, global shapes); ``largest_tensor_bytes``:
      its largest parameter or buffer; ``largest_module_bytes``: the most one module owns directly
      (64-byte aligned), the size of the reusable buffer full tensors are initialised in. So
      ``peak_bytes <= final_bytes + largest_module_bytes`` (on an accelerator mesh, plus one full
      tensor's device copy).
    * ``num_materialised``: meta tensors initialised; ``num_replayed``: scratch tensors used only to
      consume random numbers; ``num_real``: tensors that were already real (distributed as given).
    * ``init_hook``: the model init hook that was replayed ("" if none).
    """

    peak_bytes: int = 0
    final_bytes: int = 0
    current_bytes: int = 0
    total_bytes: int = 0
    largest_tensor_bytes: int = 0
    largest_module_bytes: int = 0
    num_materialised: int = 0
    num_replayed: int = 0
    num_real: int = 0
    init_hook: str = ""

    def _alloc(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass(eq=False)
class _Entry:
    """One distinct tensor of the model and every place it is registered (tied aliases)."""

    tensor: torch.Tensor
    is_param: bool
    fqns: list = dataclasses.field(default_factory=list)
    slots: list = dataclasses.field(default_factory=list)  # (module, name)
    placements: tuple = ()
    placeholder: Optional[torch.Tensor] = None
    result: Optional[torch.Tensor] = None

    @property
    def kind(self) -> str:
        return "parameter" if self.is_param else "buffer"

    def set_slots(self, value: torch.Tensor) -> None:
        for module, name in self.slots:
            _table(module, self.is_param)[name] = value


def _table(module: nn.Module, is_param: bool) -> dict:
    return module._parameters if is_param else module._buffers


def _direct_tensors(module: nn.Module) -> list:
    return [t for is_param in (True, False) for t in _table(module, is_param).values() if t is not None]


def _collect(model: nn.Module):
    """Distinct tensors (by identity, registration order), and modules in registration order."""
    entries: dict[int, _Entry] = {}
    modules: dict[int, tuple[str, nn.Module]] = {}
    slots_seen: set = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        modules.setdefault(id(module), (prefix, module))
        for is_param in (True, False):
            for name, t in _table(module, is_param).items():
                if t is None:
                    continue
                entry = entries.get(id(t))
                if entry is None:
                    entry = entries[id(t)] = _Entry(t, is_param)
                entry.fqns.append(f"{prefix}.{name}" if prefix else name)
                if (id(module), name, is_param) not in slots_seen:
                    slots_seen.add((id(module), name, is_param))
                    entry.slots.append((module, name))
    return list(entries.values()), list(modules.values())


def _resolve_placements(entry: _Entry, param_placements: dict) -> tuple:
    found = [(f, tuple(param_placements[f])) for f in entry.fqns if f in param_placements]
    if not found:
        raise ValueError(
            f"distribute_parameters: no placements for {entry.kind} '{entry.fqns[0]}' "
            f"(shape {tuple(entry.tensor.shape)}); param_placements must map every parameter and "
            "buffer FQN to one placement per mesh axis (ResolvedPlan.param_placements does)."
        )
    first_fqn, first = found[0]
    for fqn, placements in found[1:]:
        if placements != first:
            raise ValueError(
                f"distribute_parameters: tied {entry.kind} '{first_fqn}' and '{fqn}' are one tensor "
                f"but have different placements {first} and {placements}; give every alias of a "
                "tied tensor the same placements."
            )
    return first
