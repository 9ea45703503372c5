"""Ring attention: sequence-sharded SDPA computed block by block while K/V travel around the cp ring.

``hp.ContextParallel(mode="ring")``. Each rank keeps its query rows and, in ``cp`` steps, sees
every rank's key/value block: at step ``t`` it holds the block of rank ``r − t`` and sends the block
it holds to rank ``r + 1`` for the next step, so it sends exactly ``cp − 1`` K/V blocks per
attention forward (key and value stacked: one transfer per step). Each block's attention runs the
captured op's own kernel (the CPU flash kernel, or on GPUs the flash, memory-efficient or cuDNN
one: ``cp/attention_ops.py``) and returns its output and log-sum-exp; blocks merge exactly:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)`` (fp32).

Causal masks: a block whose keys all come after the rank's queries is skipped, one whose keys all
come before is computed without a mask, and the rank's own block with the causal mask (its tokens
are in increasing order, so the one-device mask on the local block is the right one also when it
holds two balanced chunks, ``cp/load_balance.py``). An explicit additive mask is sliced to the
block's query rows and key columns; rows a block masks entirely are given ``lse = −inf`` so they
add nothing (the kernel itself reports 0 for them). A mask known to hide every key after its query
(``hp_mask_within_causal``: transformers' causal mask and'ed with a padding mask, its packed-sequence
mask, ``propagation/causal_mask.py``) skips the same blocks as a causal one and is sliced into the rest.

Backward (exact): with the forward's merged output and log-sum-exp, the flash backward of one block
gives that block's exact share of dQ, dK and dV. K/V go around the ring again; each block's dK/dV
accumulator (fp32 for half-precision inputs) travels with it and reaches its owner after ``cp − 1``
transfers, the last carrying every other rank's share. dQ stays local.

Transfers are ``all_to_all_single`` calls in which a rank sends its whole tensor to its successor
and nothing to anyone else (as torch's ``permute_tensor``): functional, traceable, and on NCCL a
send/recv pair. Each is tagged ``hp_cp_ring`` (attention node, what moves, step; and whether the
plan asked for overlap), so ``debug.collectives`` counts it as a ``send_recv`` and the
``ring_overlap`` pass can sink its wait past the current block's attention (AsyncContextParallel).
As lowered, every transfer is waited for at once.

All-gather exchange (``hp.ContextParallel(mode="all_gather")``, Llama 3's context parallelism and
torch's default ``rotate_method``): the same blocks in the same order, merged the same way, but
every rank's K/V block arrives in one ``all_gather_into_tensor`` per attention instead of ``cp − 1``
transfers; backward gathers them again (nothing but the local block is saved) and returns every
block's dK/dV share to its owner with one ``reduce_scatter_tensor`` (fp32 for half precision, as
the ring's accumulators). Fewer, larger collectives, so fewer synchronisations; the price is the
``cp`` gathered blocks alive during one attention, where the ring holds two. The rank's own block
needs nothing from the gather, so with overlap its wait sinks past that block's attention.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from .. import compat
from ..ir import meta
from .attention_ops import AttentionOps, local_rng
from .load_balance import rank_chunks

c10d = torch.ops._c10d_functional
SEQ = 2  # the sequence dim of query / key / value / output [B, H, S, D] and log-sum-exp [B, H, S]


class Ring:
    """One attention node's ring: the ``n`` ranks of process group ``group`` in their group order,
    this one at ``rank`` (the cp axis itself in ring mode: :meth:`on_axis`; the hybrid's ring
    sub-group, cp/hybrid.py)."""

    def __init__(self, group: str, n: int, rank: int, balanced: bool, overlap: bool, name: str,
                 gather: bool = False):
        self.group, self.n, self.rank = group, n, rank
        self.balanced, self.overlap, self.name = balanced, overlap, name
        self.gather = gather  # K/V all-gathered and dK/dV reduce-scattered instead of passed around

    @classmethod
    def on_axis(cls, mesh, axis: int, balanced: bool, overlap: bool, name: str, gather: bool = False) -> "Ring":
        """The ring of every rank of mesh axis ``axis``, in its rank order."""
        return cls(mesh.get_group(axis).group_name, mesh.size(axis), mesh.get_local_rank(axis),
                   balanced, overlap, name, gather)

    def _tag(self, what: str, step: int) -> dict:
        exchange = "all_gather" if self.gather else "ring"
        return {meta.CP_RING: {"attention": self.name, "moves": what, "step": step, "overlap": self.overlap,
                               "exchange": exchange}}

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.n

    def shift(self, x: torch.Tensor, what: str, step: int) -> torch.Tensor:
        """``x`` sent to the next rank on the ring; returns what the previous rank sent."""
        rows = x.shape[0]
        send = [rows if p == (self.rank + 1) % self.n else 0 for p in range(self.n)]
        recv = [rows if p == (self.rank - 1) % self.n else 0 for p in range(self.n)]
        with fx_traceback.annotate(self._tag(what, step)):
            sent = c10d.all_to_all_single(x.contiguous(), recv, send, self.group)
            return c10d.wait_tensor(sent)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Key and value stacked, to travel as one block (tagged, so CSE keeps backward's own)."""
        with fx_traceback.annotate(self._tag("kv", 0)):
            return torch.stack([k, v])

    def kv_blocks(self, kv: torch.Tensor):
        """``(step, source, block)`` for every rank's stacked K/V block, this rank's own first and
        then ``source(step)``'s. Ring exchange: the next block's transfer is issued before the
        current one is handed out (the ``ring_overlap`` pass sinks its wait past the block's
        attention). All-gather exchange: one gather, issued before the own block."""
        if self.gather:
            everyone = self._all_gather(kv) if self.n > 1 else None
            for step in range(self.n):
                source = self.source(step)
                # Sliced when used, so the gather's first reader comes after the own block's attention.
                yield step, source, kv if step == 0 else everyone.narrow(0, source * len(kv), len(kv))
            return
        for step in range(self.n):
            following = self.shift(kv, "kv", step + 1) if step + 1 < self.n else None
            yield step, self.source(step), kv
            kv = following

    def _all_gather(self, kv: torch.Tensor) -> torch.Tensor:
        """Every rank's ``kv`` concatenated along dim 0 in group order."""
        with fx_traceback.annotate(self._tag("kv", 1)):
            return c10d.wait_tensor(c10d.all_gather_into_tensor(kv.contiguous(), self.n, self.group))

    def reduce_scatter(self, shares: list[torch.Tensor]) -> torch.Tensor:
        """``shares[s]`` (this rank's share of rank ``s``'s dK/dV) summed over the ranks: this
        rank's own dK/dV."""
        stacked = torch.cat(shares)
        with fx_traceback.annotate(self._tag("dkv", self.n)):
            mine = c10d.reduce_scatter_tensor(stacked, "sum", self.n, self.group)
            return c10d.wait_tensor(mine)

    def ranges(self, rank: int, length: int) -> list[tuple[int, int]]:
        """Global token ranges of ``rank``'s local sequence (``length`` tokens), in local order."""
        if self.balanced:
            half = length // 2
            return [(c * half, (c + 1) * half) for c in rank_chunks(rank, self.n)]
        return [(rank * length, (rank + 1) * length)]

    def blocks(self, source: int, length: int, causal: bool) -> list[tuple[slice, slice, bool]]:
        """Kernel calls for this rank's queries against ``source``'s keys: (query rows, key
        rows, causal) in local indices."""
        whole = slice(0, length)
        if not causal:
            return [(whole, whole, False)]
        if source == self.rank:
            return [(whole, whole, True)]  # both in increasing order: the one-device mask holds
        q_ranges, k_ranges = self.ranges(self.rank, length), self.ranges(source, length)
        q_piece, k_piece = length // len(q_ranges), length // len(k_ranges)
        calls = []
        for qi, (q0, _) in enumerate(q_ranges):
            # Chunks never overlap partly: a key chunk is wholly before or wholly after a query
            # one, and the visible ones are adjacent in local order.
            visible = [ki for ki, (_, k1) in enumerate(k_ranges) if k1 <= q0]
            if not visible:
                continue
            rows = slice(qi * q_piece, (qi + 1) * q_piece)
            keys = slice(visible[0] * k_piece, (visible[-1] + 1) * k_piece)
            if calls and calls[-1][1] == keys and calls[-1][0].stop == rows.start:
                calls[-1] = (slice(calls[-1][0].start, rows.stop), keys, False)
            else:
                calls.append((rows, keys, False))
        return calls


def _rows(x: torch.Tensor, rows: slice, dim: int = SEQ) -> torch.Tensor:
    return x.narrow(dim, rows.start, rows.stop - rows.start)


def _take(x: torch.Tensor, dim: int, index_ranges, part: slice) -> torch.Tensor:
    """Entries of ``x`` along ``dim`` at the global ``index_ranges`` (a rank's tokens), then its
    local ``part`` of them."""
    pieces = [x.narrow(dim, a, b - a) for a, b in index_ranges]
    local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    return local.narrow(dim, part.start, part.stop - part.start)


def _mask_block(mask, ring: Ring, source: int, length: int, rows: slice, keys: slice):
    """The whole additive mask's entries for this rank's query ``rows`` against ``source``'s ``keys``."""
    if mask is None:
        return None
    by_rows = _take(mask, mask.dim() - 2, ring.ranges(ring.rank, length), rows)
    return _take(by_rows, mask.dim() - 1, ring.ranges(source, length), keys)


def _merge(out, lse, rows: slice, block_out, block_lse):
    """``out``/``lse`` (fp32, every local row) with one block's result on ``rows`` merged in."""
    old_out, old_lse = _rows(out, rows), _rows(lse, rows)
    new_lse = torch.logaddexp(old_lse, block_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    merged = old_out * torch.exp(old_lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return _splice(out, rows, merged), _splice(lse, rows, new_lse)


def _splice(x, rows: slice, part, dim: int = SEQ):
    """``x`` with its ``rows`` along ``dim`` replaced by ``part`` (functional)."""
    if rows.start == 0 and rows.stop == x.shape[dim]:
        return part
    pieces = [x.narrow(dim, 0, rows.start), part, x.narrow(dim, rows.stop, x.shape[dim] - rows.stop)]
    return torch.cat([p for p in pieces if p.shape[dim]], dim=dim)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _skips_later_blocks(is_causal: bool, mask, mask_within_causal: bool) -> bool:
    """Whether every key after its query is hidden: ``is_causal``, or a mask that hides them
    (``mask_within_causal``; the kernel then applies the mask's slice, not ``is_causal``)."""
    return (is_causal and mask is None) or (mask is not None and mask_within_causal)


def forward(ring: Ring, ops: AttentionOps, q, k, v, is_causal: bool, mask, scale, mask_within_causal: bool = False):
    """Local output, log-sum-exp ``[B, H, S]`` and the first block call's other outputs (the
    family's RNG state, ``cp/attention_ops.py``) of this rank's queries against the whole sequence.
    ``mask_within_causal``: ``mask`` hides every key after its query, so blocks wholly after the
    queries are skipped (``propagation/causal_mask.py``)."""
    length = q.shape[SEQ]
    acc = _accumulate_dtype(q.dtype)
    out = lse = others = None
    skipping = _skips_later_blocks(is_causal, mask, mask_within_causal)
    for _, source, kv in ring.kv_blocks(ring.pack(k, v)):
        for rows, keys, causal in ring.blocks(source, length, skipping):
            block_mask = _mask_block(mask, ring, source, length, rows, keys)
            o, l, extra = ops.block_forward(_rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys),
                                            causal and block_mask is None, block_mask, scale)
            o, l = o.to(acc), l.to(acc)
            if block_mask is not None:  # rows this block masks entirely add nothing
                hidden = torch.isneginf(block_mask).all(-1).expand_as(l)
                l = torch.where(hidden, torch.full_like(l, float("-inf")), l)
            if out is None:
                full = torch.zeros(q.shape, dtype=acc, device=q.device)
                out, lse = full, torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
                others = extra
            out, lse = _merge(out, lse, rows, o, l)
    # A row no key is visible to (only under an explicit mask): 0 and lse 0, as the one-device kernel.
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return out.to(q.dtype), lse, others


def backward(ring: Ring, ops: AttentionOps, grad_out, q, k, v, out, lse, is_causal: bool, mask, scale, rng=(),
             mask_within_causal: bool = False):
    """dQ, dK, dV of this rank's blocks (each rank's dK/dV complete after the ring closes);
    ``lse`` is ``[B, H, S]``, ``rng`` the RNG state the family's backward takes."""
    length = q.shape[SEQ]
    skipping = _skips_later_blocks(is_causal, mask, mask_within_causal)
    acc = _accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = travelling = None
    shares = [None] * ring.n  # all-gather exchange: this rank's dK/dV share of each rank's block
    for step, source, kv in ring.kv_blocks(ring.pack(k, v)):
        arrived = ring.shift(travelling, "dkv", step) if step >= 2 and not ring.gather else None
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for rows, keys, causal in ring.blocks(source, length, skipping):
            block_mask = _mask_block(mask, ring, source, length, rows, keys)
            gq, gk, gv = ops.block_backward(
                _rows(grad_out, rows), _rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys),
                _rows(out, rows), _rows(lse, rows), causal and block_mask is None, block_mask, scale, rng)
            dq = _splice(dq, rows, _rows(dq, rows) + gq.to(acc))
            kv_seq = SEQ + 1  # key and value stacked in front
            dkv = _splice(dkv, keys, _rows(dkv, keys, kv_seq) + torch.stack([gk, gv]).to(acc), kv_seq)
        if ring.gather:
            shares[source] = dkv
        elif step == 0:
            own = dkv
        else:
            travelling = dkv if arrived is None else arrived + dkv
    if ring.gather:
        own = ring.reduce_scatter(shares) if ring.n > 1 else shares[0]
    elif ring.n > 1:
        own = own + ring.shift(travelling, "dkv", ring.n)
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


def check_mask_gradient(call, name: str) -> None:
    if call.mask_needs_grad:
        raise ValueError(
            f"context-parallel attention (node {name}) cannot compute the gradient of the attention "
            "bias (it requires grad): pass a bias that does not require grad, or drop the "
            "context_parallel entry of this module")


def check_dropout(dropout_p, name: str) -> None:
    if dropout_p:
        raise ValueError(
            f"ring attention (node {name}) cannot apply attention dropout (dropout_p={dropout_p}): "
            "each block would draw other random numbers than one device; set the attention "
            "dropout to 0 or use hp.ContextParallel(mode='all_to_all')")


def ring_kernels(axis: int, context, name: str, ops: AttentionOps, mask_within_causal: bool = False):
    """The forward and backward local kernels lowering calls with the node's arguments as
    DTensors (cp/attention.py): ring attention over mesh axis ``axis`` as ``context`` (the
    ContextPlan) asks, computed with the SDPA family ``ops``; they return the op's outputs as
    local tensors."""

    def ring_of(x):
        return Ring.on_axis(compat.spec_of(x).mesh, axis, context.balanced, context.asynchronous, name,
                            context.gathers)

    def fwd(*args, **kwargs):
        call = ops.bind(ops.forward, args, kwargs)
        check_dropout(call.dropout_p, name)
        q, k, v = (compat.local_of(x) for x in (call.query, call.key, call.value))
        mask = compat.local_of(call.mask) if call.mask is not None else None
        out, lse, others = forward(ring_of(call.query), ops, q, k, v, call.is_causal, mask, call.scale,
                                   mask_within_causal)
        return ops.forward_outputs(out, lse, others, (q.shape[SEQ], k.shape[SEQ]), call.compute_lse)

    def bwd(*args, **kwargs):
        call = ops.bind(ops.backward, args, kwargs)
        check_dropout(call.dropout_p, name)
        check_mask_gradient(call, name)
        local = [compat.local_of(x) for x in (call.grad_out, call.query, call.key, call.value, call.out)]
        lse = ops.lse_tokens(compat.local_of(call.lse), local[1].shape[SEQ])
        mask = compat.local_of(call.mask) if call.mask is not None else None
        rng = local_rng(call.rng)
        grads = backward(ring_of(call.query), ops, *local, lse, call.is_causal, mask, call.scale, rng,
                         mask_within_causal)
        return ops.backward_outputs(*grads)

    return fwd, bwd
