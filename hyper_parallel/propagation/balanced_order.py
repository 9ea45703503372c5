"""Propagation's part of load-balanced context parallelism: cp shards only along whole sequences.

Inside a program with load-balanced ring attention (``cp/load_balance.py``), a value sharded over
the cp axis holds the *balanced* chunks of the sequences along its sharded dim: lowering applies
the chunk permutation ``P`` where a value becomes sharded on the cp axis and ``P⁻¹`` where it stops
being. ``P`` is defined only on a dim that holds whole sequences (its global size a multiple of the
sequence length: the sequence itself, or ``[batch * sequence]`` rows after a flatten).

DTensor's strategies know nothing of that order and may shard another dim on the cp axis. The case
that showed it: the labels' shift (``F.pad(labels, (0, 1))`` along the sequence) under FSDP over
``dp_shard x cp`` with two sequences per rank; from about 8k tokens DTensor finds it cheaper to
move the labels' cp shard from the sequence to the batch dim than to gather them over cp. Such a
shard has no defined order: lowering could not permute it, and a later flatten of it into
``[batch * sequence]`` rows would look balanced when it is not (a silent wrong loss).

:func:`unordered_inputs` finds the inputs a rule's choice would shard that way; the engine then
decides the op again with those inputs gathered over the cp axis (what the shorter sequences get
anyway) and refuses, naming the node, if DTensor still wants such a shard.

Reads: the rule's input layouts (current and wanted) and the sequence length. Writes nothing.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from .. import compat
from ..cp.load_balance import sequence_dim


def unordered_inputs(current, wanted, axis: int, seq_len: int) -> list[int]:
    """Indices of the tensor inputs whose wanted layout newly shards, on mesh axis ``axis``, a dim
    that does not hold whole sequences of ``seq_len`` tokens."""
    found = []
    for i, (have, want) in enumerate(zip(current, wanted)):
        if not isinstance(want, compat.DTensorSpec) or not isinstance(have, compat.DTensorSpec):
            continue
        target = want.placements[axis]
        dim = sequence_dim(target)
        if dim is None or target == have.placements[axis]:
            continue
        if want.tensor_meta.shape[dim] % seq_len:
            found.append(i)
    return found


def gathered_on(spec, axis: int):
    """``spec`` with mesh axis ``axis`` replicated (the value gathered over it)."""
    placements = list(spec.placements)
    placements[axis] = Replicate()
    return compat.respec(spec, placements)
