"""``ContextParallel``: the plan entry that shards the sequence over a mesh axis.

Reference names: HyperParallel's ``ContextParallel`` and ``AsyncContextParallel`` ParallelStyles.
Written in a plan as ``ParallelPlan(context_parallel={"model.layers.*.self_attn":
hp.ContextParallel(mode="all_to_all")})``: the entry names the attention modules, and its ``axis``
(``"cp"``) shards every forward input with a sequence dim (``input_ids``, ``labels``, position ids:
dim 1) over that axis, so each rank computes its slice of the tokens everywhere except inside
attention, which ``cp/attention.py`` makes exact.

Modes:

* ``"all_to_all"`` (DeepSpeed-Ulysses, the default): heads and sequence swapped by all-to-all
  around each attention; ``cp`` must divide the heads and key/value heads. Every rank computes
  whole sequences of its heads, so the work is balanced whatever the mask (``load_balance`` is not
  read).
* ``"ring"``: K/V blocks passed around the cp ring, blockwise attention merged by log-sum-exp,
  any cp degree (``cp/ring.py``). With ``load_balance=True`` (default) the sequence is cut in
  ``2·cp`` chunks and rank r computes with chunks r and 2·cp−1−r, so a causal mask costs every rank
  the same (``cp/load_balance.py``); the compiled program reorders the tokens itself.
* ``"all_gather"``: ring attention's blocks, load balancing and merge, but every rank's K/V block
  arrives in one all-gather per attention and dK/dV go home in one reduce-scatter (Llama 3's
  context parallelism; torch's default ``rotate_method``): 1 collective per attention forward and 2
  backward whatever the degree, for ``cp`` K/V blocks alive during each attention. Suits
  grouped-query attention, whose K/V are a fraction of the activations.

Both together (``ulysses_degree``, as ParallelDims' field: the Ulysses degree inside ``cp``): the
cp ranks form groups of ``ulysses_degree`` consecutive ranks that swap heads and sequence by
all-to-all, and ``cp / ulysses_degree`` such groups run ring attention on what they gathered
(``cp/hybrid.py``). Heads need only divide by ``ulysses_degree``; each ring transfer carries a
``1/ulysses_degree`` share of the heads. ``ulysses_degree`` overrides what ``mode`` implies (all of
``cp`` for all-to-all, 1 for ring); ``load_balance`` and overlap apply to the ring part.

``AsyncContextParallel`` is ring mode with each K/V transfer overlapping the current block's
attention (the ``ring_overlap`` pass); with ``mode="all_gather"`` the gather overlaps the rank's
own block. In every mode each rank passes its contiguous slice of the
sequence (``hp.shard_sequence``) and gets its slice of sequence-shaped outputs back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AsyncContextParallel", "ContextParallel", "parse_context_style"]

MODES = ("all_to_all", "ring", "all_gather")


@dataclass(frozen=True)
class ContextParallel:
    """Shard the sequence over ``axis`` (default ``"cp"``); attention in ``mode``.

    ``load_balance`` (ring and all-gather modes): the sequence in 2·cp chunks, rank r computing
    with chunks r and 2·cp−1−r, so causal attention costs every rank the same. ``ulysses_degree``: the cp ranks
    that swap heads and sequence by all-to-all (None: all of cp in all-to-all mode, 1 in ring
    mode); between 1 and cp, ring attention runs over the ``cp / ulysses_degree`` groups."""

    mode: str = "all_to_all"
    load_balance: bool = True
    axis: str = "cp"
    ulysses_degree: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{type(self).__name__}(mode={self.mode!r}): mode is one of {list(MODES)}")
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"{type(self).__name__}(axis=...) takes a mesh axis name, got {self.axis!r}")
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"{type(self).__name__}(load_balance=...) is True or False, got {self.load_balance!r}")
        u = self.ulysses_degree
        if u is not None and (isinstance(u, bool) or not isinstance(u, int) or u < 1):
            raise ValueError(f"{type(self).__name__}(ulysses_degree={u!r}): give a positive int that divides "
                             "the cp degree, or None")

    @property
    def asynchronous(self) -> bool:
        """Whether the next K/V block's transfer overlaps the current block's attention."""
        return False


@dataclass(frozen=True)
class AsyncContextParallel(ContextParallel):
    """:class:`ContextParallel` with each ring step's K/V transfer issued before the current
    block's attention and waited after it (reference: ``AsyncContextParallel``)."""

    mode: str = "ring"

    @property
    def asynchronous(self) -> bool:
        return True


_STYLES = {
    "context_parallel": ContextParallel, "ContextParallel": ContextParallel,
    "async_context_parallel": AsyncContextParallel, "AsyncContextParallel": AsyncContextParallel,
}


def parse_context_style(spec: Any, where: str) -> ContextParallel:
    """A context_parallel plan value: a style object, its name, or ``{"style": name, **fields}``."""
    if isinstance(spec, ContextParallel):
        return spec
    if isinstance(spec, str) and spec in _STYLES:
        return _STYLES[spec]()
    if isinstance(spec, dict) and spec.get("style", "context_parallel") in _STYLES:
        cls = _STYLES[spec.get("style", "context_parallel")]
        fields = {k: v for k, v in spec.items() if k != "style"}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    raise TypeError(f"{where}: expected hp.ContextParallel() (or its name), got {spec!r}")
