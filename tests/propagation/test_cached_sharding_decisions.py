"""Lowering and propagation take DTensor's sharding decisions from a table kept for the process
(``decision_cache.decide``, ``decision_cache.cached_sharding_decisions``).

Under ``make_fx`` DTensor bypasses its per-schema cache, so lowering re-ran every op's strategy
search; on a 2-D mesh with a sequence-sharded plan that was most of the compile. And DTensor's own
caches are emptied whenever a mesh is created, so every compile onto a new mesh searched again.
A kept decision must be exactly the one DTensor computes afresh, on the mesh it is asked for: the
programs are compared with the table off and with it filled by an earlier mesh of the same shape,
and a schema with a symbolic size must still be decided afresh (it cannot be hashed)."""

import contextlib

import pytest
import torch
from torch.distributed.tensor import Shard

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.propagation import decision_cache
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

ATTENTION = "model.layers.*.self_attn"
BF16 = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PLANS = {
    # The flatten of [batch, sequence] sharded over cp gives strided shards: the costly case.
    "cp_x_tp": ("llama", {"context_parallel": {ATTENTION: hp.AsyncContextParallel()}, **llama_tp_plan()},
                ("cp", "tp")),
    "fsdp_x_tp": ("llama", {"fully_shard": {"units": ["model.layers.*", ""]}, **llama_tp_plan()}, ("dp", "tp")),
    # bf16 parameters with fp32 reduction, a transformers model, FSDP over dp_shard x cp.
    "hf_bf16_fsdp_x_cp": ("hf:LlamaForCausalLM",
                          {"context_parallel": {ATTENTION: hp.ContextParallel(mode="ring")},
                           "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=BF16)},
                          ("dp_shard", "cp")),
}


def _compile(model_name, plan, names, forget=True):
    """Programs of rank 1 on a fake 2 x 2 mesh, and the decision table's counts of the compile."""
    if forget:
        decision_cache.forget_decisions()
    before = decision_cache.decision_counts()
    with fake_world(4, 1):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)  # clears DTensor's caches
        model = build_model(model_name, num_hidden_layers=2)
        batch = local_batch(global_batch(model_name, 4, 16, ignore_fraction=0.3), mesh)
        pmodel = compile_for_explain(model, plan, mesh, (), batch)
        after = decision_cache.decision_counts()
        return [program.code for program in pmodel.compiled_programs()], {k: after[k] - before[k] for k in after}


class _WriteOnly(dict):
    """A decision table that keeps what is made but never hands it out: every decision afresh."""

    def get(self, key, default=None):
        return default


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PLANS))
def test_programs_are_the_same_with_the_cache_and_without(case, monkeypatch):
    # Every decision DTensor's own (propagation's kept, never reused; lowering's not looked up).
    with monkeypatch.context() as m:
        m.setattr(decision_cache, "cached_sharding_decisions", lambda *a, **k: contextlib.nullcontext())
        m.setattr(decision_cache, "_decisions", _WriteOnly())
        fresh, _ = _compile(*PLANS[case])
        kept = dict(decision_cache._decisions)
    # On a second mesh of the same shape (other process groups), propagation reuses every decision
    # made on the first, bound to this one; lowering reuses them and those it made itself.
    monkeypatch.setattr(decision_cache, "_decisions", kept)
    again, counts = _compile(*PLANS[case], forget=False)
    assert counts["made"] < counts["kept"], counts
    assert again == fresh
    assert len(kept) > counts["made"], (len(kept), counts)  # most were made on the first mesh


def _relu_schema(mesh, rows):
    meta = compat.TensorMeta(torch.Size([rows, 4]), (4, 1), torch.float32)
    spec = compat.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
    return compat.OpSchema(torch.ops.aten.relu.default, (spec,), {}, schema_info=None)


def test_symbolic_sizes_are_decided_afresh_and_concrete_ones_cached():
    propagator = compat.sharding_propagator()
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        shape_env = compat.ShapeEnv()
        symbolic = _relu_schema(mesh, shape_env.create_unbacked_symint())
        with decision_cache.cached_sharding_decisions(), compat.FakeTensorMode(shape_env=shape_env):  # tracing
            decided = propagator.propagate_op_sharding_non_cached(symbolic)
            assert propagator.propagate_op_sharding.cache_info().currsize == 0  # never looked up
            assert decided.output_spec.placements == (Shard(0),)
            concrete = _relu_schema(mesh, 8)
            decision_cache.forget_decisions()
            first = propagator.propagate_op_sharding_non_cached(concrete)
            again = propagator.propagate_op_sharding_non_cached(_relu_schema(mesh, 8))
        assert again == first and again.output_spec.mesh is mesh
        assert decision_cache.decision_counts() == {"kept": 1, "made": 1}


def test_the_method_comes_back_after_nesting_and_errors():
    propagator = compat.sharding_propagator()
    with decision_cache.cached_sharding_decisions():
        outer = propagator.propagate_op_sharding_non_cached
        with pytest.raises(RuntimeError, match="inside"):
            with decision_cache.cached_sharding_decisions():
                raise RuntimeError("inside")
        assert propagator.propagate_op_sharding_non_cached is outer
    assert "propagate_op_sharding_non_cached" not in vars(propagator)  # the class's method again
