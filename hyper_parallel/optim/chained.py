"""ChainedOptimizer: several optimizers stepped as one, each over its own disjoint parameters.

The usual pairing is Muon for the hidden layers' weight matrices and AdamW for everything else
(:func:`hyper_parallel.optim.get_hyper_optimizer`). The chain looks like one optimizer to a training
loop:

* ``step(closure=None)`` evaluates the closure once and steps every optimizer, in order;
  ``zero_grad(set_to_none=True)`` clears all gradients.
* ``param_groups`` is the concatenation of the optimizers' groups, the same dict objects, so a
  learning-rate schedule that sets ``group["lr"]`` drives all of them; ``state`` maps each parameter
  to its state, whichever optimizer holds it.
* Iterating yields the optimizers, so functions that take "an optimizer or an iterable of them"
  accept the chain: ``hp.get_optimizer_state_dict(model, chain)``, ``hp.set_optimizer_state_dict``,
  ``hp.save_checkpoint(path, model, chain)`` / ``hp.load_checkpoint`` (via
  ``torch.distributed.checkpoint.state_dict``, which keys state by parameter name, so one
  checkpoint holds every optimizer's state).
* ``state_dict()`` / ``load_state_dict()``: with ``flatten=False`` a dict keyed by optimizer name
  whose values are the optimizers' own ``state_dict()`` (exact round trip on the same model and
  plan); with ``flatten=True`` one flat dict keyed by parameter name (``"state.<fqn>.<key>"``,
  ``"param_groups.<fqn>.<key>"``, torch's ``flatten_optimizer_state_dict`` format), which does not
  depend on how parameters are grouped into optimizers or sharded: the form for checkpoints that
  are resharded or regrouped.

No parameter may belong to two optimizers: it would be updated twice per step. The constructor
raises ``ValueError`` naming such a parameter (its name in ``model``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as torch_state_dict

__all__ = ["ChainedOptimizer"]


def _named(optimizers) -> dict[str, torch.optim.Optimizer]:
    if isinstance(optimizers, Mapping):
        named = dict(optimizers)
    else:  # a sequence: named after their classes ("muon", "adamw"), numbered when repeated
        named = {}
        for opt in optimizers:
            base = type(opt).__name__.lower()
            name, n = base, 1
            while name in named:
                n += 1
                name = f"{base}_{n}"
            named[name] = opt
    if not named:
        raise ValueError("ChainedOptimizer needs at least one optimizer")
    for name, opt in named.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"ChainedOptimizer: optimizer names must be non-empty strings, got {name!r}")
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"ChainedOptimizer: {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
    return named


@contextlib.contextmanager
def _fresh_state_initialisable(optimizers) -> Iterator[None]:
    """Gradients of optimizers without state set aside while torch's state-dict code loads a flat
    dict: it unflattens along the optimizer's existing state keys, creating them with a zero-lr
    step, which it skips when any gradient is set (a fresh optimizer mid-run would load nothing)."""
    stashed = [(p, p.grad) for opt in optimizers if not opt.state
               for group in opt.param_groups for p in group["params"] if p.grad is not None]
    for p, _ in stashed:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in stashed:
            p.grad = grad


class ChainedOptimizer:
    """Steps the optimizers ``optimizers`` (a dict name -> optimizer, or a sequence, named after
    their classes) as one; ``model`` names parameters in errors and state dicts; ``flatten``
    selects the state-dict form (see the module docstring)."""

    def __init__(self, model: nn.Module | None,
                 optimizers: Mapping[str, torch.optim.Optimizer] | Sequence[torch.optim.Optimizer],
                 flatten: bool = False) -> None:
        self.model = model
        self.flatten = bool(flatten)
        self._optimizers = _named(optimizers)
        if self.flatten and model is None:
            raise ValueError("ChainedOptimizer(flatten=True) keys state by parameter name: pass the model")
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)} if model is not None else {}
        owner: dict[int, str] = {}
        for opt_name, opt in self._optimizers.items():
            for i, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    first = owner.setdefault(id(p), opt_name)
                    if first != opt_name:  # (torch refuses repeats within one optimizer itself)
                        what = names.get(id(p), f"params[{j}] of param group {i} (shape {tuple(p.shape)})")
                        raise ValueError(
                            f"ChainedOptimizer: parameter {what} is in optimizer {first!r} and in {opt_name!r}; "
                            "each parameter must belong to exactly one optimizer"
                        )

    # -- the optimizers -------------------------------------------------------------------------

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Name -> optimizer, in stepping order (a copy of the mapping)."""
        return dict(self._optimizers)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self._optimizers.values())

    def __len__(self) -> int:
        return len(self._optimizers)

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self._optimizers[name]

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={type(opt).__name__}" for name, opt in self._optimizers.items())
        return f"ChainedOptimizer({parts}, flatten={self.flatten})"

    # -- the optimizer interface -----------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's param groups, concatenated (the live dicts: writes reach the optimizers)."""
        return [group for opt in self for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Parameter -> its optimizer state, over all optimizers (a merged view: read it, the
        optimizers' own ``state`` is where they write)."""
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in self:
            merged.update(opt.state)
        return merged

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` (if given) once, then step every optimizer in order."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{name: optimizer.state_dict()}``, or with ``flatten`` one parameter-name-keyed flat dict."""
        if self.flatten:
            options = torch_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
            return torch_state_dict.get_optimizer_state_dict(self.model, tuple(self), options=options)
        return {name: opt.state_dict() for name, opt in self._optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (same ``flatten``); ``ValueError`` on a dict of the
        other form or naming other optimizers."""
        if self.flatten:
            if set(state_dict) & set(self._optimizers):
                raise ValueError("ChainedOptimizer(flatten=True) got a per-optimizer state dict (flatten=False's form)")
            options = torch_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
            with _fresh_state_initialisable(self):
                torch_state_dict.set_optimizer_state_dict(self.model, tuple(self), dict(state_dict), options=options)
            return
        missing = [name for name in self._optimizers if name not in state_dict]
        unexpected = [name for name in state_dict if name not in self._optimizers]
        if missing or unexpected:
            raise ValueError(
                f"ChainedOptimizer.load_state_dict: the dict is keyed by optimizer name; missing {missing}, "
                f"unexpected {sorted(map(str, unexpected))[:5]} (a flatten=True dict needs "
                "ChainedOptimizer(flatten=True))"
            )
        for name, opt in self._optimizers.items():
            opt.load_state_dict(state_dict[name])
