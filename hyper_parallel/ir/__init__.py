"""The graph contract: what stages write on graph nodes and what they read back.

``graph``: the captured joint graph (``CapturedGraph``, ``InputInfo``, ``OutputInfo``) and how
nodes are named in messages (``module_fqn_of``, ``describe_node``, ``source_line``); ``meta``: the
``node.meta`` keys (``hp_layout``, ``hp_fsdp_unit``, …) with who writes each; ``phase``:
forward/backward of a node, defined once; ``kinds``: what each placeholder and output slot of a joint
graph is; ``ops``: op sets reasoned about by kind (views); ``collectives``: the kind each collective
counts as, and ``Collective``; ``names``: node names without gaps. Nothing here imports the rest of
hyper_parallel but compat/, so every stage can depend on it. See docs/architecture.md, "The graph
contract".
"""

from . import kinds, meta, ops, phase
from .kinds import InputKind, OutputKind
from .phase import BACKWARD, FORWARD, Phase

__all__ = ["BACKWARD", "FORWARD", "InputKind", "OutputKind", "Phase", "kinds", "meta", "ops", "phase"]
