"""The caller's ``torch.autocast`` state and the compiled programs.

A program is captured inside the caller's forward call, so an autocast region around it is traced
like any other code: its casts become explicit ops of the program (the same dtypes eager autocast
would use, forward and backward). Two rules follow:

* the autocast state is part of the program cache key (``runtime/module.py:entry_for``, the
  pipeline's ``step``), and of what the ranks agree on: a call under another state compiles
  its own program instead of silently reusing one captured with other casts (bf16 numbers for an
  fp32 evaluation, or the reverse);
* the programs run with autocast off (:func:`programs_run_as_captured`): what was captured runs
  exactly, and a program is not cast a second time by the region still active around it (or
  around ``loss.backward()``).
"""

from __future__ import annotations

import contextlib
import sys

import torch

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps")


def _device_types() -> tuple[str, ...]:
    # "npu" is a device type only once torch_npu is imported (it is never imported here).
    return _DEVICE_TYPES + (("npu",) if "torch_npu" in sys.modules else ())


def autocast_state() -> tuple[tuple[str, str], ...]:
    """(device type, autocast dtype) of every device type autocast is on for now; () if none."""
    return tuple((t, str(torch.get_autocast_dtype(t)).removeprefix("torch."))
                 for t in _device_types() if torch.is_autocast_enabled(t))


def describe(state: tuple[tuple[str, str], ...]) -> str:
    """``autocast_state()`` in words ("off", "cpu bfloat16")."""
    return ", ".join(f"{t} {dtype}" for t, dtype in state) or "off"


def programs_run_as_captured() -> contextlib.AbstractContextManager:
    """Autocast off for every device type it is on for (nothing to do, and no cost, when off)."""
    state = autocast_state()
    if not state:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device_type, _ in state:
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
