"""The ``torch.compile`` backend: ``torch.compile(model, backend="hyper_parallel", options={...})``.

``options`` holds ``"plan"`` and ``"mesh"`` (as for :func:`hyper_parallel.parallelize`) and any of
parallelize's keyword options (``dump_dir``, ``disable_passes``, ``prefetch_depth``,
``bucket_cap_mb``, ``memory_budget_bytes``, ``materialize``). The name resolves after ``pip
install`` through the ``torch_dynamo_backends`` entry point, without importing hyper_parallel.

Design: Dynamo is used to find *what* to parallelize, and hyper_parallel's own pipeline does the
work, so the result is the same program ``hp.parallelize(model, plan, mesh)`` compiles (same dumps,
byte for byte). When Dynamo calls the backend with the graph of a module's whole ``forward``:

1. the options are checked, and the graph must be the complete forward of the compiled module:
   a graph ending at a graph break, a resume function after one, or a submodule's forward that
   Dynamo compiles apart because its parent broke, is rejected with a ``ValueError`` naming the
   break's source line (the program must be one joint forward+backward graph; Dynamo's pieces
   would be separate autograd programs with no layouts carried between them);
2. the module object and the exact ``(args, kwargs)`` of this call are read from the frame of
   ``nn.Module._call_impl`` that is calling the forward (after the module's pre-hooks ran);
3. the value the forward returns is walked (Dynamo's variable trackers) to know which path of it
   (``"loss"``, ``"logits"``, ``[0]`` ...) each output of Dynamo's graph is;
4. the graph is guarded on the module's identity, so another instance of the same class compiles
   its own program instead of reusing this one.

The callable returned runs once, inside this first call, outside Dynamo: it parallelizes the module
in place (parameters become DTensors, exactly as ``parallelize`` does), runs its forward with this
call's inputs (capture → propagate → lower → passes happen here, as on parallelize's first call)
and hands Dynamo the outputs in its graph's order. The parallel module's ``forward`` is one Dynamo
does not trace (runtime/module.py), so every later call of the compiled module runs the parallel module's
cached programs directly (new input shapes compile there, as with ``parallelize``); under
``fullgraph=True`` that program counts as the call's compiled frame.

Optimizers: build them from ``model.parameters()`` after the first call, or before it: an optimizer
holding the replaced (pre-parallelization) parameters is switched to the DTensor parameters at its
first ``step()``; one that already has state for them is an error, never a silent no-op.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
import re
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import compat
from .api import ParallelModule, parallelize
from .runtime.replaced_parameters import remember_replacements

__all__ = ["hyper_parallel_backend"]

BACKEND_NAME = "hyper_parallel"

# parallelize's keyword options, accepted as they are in ``options``.
PASS_OPTIONS = tuple(
    name for name, p in inspect.signature(parallelize).parameters.items() if p.kind is p.KEYWORD_ONLY
)
_USAGE = (
    f"torch.compile(model, backend={BACKEND_NAME!r}, options={{'plan': plan, 'mesh': mesh, ...}}) "
    "with plan as for hp.parallelize ({} for data parallelism only) and mesh from "
    "hp.init_device_mesh"
)


class BackendValueError(ValueError, compat.ShortenTraceback):
    """A ``ValueError`` raised while Dynamo calls the backend. Deriving from Dynamo's
    ``ShortenTraceback`` makes Dynamo re-raise it as it is instead of wrapping it in
    ``BackendCompilerFailed``, so users catch the ``ValueError`` they expect."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.first_useful_frame = None  # read by ShortenTraceback.remove_dynamo_frames


class BackendTypeError(TypeError, compat.ShortenTraceback):
    """``TypeError`` counterpart of :class:`BackendValueError`."""

    def __init__(self, message: str):
        TypeError.__init__(self, message)
        self.first_useful_frame = None


def hyper_parallel_backend(gm: torch.fx.GraphModule, example_inputs, *, options: dict | None = None,
                           mode: str | None = None):
    """The ``torch_dynamo_backends`` entry point: see the module docstring."""
    plan, mesh, pass_options = _check_options(options, mode)
    tx = compat.dynamo_translator()
    if tx is None:
        raise BackendTypeError(
            f"{BACKEND_NAME} is a torch.compile backend; call it through {_USAGE}, not directly"
        )
    _reject_graph_break(tx)
    module, (local_name, index), args, kwargs = _module_call(tx)
    output_paths = _output_paths(tx, gm, module)
    compat.dynamo_guard_identity(local_name, index)
    return _first_call(module, args, kwargs, output_paths, plan, mesh, pass_options)


# --- options ---------------------------------------------------------------------------------------

def _check_options(options, mode) -> tuple[Any, Any, dict]:
    if mode not in (None, "default"):
        raise BackendValueError(
            f"torch.compile(mode={mode!r}) does not apply to the {BACKEND_NAME} backend; drop mode "
            f"and pass the parallelization as {_USAGE}"
        )
    if options is None:
        raise BackendValueError(f"the {BACKEND_NAME} backend needs options: {_USAGE}")
    if not isinstance(options, dict):
        raise BackendTypeError(f"options must be a dict, got {type(options).__name__}: {_USAGE}")
    unknown = sorted(set(options) - {"plan", "mesh", *PASS_OPTIONS}, key=str)
    if unknown:
        raise BackendValueError(
            f"unknown {BACKEND_NAME} option(s) {unknown}: options take 'plan', 'mesh' and "
            f"hp.parallelize's keyword options {list(PASS_OPTIONS)}; remove or rename them"
        )
    for key in ("plan", "mesh"):
        if key not in options:
            raise BackendValueError(f"options has no {key!r}: {_USAGE}")
    plan = options["plan"]
    pipeline = plan.get("pipeline") if isinstance(plan, dict) else getattr(plan, "pipeline", None)
    if pipeline is not None:
        raise BackendValueError(
            f"a pipeline plan does not fit the {BACKEND_NAME} backend: a pipelined model trains through "
            "pmodel = hp.parallelize(model, plan, mesh, loss_fn=...) and pmodel.step(inputs, targets)"
        )
    experts = plan.get("expert_parallel") if isinstance(plan, dict) else getattr(plan, "expert_parallel", None)
    if experts:
        # Dynamo would trace the experts' data-dependent row counts itself (and break the graph).
        raise BackendValueError(
            f"expert_parallel is not supported through the {BACKEND_NAME} backend yet: parallelize the "
            "mixture-of-experts model with pmodel = hp.parallelize(model, plan, mesh) and call it eagerly"
        )
    context = plan.get("context_parallel") if isinstance(plan, dict) else getattr(plan, "context_parallel", None)
    if context:
        raise BackendValueError(
            f"context_parallel is not supported through the {BACKEND_NAME} backend yet: parallelize the "
            "model with pmodel = hp.parallelize(model, plan, mesh) and call it eagerly"
        )
    mesh = options["mesh"]
    if not isinstance(mesh, DeviceMesh):
        raise BackendTypeError(
            f"options['mesh'] must be a DeviceMesh (hp.init_device_mesh(...)), got {type(mesh).__name__}"
        )
    return plan, mesh, {k: v for k, v in options.items() if k in PASS_OPTIONS}


# --- what Dynamo compiles ------------------------------------------------------------------------

def _where(filename: str, lineno: int | None, code: str | None = None) -> str:
    code = code if code is not None else linecache.getline(filename, lineno or 0)
    code = (code or "").strip()
    return f"{filename}:{lineno}" + (f" `{code}`" if code else "")


def _reject_graph_break(tx) -> None:
    reason, is_break, user_stack = compat.dynamo_compile_reason(tx)
    if not is_break:
        return
    frames = " <- ".join(
        f"{_where(f.filename, f.lineno, f.line)} in {f.name}" for f in reversed(user_stack)
    ) or "(no source location recorded)"
    why = "\n".join(reason.strip().splitlines()[:3])
    raise BackendValueError(
        f"graph break at {frames}: {why}\n"
        f"The {BACKEND_NAME} backend compiles a module's whole forward as one program, so graph "
        "breaks are not supported: remove the break (no print/.item()/data-dependent Python "
        "control flow on tensor values in forward), or use hp.parallelize(model, plan, mesh), "
        "whose capture (torch.export, strict=False) accepts Python side effects such as print. "
        "torch._dynamo.explain(model)(*args, **kwargs) lists every break."
    )


def _module_call(tx) -> tuple[nn.Module, tuple, dict, dict]:
    """The module whose forward Dynamo compiled, where the frame holds it (a local's name, and its
    index when the local is a tuple holding it, else None), and this call's
    (args, kwargs); rejects any frame that is not the whole forward of the compiled module."""
    code = tx.f_code
    resumed = re.fullmatch(r"torch_dynamo_resume_in_(.+)_at_(\d+)", code.co_name)
    if resumed:
        raise BackendValueError(
            f"graph break at {_where(code.co_filename, int(resumed.group(2)))} in "
            f"{resumed.group(1)}: Dynamo split the forward there and now compiles the rest "
            f"separately. The {BACKEND_NAME} backend compiles a module's whole forward as one "
            "program: remove the break, or use hp.parallelize(model, plan, mesh). "
            "torch._dynamo.explain(model)(*args, **kwargs) lists every break."
        )
    frame = sys._getframe()
    while frame is not None and frame.f_code is not nn.Module._call_impl.__code__:
        frame = frame.f_back
    call = frame.f_locals if frame is not None else {}
    forward = call.get("forward_call")
    if getattr(getattr(forward, "__func__", forward), "__code__", None) is not code:
        raise BackendTypeError(
            f"the {BACKEND_NAME} backend parallelizes an nn.Module's forward; Dynamo gave it "
            f"{code.co_name} ({_where(code.co_filename, code.co_firstlineno)}). Compile the model "
            f"itself: {_USAGE}"
        )
    module = call["self"]
    _check_called_by_dynamo(frame, module)
    if isinstance(module, ParallelModule):
        raise BackendValueError(
            f"{type(module).__name__} is already parallelized by hp.parallelize; compile the "
            "original model with the backend instead (it calls parallelize itself)"
        )
    where = [(name, None) for name, value in tx.f_locals.items() if value is module]
    if not where:
        # A decorator's wrapper(*args, **kwargs) around forward (transformers 5.24 wraps
        # LlamaForCausalLM.forward in deprecate_kwarg): the module is an item of a tuple local.
        where = [(name, i) for name, value in tx.f_locals.items() if isinstance(value, tuple)
                 for i, item in enumerate(value) if item is module]
    if not where:
        raise BackendTypeError(
            f"{type(module).__name__}.forward does not bind the module to a local; the "
            f"{BACKEND_NAME} backend needs an ordinary forward(self, ...)"
        )
    return module, where[0], tuple(call["args"]), dict(call["kwargs"])


def _check_called_by_dynamo(frame, module: nn.Module) -> None:
    """Between torch.compile's entry wrapper and this module's call there may be only torch's own
    frames: user code in between means Dynamo broke the parent's forward and compiles this
    submodule on its own, and the plan's FQNs (relative to the compiled model) would not apply."""
    torch_dir = os.path.dirname(torch.__file__)
    f = frame.f_back
    while f is not None and not compat.is_dynamo_entry_frame(f):
        if not f.f_code.co_filename.startswith(torch_dir):
            raise BackendValueError(
                f"graph break at {_where(f.f_code.co_filename, f.f_lineno)} in {f.f_code.co_name}: "
                f"Dynamo split that forward and compiles {type(module).__name__}.forward on its "
                f"own. The {BACKEND_NAME} backend compiles the compiled model's whole forward as "
                "one program: remove the break, or use hp.parallelize(model, plan, mesh)."
            )
        f = f.f_back


def _output_paths(tx, gm: torch.fx.GraphModule, module: nn.Module) -> list[tuple]:
    """For each output of Dynamo's graph, the path of the returned value it is."""
    name = type(module).__name__
    try:
        leaves = compat.dynamo_return_tensors(tx)
    except TypeError as exc:
        raise BackendTypeError(
            f"{name}.forward returns a value the {BACKEND_NAME} backend cannot map to the "
            f"parallel module's outputs: {exc}. Return tensors in tuples, lists, dicts or HF "
            "ModelOutputs, or use hp.parallelize"
        ) from None
    path_of: dict[str, tuple] = {}
    for path, node_name in leaves:
        path_of.setdefault(node_name, path)
    paths = []
    for node in gm.graph.output_node().args[0]:
        node_name = getattr(node, "name", None)
        if node_name not in path_of:
            raise BackendValueError(
                f"{name}.forward has an effect besides its return value (graph output "
                f"{node_name or node!r}: e.g. a tensor assigned to a module attribute or a buffer "
                f"updated in place); the {BACKEND_NAME} backend runs the parallel module and "
                "cannot replay it. Keep forward free of such side effects, or use hp.parallelize"
            )
        paths.append(path_of[node_name])
    return paths


# --- the compiled callable ------------------------------------------------------------------------

def _first_call(module, args, kwargs, output_paths, plan, mesh, pass_options):
    # Only the module's first call runs this: afterwards its class's forward is the parallel one,
    # which Dynamo does not trace, and the identity guard keeps other instances away. So it holds
    # this call's inputs and the module just until it runs.
    pending = [(module, args, kwargs)]

    @torch.compiler.disable
    def run(*graph_inputs):
        if not pending:
            raise RuntimeError(
                f"internal error in the {BACKEND_NAME} backend: a compiled first call ran twice; "
                "please report it (torch._dynamo.reset() works around it)"
            )
        model, call_args, call_kwargs = pending.pop()
        try:
            _parallelize_in_place(model, plan, mesh, pass_options)
        except BaseException:
            # parallelize left the module as it was (it validates before it distributes): a call
            # after the user's fix-up runs this again and gets the same plan error, not a stale state.
            pending.append((model, call_args, call_kwargs))
            raise
        out = model.forward(*call_args, **call_kwargs)
        return tuple(_at(out, path) for path in output_paths)

    return run


def _at(value, path: tuple):
    for key in path:
        value = value[key]
    return value


def _parallelize_in_place(module: nn.Module, plan, mesh, pass_options: dict) -> None:
    before = dict(module.named_parameters())
    parallelize(module, plan, mesh, **pass_options)
    # Dynamo's graph returns the model's own tensors: plain, whole on the non-data-parallel axes.
    state = module._hp
    state.resolution = dataclasses.replace(
        state.resolution, resolved=dataclasses.replace(state.resolved, whole_outputs=True))
    remember_replacements(before, dict(module.named_parameters()), f"torch.compile(backend={BACKEND_NAME!r})",
                          "the first call")


