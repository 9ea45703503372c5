"""Why torch.export refused a model, worded for the user (compile/capture.py raises it).

Two cases get a message of their own; the rest keep export's text and the general rule:

* **Data-dependent code**: a Python branch, loop or size that depends on tensor values (``nonzero``,
  ``.item()``, ``for i in tensor``) has no value at capture, where the inputs are fake. Export's own
  error prints its whole partial graph; ours names the module and the line, and for a mixture of
  experts' expert loop (transformers' ``experts_implementation="eager"``: one iteration per expert
  that received tokens) the fixed-size implementations to switch to. (Under ``expert_parallel`` the
  module's forward is traced per rank on the rows it receives, with symbolic row counts, and the
  same loop is refused there: moe/lowering.py.)
* **transformers' KV cache**: ``use_cache=True`` (the default) returns a cache object export cannot.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch import nn

from .. import compat

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GENERAL_RULE = ("hyper_parallel needs a model that torch.export.export(model, args, kwargs, strict=False) "
                "accepts (no data-dependent Python control flow on tensor values).")


def capture_error(model: nn.Module, exc: Exception) -> Exception:
    """The exception to raise, from ``exc`` raised by ``torch.export.export(model, ...)``: of the
    same type, naming the model and the fix."""
    name = type(model).__name__
    if isinstance(exc, compat.DATA_DEPENDENT_ERRORS):
        return ValueError(_data_dependent(model, exc))
    config = getattr(model, "config", None)
    if "Cache" in str(exc) and getattr(config, "use_cache", False):
        fix = (f"{name} returns a KV cache because its config has use_cache=True (transformers' default): "
               "training needs none. Load the model with use_cache=False (from_pretrained(..., "
               "use_cache=False), or model.config.use_cache = False), or pass use_cache=False in the call.")
    else:
        fix = GENERAL_RULE
    return type(exc)(f"torch.export could not capture {name}: {exc}\n{fix}")


def _data_dependent(model: nn.Module, exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    module_fqn, module = _innermost_module(model, exc)
    where = next((f for f in reversed(frames) if _is_model_code(f.filename)), None)
    line = f'File "{where.filename}", line {where.lineno}: {where.line}' if where else "an unknown line"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    inside = f"module {module_fqn!r} ({type(module).__name__})" if module is not None else "the model"
    message = (f"torch.export could not capture {type(model).__name__}: {inside} has code whose control "
               f"flow or sizes depend on tensor values, at {line} ({type(exc).__name__}: {first}). "
               "The inputs are fake tensors while a program is captured, so such code has no value to "
               "follow; write it with fixed-size ops (masks instead of nonzero/where, no .item() or "
               "loop over a tensor).")
    if module is not None and _is_expert_loop(module):
        message += (f" {type(module).__name__} loops over the experts that received tokens (transformers' "
                    "experts_implementation='eager'): call model.set_experts_implementation('grouped_mm') "
                    "(transformers' default) or 'batched_mm', which compute every routed row at a size the "
                    "batch fixes (the routing is then data, not program: one program serves every step).")
    return message


def _is_model_code(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or path.startswith("<"))


def _innermost_module(model: nn.Module, exc: Exception) -> tuple[str, nn.Module | None]:
    """The FQN and module of the innermost ``forward`` of one of ``model``'s modules that was
    running when ``exc`` was raised ("", None when none is found)."""
    fqn_of = {id(m): name for name, m in model.named_modules()}
    found = ("", None)
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in fqn_of:
            found = (fqn_of[id(owner)], owner)
        tb = tb.tb_next
    return found


def _is_expert_loop(module: nn.Module) -> bool:
    """A mixture of experts' experts module: 3-d expert weights (transformers' ``*Experts``) or an
    ``experts`` ModuleList (older layouts)."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False)) or isinstance(
        getattr(module, "experts", None), nn.ModuleList)
