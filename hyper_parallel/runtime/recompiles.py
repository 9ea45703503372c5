"""Recompiles: what made a module compile another program, counted against a limit.

A parallelized module's programs have fixed shapes: every new input signature (a new sequence
length or batch size), input structure, FSDP flag combination or train/eval mode compiles one
more program (seconds here, a minute at scale). Dynamic shapes are not supported; pad inputs to a
few fixed lengths (bucketing) so a run compiles a handful of programs. Each compile after the
first is logged at INFO on rank 0 with what changed since the previous call; past
``parallelize(recompile_limit=N)`` programs a warning says so once, or with
``fail_on_recompile_limit=True`` the call fails before compiling (on every rank alike: the ranks
agreed on the signature first).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from ..compile.signature import current_rank, format_signature
from .autocast_state import describe as describe_autocast

log = logging.getLogger(__name__)


class ProgramKey(NamedTuple):
    """What selects a module's program (``runtime/module.py:entry_for``): everything the capture
    depends on beyond the model and plan."""

    in_spec: Any  # the inputs' pytree structure
    signatures: tuple  # per flat input: shape, dtype, device (compile.driver.signature)
    flags: tuple  # FSDP flags (fsdp/flags.py:program_key) and train/eval mode
    prefetch: str  # FSDP prefetch targets set by the user
    autocast: tuple  # runtime/autocast_state.autocast_state(): the program holds the region's casts
    frozen: tuple[str, ...]  # parameters with requires_grad=False: the program computes no gradient for them
    dtypes: tuple  # every parameter's dtype, in named_parameters() order (model.to(torch.bfloat16))
    attributes: int = 0  # the variant of the module attribute values programs read (attribute_guards.py)
    backward: bool = True  # compiled with gradients enabled (a call under torch.no_grad compiles without)


def what_changed(old: ProgramKey | None, new: ProgramKey, paths: list[str], attributes: str = "") -> str:
    """The difference between two program-cache keys, worded; ``attributes``: the changed module
    attribute values (AttributeGuards.changes), worded by the caller, which holds them."""
    if old is None:
        return "first call"
    changes = []
    if old.in_spec != new.in_spec:
        changes.append("the inputs' structure (arguments or their nesting) changed")
    else:
        changes += [f"input '{path}': {format_signature(a)} -> {format_signature(b)}"
                    + (" (a Python number is part of the program: pass a tensor to reuse one program for every value)"
                       if a[0] == b[0] == "const" and a[1] in ("int", "float") else "")
                    for path, a, b in zip(paths, old.signatures, new.signatures) if a != b]
    if old.flags != new.flags:
        changes.append(f"FSDP flags or train/eval mode: {old.flags} -> {new.flags}")
    if old.prefetch != new.prefetch:
        changes.append("the FSDP prefetch targets changed")
    if old.autocast != new.autocast:
        changes.append(f"autocast: {describe_autocast(old.autocast)} -> {describe_autocast(new.autocast)}")
    if old.frozen != new.frozen:
        changes.append(f"parameters requiring gradients: {describe_frozen(set(old.frozen) ^ set(new.frozen))} changed")
    if old.dtypes != new.dtypes:
        changes.append(f"parameter dtypes: {describe_dtypes(old.dtypes)} -> {describe_dtypes(new.dtypes)}")
    if old.backward != new.backward:
        changes.append("a call with gradients enabled, and the program for these inputs was compiled under "
                       "torch.no_grad() (without backward)" if new.backward else "a call under torch.no_grad()")
    if old.attributes != new.attributes:
        changes.append(f"module attributes the program reads: {attributes or f'variant {new.attributes}'}")
    return "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")


def describe_frozen(names) -> str:
    """A few parameter names and how many there are in all."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"


def describe_dtypes(dtypes) -> str:
    """How many parameters have each dtype ("float32 x19, bfloat16 x2")."""
    counts: dict = {}
    for d in dtypes:
        name = str(d).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items()) or "none"


def before_compile(state, key, paths, attributes: str = "") -> None:
    """Account for the compile of ``key`` about to start on ``state`` (a ParallelState); ``paths``
    gives the flat input paths (only called when something must be worded)."""
    number = len(state.cache) + 1
    if number == 1:
        return
    name = state.original_cls.__name__
    reason = what_changed(state.last_key, key, paths(), attributes)
    limit = state.options.recompile_limit
    if number > limit and state.options.fail_on_recompile_limit:
        raise ValueError(
            f"{name} would compile program {number}, past parallelize(recompile_limit={limit}); this one "
            f"because {reason}. Programs have fixed shapes: pad inputs to a few fixed lengths, or raise "
            "recompile_limit"
        )
    if current_rank() != 0:
        return
    log.info("recompiling %s (program %d): %s", name, number, reason)
    if number == limit + 1:
        log.warning(
            "%s has compiled %d programs, past recompile_limit=%d (the last because %s). Each new input "
            "signature compiles one; pad inputs to a few fixed lengths, or pass parallelize(recompile_limit=...) "
            "(fail_on_recompile_limit=True makes this an error)", name, number, limit, reason)
