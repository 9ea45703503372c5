"""The graph contract: what stages write on graph nodes and what they read back.

``meta``: the ``node.meta`` keys (``hp_layout``, ``hp_fsdp_unit``, …) with who writes each; ``phase``:
forward/backward of a node, defined once; ``kinds``: what each placeholder and output slot of a joint
graph is; ``ops``: op sets reasoned about by kind (views). Nothing here imports the rest of
hyper_parallel, so every stage can depend on it. See docs/architecture.md, "The graph contract".
"""

from . import kinds, meta, ops, phase
from .kinds import InputKind, OutputKind
from .phase import BACKWARD, FORWARD, Phase

__all__ = ["BACKWARD", "FORWARD", "InputKind", "OutputKind", "Phase", "kinds", "meta", "ops", "phase"]
