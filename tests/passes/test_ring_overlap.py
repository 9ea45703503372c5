"""ring_overlap: for AsyncContextParallel, each ring-attention transfer's wait moves past the
current block's attention to the node that first reads the received block; sync ring plans and
other collectives are left alone; the issue order does not change; a second run changes nothing.
Numerics with the pass on and off: tests/cp/test_context_parallel.py."""

import torch

import hyper_parallel as hp
from hyper_parallel.ir import meta
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
from hyper_parallel.passes.ring_overlap import ring_overlap
from hyper_parallel.testing.pass_inputs import assert_valid_order, pass_input

c10d = torch.ops._c10d_functional
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _graph(style):
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")  # this rank's 8 of 32 tokens
    plan = {"context_parallel": {"model.layers.*.self_attn": style}}
    gm, _ = pass_input(lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=1)), plan, world=4,
                       upto="ring_overlap", axis="cp", inputs={"input_ids": ids, "labels": ids})
    return gm


def _ring_waits(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default
            and meta.CP_RING in n.args[0].meta]


def _issues(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is not c10d.wait_tensor.default
            and getattr(n.target, "namespace", None) == "_c10d_functional"]


def test_waits_move_to_the_first_reader():
    gm = _graph(hp.AsyncContextParallel())
    waits = _ring_waits(gm)
    assert waits
    # As lowered each transfer is waited for right after it is issued.
    assert all(w.prev is w.args[0] for w in waits)
    issues = _issues(gm)
    ring_overlap(gm)
    assert_valid_order(gm)
    assert _issues(gm) == issues  # same collectives in the same order
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for wait in _ring_waits(gm):
        first = min(wait.users, key=index.__getitem__)
        assert wait.next is first, wait.name  # right before the node that reads the block
    # Forward: (cp - 1) K/V transfers, each now in flight across one block's attention (the
    # backward's K/V waits span attention-backward kernels instead).
    kv = [w for w in _ring_waits(gm) if w.args[0].meta[meta.CP_RING]["moves"] == "kv"]
    between = [any(n.target is SDPA for n in _span(gm, w.args[0], w)) for w in kv]
    assert sum(between) == 3, between
    code = gm.code
    ring_overlap(gm)
    assert gm.code == code  # idempotent


def _span(gm, start, stop):
    nodes, inside = [], False
    for node in gm.graph.nodes:
        if node is stop:
            break
        if inside:
            nodes.append(node)
        inside |= node is start
    return nodes


def test_sync_ring_is_left_alone():
    gm = _graph(hp.ContextParallel(mode="ring"))
    code = gm.code
    ring_overlap(gm)
    assert gm.code == code
