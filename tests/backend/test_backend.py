"""torch.compile(model, backend="hyper_parallel", options={...}): single-device parity (loss and every
gradient over 3 SGD steps) for the example Llama with DP and TP and HF LlamaForCausalLM with TP,
dumps byte-identical to hp.parallelize's, graph breaks rejected with their source line, option
errors, and the backend resolving by name through its entry point in a fresh process."""

import copy
import inspect
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate

import hyper_parallel as hp
from hyper_parallel.models import MLP
from hyper_parallel.testing.graph_builder import read_tree
from hyper_parallel.testing.parity import build_model, build_plan, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper, batches, call


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out["loss"]


def backend_parity(model_name, plan, mesh_names, *, optimizer_before_first_call=False,
                   compare_dumps=False, fullgraph=False, steps=3):
    """Train ``torch.compile(model, backend="hyper_parallel")`` next to the single-device model,
    asserting loss and every gradient each step. With ``compare_dumps``, also compile the same
    model with hp.parallelize on the first step's inputs and return whether the dumps differ."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=mesh_names)
    reference = build_model(model_name)
    model = copy.deepcopy(reference)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with tempfile.TemporaryDirectory() as backend_dump, tempfile.TemporaryDirectory() as parallelize_dump:
        options = {"plan": build_plan(plan), "mesh": mesh}
        if compare_dumps:
            options["dump_dir"] = backend_dump
        compiled = torch.compile(model, backend="hyper_parallel", options=options, fullgraph=fullgraph)

        def same_outputs_dtensor_params(record):
            out, ref_out = record.output, record.ref_output
            assert type(out) is type(ref_out) and out.keys() == ref_out.keys()
            for name, p in model.named_parameters():
                assert isinstance(p, torch.distributed.tensor.DTensor), name

        # The compiled module runs the forward; the gradients are read from ``model``'s parameters
        # (the compiled module's). Without optimizer_before_first_call the optimizer is built after
        # the first call, from the DTensor parameters.
        ParityStepper(reference, model, mesh=mesh, batch=batches(model_name), forward=lambda m, b: compiled(**b),
                      ref_forward=call, lazy_optimizer=not optimizer_before_first_call,
                      after_backward=same_outputs_dtensor_params).run(steps)
        differing = None
        if compare_dumps:
            # The backend returns whole outputs (Dynamo's graph has the model's own shapes): the
            # same program parallelize compiles when the plan asks for every output whole.
            whole = {**build_plan(plan), "outputs": {"*": Replicate()}}
            parallel = hp.parallelize(build_model(model_name), whole, mesh, dump_dir=parallelize_dump)
            _loss(parallel(**local_batch(global_batch(model_name, 4, 16, seed=1), mesh))).backward()
            ours, theirs = read_tree(backend_dump), read_tree(parallelize_dump)
            differing = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
            assert len(ours) > 10, sorted(ours)
    return {
        "summary": model.compile_summary(),
        "programs": len(model._hp.cache),
        "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
        "differing_dumps": differing,
    }


def _counts(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {}).get("count", 0)


def test_llama_data_parallel_optimizer_built_before_first_call(dist2):
    result = dist2.run(backend_parity, "llama", "dp", ("dp",), optimizer_before_first_call=True)[0]
    # Dynamo compiled the forward once; later calls ran the parallel module's cached program.
    assert result["dynamo_graphs"] == 1 and result["programs"] == 1
    assert _counts(result["summary"], "forward", "all_reduce", "dp") == 1  # the global loss: sum and token count, packed


def test_llama_tensor_parallel_dumps_equal_parallelize(dist2):
    result = dist2.run(backend_parity, "llama", "tp", ("tp",), compare_dumps=True)[0]
    assert result["differing_dumps"] == []
    # Megatron, + the vocab-parallel loss (per-token max and exp-sum, the loss's partial sum).
    assert _counts(result["summary"], "forward", "all_reduce", "tp") == 2 * 2 + 1 + 3  # 2 layers
    assert result["summary"]["fallbacks"] == []


def test_hf_llama_tensor_parallel_fullgraph(dist2):
    pytest.importorskip("transformers")
    # fullgraph=True: every call must run compiled code; later calls run the parallel program.
    result = dist2.run(backend_parity, "hf_llama", "tp", ("tp",), fullgraph=True)[0]
    assert result["dynamo_graphs"] == 1 and result["summary"]["fallbacks"] == []


def test_hf_llama_data_parallel(dist2):
    pytest.importorskip("transformers")
    result = dist2.run(backend_parity, "hf_llama", "dp", ("dp",))[0]
    assert result["dynamo_graphs"] == 1 and result["programs"] == 1
    # Every parameter gradient is reduced over dp, in DDP-style buckets (one for this small model).
    assert _counts(result["summary"], "backward", "all_reduce", "dp") >= 1


# --- graph breaks, instances, optimizer state --------------------------------------------------

class ItemBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, target):
        y = self.fc(x)
        if y.sum().item() > 1e9:  # BREAK: item
            y = y * 2
        return (y - target).pow(2).mean()


class Printing(ItemBranch):
    def forward(self, x, target):
        print("forward")  # BREAK: print
        return (self.fc(x) - target).pow(2).mean()


class BreakInChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        torch._dynamo.graph_break()  # BREAK: explicit
        return h


class ParentOfBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = BreakInChild()

    def forward(self, x, target):
        return (self.child(x) - target).pow(2).mean()


def _break_line(cls, marker):
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def small_cases():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    options = {"plan": {}, "mesh": mesh}
    batch = local_batch({"x": torch.randn(8, 16), "target": torch.randn(8, 16)}, mesh)
    messages = {}
    for cls in (ItemBranch, Printing, ParentOfBreak):
        try:
            torch.compile(cls(), backend="hyper_parallel", options=options)(**batch)
        except ValueError as exc:
            messages[cls.__name__] = str(exc)
    # Two instances of one class: each gets its own parallel program (Dynamo guards on identity).
    batch = local_batch(global_batch("mlp", 8, 0), mesh)
    models = [MLP(), MLP()]
    for m in models:
        torch.compile(m, backend="hyper_parallel", options=options)(**batch).backward()
    # Plan errors are parallelize's own, raised by the first call (and again by the next one).
    tp_on_dp_mesh = {"plan": {"tensor_parallel": {"layers.0": "colwise"}}, "mesh": mesh}
    bad_plan = torch.compile(MLP(), backend="hyper_parallel", options=tp_on_dp_mesh)
    for _ in range(2):
        try:
            bad_plan(**batch)
        except ValueError as exc:
            messages.setdefault("plan", []).append(str(exc))
    instances = [all(isinstance(p, torch.distributed.tensor.DTensor) for p in m.parameters()) for m in models]
    # An optimizer that stepped the unsharded parameters cannot be switched to the shards.
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(**batch).backward()
    opt.step()
    compiled = torch.compile(model, backend="hyper_parallel", options=options)
    compiled(**batch).backward()
    try:
        opt.step()
        stale_state = None
    except RuntimeError as exc:
        stale_state = str(exc)
    return messages, instances, stale_state


def _compile_parallelized(fullgraph: bool) -> int:
    """``torch.compile`` (Inductor, the default backend) of a model already parallelized, as a
    training script that compiles whatever model it is handed does: the call runs the parallel
    program, at single-device parity over 2 SGD steps. Dynamo used to trace into the compiler on
    the first call and fail there with a ValueError blaming the plan ("cannot shard node
    'embedding'")."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    reference = build_model("hf_llama")
    parallel = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    compiled = torch.compile(parallel, fullgraph=fullgraph)
    ParityStepper(reference, parallel, mesh=mesh, forward=lambda m, b: compiled(**b), ref_forward=call).run(2)
    return len(parallel._hp.cache)


def test_torch_compile_of_a_parallelized_model(dist2):
    pytest.importorskip("transformers")
    assert dist2.run(_compile_parallelized, False) == [1, 1]
    # fullgraph=True cannot hold the parallel program inside Dynamo's graph: the graph break's
    # error says why and what to do.
    with pytest.raises(Exception, match="runs its own compiled programs.*without fullgraph=True"):
        dist2.run(_compile_parallelized, True)


def test_graph_breaks_instances_and_optimizer_state(dist2):
    messages, instances, stale_state = dist2.run(small_cases)[0]
    for cls, marker in ((ItemBranch, "BREAK: item"), (Printing, "BREAK: print"),
                        (BreakInChild, "BREAK: explicit")):
        message = messages[{BreakInChild: ParentOfBreak}.get(cls, cls).__name__]
        assert f"{__file__}:{_break_line(cls, marker)}" in message, message
        assert "graph break" in message and "hp.parallelize" in message, message
    assert "Tensor.item()" in messages["ItemBranch"]
    first, again = messages["plan"]  # parallelize's own error, twice
    assert "tensor_parallel" in first and again == first, messages["plan"]
    assert instances == [True, True]
    assert stale_state is not None and "after the first call" in stale_state


# --- options and the entry point (no process group needed) ---------------------------------------

@pytest.mark.parametrize("options, error, match", [
    (None, ValueError, r"needs options: torch.compile\(model, backend='hyper_parallel', options="),
    ({"mesh": None}, ValueError, r"options has no 'plan'"),
    ({"plan": {}}, ValueError, r"options has no 'mesh'"),
    ({"plan": {}, "mesh": None, "bucket_mb": 1}, ValueError,
     r"unknown hyper_parallel option\(s\) \['bucket_mb'\].*bucket_cap_mb"),
    ({"plan": {}, "mesh": "dp"}, TypeError, r"options\['mesh'\] must be a DeviceMesh"),
    ({"plan": {"pipeline": {"schedule": "1F1B"}}, "mesh": None}, ValueError,
     r"a pipeline plan does not fit the hyper_parallel backend.*pmodel.step\(inputs, targets\)"),
    ({"plan": {"expert_parallel": {"experts": "expert_parallel"}}, "mesh": None}, ValueError,
     r"expert_parallel is not supported through the hyper_parallel backend yet: .*hp.parallelize"),
    ({"plan": {"context_parallel": {"model.layers.*.self_attn": "context_parallel"}}, "mesh": None}, ValueError,
     r"context_parallel is not supported through the hyper_parallel backend yet: .*hp.parallelize"),
])
def test_bad_options(options, error, match):
    compiled = torch.compile(MLP(), backend="hyper_parallel", options=options)
    with pytest.raises(error, match=match):
        compiled(x=torch.randn(2, 16), target=torch.randn(2, 8))


@pytest.mark.slow
def test_entry_point_resolves_by_name_in_fresh_process(tmp_path):
    # Plain torch only: the name must resolve through the entry point, with no import of ours.
    script = (
        "import sys, torch\n"
        "assert 'hyper_parallel' not in sys.modules\n"
        "m = torch.compile(torch.nn.Linear(4, 4), backend='hyper_parallel', options={'plan': {}})\n"
        "try:\n"
        "    m(torch.randn(2, 4))\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ValueError: options has no 'mesh'" in result.stdout, result.stdout + result.stderr
