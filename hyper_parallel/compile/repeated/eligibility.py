"""Repeated blocks, eligibility: which ModuleList's blocks may be traced two and copied.

The copies are exact only when the blocks are one class with the same parameters and buffers
(names, shapes, dtypes), the same submodule classes and the same plain attributes, where an
attribute may differ only by holding the block's own index (transformers' ``layer_idx``); their
hooks are the same code over equal values (FSDP's mixed-precision casts); no block shares a
parameter with another or is planned differently from block 1 (:func:`find_repeated_blocks`).
What the traced graph must show besides is checked in :mod:`.correspondence`.

Reads: the model and the plan's module boundaries. Writes: nothing (the list to copy, or why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Callable

import torch
import torch.nn as nn

from .renaming import renamer

TRACED = 2  # blocks traced: block 0, and block 1 as the template of the others

_SIMPLE = (int, float, str, bool, type(None))


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """The ModuleList whose blocks are traced two and copied: its FQN and its length."""

    prefix: str
    count: int


class BlocksDiffer(Exception):
    """Why the traced blocks cannot stand for the others; the compile then traces them all."""


def check_option(value, model: nn.Module):
    """``repeated_blocks`` as ``parallelize`` accepts it: None, ``"auto"`` or a ModuleList's FQN."""
    if value is None or value == "auto":
        return value
    lists = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not isinstance(value, str):
        raise TypeError(f"repeated_blocks is None, 'auto' or the FQN of a ModuleList, got {value!r}")
    if value not in lists:
        raise ValueError(
            f"repeated_blocks={value!r}: {type(model).__name__} has no ModuleList of that name; "
            f"its ModuleLists are {lists or 'none'}. Pass one of them, 'auto', or None")
    return value


def find_repeated_blocks(model: nn.Module, option, boundaries) -> tuple[RepeatedBlocks | None, str]:
    """The list to trace two blocks of, or None and why not. ``option``: ``"auto"`` (the
    ModuleList of identical blocks holding the most parameters) or a ModuleList's FQN;
    ``boundaries``: the plan's module boundaries (capture's annotations), compared per block."""
    if option is None:
        return None, "not asked for"
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if option != "auto":
        lists = [(fqn, m) for fqn, m in lists if fqn == option]
    reasons = []
    found = []
    for fqn, blocks in lists:
        why = _why_not_repeated(fqn, list(blocks), boundaries)
        if why:
            reasons.append((sum(p.numel() for p in blocks.parameters()), f"{fqn}: {why}"))
        else:
            found.append((sum(p.numel() for p in blocks.parameters()), fqn, len(blocks)))
    if not found:  # the reasons of the largest lists: those a user means
        reasons.sort(key=lambda r: -r[0])
        return None, "; ".join(text for _, text in reasons[:2]) or "the model has no ModuleList"
    _, fqn, count = max(found)
    return RepeatedBlocks(fqn, count), ""


@contextlib.contextmanager
def first_blocks_only(model: nn.Module, blocks: RepeatedBlocks):
    """The model with its list cut to the first :data:`TRACED` blocks while the block runs; yields
    the cut list (a :class:`FirstBlocks`, whose ``seen`` tells, once the block is left, what the
    model's code read of it)."""
    parent_fqn, _, name = blocks.prefix.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    full = getattr(parent, name)
    cut = FirstBlocks(list(full)[:TRACED], len(full))
    parent._modules[name] = cut
    _SEEN[id(cut)] = []
    try:
        yield cut
    finally:
        parent._modules[name] = full
        cut.seen = _SEEN.pop(id(cut))


# What the model's code read of each cut list, while it is cut: kept outside the module, whose
# attributes export restores after tracing.
_SEEN: dict[int, list[str]] = {}


_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]]))


class FirstBlocks(nn.ModuleList):
    """A list of blocks cut to the traced ones, noting what of the model's own code would see the
    cut: its length (``len(self.layers)`` in a formula, a loop over ``range(len(...))``), an index
    past the traced blocks or from the end, a slice that does not take the whole list. A trace that
    read any of these is not the trace of every block with copies written in, so the compile traces
    every block (:func:`~.capture.capture_blocks_once`). Reads by torch and this package (module
    traversal, hooks) are not the model's and are not noted."""

    def __init__(self, traced: list[nn.Module], full_count: int):
        super().__init__(traced)
        self.full_count = full_count
        self.seen: list[str] = []  # set when the list is put back (first_blocks_only)

    def _note(self, what: str) -> None:
        caller = sys._getframe(2)
        if id(self) in _SEEN and not caller.f_code.co_filename.startswith(_LIBRARIES):
            _SEEN[id(self)].append(f"{what} at {caller.f_code.co_filename}:{caller.f_lineno}")

    def __len__(self) -> int:
        self._note("len()")
        return super().__len__()

    def __getitem__(self, index):
        if isinstance(index, slice):
            if index.indices(self.full_count) != (0, self.full_count, 1):
                self._note(f"slice [{index.start}:{index.stop}:{index.step}]")
            # nn.ModuleList slices into ``type(self)(...)``, which has no full_count; the slice a
            # model iterates over is a plain list of the traced blocks.
            return nn.ModuleList(list(self._modules.values())[index])
        if isinstance(index, int) and not 0 <= index < TRACED:
            self._note(f"index [{index}]")
        return super().__getitem__(index)


def _why_not_repeated(prefix: str, blocks: list[nn.Module], boundaries) -> str:
    if len(blocks) <= TRACED:
        return f"{len(blocks)} blocks: copying pays from {TRACED + 1}"
    if len({id(b) for b in blocks}) < len(blocks):
        return "one module appears twice in the list (shared weights)"
    template = _structure(blocks[1])
    for i, block in enumerate(blocks):
        if type(block) is not type(blocks[1]):
            return f"block {i} is a {type(block).__name__}, block 1 a {type(blocks[1]).__name__}"
        if _structure(block) != template:
            return f"block {i}'s submodules, parameters or buffers differ from block 1's"
        hooks, template_hooks = _hooks(block), _hooks(blocks[1])
        if hooks != template_hooks:
            name = next(n for n in {**hooks, **template_hooks} if hooks.get(n) != template_hooks.get(n))
            return f"block {i}'s hooks on {name or 'itself'!r} differ from block 1's"
    attributes = [_attributes(block) for block in blocks]
    for key in sorted({k for a in attributes for k in a}):
        values = [a.get(key) for a in attributes]
        if any(v != values[1] for v in values) and values != list(range(len(blocks))):
            where = ".".join(filter(None, key))
            return f"attribute {where!r} differs between blocks ({values[0]!r}, {values[1]!r}, ...)"
    params = {id(p) for b in blocks for p in b.parameters()}
    if len(params) < sum(1 for b in blocks for _ in b.parameters()):
        return "blocks share parameters"
    planned = _planned_boundaries(prefix, 1, boundaries)
    for i in range(len(blocks)):
        if _planned_boundaries(prefix, i, boundaries, rename=renamer(prefix, i, 1)) != planned:
            return f"the plan annotates block {i}'s inputs or outputs unlike block 1's"
    return ""


def _structure(block: nn.Module) -> tuple:
    """Submodule classes, parameter and buffer names/shapes/dtypes: equal for blocks that trace alike."""
    modules = tuple((name, type(m)) for name, m in block.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return modules, params, buffers


def _hooks(block: nn.Module) -> dict:
    """Submodule -> what its hooks do: the same hook code closing over equal values in every block
    (FSDP's mixed-precision casts) traces alike; anything else counts as different."""
    out = {}
    for name, m in block.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values(), *m._backward_pre_hooks.values(),
                 *m._backward_hooks.values()]
        if hooks:
            out[name] = tuple(_function_signature(h) for h in hooks)
    return out


def _function_signature(fn, depth: int = 0):
    if depth > 3 or not hasattr(fn, "__code__"):
        return fn if isinstance(fn, (*_SIMPLE, torch.dtype)) else ("object", id(fn))
    cells = tuple(_function_signature(c.cell_contents, depth + 1) for c in (fn.__closure__ or ()))
    return fn.__code__, cells


def _attributes(block: nn.Module) -> dict:
    """(submodule, attribute) -> value of every plain attribute: equal across blocks, or each
    block's own index (transformers' ``layer_idx``)."""
    attrs = {}
    for name, m in block.named_modules():
        for key, value in vars(m).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _SIMPLE):
                attrs[(name, key)] = value
            elif isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
                attrs[(name, key)] = (type(value).__name__, *value)
            elif isinstance(value, dict) and all(isinstance(v, _SIMPLE) for v in (*value, *value.values())):
                attrs[(name, key)] = ("dict", *sorted(value.items(), key=repr))
            elif isinstance(value, (torch.dtype, torch.device)):
                attrs[(name, key)] = str(value)
    return attrs


def _planned_boundaries(prefix: str, index: int, boundaries, rename: Callable[[str], str] | None = None) -> dict:
    own = f"{prefix}.{index}"
    return {
        (rename(fqn) if rename else fqn): (rename(repr(cons)) if rename else repr(cons))
        for fqn, cons in (boundaries or {}).items()
        if fqn == own or fqn.startswith(own + ".")
    }
