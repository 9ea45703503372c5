"""Python values a captured program read from the model: recorded while capturing, checked per call.

A program is traced once per input signature, so what its forward reads from Python besides the
inputs (a dropout probability, ``config.use_cache``, transformers' ``gradient_checkpointing`` flag
or attention implementation, a module's own switches) is baked into it. Changed after the first
call, such a value used to change nothing: the cached program ran on with the old one, silently.
torch.compile guards these reads; so does this module:

* While a program is captured (:func:`recording_reads`), every *plain* value (bool, int, float,
  str, None, an enum, a dtype, a tuple of those) read as an attribute of one of the model's modules,
  or of a config object one of them holds (a transformers ``PretrainedConfig`` or a dataclass), is
  recorded with the value it had. Reads are seen by a ``__getattribute__`` put on those classes for
  the capture only. A value that differs once capture is over (the forward or the capture
  machinery changed it) is not a guard: the program cannot depend on one fixed value of it.
* Every call reads the guarded attributes again (:meth:`AttributeGuards.variant`). Each distinct
  set of values is a numbered *variant*, part of the program cache key (``ProgramKey.attributes``):
  a changed value selects, or compiles, another program, and the recompile log names what changed.
  Ranks agree on the variant number, not on the values, so a value that differs between ranks but
  stays put (a rank's own index) is no disagreement, while a value changed on some ranks only is
  one (a ValueError on every rank naming the attribute, not two programs that would hang).

Not seen: values read through other objects (a dict of settings, a module-level global), an
attribute missing when captured (``getattr(config, "x", default)``) that is set later, and, with
``repeated_blocks``, a value changed on one of the blocks that are copied rather than traced only
(the traced blocks' reads are recorded; a value changed on every block is seen through them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys

import torch
import torch.nn as nn

_MISSING = object()  # an attribute deleted since it was recorded
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
# nn.Module's own machinery (its call path reads ``_compiled_call_impl`` on every module), not the
# model's settings; ``training`` too: every module's is in the cache key already (the train/eval
# mode, runtime/module.py:entry_for), so guarding it again would only repeat it in the recompile log.
_MODULE_INTERNALS = frozenset(dir(nn.Module)) | {"_compiled_call_impl", "training"}


def _plain(value) -> bool:
    if isinstance(value, _PLAIN) or isinstance(value, enum.Enum):
        return True
    return type(value) is tuple and all(_plain(v) for v in value)


def _is_config(value) -> bool:
    """A config object modules hold: transformers' ``PretrainedConfig`` or a dataclass instance."""
    if isinstance(value, type) or isinstance(value, (nn.Module, torch.Tensor)):
        return False
    if dataclasses.is_dataclass(value):
        return True
    transformers = sys.modules.get("transformers")  # only if the model brought it in
    config_cls = getattr(transformers, "PretrainedConfig", None) if transformers is not None else None
    return config_cls is not None and isinstance(value, config_cls)


def _watched(model: nn.Module) -> dict[int, tuple[object, str]]:
    """id -> (object, label) of the model's modules and the config objects they hold."""
    watched: dict[int, tuple[object, str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=True):
        watched[id(module)] = (module, fqn or "<root>")
        for attr, value in vars(module).items():
            if _is_config(value) and id(value) not in watched:
                watched[id(value)] = (value, f"{fqn}.{attr}" if fqn else attr)
    return watched


@contextlib.contextmanager
def recording_reads(model: nn.Module, into: list):
    """While inside, record the plain attribute values read from ``model``'s modules and configs;
    on exit ``into`` receives ``(object, attribute, label)`` for each read whose value is still
    the one read (see the module docstring)."""
    watched = _watched(model)
    reads: dict[tuple[int, str], tuple[object, str, object]] = {}
    installed = []

    def recorder(cls):
        inherited = cls.__getattribute__

        def __getattribute__(self, name):
            value = inherited(self, name)
            if id(self) in watched and name not in _MODULE_INTERNALS and not name.startswith("__") and _plain(value):
                reads.setdefault((id(self), name), (self, name, value))
            return value

        return __getattribute__

    try:
        for cls in dict.fromkeys(type(obj) for obj, _ in watched.values()):
            installed.append((cls, cls.__dict__.get("__getattribute__")))
            cls.__getattribute__ = recorder(cls)
        yield
    finally:
        for cls, own in reversed(installed):
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own
    for (obj_id, name), (obj, _, value) in reads.items():
        now = getattr(obj, name, _MISSING)
        if now is value or (type(now) is type(value) and now == value):
            into.append((obj, name, f"{watched[obj_id][1]}.{name}"))


class AttributeGuards:
    """A module's guarded attributes (the union over its captures) and the value sets seen."""

    def __init__(self):
        self.guards: list[tuple[object, str, str]] = []  # (object, attribute, label)
        self._guarded: set[tuple[int, str]] = set()
        self.variants: list[tuple] = []  # each variant's values, in guard order
        self._index: dict[tuple, int] = {}

    def values(self) -> tuple:
        return tuple(_hashable(getattr(obj, name, _MISSING)) for obj, name, _ in self.guards)

    def variant(self) -> tuple[int, tuple]:
        """(variant number, the values now): a value set seen before keeps its number, a new
        one gets the next (it is remembered once its program is compiled, :meth:`remember`)."""
        values = self.values()
        return self._index.get(values, len(self.variants)), values

    def remember(self, values: tuple) -> None:
        """Record ``values`` as the next variant (before the compile its number selects)."""
        if values not in self._index:
            self._index[values] = len(self.variants)
            self.variants.append(values)

    def add(self, reads: list) -> None:
        """Guard the attributes a capture read. Existing variants take their current values: the
        programs of those variants did not read them (or read these very values)."""
        new = [(obj, name, label) for obj, name, label in reads if (id(obj), name) not in self._guarded]
        if not new:
            return
        self._guarded.update((id(obj), name) for obj, name, _ in new)
        self.guards.extend(new)
        now = tuple(_hashable(getattr(obj, name, _MISSING)) for obj, name, _ in new)
        self.variants = [values + now for values in self.variants]
        self._index = {values: i for i, values in enumerate(self.variants)}

    def changes(self, old: int | None, values: tuple, limit: int = 3) -> str:
        """The guarded attributes whose values differ between variant ``old`` and ``values``."""
        if old is None or old >= len(self.variants):
            return ""
        before = self.variants[old]
        changed = [f"{label} {_show(a)} -> {_show(b)}" for (_, _, label), a, b in zip(self.guards, before, values)
                   if not (a is b or (type(a) is type(b) and a == b))]
        text = ", ".join(changed[:limit])
        return text + (f" and {len(changed) - limit} more" if len(changed) > limit else "")


def _hashable(value):
    """``value`` as a variant entry: itself when plain, else its type and repr (a guarded value
    the user replaced with a list or an object still compares, and is shown, by what it prints)."""
    if value is _MISSING or _plain(value):
        return value
    return _Replaced(type(value).__name__, repr(value))


@dataclasses.dataclass(frozen=True)
class _Replaced:
    type_name: str
    text: str

    def __repr__(self) -> str:
        return f"{self.text} ({self.type_name})"


def _show(value) -> str:
    return "<deleted>" if value is _MISSING else repr(value)
