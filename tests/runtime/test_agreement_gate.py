"""Where a call's agreement is waited for (runtime/agreement_gate.py): right before the forward
program's first collective, so a call reusing a cached program overlaps the exchange with the
forward's compute up to there. Compiled on one simulated rank of 2 (torch's ``fake`` backend)."""

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.ir.collectives import collective_kind
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
from hyper_parallel.runtime.agreement_gate import await_agreement, insert_gate

PLANS = {"dp": {}, "fsdp": {"fully_shard": {"units": ["model.layers.*", ""]}}}


def _forward_nodes(plan):
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
        ids = torch.empty(2, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids})
    return list(pmodel.compiled_programs()[0].graph.nodes)


@pytest.mark.parametrize("plan", list(PLANS))
def test_gate_sits_right_before_the_first_collective(plan):
    nodes = _forward_nodes(PLANS[plan])
    gates = [i for i, n in enumerate(nodes) if n.target is await_agreement]
    collectives = [i for i, n in enumerate(nodes) if collective_kind(n) is not None]
    assert len(gates) == 1 and gates[0] + 1 == collectives[0], (gates, collectives[:3])
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    if plan == "dp":  # the first collective is the loss's: the whole forward computes before the wait
        assert gates[0] > matmuls[-1], (gates, matmuls[-1])
    else:  # FSDP gathers the root unit's parameters first: nothing to overlap, the wait comes first
        assert gates[0] < matmuls[0]


@pytest.mark.slow
def test_gate_stays_in_place_around_inductor_regions():
    """codegen="inductor" hands only compute runs to Inductor; the gate, not compute, stays a node
    of the program between the last region and the first collective."""
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
        ids = torch.empty(2, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, {}, mesh, (), {"input_ids": ids, "labels": ids}, codegen="inductor")
    nodes = list(pmodel.generated_programs()[0].gm.graph.nodes)
    gate = next(i for i, n in enumerate(nodes) if n.target is await_agreement)
    first = next(i for i, n in enumerate(nodes) if collective_kind(n) is not None)
    regions = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    assert gate + 1 == first and regions and regions[0] < gate, (gate, first, regions)


def test_program_without_collectives_gets_no_gate():
    """(The runtime waits when such a forward returns.) A gate, where inserted, is kept by
    dead-code elimination though nothing reads it: it has a side effect."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    assert not insert_gate(gm)
    gate = gm.graph.call_function(await_agreement)
    gm.graph.eliminate_dead_code()
    assert gate in list(gm.graph.nodes)
