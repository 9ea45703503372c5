"""Every check of the compiler a user can reach is an error naming the culprit and what to do
(issue 13; the inventory is docs/internal_checks.md).

Part (a) triggers each check classified reachable, from user input where one can (a model through
``parallelize`` on torch's ``fake`` process-group backend: one process, no collective runs) and
otherwise from a hand-built graph or program through the module's public function, and checks the
error type and that the message names the node, module, output or parameter. Part (b) walks the
compiler's source with ``ast``: every ``assert`` left must be listed in the inventory as
unreachable, every ``internal_error`` raise must be listed, and no ``raise AssertionError`` /
``raise NotImplementedError`` may come back unclassified.
"""

from __future__ import annotations

import ast
import math
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.testing._internal.two_tensor import TwoTensor

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.compile.capture import capture
from hyper_parallel.errors import InternalError, internal_error
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.testing.graph_builder import GraphBuilder

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "internal_checks.md"
REPORT = "please report it with the model, plan and mesh"


# --------------------------------------------------------------------------- (a) user-reachable


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.block(x)).sum()


def _compile(model, plan=None, x=None):
    """parallelize + compile for a (4, 8) batch on 2 simulated data-parallel ranks."""
    with fake_world(2):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        x = torch.empty(2, 8, device="meta") if x is None else x
        return compile_for_explain(model, plan, mesh, (x,))


class ViewOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return {"loss": y.sum(), "flat": y.view(-1), "grid": y.view(-1, 2, 4)}


def test_outputs_viewing_one_tensor_are_a_value_error_naming_the_output():
    """capture.capture (placeholder of an unsupported descriptor), reached through parallelize."""
    with pytest.raises(ValueError) as info:
        _compile(ViewOutputs())
    msg = str(info.value)
    assert "ViewOutputs.forward are views of one intermediate tensor" in msg
    assert "output ['flat']" in msg and ".clone()" in msg


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class SubclassLoss(_Base):
    def forward(self, x):
        y = self.proj(x)
        return TwoTensor(y, y).sum()


class SubclassOutput(_Base):
    def forward(self, x):
        return self.proj(x).sum(), TwoTensor(x, x)


class Prints(_Base):
    def forward(self, x):
        torch.ops.aten._print("step")
        return self.proj(x).sum()


class WritesInput(_Base):
    def forward(self, x, v):
        v.add_(1)
        return self.proj(x).sum()


_base = torch.randn(2, 4)


@pytest.mark.parametrize("model, args, slot, expected", [
    (SubclassLoss(), (_base,), "placeholder 'tangents_1'", ["a tensor subclass", "output (the only one)"]),
    (SubclassOutput(), (_base,), "output slot", ["a tensor subclass", "output [1]", "plain tensors"]),
    (Prints(), (_base,), "placeholder 'primals_1'", ["side effects", "Remove it from forward"]),
    (WritesInput(), (_base, _base[0]), "placeholder 'primals_1'", ["alias each other", "input [0][1]"]),
], ids=["subclass-loss", "subclass-output", "effectful-op", "aliased-inputs"])
def test_unsupported_joint_graph_values_are_value_errors(model, args, slot, expected):
    """capture.capture: joint-graph inputs and outputs capture has no meaning for."""
    with pytest.raises(ValueError) as info:
        capture(model, args, {})
    msg = str(info.value)
    assert msg.startswith(f"capture: {type(model).__name__}: the joint graph's {slot} is unsupported")
    for text in expected:
        assert text in msg


def _sabotaged_rule(monkeypatch, change):
    """Make propagation's rule for relu answer ``change(output_spec, suggested)`` (a broken rule)."""
    from hyper_parallel.propagation import engine

    real = engine.propagate_op

    def propagate_op(op, args_schema, kwargs_schema):
        out, suggested = real(op, args_schema, kwargs_schema)
        return change(out, suggested, args_schema) if op is aten.relu.default else (out, suggested)

    monkeypatch.setattr(engine, "propagate_op", propagate_op)


def test_layouts_disagreeing_at_lowering_are_an_internal_error_naming_node_and_module(monkeypatch):
    """lower._check_agrees: DTensor's dispatch and propagation chose different layouts."""
    assert _compile(Net()).compile_summary()["collectives"]  # the rule as it is: compiles

    def replicated(out, suggested, args_schema):
        return compat.DTensorSpec(out.mesh, (Replicate(),), tensor_meta=out.tensor_meta), suggested

    _sabotaged_rule(monkeypatch, replicated)
    with pytest.raises(InternalError) as info:
        _compile(Net())
    msg = str(info.value)
    assert msg.startswith("internal error in lowering, at node 'relu' (aten.relu.default) in module 'block'")
    assert "computed the layout [S(0)] but propagation chose [R]" in msg
    assert "plan entry of module 'block'" in msg and REPORT in msg


def test_a_rule_with_too_many_input_layouts_is_an_internal_error_naming_the_node(monkeypatch):
    """propagation.engine._Propagator.call: a rule's input layouts do not match the op's inputs."""
    def extra(out, suggested, args_schema):
        return out, [args_schema[0], args_schema[0]]

    _sabotaged_rule(monkeypatch, extra)
    with pytest.raises(InternalError) as info:
        _compile(Net())
    msg = str(info.value)
    assert msg.startswith("internal error in layout propagation, at node 'relu' (aten.relu.default) in module 'block'")
    assert "gave 2 input layouts for the op's 1 tensor inputs" in msg and REPORT in msg


def test_a_pass_assertion_is_an_internal_error_naming_the_pass_and_its_workaround():
    """passes.run_passes around bucketing._fake: a graph without fake values (hand-built)."""
    from hyper_parallel.passes import PassContext, pass_names, run_passes

    g = GraphBuilder()
    grads = [g.input(f"d_{p}", 4, 8) for p in ("a", "b")]
    outs = [g(c10d.wait_tensor.default,
              g(c10d.reduce_scatter_tensor.default, d, "sum", 2, "dp", hp_grad_of=f"u.{p}", hp_role="redistribute"))
            for d, p in zip(grads, ("a", "b"))]
    gm = g.module(*outs)
    for node in gm.graph.nodes:  # real values where lowering leaves fake ones
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = torch.zeros(node.meta["val"].shape)
    fsdp = SimpleNamespace(unit_of={"u.a": "u", "u.b": "u"}, comm_fusion=True)
    ctx = PassContext(mesh=None, fsdp=fsdp, disable_passes=frozenset(set(pass_names()) - {"bucketing"}))
    with pytest.raises(InternalError) as info:
        run_passes(gm, ctx)
    msg = str(info.value)
    assert msg.startswith("internal error in pass 'bucketing': bucketing needs fake-tensor metadata")
    assert "disable_passes=['bucketing']" in msg and REPORT in msg


def test_a_forward_output_computed_in_backward_is_an_internal_error_naming_it():
    """runtime.partition.partition_by_phase: a node a forward output needs is tagged backward."""
    from hyper_parallel.runtime.partition import partition_by_phase

    g = GraphBuilder()
    x = g.input("x", 4)
    y = g(aten.mul.Tensor, x, 2.0, partitioner_tag="is_backward")
    with pytest.raises(InternalError) as info:
        partition_by_phase(g.module(y), 1)
    msg = str(info.value)
    assert msg.startswith(f"internal error in the forward/backward partition, at node '{y.name}' (aten.mul.Tensor)")
    assert "disable_passes" in msg and REPORT in msg


def test_a_backward_returning_the_wrong_number_of_gradients_is_an_internal_error():
    """runtime.program._RunStep.backward: gradients would go to the wrong parameters."""
    from hyper_parallel.runtime.program import CompiledProgram

    program = CompiledProgram(
        forward_gm=lambda w: (w.sum(), w), backward_gm=lambda args: [args[0], args[0]],
        num_user_outputs=1, num_primals=1, tangent_outputs=(0,), differentiable=(True,),
    )
    w = torch.ones(3, requires_grad=True)
    loss = program(w)[0]
    with pytest.raises(InternalError) as info:
        loss.backward()
    msg = str(info.value)
    assert msg.startswith("internal error in the runtime (backward): the backward program returned 2 values")
    assert "one gradient per primal (1)" in msg and REPORT in msg


def test_a_non_finite_stage_time_in_auto_split_is_an_internal_error():
    """pipeline.auto.best_split: only a non-finite cost (a cost-model bug) misses the full graph's path."""
    from hyper_parallel.pipeline.auto import best_split

    assert best_split([1.0, 1.0, 1.0], None, 3) == ([1, 2], 1.0)
    with pytest.raises(InternalError) as info:
        best_split([math.nan, 1.0], None, 2)
    msg = str(info.value)
    assert msg.startswith("internal error in pipeline split_points='auto'")
    assert "[nan, 1.0]" in msg and "split_points=[...]" in msg and REPORT in msg


def _stage_program():
    from hyper_parallel.ir.phase import BACKWARD, FORWARD

    programs = {"forward": lambda *a: (), "backward": lambda args: []}
    return SimpleNamespace(
        graph=SimpleNamespace(inputs=[], outputs=[], recvs=[]), forward_gm=programs["forward"],
        backward_gm=programs["backward"], run=programs.__getitem__, num_forward_outputs=0, primal_infos=[],
        tangent_infos=[], sends={FORWARD: [], BACKWARD: []},
    )


def _executor(schedule):
    from hyper_parallel.pipeline.runtime import PipelineExecutor

    return PipelineExecutor({0: _stage_program()}, schedule, [], 1, 1, None, torch.device("cpu"), torch.float32)


def test_pipeline_steps_the_executor_cannot_run_are_internal_errors():
    """pipeline.runtime.PipelineExecutor.run: an unsupported step type; a forward whose backward
    never ran (both impossible with the schedules build_schedule makes and checks)."""
    from hyper_parallel.pipeline.schedules import MetaStep, MetaStepType as T

    fwd, bwd = MetaStep(T.FORWARD, 0, 0), MetaStep(T.BACKWARD, 0, 0)
    assert _executor([fwd, bwd]).run(nn.Module(), [[]])[0] is None  # a complete step runs
    with pytest.raises(InternalError) as info:
        _executor([MetaStep(T.OVERLAP_F_B, 0, 0, sub_steps=(fwd, bwd))]).run(nn.Module(), [[]])
    assert str(info.value).startswith("internal error in the pipeline executor: step OFB[F0@s0|B0@s0] of type "
                                      "OVERLAP_F_B is not supported")
    with pytest.raises(InternalError) as info:
        _executor([fwd]).run(nn.Module(), [[]])
    msg = str(info.value)
    assert "saved activations of (stage, micro-batch) [(0, 0)], whose backward did not run, so" in msg
    assert "PipelinePlan(schedule=...)" in msg and REPORT in msg


def test_unreachable_propagation_and_loss_checks_still_name_the_node():
    """propagation.engine._Propagator.run (a node kind capture never emits) and
    loss_reduction._later (nodes of two graphs): hand-built graphs only."""
    from hyper_parallel.propagation.engine import _Propagator
    from hyper_parallel.propagation.loss_reduction import _later

    graph = torch.fx.Graph()
    graph.call_method("upper", ("x",))
    captured = SimpleNamespace(gm=torch.fx.GraphModule(nn.Module(), graph), inputs=[], outputs=[])
    with pytest.raises(InternalError, match=r"layout propagation, at node 'upper' \(upper\).*'call_method'"):
        _Propagator(captured, SimpleNamespace(outputs={}), SimpleNamespace(mesh_dim_names=("dp",))).run()
    a, b = GraphBuilder(), GraphBuilder()
    x, y = a.input("loss", 2), b.input("total_weight", 2)
    a.graph.erase_node(x)
    with pytest.raises(InternalError, match="nodes 'loss' and 'total_weight'"):
        _later(x, y)


def test_usage_errors_name_the_parameter_or_method():
    """Runtime state errors a user's call order reaches: they stay RuntimeErrors (as torch's)."""
    from hyper_parallel.fsdp.grad_accumulation import GradientAccumulator

    acc = GradientAccumulator()
    acc.keep_hook(["w"], "unreduced")([torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"gradients of \['w'\] pending in layout 'unreduced' meet new ones"):
        acc.keep_hook(["w"], "reduce_scattered")([torch.ones(2)])
    unit = hp.fully_shard(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"unshard needs the parallelized model: call hp.parallelize"):
        unit.unshard()


def test_internal_error_message_format():
    msg = str(internal_error("bucketing", "x broke", pass_name="bucketing", culprit="unit 'layers.0'"))
    assert msg == (
        "internal error in pass 'bucketing', unit 'layers.0': x broke. Workaround: turn the pass off with "
        "parallelize(..., disable_passes=['bucketing']). This is a bug in hyper_parallel, not in your model "
        "or plan: please report it with the model, plan and mesh (the dumps of parallelize(..., dump_dir=...) "
        "help)."
    )
    assert isinstance(internal_error("lowering", "y"), RuntimeError)
    assert "No workaround is known" in str(internal_error("lowering", "y"))


# ----------------------------------------------------------------------- (b) the inventory is whole

COMPILER = [
    "hyper_parallel/passes/*.py", "hyper_parallel/propagation/*.py",
    "hyper_parallel/runtime/*.py",
    "hyper_parallel/recompute.py", "hyper_parallel/pipeline/*.py", "hyper_parallel/analysis/memory.py",
    "hyper_parallel/plan/*.py", "hyper_parallel/init/*.py", "hyper_parallel/errors.py",
    "hyper_parallel/ir/*.py", "hyper_parallel/fsdp/*.py", "hyper_parallel/compile/*.py",
]


def test_every_compiler_pattern_names_files():
    """A pattern that matches nothing (a module moved) would silently drop its checks from the scan."""
    assert all(list(ROOT.glob(pattern)) for pattern in COMPILER), [p for p in COMPILER if not list(ROOT.glob(p))]


def _sites():
    """(kind, "path:Class.function", line) of every assert, internal_error raise, and raise of
    AssertionError / NotImplementedError in the compiler's modules."""
    out = []
    for pattern in COMPILER:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), rel)

            def visit(node, scope):
                for child in ast.iter_child_nodes(node):
                    inner = scope
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        inner = scope + [child.name]
                    where = f"{rel}:{'.'.join(scope) or '<module>'}"
                    if isinstance(child, ast.Assert):
                        out.append(("assert", where, child.lineno))
                    elif isinstance(child, ast.Raise) and child.exc is not None:
                        exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                        name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", "")
                        if name == "internal_error":
                            out.append(("InternalError", where, child.lineno))
                        elif name in ("AssertionError", "NotImplementedError"):
                            out.append((name, where, child.lineno))
                        elif name == "InternalError":
                            out.append(("InternalError without internal_error()", where, child.lineno))
                    visit(child, inner)

            visit(tree, [])
    return out


def _inventory():
    """{(kept as, "path:function"): [reachable? cell, ...]} from the doc's table rows."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not re.fullmatch(r"`[^`]+:[^`]+`", cells[1]):
            continue
        kept = re.fullmatch(r"`?(\w+)`?", cells[4].split()[0].rstrip(":,"))
        rows.setdefault((kept.group(1) if kept else cells[4], cells[1].strip("`")), []).append(cells[3].lower())
    return rows


def test_every_remaining_check_is_in_the_inventory():
    sites = _sites()
    rows = _inventory()
    assert sites, "no check found: the module list is stale"
    problems = []
    for kind in ("AssertionError", "NotImplementedError", "InternalError without internal_error()"):
        problems += [f"{where} (line {line}): raise {kind} directly; use errors.internal_error or a ValueError"
                     for k, where, line in sites if k == kind]
    counts: dict = {}
    for kind, where, line in sites:
        if kind not in ("assert", "InternalError"):
            continue
        counts[(kind, where)] = counts.get((kind, where), 0) + 1
        listed = rows.get((kind, where), [])
        if len(listed) < counts[(kind, where)]:
            problems.append(f"{where} (line {line}): an {kind} not listed in docs/internal_checks.md "
                            f"with 'kept as' {kind}")
        elif kind == "assert" and not all(r.startswith("no") for r in listed):
            problems.append(f"{where}: an assert must be unreachable from user input ('no, ...' in the doc)")
    assert not problems, "\n".join(problems)
