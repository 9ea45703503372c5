"""Capture: a model and example inputs → one joint forward+loss+backward aten graph.

``torch.export.export(strict=False)`` traces the model (keeping ``nn_module_stack`` and source lines
on every node); ``aot_export_joint_with_descriptors`` then retraces that program into a functional
joint graph whose placeholders and outputs carry descriptors (which parameter, which user input,
which output's tangent, which parameter's gradient). Backward nodes keep their forward module in
``fwd_nn_module_stack``, so plan entries apply to both directions.

Modules with planned input/output layouts get ``hyper_parallel::boundary`` annotations for the
duration of the export only (see annotations.py); no hook survives capture.

Buffers the forward updates in place (BatchNorm's running statistics, step counters) come out of
aot_autograd as input-mutation outputs; they become ``BUFFER_UPDATE`` output slots (after the user
outputs) holding the buffer's new value, which propagation brings to the buffer's layout and the
runtime writes back. Batch norm itself is captured decomposed into per-channel sums
(decompositions.py), so its statistics are global on a batch-sharded input, as SyncBatchNorm's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

# The graph contract (CapturedGraph, InputInfo, OutputInfo, flat_paths, ...) lives in ir/graph.py.
from ..ir.graph import BUFFER_UPDATE, INPUT_GRAD, CapturedGraph, InputInfo, OutputInfo, flat_paths
from ..ir.kinds import InputKind, OutputKind
from ..ir.names import renumber
from ..compat import pytree
from .. import compat
from ..moe.region import expert_regions
from .annotations import boundary, boundary_key
from .capture_errors import capture_error
from .decompositions import capture_decompositions

aten = torch.ops.aten


@contextlib.contextmanager
def _boundary_annotations(model: nn.Module, boundaries: Mapping[str, Any]):
    """Wrap the planned inputs/outputs of the given modules in boundary ops while the block runs.

    ``boundaries`` maps module FQN → an object with ``inputs`` (tuple, one entry per positional
    input, None = unconstrained), ``kwarg_inputs`` (dict) and ``outputs`` (tuple per flat output).
    """
    handles = []
    modules = dict(model.named_modules())

    def pre_hook(fqn, cons):
        def hook(module, args, kwargs):
            args = tuple(
                boundary(a, boundary_key(fqn, "in", i))
                if i < len(cons.inputs) and cons.inputs[i] is not None and isinstance(a, torch.Tensor)
                else a
                for i, a in enumerate(args)
            )
            kwargs = {
                k: boundary(v, boundary_key(fqn, "kw", k))
                if k in cons.kwarg_inputs and isinstance(v, torch.Tensor)
                else v
                for k, v in kwargs.items()
            }
            return args, kwargs

        return hook

    def post_hook(fqn, cons):
        def hook(module, args, kwargs, output):
            leaves, spec = pytree.tree_flatten(output)
            leaves = [
                boundary(o, boundary_key(fqn, "out", i))
                if i < len(cons.outputs) and cons.outputs[i] is not None and isinstance(o, torch.Tensor)
                else o
                for i, o in enumerate(leaves)
            ]
            return pytree.tree_unflatten(leaves, spec)

        return hook

    try:
        for fqn, cons in boundaries.items():
            module = modules[fqn]
            if any(c is not None for c in cons.inputs) or cons.kwarg_inputs:
                handles.append(
                    module.register_forward_pre_hook(pre_hook(fqn, cons), with_kwargs=True)
                )
            if any(c is not None for c in cons.outputs):
                handles.append(module.register_forward_hook(post_hook(fqn, cons), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    boundaries: Mapping[str, Any] | None = None,
    experts: Mapping[str, Any] | None = None,
) -> CapturedGraph:
    """Trace ``model(*args, **kwargs)`` into a joint forward/backward aten graph.

    ``args``/``kwargs`` may be real or fake tensors with the *global* shapes; the joint graph
    describes single-device semantics, propagation and lowering make it distributed.
    """
    # preserve_node_meta keeps ``fx.traceback.annotate`` metadata (``node.meta["custom"]``, how
    # hp.checkpoint / hp.swap mark code regions) through export and into the joint graph.
    with _boundary_annotations(model, boundaries or {}), expert_regions(model, experts or {}), \
            fx_traceback.preserve_node_meta():
        try:
            exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
        except Exception as exc:  # re-raised with the fix a user needs most often
            error = capture_error(model, exc)
            # A data-dependent guard's own text is export's whole partial graph: not chained.
            raise error from (None if isinstance(exc, compat.DATA_DEPENDENT_ERRORS) else exc)
    program = exported.module()
    with contextlib.ExitStack() as stack:
        with fx_traceback.preserve_node_meta():
            joint = compat.aot_export_joint_with_descriptors(
                stack, program, tuple(args), dict(kwargs),
                decompositions=capture_decompositions(),
            )
    gm = joint.graph_module
    _drop_metadata_assertions(gm)

    user_inputs_tree = (tuple(args), dict(kwargs))
    input_paths = flat_paths(user_inputs_tree)
    flat_inputs = pytree.tree_leaves(user_inputs_tree)
    inputs: list[InputInfo] = []
    primals = [n for n in gm.graph.find_nodes(op="placeholder") if not isinstance(n.meta["desc"], compat.TangentAOTInput)]
    constants = [k for k, n in enumerate(primals) if isinstance(n.meta["desc"], compat.PlainAOTInput)
                 and not isinstance(flat_inputs[n.meta["desc"].idx], torch.Tensor)]
    if constants:
        _drop_constant_inputs(gm, primals, constants, input_paths, flat_inputs, type(model).__name__)
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta["desc"]
        if isinstance(desc, compat.ParamAOTInput):
            inputs.append(InputInfo(InputKind.PARAM, desc.target, -1))
        elif isinstance(desc, compat.BufferAOTInput):
            inputs.append(InputInfo(InputKind.BUFFER, desc.target, -1))
        elif isinstance(desc, compat.PlainAOTInput):
            inputs.append(InputInfo(InputKind.INPUT, input_paths[desc.idx], desc.idx))
        elif isinstance(desc, compat.TangentAOTInput) and isinstance(
            desc.output, compat.PlainAOTOutput
        ):
            inputs.append(InputInfo(InputKind.TANGENT, f"tangent of output {desc.output.idx}", desc.output.idx))
        elif isinstance(desc, compat.TangentAOTInput) and isinstance(desc.output, compat.InputMutationAOTOutput):
            # A value written into something that requires grad: rejected with what to do.
            _mutation_output(desc.output.mutated_input, type(model).__name__, input_paths)
            raise ValueError(
                f"capture: {type(model).__name__}.forward writes into {desc.output.mutated_input.expr()}, "
                "which requires grad; only buffers without gradients may be updated in forward"
            )
        else:
            raise _unsupported(desc, f"placeholder {node.name!r}", type(model).__name__, input_paths, joint.out_spec)

    output_node = gm.graph.output_node()
    outputs: list[OutputInfo] = []
    num_user_outputs = 0
    for desc in output_node.meta["desc"]:
        if isinstance(desc, compat.PlainAOTOutput):
            outputs.append(OutputInfo(OutputKind.OUTPUT, str(desc.idx), desc.idx))
            num_user_outputs += 1
        elif isinstance(desc, compat.InputMutationAOTOutput):
            outputs.append(_mutation_output(desc.mutated_input, type(model).__name__, input_paths))
        elif isinstance(desc, compat.GradAOTOutput):
            grad_of = desc.grad_of
            if isinstance(grad_of, compat.ParamAOTInput):
                outputs.append(OutputInfo(OutputKind.GRAD, grad_of.target, -1))
            elif isinstance(grad_of, compat.PlainAOTInput):  # a user input that requires grad
                outputs.append(OutputInfo(INPUT_GRAD, input_paths[grad_of.idx], grad_of.idx))
            else:
                outputs.append(OutputInfo(OutputKind.NONE, repr(grad_of), -1))
        elif desc is None:
            outputs.append(OutputInfo(OutputKind.NONE, "", -1))
        else:
            raise _unsupported(desc, "output slot", type(model).__name__, input_paths, joint.out_spec)

    _put_buffer_updates_after_user_outputs(gm, outputs)
    renumber(gm, recompile=False)  # the trace dropped dead nodes: no gaps in the names (ir/names.py)
    gm.recompile()  # once for the rewrites of the graph above

    # Readable output paths ("loss", "logits", "[0]") from the exported program's output structure.
    out_spec = joint.out_spec
    dummy = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    output_paths = flat_paths(dummy)
    outputs = [
        dataclasses.replace(o, name=output_paths[o.index]) if o.kind == OutputKind.OUTPUT else o
        for o in outputs
    ]
    return CapturedGraph(
        gm=gm,
        inputs=inputs,
        outputs=outputs,
        in_spec=pytree.tree_flatten(user_inputs_tree)[1],
        out_spec=out_spec,
        num_user_outputs=num_user_outputs,
        input_paths=input_paths,
        output_paths=output_paths,
        expert_regions={fqn: (region, model.get_submodule(fqn)) for fqn, region in (experts or {}).items()},
    )


def _mutation_output(mutated, model_name: str, input_paths: list[str]) -> OutputInfo:
    """The output slot of a value the forward writes into one of its inputs: a buffer's new value
    (written back by the runtime); anything else is rejected, naming it and what to do."""
    if isinstance(mutated, compat.BufferAOTInput):
        return OutputInfo(BUFFER_UPDATE, mutated.target, -1)
    if isinstance(mutated, compat.ParamAOTInput):
        raise ValueError(
            f"capture: {model_name}.forward writes into parameter {mutated.target!r} in place; "
            "parameters are sharded DTensors owned by the optimizer. Update it outside forward (e.g. "
            "under torch.no_grad() after optimizer.step()), or register it as a buffer if it is state"
        )
    if isinstance(mutated, compat.PlainAOTInput):
        raise ValueError(
            f"capture: {model_name}.forward writes into its input {input_paths[mutated.idx]!r} in "
            "place; inputs are this rank's shard of the batch, so the write would not reach the "
            "caller's tensor. Return the new value instead"
        )
    raise _unsupported(mutated, "mutated input", model_name, input_paths, None)


def _drop_constant_inputs(gm: torch.fx.GraphModule, primals: list, constants: list[int], input_paths,
                          flat_inputs, model_name: str) -> None:
    """A Python constant the caller passed (``return_dict=False``) is a placeholder of the joint
    graph with a gradient slot (None), but export specialised the code on its value (which is part
    of the program cache key): nothing reads it, so it leaves the program's arguments and outputs.
    ``constants``: positions in ``primals`` (the placeholders before the tangents, whose gradient
    slots end the output, in that order)."""
    output_node = gm.graph.output_node()
    outs, descs = list(output_node.args[0]), list(output_node.meta["desc"])
    first_grad = len(outs) - len(primals)
    for k in sorted(constants, reverse=True):
        node = primals[k]
        if node.users:
            path, value = input_paths[node.meta["desc"].idx], flat_inputs[node.meta["desc"].idx]
            raise ValueError(
                f"capture: {model_name}.forward computes with its input {path!r}, a Python "
                f"{type(value).__name__} ({value!r}), inside the traced graph; pass it as a tensor (its "
                "value may then change between calls) or keep it a constant the code only branches on"
            )
        del outs[first_grad + k], descs[first_grad + k]
        gm.graph.erase_node(node)
    output_node.args = (type(output_node.args[0])(outs),)
    output_node.meta["desc"] = descs


def _desc_chain(desc) -> list:
    """An aot_autograd descriptor and the descriptors it refers to (a tangent's output, a
    subclass attribute's tensor, a view's base ...), outermost first."""
    chain = [desc]
    while dataclasses.is_dataclass(chain[-1]) and len(chain) < 16:
        inner = [getattr(chain[-1], f.name) for f in dataclasses.fields(chain[-1])]
        inner = [v for v in inner if type(v).__name__.endswith(("AOTInput", "AOTOutput"))]
        if not inner:
            break
        chain.append(inner[0])
    return chain


def _unsupported(desc, slot: str, model_name: str, input_paths: list[str], out_spec) -> ValueError:
    """The error for a joint-graph input or output capture has no meaning for: which value of the
    model it is, why, and what to do."""
    chain = _desc_chain(desc)
    kinds = " ".join(type(d).__name__ for d in chain)
    try:
        expr = desc.expr()
    except Exception:  # noqa: BLE001 - the repr still names it
        expr = repr(desc)
    names = []
    for d in chain:
        if isinstance(d, compat.PlainAOTInput) and d.idx < len(input_paths):
            names.append(f"input {input_paths[d.idx]}")
        elif isinstance(d, compat.PlainAOTOutput) and out_spec is not None:
            paths = flat_paths(pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec))
            names.append(f"output {(paths[d.idx] if d.idx < len(paths) else d.idx) or '(the only one)'}")
    value = f"{expr} ({', '.join(names)})" if names else expr
    if "Subclass" in kinds:
        why = (f"a tensor subclass (a DTensor, a quantized or wrapper tensor) reaches the joint graph as "
               f"{value}; hyper_parallel captures plain tensors only. Make forward take, hold and return "
               "plain tensors (e.g. .full_tensor() / .to_local() of a DTensor, dequantize)")
    elif "IntermediateBase" in kinds:
        why = (f"outputs of {model_name}.forward are views of one intermediate tensor ({value}), which "
               "capture does not support (aot_autograd adds their common base as an extra output). Return "
               ".clone() of the views (or return the tensor once and take the views outside the model)")
    elif "ViewBase" in kinds or "SyntheticBase" in kinds:
        why = (f"inputs of {model_name}.forward alias each other ({value}: one is a view of another). "
               "Pass separate tensors (.clone() the view)")
    elif "Token" in kinds:
        why = (f"{model_name}.forward calls an op with side effects ({value}: e.g. print through "
               "torch.ops.aten._print, or another effectful op), which capture does not support "
               "(aot_autograd threads effect tokens through the graph). Remove it from forward")
    else:
        why = (f"{value} ({desc!r}) is not a parameter, buffer, input, output, tangent or gradient "
               "capture knows. If the model is otherwise ordinary PyTorch, please report it")
    return ValueError(f"capture: {model_name}: the joint graph's {slot} is unsupported: {why}.")


def _put_buffer_updates_after_user_outputs(gm: torch.fx.GraphModule, outputs: list[OutputInfo]) -> None:
    """Reorder the joint graph's output slots (and ``outputs``, in place) to user outputs, buffer
    updates, then the rest (gradients): aot_autograd puts input mutations first, while the
    compiler's passes and the runtime find the gradients right after the forward's outputs. The
    caller recompiles ``gm``."""
    rank = {"output": 0, BUFFER_UPDATE: 1}
    order = sorted(range(len(outputs)), key=lambda i: rank.get(outputs[i].kind, 2))  # stable
    if order == list(range(len(outputs))):
        return
    output_node = gm.graph.output_node()
    slots = list(output_node.args[0])
    output_node.args = (type(output_node.args[0])(slots[i] for i in order),)
    descs = output_node.meta.get("desc")
    if descs is not None:
        output_node.meta["desc"] = [descs[i] for i in order]
    outputs[:] = [outputs[i] for i in order]


def _drop_metadata_assertions(gm: torch.fx.GraphModule) -> None:
    """``aten._assert_tensor_metadata`` checks dtype/device of a global value at trace time; it
    computes nothing and has no meaning on shards, so it is removed from the joint graph. The caller
    recompiles ``gm``."""
    for node in list(gm.graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default)):
        gm.graph.erase_node(node)
