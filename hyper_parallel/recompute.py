"""Activation memory as plan entries: which values backward recomputes, which it swaps to host.

Regions come from three places:

* ``ParallelPlan.recompute = {module glob: policy}`` and ``hp.checkpoint_wrapper(module, policy)``;
* ``ParallelPlan.swap = {module glob: True | policy}`` and ``hp.swap_wrapper(module)``;
* ``hp.checkpoint(fn, *args, ...)`` / ``hp.swap(fn, *args, ...)`` called inside the model: while
  the model is captured they mark the nodes ``fn`` produces (``node.meta["custom"]["hp_region"]``,
  via ``torch.fx.traceback.annotate``); run eagerly (not parallelized) they behave like
  ``torch.utils.checkpoint`` / ``torch.autograd.graph.save_on_cpu``, so a model stays runnable on
  one device.

A recompute policy is ``"full"`` (recompute everything computed in the region), ``"selective"``
(keep matmul, attention and collective outputs; recompute pointwise ops, norms, views) or a
callable with the signature of torch's selective-checkpoint policies, ``policy(ctx, op, *args,
**kwargs) -> CheckpointPolicy`` (``op`` the aten overload, ``args`` fake tensors of the op's
inputs, ``ctx.module_fqn`` the module computing it); torch's own ``CheckpointPolicy`` values are
accepted too. ``MUST_SWAP`` keeps a value by copying it to host memory.

Random ops are never recomputed (their outputs are kept), so recompute never changes numbers.
:func:`resolve_activation_plan` turns the plan entries and recorded wrappers into an
:class:`ActivationPlan` that the recompute and swap passes read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from . import compat
from .plan import fqn_matches
from .ir import meta

log = logging.getLogger(__name__)


class CheckpointPolicy(enum.Enum):
    """Per-op decision (HyperParallel's names; torch's selective-checkpoint values map onto them)."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4

    @property
    def saves(self) -> bool:
        return self in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    @classmethod
    def of(cls, value: Any) -> "CheckpointPolicy":
        """Accept ours, torch.utils.checkpoint's (CPU_OFFLOAD means swap) or a bool (True = save)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.MUST_SAVE if value else cls.PREFER_RECOMPUTE
        name = getattr(value, "name", None)
        if name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"):
            return cls.MUST_SWAP
        if name in cls.__members__:
            return cls[name]
        raise TypeError(f"a recompute policy returned {value!r}; return an hp.CheckpointPolicy")


# Ops whose outputs "selective" keeps: the expensive ones to recompute.
SELECTIVE_SAVE_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.linear.default", "aten.matmul.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.wait_tensor.default",
    # An expert region's dispatch and combine: backward reads their received row counts off the
    # collective itself (sym_size), which would otherwise re-run the all-to-all in backward.
    "_c10d_functional.all_to_all_single.default",
})

# Ops whose result must never be recomputed: recomputing them would draw new random numbers. A list,
# not torch's ``nondeterministic_seeded`` tag: the tag also marks the attention kernels (they take a
# dropout probability), which full recompute must recompute when that probability is 0.
RANDOM_OPS = frozenset({
    "aten.native_dropout.default", "aten.bernoulli.default", "aten.bernoulli_.float",
    "aten.bernoulli.p", "aten.rand.default", "aten.randn.default", "aten.rand_like.default",
    "aten.randn_like.default", "aten.randint.default", "aten.randperm.default",
    "aten.uniform_.default", "aten.normal_.default",
})


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What a policy callable gets as ``ctx``."""

    module_fqn: str
    is_recompute: bool = False


@dataclasses.dataclass(frozen=True)
class Region:
    """One recompute or swap region: a module (``module_fqn``) or an annotated call (``key``)."""

    key: str  # module FQN, or "checkpoint:<n>" / "swap:<n>" for hp.checkpoint / hp.swap calls
    kind: str  # "recompute" | "swap"
    policy_name: str
    policy: Callable | None = dataclasses.field(default=None, compare=False)
    swap_inputs: bool = False  # hp.checkpoint(swap_inputs=True): the saved region inputs go to host
    group_swap: bool = False  # one host copy per region (and dtype) instead of one per tensor

    def decide(self, op_name: str, op, args, kwargs, module_fqn: str) -> CheckpointPolicy:
        """What to do with a value of this region computed by ``op``."""
        if op_name in RANDOM_OPS:
            return CheckpointPolicy.MUST_SAVE
        if self.policy_name == "selective":
            save = op_name in SELECTIVE_SAVE_OPS
            return CheckpointPolicy.PREFER_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        if self.policy is None:  # "full" recompute, or a swap region without a policy
            return CheckpointPolicy.MUST_SWAP if self.kind == "swap" else CheckpointPolicy.PREFER_RECOMPUTE
        try:
            decision = self.policy(OpContext(module_fqn), op, *args, **kwargs)
        except Exception as exc:
            raise type(exc)(f"{self.kind} policy {self.policy_name!r} of region {self.key!r} failed on {op_name}: {exc}") from exc
        return CheckpointPolicy.of(decision)


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """Module regions of the plan (outermost first) and the annotated regions of this capture."""

    modules: tuple[Region, ...] = ()
    annotated: dict = dataclasses.field(default_factory=dict, compare=False)  # key -> Region
    # recompute="auto": the repeated blocks whose policy the compiler chooses to fit a budget.
    auto_blocks: tuple[str, ...] = ()

    def region_of(self, node: torch.fx.Node, module_fqn: str) -> Region | None:
        """The region a forward node belongs to: an annotated call wins over a module region."""
        custom = node.meta.get("custom") or {}
        key = custom.get(meta.REGION) or node.meta.get(meta.REGION)
        if key is not None and key in self.annotated:
            return self.annotated[key]
        for region in self.modules:
            fqn = region.key
            if fqn == "" or module_fqn == fqn or module_fqn.startswith(fqn + "."):
                return region
        return None

    def __bool__(self) -> bool:
        return bool(self.modules or self.annotated)


# --- module-level recording (checkpoint_wrapper / swap_wrapper) ---------------------------------

_RECOMPUTE_ATTR = "_hp_recompute"
_SWAP_ATTR = "_hp_swap"


def checkpoint_wrapper(module: nn.Module, policy: Any = "full") -> nn.Module:
    """Mark ``module`` for recompute (``"full"``, ``"selective"`` or a policy callable); the
    parallelized model recomputes it in backward. The module is otherwise unchanged."""
    _policy(policy, "checkpoint_wrapper(policy=...)")
    setattr(module, _RECOMPUTE_ATTR, policy)
    return module


def swap_wrapper(module: nn.Module, offload_to: str = "cpu", *, group_swap: bool = False) -> nn.Module:
    """Mark ``module``: the activations it saves for backward are kept in host memory between
    forward and backward (copied back one region ahead of their use)."""
    if offload_to != "cpu":
        raise ValueError(f"swap_wrapper(offload_to={offload_to!r}): only 'cpu' (host memory) is supported")
    setattr(module, _SWAP_ATTR, {"group_swap": group_swap})
    return module


def _policy(policy: Any, where: str) -> tuple[str, Callable | None]:
    if policy == "full":
        return "full", None
    if policy == "selective":
        return "selective", None
    if callable(policy):
        return getattr(policy, "__name__", repr(policy)), policy
    raise ValueError(
        f"{where}: unknown recompute policy {policy!r}; use 'full', 'selective' or a callable "
        "(ctx, op, *args, **kwargs) -> hp.CheckpointPolicy"
    )


def _matched(spec: Any, model: nn.Module, entry: str) -> dict[str, Any]:
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise TypeError(f"ParallelPlan.{entry} must be a dict {{module glob: ...}}, got {type(spec).__name__}")
    module_fqns = [fqn for fqn, _ in model.named_modules()]
    out: dict[str, Any] = {}
    for glob, value in spec.items():
        matched = [fqn for fqn in module_fqns if fqn_matches(glob, fqn)] if glob else [""]
        if not matched:
            raise ValueError(
                f"{entry}[{glob!r}] matches no module of {type(model).__name__}; globs match module "
                "FQNs segment by segment, e.g. 'model.layers.*'"
            )
        for fqn in matched:
            out.setdefault(fqn, value)
    return out


AUTO = "auto"


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """FQNs of the modules held in ``nn.ModuleList``s (the decoder layers of a transformer): the
    units ``recompute="auto"`` chooses a policy for."""
    return tuple(
        f"{fqn}.{i}" if fqn else str(i)
        for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)
        for i in range(len(m))
    )


def auto_candidates(blocks: tuple[str, ...]) -> list[dict[str, str]]:
    """``recompute`` entries from "save everything" to "recompute every block fully", each
    recomputing at least as much as the one before: blocks turn selective one at a time, then
    full one at a time. Every candidate recomputes no more than all-full does."""
    candidates = []
    for level in ("selective", "full"):
        base = {b: "selective" for b in blocks} if level == "full" else {}
        for k in range(0 if level == "selective" else 1, len(blocks) + 1):
            candidates.append({**base, **{b: level for b in blocks[:k]}})
    return candidates


def auto_activation_candidates(activation: "ActivationPlan", swap: Any, model: nn.Module) -> tuple:
    """``recompute="auto"``: ``(recompute entry, ActivationPlan)`` of every candidate of
    :func:`auto_candidates` for ``activation.auto_blocks``, resolved once with the plan (the compile
    only chooses among them); ``()`` without ``auto_blocks``."""
    if not activation.auto_blocks:
        return ()
    return tuple((c, resolve_activation_plan(c, swap, model)) for c in auto_candidates(activation.auto_blocks))


def resolve_activation_plan(recompute: Any, swap: Any, model: nn.Module) -> ActivationPlan:
    """The plan's ``recompute`` / ``swap`` entries plus recorded wrappers, against ``model``.
    ``recompute="auto"`` leaves the choice to compile time (``auto_blocks``)."""
    if recompute == AUTO:
        blocks = repeated_blocks(model)
        if not blocks:
            raise ValueError(
                f"recompute='auto' chooses a policy per repeated block (the modules in an "
                f"nn.ModuleList), and {type(model).__name__} has none; give recompute as "
                "{module glob: 'full' | 'selective'}"
            )
        return dataclasses.replace(resolve_activation_plan(None, swap, model), auto_blocks=blocks)
    regions: dict[str, Region] = {}
    recompute_entries = {
        **{f: getattr(m, _RECOMPUTE_ATTR) for f, m in model.named_modules() if hasattr(m, _RECOMPUTE_ATTR)},
        **_matched(recompute, model, "recompute"),
    }
    for fqn, policy in recompute_entries.items():
        name, fn = _policy(policy, f"recompute[{fqn!r}]")
        regions[fqn] = Region(fqn, "recompute", name, fn)
    swap_entries = {
        **{f: getattr(m, _SWAP_ATTR) for f, m in model.named_modules() if hasattr(m, _SWAP_ATTR)},
        **_matched(swap, model, "swap"),
    }
    for fqn, value in swap_entries.items():
        if fqn in regions:
            raise ValueError(
                f"module {fqn!r} is in both recompute and swap; a value is either recomputed or "
                "swapped: use a recompute policy that returns CheckpointPolicy.MUST_SWAP for some ops"
            )
        group = bool(value.get("group_swap")) if isinstance(value, dict) else False
        if value is True or isinstance(value, dict):
            regions[fqn] = Region(fqn, "swap", "all", None, group_swap=group)
        elif callable(value):
            regions[fqn] = Region(fqn, "swap", getattr(value, "__name__", repr(value)), value)
        else:
            raise ValueError(f"swap[{fqn!r}] must be True, {{'group_swap': bool}} or a policy callable, got {value!r}")
    ordered = sorted(regions.values(), key=lambda r: (r.key.count(".") + (r.key != ""), r.key))
    return ActivationPlan(tuple(ordered), dict(_ANNOTATED))


# --- functional forms: hp.checkpoint / hp.swap ------------------------------------------------------

_ANNOTATED: dict[str, Region] = {}  # regions marked by calls during the current capture
_COUNTER = itertools.count()
_CAPTURING = [False]


@contextlib.contextmanager
def capturing():
    """Set while hyper_parallel captures a model: hp.checkpoint / hp.swap then mark regions, and
    so do the model's own ``torch.utils.checkpoint`` calls (transformers'
    ``gradient_checkpointing_enable()``, checkpoint wrappers): each becomes a full-recompute region."""
    _ANNOTATED.clear()
    _CAPTURING[0] = True
    try:
        with compat.torch_checkpoint_calls_marked(_torch_checkpoint_region):
            yield
    finally:
        _CAPTURING[0] = False


@contextlib.contextmanager
def _torch_checkpoint_region(selective: bool, offload: bool):
    """A ``torch.utils.checkpoint`` call met while capturing: a full-recompute region, as
    ``hp.checkpoint(fn)``; inside ``save_on_cpu`` (``offload``: transformers'
    ``activation_checkpointing_enable(offload=True)``) with its inputs swapped to host, as
    ``hp.checkpoint(fn, swap_inputs=True)``. A selective ``context_fn`` is torch's own dispatch
    mode, which the compiler cannot read: the region is recomputed fully (never fewer values kept
    than asked)."""
    if selective:
        log.warning("torch.utils.checkpoint with a context_fn (selective checkpointing) inside a "
                    "parallelized model: its region is recomputed fully; give the policy as "
                    "hp.checkpoint(fn, policy_fn=...) or ParallelPlan.recompute to keep it selective")
    key = f"checkpoint:{next(_COUNTER)}"
    _ANNOTATED[key] = Region(key, "recompute", "full", None, swap_inputs=offload)
    with fx_traceback.annotate({meta.REGION: key}):
        yield


def is_capturing() -> bool:
    """Whether hyper_parallel is capturing a model right now."""
    return _CAPTURING[0]


def forget_annotated_regions() -> None:
    """Drop the regions recorded so far in this capture (a trace that was abandoned)."""
    _ANNOTATED.clear()


def annotated_regions() -> dict[str, Region]:
    """The regions the last capture's hp.checkpoint / hp.swap calls marked."""
    return dict(_ANNOTATED)


def checkpoint(function, *args, swap_inputs: bool = False, policy_fn: Callable | None = None,
               context_fn: Callable | None = None, group_swap: bool = False, **kwargs):
    """Recompute ``function``'s activations in backward instead of keeping them (per-op
    ``policy_fn`` as in torch's selective checkpointing); ``swap_inputs`` keeps the region's inputs
    in host memory. Eagerly this is ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""
    if _CAPTURING[0]:
        name, fn = ("full", None) if policy_fn is None else _policy(policy_fn, "checkpoint(policy_fn=...)")
        key = f"checkpoint:{next(_COUNTER)}"
        _ANNOTATED[key] = Region(key, "recompute", name, fn, swap_inputs=swap_inputs, group_swap=group_swap)
        with fx_traceback.annotate({meta.REGION: key}):
            return function(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint, create_selective_checkpoint_contexts

    if policy_fn is not None and context_fn is None:
        def torch_policy(ctx, op, *a, **k):
            decision = CheckpointPolicy.of(policy_fn(ctx, op, *a, **k))
            return _torch_policy(decision)

        context_fn = lambda: create_selective_checkpoint_contexts(torch_policy)  # noqa: E731
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    if swap_inputs:
        with torch.autograd.graph.save_on_cpu():
            return torch_checkpoint(function, *args, use_reentrant=False, **extra, **kwargs)
    return torch_checkpoint(function, *args, use_reentrant=False, **extra, **kwargs)


def swap(function, *args, policy_fn: Callable | None = None, group_swap: bool = False, **kwargs):
    """Keep the activations ``function`` saves for backward in host memory. Eagerly this is
    ``torch.autograd.graph.save_on_cpu``."""
    if _CAPTURING[0]:
        key = f"swap:{next(_COUNTER)}"
        name = "all" if policy_fn is None else getattr(policy_fn, "__name__", repr(policy_fn))
        _ANNOTATED[key] = Region(key, "swap", name, policy_fn, group_swap=group_swap)
        with fx_traceback.annotate({meta.REGION: key}):
            return function(*args, **kwargs)
    with torch.autograd.graph.save_on_cpu():
        return function(*args, **kwargs)


def _torch_policy(decision: CheckpointPolicy):
    """torch.utils.checkpoint's value for ours (eager selective checkpointing)."""
    from torch.utils.checkpoint import CheckpointPolicy as T

    return T.MUST_CPU_OFFLOAD if decision is CheckpointPolicy.MUST_SWAP else T[decision.name]
