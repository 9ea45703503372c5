"""The replay's schedule: in which order single-device construction initialised the tensors.

``_schedule`` lists the steps (a module's own ``reset_parameters()``, or a model init hook applied
to one module) in the order the constructors ran them; ``_check_initialisable`` rejects, before
anything is materialised, a meta module that no step can initialise.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from torch import nn

from .tensors import _table


def _module_label(fqn: str, module: nn.Module) -> str:
    return f"'{fqn}' ({type(module).__name__})" if fqn else f"<root> ({type(module).__name__})"


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


@dataclasses.dataclass
class _Step:
    """One step of the replayed construction: ``reset`` (the module's own ``reset_parameters()``,
    as its constructor ran it) or ``hook`` (a model init hook applied to this module)."""

    kind: str  # "reset" | "hook"
    fqn: str
    module: nn.Module
    call: Optional[Callable[[], None]] = None  # hook steps


@dataclasses.dataclass
class _Schedule:
    steps: list
    hook_name: str = ""
    ties_visible: bool = True  # hooks see tied aliases as the shared tensor (tie before init)


def _is_hf_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _schedule(model: nn.Module, modules) -> _Schedule:
    """The order in which single-device construction initialised the model's tensors.

    * Every module: ``reset_parameters()`` in registration (pre-)order, as the constructors ran.
    * A root ``init_weights()`` (LlamaForCausalLM, torchtitan style), assumed to run at the end of
      construction: once more per module in ``modules()`` order (the order it visits them).
    * transformers ``PreTrainedModel``: each (sub-)model runs ``post_init`` at the end of its own
      constructor, applying its ``_init_weights`` children-first to the modules not initialised
      yet (a nested sub-model's modules were initialised by its own post_init); weights are tied
      after that, so its hook sees a tied alias's own tensor.
    """
    fqn_of = {id(m): fqn for fqn, m in modules}
    if _is_hf_model(model):
        steps: list = []
        visited: set = set()

        def unit(owner: nn.Module) -> None:
            members: list = []

            def construct(m: nn.Module) -> None:
                if id(m) in visited:
                    return
                if m is not owner and _is_hf_model(m):
                    unit(m)
                    return
                visited.add(id(m))
                members.append(m)
                steps.append(_Step("reset", fqn_of[id(m)], m))
                for child in m.children():
                    construct(child)

            construct(owner)
            member_ids = {id(m) for m in members}

            def post(m: nn.Module) -> None:
                if id(m) not in member_ids:
                    return
                member_ids.discard(id(m))
                for child in m.children():
                    post(child)
                steps.append(_Step("hook", fqn_of[id(m)], m, lambda m=m: owner._init_weights(m)))

            post(owner)

        unit(model)
        return _Schedule(steps, f"{type(model).__name__}._init_weights (transformers post_init)", False)
    steps = [_Step("reset", fqn, m) for fqn, m in modules]
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights):
        steps += [_Step("hook", fqn, m, init_weights) for fqn, m in modules]
        return _Schedule(steps, f"{type(model).__name__}.init_weights", True)
    return _Schedule(steps)


def _check_initialisable(schedule: _Schedule) -> None:
    hooked = {id(s.module) for s in schedule.steps if s.kind == "hook"}
    for step in schedule.steps:
        module = step.module
        if step.kind != "reset" or _has_reset(module) or id(module) in hooked:
            continue  # modules a hook covers are checked after the hook ran on them
        meta = [
            name
            for is_param in (True, False)
            for name, t in _table(module, is_param).items()
            if t is not None and t.is_meta
        ]
        if meta:
            names = ", ".join(f"'{n}'" for n in meta)
            raise ValueError(
                f"distribute_parameters: module {_module_label(step.fqn, module)} has {names} on the "
                f"meta device but no way to initialise {'it' if len(meta) == 1 else 'them'}: it "
                "defines no reset_parameters() and the model has no known init hook (a root "
                "init_weights(), or transformers' _init_weights). Fix: give "
                f"{type(module).__name__} a reset_parameters() that initialises its own parameters "
                "and buffers as its __init__ does, or build the model on a real device "
                "(hp.init_on_device('cpu') instead of hp.init_empty_weights())."
            )
