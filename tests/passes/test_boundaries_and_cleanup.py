"""Graph-level tests of the boundary merge (propagation/boundaries.py) and the cleanup pass, on the
captured example Llama; no process group is needed."""

import torch

import hyper_parallel as hp
from hyper_parallel.compile.annotations import BOUNDARY, BOUNDARY_GRAD
from hyper_parallel.compile.capture import capture
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, llama_tp_plan
from hyper_parallel.passes.cleanup import cleanup_pass
from hyper_parallel.plan import resolve_plan
from hyper_parallel.propagation.boundaries import merge_boundaries

LAYERS = 2


def _captured(plan):
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=LAYERS))
    resolved = resolve_plan(plan, model, hp.Layout((2,), ("tp",)))
    ids = torch.zeros(2, 8, dtype=torch.long)
    return capture(model, (), {"input_ids": ids, "labels": ids}, resolved.modules), resolved


def _count(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def test_boundaries_of_one_value_merge_and_gradients_sum_before_crossing():
    captured, resolved = _captured(llama_tp_plan(sequence_parallel=True))
    gm = captured.gm
    fwd_before, bwd_before = _count(gm, BOUNDARY), _count(gm, BOUNDARY_GRAD)
    # Every boundary has a gradient boundary except the embedding's integer token ids.
    assert bwd_before == fwd_before - 1
    merge_boundaries(gm, resolved)
    # q/k/v share one input boundary and gate/up another: 3 fewer forward boundaries per layer.
    assert _count(gm, BOUNDARY) == fwd_before - 3 * LAYERS
    # Their gradients are summed before crossing back: 3 fewer gradient boundaries per layer too.
    assert _count(gm, BOUNDARY_GRAD) == bwd_before - 3 * LAYERS
    # Idempotent: a second run changes nothing.
    code = gm.code
    assert merge_boundaries(gm, resolved) == 0
    assert gm.code == code


def test_cleanup_removes_detach_and_is_idempotent():
    captured, _ = _captured({})
    gm = captured.gm
    assert _count(gm, torch.ops.aten.detach.default) > 0
    gm = cleanup_pass(gm, None)
    assert _count(gm, torch.ops.aten.detach.default) == 0
    code = gm.code
    assert cleanup_pass(gm, None).code == code
