"""Matching plan keys against a model: module-FQN globs and the errors when they match nothing.

Plan keys are module-FQN globs matched segment by segment (:func:`fqn_matches`). When a key matches
no module, or names a parameter a module does not have, the errors built here name the culprit and
suggest the likeliest intended keys ("did you mean ...?").
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Any, Iterable

from torch import nn


def fqn_matches(glob: str, fqn: str) -> bool:
    """True if module FQN ``fqn`` matches ``glob`` segment by segment (fnmatch per segment).

    ``"model.layers.*"`` matches ``"model.layers.0"`` but not ``"model.layers.0.mlp"``; ``""`` is
    the root module only.
    """
    if glob == "" or fqn == "":
        return glob == fqn
    glob_parts = glob.split(".")
    fqn_parts = fqn.split(".")
    return len(glob_parts) == len(fqn_parts) and all(
        fnmatchcase(part, pattern) for part, pattern in zip(fqn_parts, glob_parts)
    )


def match_module_fqns(glob: str, fqns: Iterable[str]) -> list[str]:
    """The FQNs among ``fqns`` that ``glob`` matches (see :func:`fqn_matches`), in the given order."""
    return [fqn for fqn in fqns if fqn_matches(glob, fqn)]


def _module_fqns(model: nn.Module) -> dict[str, nn.Module]:
    # remove_duplicate=False: a module reachable under two names matches a glob through either.
    return dict(model.named_modules(remove_duplicate=False))


def _generalize(fqn: str) -> str:
    """'model.layers.3.mlp' -> 'model.layers.*.mlp' (for "did you mean" suggestions)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _no_match_error(
    where: str, key: str, modules: dict[str, nn.Module], model: nn.Module
) -> ValueError:
    """The ValueError for a plan key that matches no module, with the likeliest intended keys."""
    names = [f for f in modules if f]
    # Suggest globs for a glob key, concrete names for a concrete one: both read more naturally.
    if any(ch in key for ch in "*?["):
        candidates = sorted({_generalize(f) for f in names})
    else:
        candidates = sorted(set(names))
    close = difflib.get_close_matches(key, candidates, n=len(candidates), cutoff=0.5)
    # Rank what users most often mean first: the key missing a prefix ('layers.*' for
    # 'model.layers.*'), then the same leaf name under another path; difflib order otherwise.
    suffix = [c for c in candidates if c.endswith("." + key)]
    leaf = key.rsplit(".", 1)[-1]
    close = suffix + sorted(
        (c for c in close if c not in suffix), key=lambda c: c.rsplit(".", 1)[-1] != leaf
    )
    close = close[:5]
    owner, _, leaf = key.rpartition(".")
    owners = match_module_fqns(owner, modules) if owner else []
    if any(leaf in modules[o]._parameters for o in owners):
        hint = (
            f"the key names a parameter, but plan keys are module FQNs: use {owner!r} "
            "(styles and layouts say which of its parameters to shard)"
        )
    elif close:
        hint = "did you mean " + ", ".join(repr(c) for c in close) + "?"
    else:
        top = [f for f in names if "." not in f][:5]
        hint = f"the top-level modules are {top}"
    return ValueError(
        f"{where}[{key!r}] matches no module of {type(model).__name__}; globs match module FQNs "
        f"segment by segment ('model.layers.*' matches 'model.layers.0' but not "
        f"'model.layers.0.mlp'; '' is the root module); {hint}"
    )


def _join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _direct_tensors(module: nn.Module) -> dict[str, Any]:
    """The module's own (non-recursive) parameters and buffers, by local name."""
    tensors = {n: p for n, p in module._parameters.items() if p is not None}
    tensors.update({n: b for n, b in module._buffers.items() if b is not None})
    return tensors


def _missing_param_error(where: str, module_fqn: str, module: nn.Module, name: str) -> ValueError:
    own = list(module._parameters) + list(module._buffers)
    own = [n for n in own if getattr(module, n, None) is not None]
    return ValueError(
        f"{where}: module {module_fqn or '<root>'!r} ({type(module).__name__}) has no parameter or "
        f"buffer {name!r}; its own parameters/buffers are {own}. Name a direct parameter; for a "
        "submodule's parameter, add an entry for that submodule's FQN"
    )
