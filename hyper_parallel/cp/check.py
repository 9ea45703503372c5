"""The check that context-parallel attention stays sequence-sharded.

Context parallelism computes attention on sequence shards only through the SDPA ops our rules know
(``propagation/attention_rules.py``: the CPU flash kernel and the GPU flash, memory-efficient and
cuDNN kernels, with their backwards). Any other form of
attention in a context-parallel module — the eager math form (``q @ k.T``, softmax, ``@ v``), an
SDPA variant we have no rule for — would still give the right numbers, because DTensor gathers the
whole sequence over the cp axis to compute it. That gather is exactly what context parallelism is
for avoiding (every rank would hold the whole sequence's keys and values, or its full attention
matrix), so it is refused.

Reads the propagated joint graph (``hp_layout`` of each node and of its inputs' producers) and the
``ContextPlan``. Raises ``ValueError`` naming the node, its op, module and source line, and the fix.
"""

from __future__ import annotations

import torch

from ..compat import pytree
from ..ir.graph import describe_node, module_fqn_of
from ..ir import meta
from ..layout import format_placements
from .attention_ops import FAMILIES
from .load_balance import sequence_dim

KNOWN_ATTENTION_OPS = tuple(
    str(op).removesuffix(".default") for f in FAMILIES for op in (f.forward, f.backward)
)


def _output_spec(node: torch.fx.Node):
    layout = node.meta.get(meta.LAYOUT)
    return None if layout is None else layout.output


def _inside(fqn: str, modules: tuple[str, ...]) -> bool:
    return any(fqn == m or fqn.startswith(m + ".") for m in modules)


def check_attention_stays_sharded(gm: torch.fx.GraphModule, context, mesh) -> None:
    """Refuse an op in a context-parallel module that gathers a sequence-sharded activation."""
    if context is None or context.degree <= 1:
        return
    axis = mesh.mesh_dim_names.index(context.axis)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _inside(module_fqn_of(node), context.modules):
            continue
        layout = node.meta.get(meta.LAYOUT)
        if layout is None or not layout.inputs:
            continue
        # The tensor arguments in the order propagation gave their layouts (as lowering reads them).
        flat = pytree.tree_leaves((node.args, node.kwargs))
        tensor_inputs = [a for a in flat if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        for producer, wanted in zip(tensor_inputs, layout.inputs):
            have = _output_spec(producer)
            if not hasattr(have, "placements") or not hasattr(wanted, "placements"):
                continue
            if sequence_dim(have.placements[axis]) is not None and sequence_dim(wanted.placements[axis]) is None:
                raise ValueError(
                    f"context parallelism ({context.source}): {describe_node(node)} reads "
                    f"{producer.name} whole over {context.axis!r} ({format_placements(have.placements)} -> "
                    f"{format_placements(wanted.placements)}): this form of attention would gather the "
                    "whole sequence on every rank. Context-parallel attention runs through "
                    "torch.nn.functional.scaled_dot_product_attention (ops "
                    f"{', '.join(KNOWN_ATTENTION_OPS)}): use it in this module (for transformers models "
                    "attn_implementation='sdpa'), without dropout"
                )
