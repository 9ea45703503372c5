"""The ``node.meta`` keys hyper_parallel writes on graph nodes: the graph contract between stages.

Every key a stage writes and a later stage (or a dump) reads is named here once; code elsewhere
uses these constants, never the spelled-out string (``tests/package/test_imports.py`` checks). Each
entry says who writes it and what its value is. The values are the strings the dumps show, so
renaming a constant's value changes every dump.
"""

from __future__ import annotations

import torch

# --- propagation (propagation/engine.py) ----------------------------------------------------------
LAYOUT = "hp_layout"  # NodeLayout: the input layouts a node computes with and its output layout
LOSS_MEAN = "hp_loss_mean"  # True on the global token-mean loss (propagation/loss_reduction.py)
PLAN_ENTRY = "hp_plan_entry"  # on boundary / boundary_grad nodes: the plan entry they apply, as text
# The propagation report's lines, on the nodes they are about (a report can be rebuilt from a graph):
FALLBACK = "hp_fallback"  # on a node run replicated for want of a rule: why, one line
BOUNDARY_CHANGE = "hp_boundary_change"  # on a boundary node whose plan entry changes the layout: the line

# --- FSDP (propagation/unshard.py, passes/reshard_after_forward.py, passes/bucketing.py) ----------
FSDP_PARAM = "hp_fsdp_param"  # FQN of the FSDP parameter an all-gather (or its copy) gathers
FSDP_UNIT = "hp_fsdp_unit"  # the FSDP unit (module FQN) the gathered parameter belongs to
FSDP_PHASE = "hp_fsdp_phase"  # "backward" on gathers backward re-issues; absent = forward
FSDP_POST_FORWARD = "hp_fsdp_post_forward"  # k: the 1/k piece kept after forward (int reshard)
# FQN of the FSDP parameter whose shard a node casts to the unit's ``param_dtype`` (mixed precision;
# before the all-gather, or all there is of "gathering" on a shard axis of one rank)
FSDP_CAST = "hp_fsdp_cast"

# --- lowering (compile/lower.py) ---------------------------------------------------------------------------
SOURCE = "hp_source"  # name of the joint-graph node a lowered node comes from
ROLE = "hp_role"  # one of the ROLE_* values below
REDISTRIBUTE = "hp_redistribute"  # text of a layout change, "S(0) -> R"
GRAD_OF = "hp_grad_of"  # FQN of the parameter whose gradient a collective reduces
WHY = "hp_why"  # on redistributions: why the program has them, one line (analysis/why.py)

ROLE_COMPUTE = "compute"  # the op of the source node, on local shards
ROLE_REDISTRIBUTE = "redistribute"  # a collective (or local slice) that changes a layout
ROLE_ACCUMULATE = "accumulate"  # the add of a gradient accumulated by earlier micro-steps

# --- activation regions (recompute.py marks them at capture; passes/recompute.py, passes/swap.py) -
REGION = "hp_region"  # key of the recompute/swap region a captured node belongs to
RECOMPUTE = "hp_recompute"  # region key on a copy recomputed in backward
SWAP = "hp_swap"  # region key on a forward value to copy to the host for backward
SWAP_GROUP = "hp_swap_group"  # True: the region's values move as one host buffer
SWAP_COPY = "hp_swap_copy"  # "to_host" | "to_device" on the swap pass's copy nodes
SWAP_TO_HOST, SWAP_TO_DEVICE = "to_host", "to_device"

# --- expert regions (moe/lowering.py; passes/expert_overlap.py) -----------------------------------
EXPERT_CHUNK = "hp_expert_chunk"  # "<experts module fqn>#<chunk>" on the nodes of one token chunk

# --- context parallelism (cp/ring.py; passes/ring_overlap.py, passes/cse.py, analysis/debug.py) ---
# {"attention": node, "moves": "kv" | "dkv", "step": t, "overlap": bool, "exchange": "ring" |
# "all_gather"} on a ring transfer
CP_RING = "hp_cp_ring"
# True on an attention node (forward and backward) whose explicit mask reads an input but hides
# every key after its query: a causal mask and'ed with a padding mask (propagation/causal_mask.py).
# Ring attention then skips the K/V blocks after the queries as for is_causal (cp/ring.py).
MASK_WITHIN_CAUSAL = "hp_mask_within_causal"

# --- gradient and gather fusion (passes/bucketing.py) ---------------------------------------------
BUCKET = "hp_bucket"  # "<unit> <phase> <kind> (<n> params)" on fused collectives
PACK = "hp_pack"  # True on the nodes packing a fused collective's buffer or copying out of it: a bucket's cat, an FSDP unit's copy-out of its gathered rows (codegen/regions.py keeps them op by op)

# --- in-place reuse (passes/inplace_reuse.py; runtime/program.py) -----------------------------------
INPLACE_OF = "hp_inplace_of"  # the out-of-place op an in-place node replaced (its result took an input's storage)

# --- the per-call agreement (runtime/agreement_gate.py; cost/simulate.py) --------------------------
AGREEMENT_GATE = "hp_agreement_gate"  # True on the forward program's wait for the per-call agreement

# Keys lowering copies from a joint-graph node onto the nodes it becomes (besides ROLE/SOURCE/LAYOUT,
# which lowering sets itself). torch's own keys first: source lines and module stacks for dumps and
# errors, the phase tag for the partition.
COPIED_BY_LOWERING = (
    "stack_trace", "nn_module_stack", "fwd_nn_module_stack", "partitioner_tag", "seq_nr",
    FSDP_PARAM, FSDP_UNIT, FSDP_PHASE, FSDP_CAST, LOSS_MEAN,
)

ALL_KEYS = (
    LAYOUT, LOSS_MEAN, PLAN_ENTRY, FALLBACK, BOUNDARY_CHANGE, FSDP_PARAM, FSDP_UNIT, FSDP_PHASE, FSDP_POST_FORWARD,
    FSDP_CAST, SOURCE, ROLE, REDISTRIBUTE, GRAD_OF, WHY, REGION, RECOMPUTE, SWAP, SWAP_GROUP, SWAP_COPY, BUCKET, PACK, EXPERT_CHUNK,
    CP_RING, MASK_WITHIN_CAUSAL, INPLACE_OF, AGREEMENT_GATE,
)


def is_redistribute(node: torch.fx.Node) -> bool:
    """A layout change lowering (or a pass standing in for one) inserted."""
    return node.meta.get(ROLE) == ROLE_REDISTRIBUTE

