"""A compile reads a frozen CompileRequest and changes nothing of the module's run-time state
(compile/request.py, compile/driver.py): what a planner needs to compile many candidates of one
model in one process. On torch's fake backend (4 simulated ranks, a meta-device model)."""

import dataclasses

import torch

import hyper_parallel as hp
from hyper_parallel.compile.driver import compile_program
from hyper_parallel.tools.explain import fake_world
from hyper_parallel.testing.pass_inputs import LayerStack


def _count(summary: dict, kind: str, axis: str = "dp") -> int:
    return summary["collectives_per_step"].get(kind, {}).get(axis, {}).get("count", 0)


def test_candidates_compile_from_requests_without_touching_the_module_state():
    with fake_world(4):
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = LayerStack(3)
        pmodel = hp.parallelize(model, {"fully_shard": {"units": ["layers.*", ""]}}, mesh, materialize=False)
        state = pmodel._hp
        params_before = {n: (p.placements, p.to_local().shape) for n, p in pmodel.named_parameters()}
        request = state.compile_request(pmodel)
        x = torch.empty(4, 8, device="meta")
        fused = compile_program(pmodel, request, (x,), {}, [x])
        # Another candidate: the same plan without gradient bucketing, from the same request.
        unfused_request = dataclasses.replace(
            request, options=dataclasses.replace(request.options, disable_passes=frozenset({"bucketing"})))
        unfused = compile_program(pmodel, unfused_request, (x,), {}, [x])

        # Each candidate is the program its request asks for: one fused reduce-scatter per unit
        # (3 layers + root) with bucketing, one per parameter gradient without.
        assert _count(fused.summary, "reduce_scatter") == 4
        assert _count(unfused.summary, "reduce_scatter") > 4
        # ... and the module is as parallelize left it: no program cached or made its last, no
        # attribute guard added, its class and parameters unchanged, the request itself unchanged.
        assert state.cache == {} and state.last is None and state.attributes.guards == []
        assert type(pmodel).__name__ == "ParallelLayerStack"
        assert {n: (p.placements, p.to_local().shape) for n, p in pmodel.named_parameters()} == params_before
        assert request.options.disable_passes == frozenset()
        # What the capture read of the module comes back with the entry, for the runtime to guard.
        assert isinstance(fused.reads, tuple)
