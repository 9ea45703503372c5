"""Repeated blocks, renaming: one block's names written as another's.

A copy of block 1 is block j once the names in its nodes' arguments and meta say ``j``: module
paths, module-stack keys, parameter FQNs, annotations (``hp_*``), plan boundary keys and
aot_autograd's descriptors. :func:`renamer` rewrites strings; :func:`_rename_meta` a node's meta.

Reads and writes: plain values and node meta (copies; the inputs are not changed).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable


def renamer(prefix: str, src: int, dst: int) -> Callable[[Any], Any]:
    """Rewrites block ``src``'s names to block ``dst``'s in strings (module paths, stack keys,
    parameter FQNs, boundary keys); other values pass through."""
    if src == dst:
        return lambda value: value
    pattern = re.compile(r"(?<![A-Za-z0-9.])(" + re.escape(prefix) + r")(\.|\[)" + str(src) + r"(?![0-9])")
    done: dict[str, str] = {}  # the same module paths recur on many nodes

    def rename(value):
        if isinstance(value, str):
            if value not in done:
                done[value] = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{dst}", value)
            return done[value]
        return value

    rename.stacks = {}  # id(module stack) -> (it, renamed): nodes share their stack dicts (_rename_meta)
    return rename


def _renamed_stack(stack: dict, rename) -> dict:
    """A module stack with its paths renamed. Traced nodes share stack dicts (a few hundred for
    thousands of nodes), so each is renamed once per renamer and its copy shared the same way."""
    cache = getattr(rename, "stacks", None)
    if cache is None:  # not a renamer: names stay
        return stack
    hit = cache.get(id(stack))
    if hit is not None and hit[0] is stack:
        return hit[1]
    renamed = {rename(k): (rename(path), cls) for k, (path, cls) in stack.items()}
    cache[id(stack)] = (stack, renamed)  # holding ``stack`` keeps its id from being reused
    return renamed


def _rename_meta(meta: dict, rename) -> dict:
    """A copy of a node's meta for another block: module stacks, annotations and descriptors renamed."""
    out = dict(meta)
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = meta.get(key)
        if stack:
            out[key] = _renamed_stack(stack, rename)
    if isinstance(meta.get("custom"), dict):
        out["custom"] = {k: rename(v) for k, v in meta["custom"].items()}
    for key, value in meta.items():  # our own annotations that name modules or parameters
        if key.startswith("hp_") and isinstance(value, str):
            out[key] = rename(value)
    if "desc" in meta:
        out["desc"] = _rename_desc(meta["desc"], rename)
    out.pop("from_node", None)  # provenance of the traced block; a copy has none of its own
    return out


def _rename_desc(desc, rename):
    """aot_autograd descriptors name parameters by FQN (``ParamAOTInput(target=...)``)."""
    if isinstance(desc, list):
        return [_rename_desc(d, rename) for d in desc]
    if dataclasses.is_dataclass(desc) and not isinstance(desc, type):
        changes = {}
        for f in dataclasses.fields(desc):
            value = getattr(desc, f.name)
            new = rename(value) if isinstance(value, str) else _rename_desc(value, rename)
            if new is not value and new != value:
                changes[f.name] = new
        return dataclasses.replace(desc, **changes) if changes else desc
    return desc
