"""``CompileRequest``: everything one compile reads besides the module and the call's inputs.

The driver (compile/driver.py) takes a request and returns a program; it changes nothing of the
module's run-time state (``runtime.module.ParallelState``), which builds the request for each
cache miss (``ParallelState.compile_request``) and records what the compile read (the module
attributes the forward read: ``CompiledEntry.reads``). A planner builds requests itself, one per
candidate plan, without a parallelized module's state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..plan import ResolvedPlan
from ..recompute import ActivationPlan
from .options import CompileOptions


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    mesh: Any  # the DeviceMesh the programs run on (a pipeline's stage mesh)
    resolved: ResolvedPlan  # the resolved plan, with this call's FSDP flags applied
    activation: ActivationPlan  # recompute and swap regions
    options: CompileOptions
    original_cls: type  # the model's own class: captured with it, not the parallel subclass
    # FQN -> (global shape, dtype, requires_grad, capture device) of every parameter, also those
    # a pipeline split released from this rank (captured as fake tensors of these)
    parameters: Mapping[str, tuple]
    explicit_prefetch: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # set_modules_to_*_prefetch
    # recompute="auto": (the recompute entry, its ActivationPlan) of each candidate, from saving
    # everything to recomputing every block fully (recompute.auto_candidates), resolved with the plan
    auto_candidates: tuple[tuple[dict, ActivationPlan], ...] = ()

    @property
    def model_name(self) -> str:
        return self.original_cls.__name__
