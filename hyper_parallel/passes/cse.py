"""cse: common-subexpression elimination over the local joint graph, collectives included.

Lowering redistributes each *use* of a value separately, so a value needed in the same layout by two
consumers is communicated twice (under tensor parallelism the logits are all-gathered once for the
loss and once for the user-visible output). Two nodes with the same target and the same arguments
compute the same thing; the later one is replaced by the earlier one.

Reads: ``hp_cp_ring`` (ring attention's transfers are never merged). Writes: removes duplicate nodes (their users are rewired to the
survivor, whose meta is kept). Pure ops and ``_c10d_functional`` collectives and waits qualify
(functional collectives are pure by construction: same input, group and size, same result); ops
with side effects or randomness never do. Idempotent; numerics unchanged.
"""

from __future__ import annotations

import torch

from .. import compat
from ..ir import meta
from ..propagation import recompile

_C10D_NAMESPACE = "_c10d_functional"


def _eligible(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if meta.CP_RING in node.meta:
        # Ring attention sends K/V around the ring again in backward on purpose: reusing forward's
        # transfers would keep every rank's K/V blocks alive until backward (cp/ring.py).
        return False
    target = node.target
    if isinstance(target, compat.OpOverload):  # the type of every torch.ops.<ns>.<op>.<overload>
        if target.namespace == _C10D_NAMESPACE:
            return True
        if compat.is_random_op(target) or compat.is_mutating_op(target):
            return False
    return not node.is_impure()


def _key(node: torch.fx.Node):
    def freeze(a):
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(freeze(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, freeze(v)) for k, v in a.items())))
        if isinstance(a, torch.fx.Node):
            return ("node", a.name)
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return ("torch", str(a))
        return ("const", type(a).__name__, a)

    return (str(node.target), freeze(node.args), freeze(node.kwargs))


def cse_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    seen: dict = {}
    for node in list(gm.graph.nodes):
        if not _eligible(node):
            continue
        try:
            key = _key(node)
            hash(key)
        except TypeError:  # an unhashable constant argument: leave the node alone
            continue
        survivor = seen.setdefault(key, node)
        if survivor is not node:
            node.replace_all_uses_with(survivor)
            gm.graph.erase_node(node)
    recompile(gm)
    return gm
