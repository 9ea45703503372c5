"""Compile-level behaviour: dumps (content and byte-identical determinism), the SPMD check, errors
that must name their culprit, recorded plans, and the DTensor parameters users optimise."""

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.testing.graph_builder import read_tree
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper


def _compile_llama_tp(dump_dir, seq_len=16):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = hp.parallelize(build_model("llama"), llama_tp_plan(), mesh, dump_dir=dump_dir)
    model(**global_batch("llama", 2, seq_len))["loss"].backward()
    return model


def dump_twice():
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        _compile_llama_tp(a)
        _compile_llama_tp(b)
        return read_tree(a), read_tree(b)


def test_dumps_are_deterministic_and_readable(dist2):
    first, second = dist2.run(dump_twice)[0]
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between two identical compilations"
    rank0 = {k.split("/", 1)[1]: v.decode() for k, v in first.items() if k.startswith("rank0/")}
    stages = sorted(k for k in rank0 if k.endswith(".py"))
    assert stages[0].endswith("_captured.py") and any(s.endswith("_lowered.py") for s in stages)
    assert any(s.endswith("_cleanup.py") for s in stages), "one file per pass"
    assert any(s.endswith("_forward.py") for s in stages) and any(s.endswith("_backward.py") for s in stages)
    header, *rows = rank0["layouts.tsv"].splitlines()
    assert header.split("\t") == ["node", "op", "module", "input_layouts", "output_layout", "local_shape", "source",
                                   "why"]
    q_proj = [r for r in rows if "\tmodel.layers.0.self_attn.q_proj\t" in r and "aten.mm" in r]
    assert q_proj and "[S(1)]" in q_proj[0], q_proj  # colwise output: sharded features
    # Every collective says why it is there; the row-parallel output's all-reduce names its entry.
    collectives = [r.split("\t") for r in rows if "_c10d_functional.all_reduce" in r]
    assert collectives and all(r[-1] for r in collectives)
    assert any(r[-1] == "plan: tensor_parallel['model.layers.*.self_attn.o_proj'] RowwiseParallel output 0"
               for r in collectives), [r[-1] for r in collectives]
    summary = rank0["summary.json"]
    assert '"all_reduce"' in summary and '"tp"' in summary and '"bytes"' in summary


def spmd_mismatch():
    # Ranks disagree on the sequence length: their programs would issue different collectives.
    _compile_llama_tp(None, seq_len=16 if dist.get_rank() == 0 else 8)


def test_input_signature_mismatch_is_an_error_not_a_hang(dist2):
    # The per-call agreement (spmd.agree) catches it before either rank compiles, naming both sides.
    with pytest.raises(ValueError, match=r"rank 0 has .input 'input_ids': int64\[2, 16\] on cpu. where rank 1 "
                                         r"has .input 'input_ids': int64\[2, 8\] on cpu"):
        dist2.run(spmd_mismatch)


class _RankDependent(torch.nn.Module):
    """Runs its layer twice on rank 0 only: same inputs and plan, different programs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if dist.get_rank() == 0:
            h = self.lin(h)
        return h.sum()


def rank_dependent_program():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = hp.parallelize(_RankDependent(), {"tensor_parallel": {"lin": "colwise"}}, mesh)
    model(torch.randn(4, 8)).backward()


def test_spmd_mismatch_is_an_error_not_a_hang(dist2):
    # Model code that branches on the rank passes the input agreement; the compile-time check of
    # the collective sequences catches it.
    with pytest.raises(ValueError, match=r"SPMD check failed: collective #\d+ of the forward program"):
        dist2.run(rank_dependent_program)


def wrong_mesh_size():
    hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))


def test_mesh_size_must_equal_world_size(dist2):
    with pytest.raises(ValueError, match=r"4 ranks.*world size is 2"):
        dist2.run(wrong_mesh_size)


def recorded_plan_and_dtensor_params():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    reference = build_model("mlp")
    model = copy.deepcopy(reference)
    # The same plan entries written with parallelize_module instead of ParallelPlan.
    hp.parallelize_module(model, mesh, {"layers.0": hp.ColwiseParallel(), "layers.1": hp.RowwiseParallel()})
    model = hp.parallelize(model, None, mesh)
    batch = global_batch("mlp", 8, 0)
    loss = model(**batch)
    # The DTensor parameters feed the compiled step directly (program._RunStep unwraps them): their
    # gradients reach AccumulateGrad with no per-parameter to_local node in between.
    between = {type(fn).__name__ for fn, _ in loss.grad_fn.next_functions if fn is not None}
    loss.backward()
    reference(**batch).backward()
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    for name, p in model.named_parameters():  # each gradient laid out as its parameter
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements and p.grad.shape == p.shape, name
        assert p.grad.to_local().shape == p.to_local().shape, name
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e9)
    torch.testing.assert_close(total.full_tensor() if hasattr(total, "full_tensor") else total, ref_total)
    state = model.state_dict()
    assert set(state) == set(reference.state_dict())
    torch.testing.assert_close(state["layers.0.weight"].full_tensor(), reference.layers[0].weight)
    # A new input shape compiles again; the old one stays cached.
    model(**global_batch("mlp", 4, 0))
    model(**batch)
    return placements, len(model._hp.cache), between


def test_recorded_plan_dtensor_params_and_cache(dist2):
    placements, num_compiled, between = dist2.run(recorded_plan_and_dtensor_params)[0]
    assert between == {"AccumulateGrad"}, between
    assert placements["layers.0.weight"] == "(Shard(dim=0),)"
    assert placements["layers.1.weight"] == "(Shard(dim=1),)"
    assert num_compiled == 2


def unsupported_plan_entry():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    hp.parallelize(build_model("mlp"), {"pipeline": {"split_points": ["layers.1"]}}, mesh)


def test_unsupported_plan_entry_is_rejected(dist2):
    with pytest.raises(ValueError, match="pipeline"):
        dist2.run(unsupported_plan_entry)


def local_batch_shapes():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return tuple(local_batch(global_batch("llama", 4, 8), mesh)["input_ids"].shape)


def test_local_batch_slices_over_dp_only(dist4):
    assert dist4.run(local_batch_shapes) == [(2, 8)] * 4


def layouts_plan_parity():
    # The shard_module form: Megatron MLP written as full-mesh layouts instead of styles.
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    layout = hp.Layout((world,), ("tp",))
    reference = build_model("mlp")
    model = copy.deepcopy(reference)
    hp.shard_module(model.layers[0], {"parameter": {"weight": layout("tp", "None"), "bias": layout("tp")}})
    hp.shard_module(model.layers[1], {
        "parameter": {"weight": layout("None", "tp")},
        "forward": {"output": (layout("None", "None"),)},
    })
    model = hp.parallelize(model, None, mesh)
    # Tensor parallel only: both models get the whole batch.
    ParityStepper(reference, model, batch=lambda step: global_batch("mlp", 8, 0, seed=step)).run(3)
    return model.compile_summary()


def test_shard_module_layouts_parity(dist2):
    summary = dist2.run(layouts_plan_parity)[0]
    # Megatron MLP: forward, one all-reduce of the rowwise partial output; backward, none: every
    # weight gradient is computed on its own shard and the model input needs no gradient.
    assert summary["collectives"]["forward"] == {"all_reduce": {"tp": {"count": 1, "bytes": 8 * 8 * 4}}}
    assert summary["collectives"]["backward"] == {}
