"""torch's op dispatcher: op overloads, their schemas and tags, decompositions, foreach kernels,
Python dispatch modes and pytree.

Private names: ``torch._ops.OpOverload`` (the type of every ``torch.ops.<ns>.<op>.<overload>``;
its ``_overloadname`` and ``_schema`` tell the overload and whether it writes an argument),
``torch._decomp`` (torch's own decompositions), ``torch._foreach_mul_`` (one dispatch for a list
of tensors), ``torch.utils._python_dispatch.TorchDispatchMode`` (the memory tracker's hook on every
op) and ``torch.utils._pytree`` (flatten/unflatten of call arguments and outputs; torch's public
``torch.utils.pytree`` does not know the node types torch registers privately).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree  # noqa: F401 - flatten/unflatten of call arguments and outputs
from torch._ops import OpOverload  # noqa: F401 - the type of every torch.ops.<ns>.<op>.<overload>
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - analysis/memory.py, testing/memory_tracker.py

__all__ = [
    "pytree",
    "OpOverload",
    "TorchDispatchMode",
    "op_overload_name",
    "is_mutating_op",
    "is_random_op",
    "decompositions_for",
    "foreach_mul_",
    "storage_key",
]


def op_overload_name(target) -> str:
    """``"aten.mm.default"`` for an aten/custom op overload, else the callable's name."""
    if isinstance(target, torch._ops.OpOverload):
        # name() is "aten::mm" for the default overload and "aten::add.Tensor" for the others.
        name = target.name().replace("::", ".")
        return f"{name}.default" if target._overloadname == "default" else name
    return getattr(target, "__name__", str(target))


def is_mutating_op(target) -> bool:
    """Whether an op overload writes into one of its arguments."""
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def is_random_op(target) -> bool:
    """Whether an op overload draws random numbers (torch's ``nondeterministic_seeded`` tag)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def decompositions_for(ops) -> dict:
    """torch's own decompositions (``torch._decomp``) for the given aten ops, where it has one."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))


def foreach_mul_(tensors: list, scalar: float) -> None:
    """``tensors[i] *= scalar`` for all of them in one call (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalar)


def storage_key(t: torch.Tensor):
    """A hashable identity of a tensor's storage, equal for every view of it (held weakly)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())
