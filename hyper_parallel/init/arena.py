"""The reusable host buffer the replay initialises one module's full tensors in.

Sized for the module owning the most bytes directly (``_arena_bytes`` of its own parameters and
buffers) and reset before each step, so a rank never holds more than one module's full tensors.
"""

from __future__ import annotations

import torch

from .tensors import InitStats


_ALIGN = 64


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage region a tensor of ``t``'s shape and strides covers."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _arena_bytes(tensors) -> int:
    """Room for ``tensors`` taken from an arena in any order (each start is aligned)."""
    return sum(-(-_span_bytes(t) // _ALIGN) * _ALIGN for t in tensors)


class _Arena:
    """One host buffer, reused for the full tensors of the module being initialised.

    Allocating and freeing a full tensor per module through malloc fragments the heap (glibc keeps
    the freed holes resident), so the process's RSS ends up far above the bytes actually alive; one
    buffer sized for the largest module keeps RSS equal to what :class:`InitStats` counts.
    """

    def __init__(self, nbytes: int, stats: InitStats) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.offset = 0
        stats._alloc(nbytes)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A CPU tensor with ``like``'s dtype, shape and strides in the buffer (own version counter)."""
        start = -(-self.offset // _ALIGN) * _ALIGN
        end = start + _span_bytes(like)
        assert end <= self.nbytes, (
            f"init arena: {end} bytes needed, {self.nbytes} held; it is sized for the largest module's own "
            "tensors, and one step takes only the tensors of one module"
        )
        self.offset = end
        t = torch.empty(0, dtype=like.dtype)
        t.set_(self.buffer.untyped_storage(), start // like.element_size(), like.shape, like.stride())
        return t

    def reset(self) -> None:
        self.offset = 0
