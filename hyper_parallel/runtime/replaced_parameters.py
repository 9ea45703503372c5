"""Optimizers built before the model was parallelized: they get the parallel parameters.

``parallelize`` replaces every parameter of the model by a DTensor (its shard and layout). An
optimizer built from ``model.parameters()`` *before* that still holds the replaced tensors, which
never get a gradient again: ``optimizer.step()`` then updated nothing, every step, with no error
(FSDP2 asks for the optimizer to be built after ``fully_shard`` for the same reason). The same holds
for ``torch.compile(model, backend="hyper_parallel")``, which parallelizes on the first call.

So each replacement is remembered (weakly: a replaced tensor nobody holds is forgotten), and a
step pre-hook on every optimizer puts the parallel parameter in the replaced one's place before the
optimizer's first step. An optimizer that already has state for a replaced parameter (it stepped
before) is an error naming it: that state is not sharded. A parameter the model no longer holds on
this rank (a pipeline stage run elsewhere) leaves the optimizer."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(replaced parameter) -> (weak replaced parameter, weak parallel parameter, FQN, what replaced it,
# after what to build the optimizer)
_REPLACED: dict[int, tuple[weakref.ref, weakref.ref, str, str, str]] = {}
_HOOK: list = []


def remember_replacements(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], by: str,
                          build_after: str) -> None:
    """Record ``before[fqn]`` -> ``after[fqn]`` for every parameter that changed; ``by`` names what
    replaced them and ``build_after`` when an optimizer should be built instead (for the error)."""
    for fqn, old in before.items():
        new = after.get(fqn)
        if new is not None and new is not old:
            key = id(old)
            _REPLACED[key] = (weakref.ref(old, lambda _, key=key: _REPLACED.pop(key, None)), weakref.ref(new),
                              fqn, by, build_after)
    if _REPLACED and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_use_parallel_parameters))


def _use_parallel_parameters(optimizer, args, kwargs) -> None:
    """Before an optimizer steps: put the parallel parameters in place of the ones they replaced."""
    if not _REPLACED:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        kept = []
        for p in params:
            entry = _REPLACED.get(id(p))
            if entry is None or entry[0]() is not p:
                kept.append(p)
                continue
            old_ref, new_ref, fqn, by, build_after = entry
            if optimizer.state.get(p):
                raise RuntimeError(
                    f"the optimizer has state for parameter {fqn!r} from before {by} replaced it by its "
                    "parallel (sharded) version; that state is not sharded. Build the optimizer from "
                    f"model.parameters() after {build_after}, or load its state with "
                    "hp.set_optimizer_state_dict"
                )
            new = new_ref()
            if new is not None:  # else the parameter left this rank (another pipeline stage's)
                kept.append(new)
        params[:] = kept
