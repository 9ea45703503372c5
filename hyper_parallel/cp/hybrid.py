"""Ring attention over groups of Ulysses ranks: context parallelism with ``1 < ulysses_degree < cp``.

``hp.ContextParallel(ulysses_degree=u)`` on a cp axis of ``n = u · m`` ranks (ParallelDims'
``ulysses_degree``; USP's "unified sequence parallelism"). The cp axis is split row-major into a
ring axis of ``m`` and a Ulysses axis of ``u`` (cp/resolve.py: ``attach_context_groups``): cp rank
``r`` is Ulysses rank ``r mod u`` of group ``r div u``.

Per attention, on each rank:

1. query, key and value go from sequence- to head-sharded *within the Ulysses group*: one
   all-to-all each (cp/exchange.py). The group's ``u`` sequence pieces are consecutive, so the
   rank now holds ``heads / u`` heads of the group's block of ``S / m`` tokens;
2. ring attention (cp/ring.py) runs over the ``m`` groups' blocks on the ring sub-group: ``m − 1``
   K/V transfers of ``1/u`` of the heads each, merged by log-sum-exp, with the load-balanced
   causal order over ``2·m`` chunks (cp/load_balance.py: the balanced permutation of ``m`` ring
   ranks, cut in ``n`` pieces, gives each group its two chunks in ``u`` consecutive pieces);
3. output and log-sum-exp go back to sequence-sharded (two all-to-alls).

Backward moves the output gradient, query, key, value, output and log-sum-exp to head-sharded,
runs the ring backward (dK/dV travelling home) and moves the three gradients back. Exact, as both
parts are: each head of a group sees the group's whole block, and the ring merges the blocks.

Heads need only divide by ``u``, and the ring carries ``1/u`` of the bytes pure ring attention
would; the all-to-alls stay inside groups of ``u`` consecutive ranks (one node's fast links).
With ``mode="all_gather"`` the ring part gathers the groups' blocks at once (cp/ring.py).
"""

from __future__ import annotations

from .. import compat
from .attention_ops import AttentionOps, local_rng
from .exchange import swap_sharded_dims
from .ring import Ring, backward, check_dropout, check_mask_gradient, forward

SEQ, HEADS = 2, 1  # of [B, H, S, D] (query, key, value, output) and [B, H, S] (log-sum-exp)


def hybrid_kernels(axis: int, context, name: str, ops: AttentionOps, mask_within_causal: bool = False):
    """The forward and backward local kernels lowering calls with the node's arguments as
    DTensors (cp/attention.py): mesh axis ``axis`` is the cp axis of ``context`` (the ContextPlan,
    with its groups attached); ``ops`` is the SDPA family that computes each block;
    ``mask_within_causal``: the mask hides every key after its query (cp/ring.py)."""
    u = context.ulysses

    def placed(query, attn_mask):
        """This rank's ring (on the ring sub-group) and its share of the additive mask: a mask with
        one entry per head keeps this rank's heads (its index in the Ulysses group), a broadcast
        one stays whole."""
        r = compat.spec_of(query).mesh.get_local_rank(axis)
        ring = Ring(context.ring_group, context.ring, r // u, context.balanced, context.asynchronous, name,
                    context.gathers)
        mask = compat.local_of(attn_mask) if attn_mask is not None else None
        if mask is not None and mask.dim() >= 4 and mask.shape[-3] > 1:
            share = query.shape[HEADS] // u
            mask = mask.narrow(-3, (r % u) * share, share)
        return ring, mask

    def to_heads(*xs):
        return swap_sharded_dims(list(xs), context.ulysses_group, u, SEQ, HEADS,
                                 f"{context.axis}_ulysses: sequence -> heads")

    def to_sequence(*xs):
        return swap_sharded_dims(list(xs), context.ulysses_group, u, HEADS, SEQ,
                                 f"{context.axis}_ulysses: heads -> sequence")

    def fwd(*args, **kwargs):
        call = ops.bind(ops.forward, args, kwargs)
        check_dropout(call.dropout_p, name)
        ring, mask = placed(call.query, call.mask)
        q, k, v = to_heads(*(compat.local_of(x) for x in (call.query, call.key, call.value)))
        out, lse, others = forward(ring, ops, q, k, v, call.is_causal, mask, call.scale, mask_within_causal)
        out, lse = to_sequence(out, lse)
        return ops.forward_outputs(out, lse, others, (out.shape[SEQ], out.shape[SEQ]), call.compute_lse)

    def bwd(*args, **kwargs):
        call = ops.bind(ops.backward, args, kwargs)
        check_dropout(call.dropout_p, name)
        check_mask_gradient(call, name)
        ring, mask = placed(call.query, call.mask)
        grad_out, q, k, v, out = (compat.local_of(x) for x in (call.grad_out, call.query, call.key, call.value,
                                                               call.out))
        lse = ops.lse_tokens(compat.local_of(call.lse), q.shape[SEQ])
        q, k, v = to_heads(q, k, v)  # as forward moved them: CSE merges the two
        grad_out, out, lse = to_heads(grad_out, out, lse)
        rng = local_rng(call.rng)
        grads = backward(ring, ops, grad_out, q, k, v, out, lse, call.is_causal, mask, call.scale, rng,
                         mask_within_causal)
        return ops.backward_outputs(*to_sequence(*grads))

    return fwd, bwd
