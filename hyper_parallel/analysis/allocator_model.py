"""A model of PyTorch's CUDA caching allocator: the memory it *reserves* for a sequence of tensor
allocations and frees.

Why. ``analysis/memory.py`` predicts the peak of live tensor bytes, which is ``torch.cuda.max_memory_allocated``
(to 0.2% on an H200 at Llama 3 8B layer shapes). What runs out is the device memory the caching
allocator has taken from the driver, ``max_memory_reserved``: it keeps freed blocks cached, and a
request that no cached block fits takes new memory even when enough is free in pieces. That is what
``nvidia-smi`` and published training logs report (torchtitan's "memory" is the reserved peak), and
on the H200 it was 1.08-1.33x the allocated peak for the same program, depending on the allocator's
mode. Replaying the step's allocation order through the allocator's placement rules predicts it.

The rules modelled (the allocator's documented behaviour for one stream, no memory pressure, no
``max_split_size_mb`` / ``roundup_power2_divisions`` / garbage collection, all off by default):

- a request is rounded up to a multiple of 512 bytes; requests of at most 1 MiB use the small pool,
  larger ones the large pool;
- a request takes the smallest cached free block of its pool that fits (best fit, lowest address on
  ties) and splits it when the rest is worth keeping: at least 512 bytes in the small pool, more
  than 1 MiB in the large one (else the whole block is handed out), and with expandable segments at
  least 512 bytes in both;
- freeing a block returns it to its pool and merges it with free neighbours of the same segment;
- the default allocator takes a new segment when nothing fits: 2 MiB for a small request, 20 MiB
  for a large one under 10 MiB, else the request rounded up to 2 MiB. Segments are never returned
  (without ``empty_cache`` or an allocation failure), so the reserved peak is their total;
- with ``expandable_segments:True`` each pool is one growing segment: a request no cached block
  fits is placed at its end, reusing a free block there, and the segment maps more memory in pages
  of 2 MiB (small pool) or 20 MiB (large pool). Of the free blocks that fit, one at the end is
  taken only when no other does (it can grow, so best fit ranks it last).

Not modelled: other streams (FSDP2's and NCCL's side streams cache blocks per stream; blocks used on
another stream are reused only after its events complete), the allocator's behaviour near the
device's capacity (it frees cached segments and retries before failing), and allocations outside
the trace (cuBLAS workspaces, NCCL buffers).
"""

from __future__ import annotations

import bisect
import dataclasses

MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_REQUEST = 1 << 20  # requests up to this size use the small pool
SMALL_SEGMENT = 2 << 20  # the default allocator's segment for small requests; the small pool's page
LARGE_SEGMENT = 20 << 20  # the default allocator's segment for requests under MIN_LARGE_ALLOC; the large pool's page
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20  # larger requests take a segment of their size rounded up to this


def round_size(nbytes: int) -> int:
    """The bytes the allocator hands out for a request of ``nbytes``."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


@dataclasses.dataclass(eq=False)
class _Block:
    segment: int  # index into the pool's segments
    offset: int
    size: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


class _Pool:
    """The blocks of one pool (small or large) in their segments, and the free ones sorted by
    (size, segment, offset) for best fit."""

    def __init__(self, small: bool, expandable: bool):
        self.small, self.expandable = small, expandable
        self.page = SMALL_SEGMENT if small else LARGE_SEGMENT
        self.segments: list[int] = []  # bytes of each segment (mapped bytes when expandable)
        self.tails: list[_Block] = []  # each segment's last block
        self._free: list[tuple] = []  # sorted (size, segment, offset, id) keys
        self._by_key: dict[tuple, _Block] = {}

    @property
    def reserved(self) -> int:
        return sum(self.segments)

    def _key(self, b: _Block) -> tuple:
        return (b.size, b.segment, b.offset, id(b))

    def _add_free(self, b: _Block) -> None:
        b.free = True
        key = self._key(b)
        bisect.insort(self._free, key)
        self._by_key[key] = b

    def _remove_free(self, b: _Block) -> None:
        key = self._key(b)
        self._free.pop(bisect.bisect_left(self._free, key))
        del self._by_key[key]

    def _best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self._free, (size,))
        if i == len(self._free):
            return None
        block = self._by_key[self._free[i]]
        if self.expandable and block is self.tails[block.segment]:
            # A free block at a segment's end can grow into more pages: best fit ranks it after
            # every other block that fits.
            for key in self._free[i + 1:]:
                other = self._by_key[key]
                if other is not self.tails[other.segment]:
                    return other
        return block

    def malloc(self, size: int) -> _Block:
        block = self._best_fit(size)
        if block is not None:
            self._remove_free(block)
        elif self.expandable:
            block = self._grow(size)
        else:
            block = self._new_segment(size)
        rest = block.size - size
        keep_rest = rest >= MIN_BLOCK if self.small or self.expandable else rest > SMALL_REQUEST
        if keep_rest:
            self._split(block, size)
        block.free = False
        return block

    def _new_segment(self, size: int) -> _Block:
        if self.small:
            nbytes = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            nbytes = LARGE_SEGMENT
        else:
            nbytes = -(-size // ROUND_LARGE) * ROUND_LARGE
        self.segments.append(nbytes)
        block = _Block(len(self.segments) - 1, 0, nbytes, free=False)
        self.tails.append(block)
        return block

    def _grow(self, size: int) -> _Block:
        """Map pages at the end of the pool's one segment until a block there holds ``size``."""
        if not self.segments:
            self.segments.append(0)
            self.tails.append(None)
        tail = self.tails[0]
        have = tail.size if tail is not None and tail.free else 0
        pages = -(-(size - have) // self.page) * self.page
        start = self.segments[0]
        self.segments[0] += pages
        if have:
            self._remove_free(tail)
            tail.size += pages
            return tail
        block = _Block(0, start, pages, free=False, prev=tail)
        if tail is not None:
            tail.next = block
        self.tails[0] = block
        return block

    def _split(self, block: _Block, size: int) -> None:
        rest = _Block(block.segment, block.offset + size, block.size - size, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        if self.tails[block.segment] is block:
            self.tails[block.segment] = rest
        self._add_free(rest)

    def free(self, block: _Block) -> None:
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                self._merge(block, neighbour)
        self._add_free(block)

    def _merge(self, block: _Block, other: _Block) -> None:
        if other is block.prev:
            block.offset, block.prev = other.offset, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
            if self.tails[block.segment] is other:
                self.tails[block.segment] = block
        block.size += other.size


class CachingAllocatorModel:
    """Replays allocations and frees as the CUDA caching allocator places them; tracks the allocated
    and reserved bytes and their peaks (``torch.cuda.max_memory_allocated`` / ``_reserved``).

    >>> a = CachingAllocatorModel(expandable_segments=False)
    >>> a.malloc("x", 3 << 20); a.reserved == 20 << 20   # a 20 MiB segment for a 3 MiB tensor
    True
    """

    def __init__(self, expandable_segments: bool = False):
        self.expandable_segments = expandable_segments
        self._pools = (_Pool(True, expandable_segments), _Pool(False, expandable_segments))
        self._live: dict = {}
        self.allocated = self.peak_allocated = self.peak_reserved = 0

    @property
    def reserved(self) -> int:
        return self._pools[0].reserved + self._pools[1].reserved

    def malloc(self, key, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key`` (any hashable naming the tensor's storage); 0 bytes
        allocates nothing, as the allocator's ``malloc(0)`` does."""
        if key in self._live:
            raise ValueError(f"allocator model: {key!r} is already allocated")
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        pool = self._pools[0] if size <= SMALL_REQUEST else self._pools[1]
        block = pool.malloc(size)
        self._live[key] = (pool, block)
        self.allocated += block.size  # a block not split is handed out, and counted, whole
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key) -> None:
        """Free ``key``'s block (nothing for a key never allocated, e.g. a 0-byte tensor's)."""
        entry = self._live.pop(key, None)
        if entry is None:
            return
        pool, block = entry
        self.allocated -= block.size
        pool.free(block)

    def replay(self, events) -> "CachingAllocatorModel":
        """Apply ``events``, each ``("malloc", key, nbytes)`` or ``("free", key)``; returns self."""
        for event in events:
            if event[0] == "malloc":
                self.malloc(event[1], event[2])
            else:
                self.free(event[1])
        return self
