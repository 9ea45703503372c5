"""Op sets the compiler reasons about by kind rather than one by one."""

from __future__ import annotations

import torch

from .. import compat

aten = torch.ops.aten

# Ops whose result re-views their first argument's storage, as the recompute pass walks them back to
# a graph input (a re-view of an input costs nothing to keep: the input's storage lives anyway).
VIEW_OPS = frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default,
    aten.view.default, aten._unsafe_view.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default,
    aten.slice.Tensor, aten.select.int,
})

# Ops that alias their input but whose schema does not say so.
VIEWS_WITHOUT_ANNOTATION = frozenset({aten._unsafe_view.default})


def aliases_input(target) -> bool:
    """Whether an op (an OpOverload; anything without a schema is not) may return an input's
    storage: its schema's alias annotations (views and in-place ops), plus
    :data:`VIEWS_WITHOUT_ANNOTATION`."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return target in VIEWS_WITHOUT_ANNOTATION or any(r.alias_info is not None for r in schema.returns)


def is_view_of_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` only re-views a graph input (e.g. ``t(weight)``): keeping it costs nothing,
    the input's storage lives anyway, so it is neither swapped nor counted as an activation."""
    while node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node.op == "placeholder"


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws from a random generator when it runs: a seeded op (torch's
    ``nondeterministic_seeded`` tag: dropout, bernoulli, rand...), except an attention kernel called
    with ``dropout_p=0`` (training without attention dropout, and always in eval), which the tag
    marks too."""
    target = node.target
    if not compat.is_random_op(target):
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", target._schema.arguments[i].default_value)
    return value != 0
