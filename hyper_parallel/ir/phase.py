"""Forward or backward: the one definition of a node's phase in the joint graph.

Captured nodes carry autograd's ``partitioner_tag`` (``"is_forward"`` / ``"is_backward"``); passes
that add nodes tag them with :func:`tag`. FSDP's backward re-gathers are also marked by
``meta.FSDP_PHASE``. :func:`is_tagged_backward` answers from a node's own tags (what passes use
while they edit the graph); :func:`phases_of` gives every node its phase, an untagged node being
backward when one of its inputs is (what the forward/backward partition and the pipeline split use).
"""

from __future__ import annotations

import enum

import torch

from . import meta


class Phase(enum.StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


FORWARD, BACKWARD = Phase.FORWARD, Phase.BACKWARD

PARTITIONER_TAG = "partitioner_tag"  # torch's key
_TAG_OF = {FORWARD: "is_forward", BACKWARD: "is_backward"}


def tag(node: torch.fx.Node, phase: Phase) -> None:
    """Mark ``node`` as running in ``phase`` (autograd's partitioner tag)."""
    node.meta[PARTITIONER_TAG] = _TAG_OF[Phase(phase)]


def tag_value(phase: Phase) -> str:
    """The ``partitioner_tag`` value of ``phase``, for building a meta dict."""
    return _TAG_OF[Phase(phase)]


def is_tagged_backward(node: torch.fx.Node) -> bool:
    """Tagged backward (by capture or a pass), or an FSDP gather marked for backward."""
    return node.meta.get(PARTITIONER_TAG) == "is_backward" or node.meta.get(meta.FSDP_PHASE) == BACKWARD


def is_tagged_forward(node: torch.fx.Node) -> bool:
    return node.meta.get(PARTITIONER_TAG) == "is_forward"


def gather_phase(node: torch.fx.Node) -> Phase:
    """The phase an FSDP all-gather serves: backward for backward's re-gather, else forward."""
    return Phase(node.meta.get(meta.FSDP_PHASE, FORWARD))


def phase_of(node: torch.fx.Node, phases: dict) -> Phase:
    """``node``'s phase given the phases of the nodes before it (``phases``): tangent placeholders
    and tagged nodes are backward, so is an untagged node that reads a backward value."""
    if node.op == "placeholder":
        return BACKWARD if "tangents" in node.name else FORWARD
    if is_tagged_backward(node):
        return BACKWARD
    if any(phases.get(a) == BACKWARD for a in node.all_input_nodes):
        return BACKWARD
    return FORWARD


def phases_of(graph: torch.fx.Graph) -> dict[torch.fx.Node, Phase]:
    """Every node's phase except the output node's, in one walk in graph order."""
    phases: dict[torch.fx.Node, Phase] = {}
    for node in graph.nodes:
        if node.op != "output":
            phases[node] = phase_of(node, phases)
    return phases
