"""State dicts and checkpoints of parallelized models (hyper_parallel.checkpoints.state_dict).

The oracle is the single-device model built from the same seed: state-dict keys and full tensors
must equal its own, every load path must round-trip exactly, and a checkpoint saved on 2 ranks and
resumed on 4 ranks (another mesh) must continue training with the losses of an uninterrupted
single-device run.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import hyper_parallel as hp
from hyper_parallel.checkpoints.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from hyper_parallel.checkpoints.io import load_checkpoint, save_checkpoint
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

LLAMA = {"num_key_value_heads": 4, "num_hidden_layers": 2}  # kv heads divisible by tp=4
FSDP = {"fully_shard": {"units": ["model.layers.*", ""]}}
CASES = {  # name -> (model, overrides, plan, mesh names, a parameter to freeze)
    "llama_tp": ("llama", LLAMA, llama_tp_plan, ("tp",), "model.layers.1.self_attn.q_proj.weight"),
    "mlp_dp": ("mlp", {}, dict, ("dp",), "layers.1.bias"),
    "llama_dp": ("llama", LLAMA, dict, ("dp",), "model.norm.weight"),
    "llama_dp_tp": ("llama", LLAMA, llama_tp_plan, ("dp", "tp"), "model.norm.weight"),
    # FSDP stores parameters Shard(0) over dp; with TP, colwise weights become _StridedShard(0).
    "llama_fsdp": ("llama", LLAMA, lambda: dict(FSDP), ("dp",), "model.norm.weight"),
    "llama_fsdp_tp": ("llama", LLAMA, lambda: {**llama_tp_plan(), **FSDP}, ("dp", "tp"), "model.norm.weight"),
    # Fused projections split per part (ColwiseParallel(parts=n), GPT-2's c_attn): _StridedShard with
    # no other axis nested, a shard DCP cannot record as one box (checkpoints/layouts.py).
    "phi3_tp": ("hf:Phi3ForCausalLM", {}, lambda: _hf_plan("Phi3ForCausalLM", "tp"), ("tp",), "model.norm.weight"),
    "phi3_fsdp_tp": ("hf:Phi3ForCausalLM", {}, lambda: _hf_plan("Phi3ForCausalLM", "fsdp_tp"), ("dp", "tp"),
                     "model.norm.weight"),
    "gpt2_tp": ("hf_gpt2", {}, lambda: _hf_plan("GPT2LMHeadModel", "tp"), ("tp",), "transformer.ln_f.weight"),
    "gpt2_dp": ("hf_gpt2", {}, dict, ("dp",), "transformer.ln_f.weight"),
}
MESH_SHAPES = {"llama_dp_tp": (2, 2), "llama_fsdp_tp": (2, 2), "phi3_fsdp_tp": (2, 2)}  # default: (world size,)
MATRIX_CASES = [("llama_tp", 2), ("mlp_dp", 2), ("llama_fsdp_tp", 4)]


def _hf_plan(arch: str, plan: str) -> dict:
    from hyper_parallel.models.hf_zoo import hf_fsdp_plan, hf_tp_plan

    return hf_tp_plan(arch) if plan == "tp" else {**hf_tp_plan(arch), **hf_fsdp_plan(arch)}


def _parallel(case, seed=0, mesh=None):
    name, overrides, plan, mesh_names, _ = CASES[case]
    if mesh is None:
        shape = MESH_SHAPES.get(case, (dist.get_world_size(),))
        mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=mesh_names)
    return hp.parallelize(build_model(name, seed=seed, **overrides), plan(), mesh), mesh


def _reference(case, seed=0):
    name, overrides, *_ = CASES[case]
    return build_model(name, seed=seed, **overrides)


def _assert_equal_to(model, reference_state, what):
    full = get_model_state_dict(model, StateDictOptions(full_state_dict=True))
    assert full.keys() == reference_state.keys(), what
    for key, value in full.items():
        torch.testing.assert_close(value, reference_state[key], rtol=0, atol=0,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


# --------------------------------------------------------------------------------------------
# The get matrix
# --------------------------------------------------------------------------------------------


def get_matrix(case):
    model, _ = _parallel(case)
    reference = _reference(case).state_dict()
    params = dict(model.named_parameters())
    rank = dist.get_rank()

    sharded = get_model_state_dict(model)
    assert list(sharded) == list(reference)
    for key, value in sharded.items():
        assert isinstance(value, DTensor), key
        assert value.placements == params[key].placements
        # A view of the live parameter, not a copy.
        assert value.to_local().data_ptr() == params[key].to_local().data_ptr(), key
        torch.testing.assert_close(value.full_tensor(), reference[key], rtol=0, atol=0)

    full = get_model_state_dict(model, StateDictOptions(full_state_dict=True))
    assert list(full) == list(reference)
    for key, value in full.items():
        assert type(value) is torch.Tensor, f"{key}: {type(value)}"
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0)

    offloaded = get_model_state_dict(model, StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert list(offloaded) == list(reference)
        for key, value in offloaded.items():
            assert type(value) is torch.Tensor and value.device.type == "cpu", key
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0)
    else:
        assert offloaded == {}

    local_cpu = get_model_state_dict(model, StateDictOptions(cpu_offload=True))
    for key, value in local_cpu.items():
        assert isinstance(value, DTensor) and value.to_local().device.type == "cpu", key
        assert value.placements == params[key].placements and value.shape == params[key].shape
        torch.testing.assert_close(value.to_local(), params[key].to_local(), rtol=0, atol=0)

    frozen = CASES[case][4]
    params[frozen].requires_grad_(False)
    for full_state_dict in (False, True):
        kept = get_model_state_dict(
            model, StateDictOptions(full_state_dict=full_state_dict, ignore_frozen_params=True))
        assert list(kept) == [k for k in reference if k != frozen]
    # ... and a load need not provide it.
    missing = set_model_state_dict(
        model, {k: v for k, v in reference.items() if k != frozen}, StateDictOptions(ignore_frozen_params=True))
    assert missing == ([], [])
    params[frozen].requires_grad_(True)
    return len(full)


@pytest.mark.pool  # request.getfixturevalue(f"dist{world}")
@pytest.mark.parametrize("case,world", MATRIX_CASES)
def test_get_model_state_dict_matrix(request, case, world):
    pool = request.getfixturevalue(f"dist{world}")
    assert pool.run(get_matrix, case) == [len(_reference(case).state_dict())] * world


# --------------------------------------------------------------------------------------------
# The set (load) paths
# --------------------------------------------------------------------------------------------


def set_paths(case):
    model, mesh = _parallel(case)
    params = dict(model.named_parameters())
    storage = {k: p.to_local().data_ptr() for k, p in params.items()}
    rank = dist.get_rank()

    # 1. Full plain tensors (sliced locally).
    other = _reference(case, seed=1).state_dict()
    set_model_state_dict(model, other)
    _assert_equal_to(model, other, "full tensors")

    # 2. DTensors placed like the parameters, from another parallelized model.
    source, _ = _parallel(case, seed=2)
    set_model_state_dict(model, get_model_state_dict(source))
    _assert_equal_to(model, _reference(case, seed=2).state_dict(), "DTensors")

    # 3. DTensors placed differently (Replicate): redistributed to the parameters' placements.
    other = _reference(case, seed=3).state_dict()
    replicated = {k: distribute_tensor(v, mesh, [Replicate()] * mesh.ndim) for k, v in other.items()}
    set_model_state_dict(model, replicated)
    _assert_equal_to(model, other, "redistributed DTensors")

    # 4. This rank's local shards as plain tensors.
    source, _ = _parallel(case, seed=4)
    set_model_state_dict(model, {k: v.to_local() for k, v in get_model_state_dict(source).items()})
    _assert_equal_to(model, _reference(case, seed=4).state_dict(), "local shards")

    # 5. broadcast_from_rank0: only rank 0 passes values.
    other = _reference(case, seed=5).state_dict()
    set_model_state_dict(model, other if rank == 0 else {},
                         StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _assert_equal_to(model, other, "broadcast from rank 0")

    # 6. A full state dict round-trips through get/set (CPU offload on rank 0 + broadcast).
    saved = get_model_state_dict(model, StateDictOptions(full_state_dict=True, cpu_offload=True))
    set_model_state_dict(model, _reference(case, seed=6).state_dict())
    set_model_state_dict(model, saved, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _assert_equal_to(model, other, "offload + broadcast round trip")

    # 7. strict=False loads a subset and reports the rest.
    key = next(iter(other))
    subset = _reference(case, seed=7).state_dict()
    result = set_model_state_dict(model, {key: subset[key], "extra.weight": torch.zeros(1)},
                                  StateDictOptions(strict=False))
    assert result.missing_keys == [k for k in sorted(other) if k != key]
    assert result.unexpected_keys == ["extra.weight"]
    torch.testing.assert_close(params[key].full_tensor(), subset[key], rtol=0, atol=0)

    # Everything was copied in place: the same Parameter objects over the same storage.
    assert dict(model.named_parameters()) == params
    assert {k: p.to_local().data_ptr() for k, p in model.named_parameters()} == storage
    return True


@pytest.mark.pool  # request.getfixturevalue(f"dist{world}")
@pytest.mark.parametrize("case,world", MATRIX_CASES)
def test_set_model_state_dict_round_trips(request, case, world):
    pool = request.getfixturevalue(f"dist{world}")
    assert pool.run(set_paths, case) == [True] * world


def bad_loads():
    model, _ = _parallel("llama_tp")
    good = _reference("llama_tp", seed=1).state_dict()
    before = get_model_state_dict(model, StateDictOptions(full_state_dict=True))
    messages = {}

    def expect(kind, state, options=None, error=ValueError):
        with pytest.raises(error) as info:
            set_model_state_dict(model, state, options)
        messages[kind] = str(info.value)

    missing = dict(good)
    del missing["lm_head.weight"]
    expect("missing", missing)
    expect("unexpected", {**good, "model.bogus": torch.zeros(2)})
    # q_proj.weight is (64, 64) sharded by rows over 2 ranks: local shard (32, 64).
    expect("shape", {**good, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)})
    expect("replicated_shape", {**good, "model.norm.weight": torch.zeros(65)})
    expect("dtensor_shape", {**good, "model.norm.weight": distribute_tensor(
        torch.zeros(65), model.model.norm.weight.device_mesh, [Replicate()])})
    expect("not_a_tensor", {**good, "model.norm.weight": [1.0]}, error=TypeError)
    bad_rank0 = {**good, "lm_head.weight": torch.zeros(3, 3)} if dist.get_rank() == 0 else {}
    expect("broadcast", bad_rank0, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with pytest.raises(ValueError, match="broadcast_from_rank0=True.*full_state_dict=True"):
        StateDictOptions(broadcast_from_rank0=True)
    # A rejected dict leaves the model untouched (everything is validated before copying).
    _assert_equal_to(model, before, "after rejected loads")
    return messages


def test_bad_state_dicts_name_the_key_and_shapes(dist2):
    messages = dist2.run(bad_loads)[0]
    assert "missing keys ['lm_head.weight']" in messages["missing"]
    assert "unexpected keys ['model.bogus']" in messages["unexpected"]
    assert "strict=False" in messages["missing"]
    shape = messages["shape"]
    assert "'model.layers.0.self_attn.q_proj.weight'" in shape and "(64, 63)" in shape
    assert "full shape (64, 64)" in shape and "local shard shape (32, 64)" in shape and "Shard(dim=0)" in shape
    assert "'model.norm.weight' has shape (65,); expected the full shape (64,)" in messages["replicated_shape"]
    assert "global shape (65,)" in messages["dtensor_shape"] and "(64,)" in messages["dtensor_shape"]
    assert "'model.norm.weight'" in messages["not_a_tensor"]
    assert "'lm_head.weight'" in messages["broadcast"] and "(3, 3)" in messages["broadcast"]


# --------------------------------------------------------------------------------------------
# Optimizer state and checkpoints: save on 2 ranks, resume on 4
# --------------------------------------------------------------------------------------------

STEPS_BEFORE, STEPS_AFTER, BATCH, SEQ = 2, 3, 4, 16


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: the optimizer state matters


def _train(model, opt, steps, mesh=None):
    losses = []
    for step in steps:
        batch = global_batch("llama", BATCH, SEQ, seed=step + 1)
        loss = model(**(local_batch(batch, mesh) if mesh is not None else batch))["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def save_job(case, path):
    model, mesh = _parallel(case)
    opt = _sgd(model.parameters())
    reference = _reference(case)
    ref_opt = _sgd(reference.parameters())
    losses = _train(model, opt, range(STEPS_BEFORE), mesh)
    torch.testing.assert_close(losses, _train(reference, ref_opt, range(STEPS_BEFORE)))

    # The optimizer state dict is keyed by FQN; its momentum buffers are DTensors placed like their
    # parameters, and their full values are the single-device optimizer's.
    params = dict(model.named_parameters())
    sharded = get_optimizer_state_dict(model, opt)
    assert list(sharded["state"]) == list(params)
    assert sharded["param_groups"][0]["params"] == list(params)
    full = get_optimizer_state_dict(model, opt, StateDictOptions(full_state_dict=True))
    for (key, param), ref_param in zip(params.items(), reference.parameters()):
        buf = sharded["state"][key]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf.placements == param.placements, key
        torch.testing.assert_close(full["state"][key]["momentum_buffer"], ref_opt.state[ref_param]["momentum_buffer"])

    # In memory round trips into a fresh optimizer: full plain tensors; rank 0's full CPU copy
    # broadcast to the others; this rank's local shards as plain tensors.
    on_rank0 = get_optimizer_state_dict(model, opt, StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (on_rank0 == {}) == (dist.get_rank() != 0)
    local = {"state": {k: {n: t.to_local() for n, t in v.items()} for k, v in sharded["state"].items()},
             "param_groups": sharded["param_groups"]}
    for state, options in [
        (full, StateDictOptions(full_state_dict=True)),
        (on_rank0, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
        (local, None),
    ]:
        fresh = _sgd(model.parameters())
        set_optimizer_state_dict(model, fresh, state, options)
        for key, param in params.items():
            loaded = fresh.state[param]["momentum_buffer"]
            assert isinstance(loaded, DTensor) and loaded.placements == param.placements, key
            torch.testing.assert_close(loaded.to_local(), opt.state[param]["momentum_buffer"].to_local(),
                                       rtol=0, atol=0)

    save_checkpoint(path, model, opt)
    return losses


def resume_job(case, path, check_momentum_matters=False):
    # Another seed: every value that matters must come from the checkpoint.
    model, mesh = _parallel(case, seed=123)
    opt = _sgd(model.parameters())
    load_checkpoint(path, model, opt)
    losses = _train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), mesh)

    reference = _reference(case)
    uninterrupted = _train(reference, _sgd(reference.parameters()), range(STEPS_BEFORE + STEPS_AFTER))
    torch.testing.assert_close(losses, uninterrupted[STEPS_BEFORE:])

    if not check_momentum_matters:
        return losses, uninterrupted
    # Without the optimizer state (momentum lost) the run diverges from the second step on.
    model, mesh = _parallel(case, seed=123, mesh=mesh)
    opt = _sgd(model.parameters())
    load_checkpoint(path, model)
    no_momentum = _train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), mesh)
    torch.testing.assert_close(no_momentum[0], uninterrupted[STEPS_BEFORE])
    assert (no_momentum[1:] - uninterrupted[STEPS_BEFORE + 1:]).abs().min() > 1e-4
    return losses, uninterrupted


RESUME = {  # saved on 2 ranks with this case -> resumed on 4 ranks with that one
    "llama_tp": "llama_tp",  # tp 2 -> tp 4
    "llama_dp": "llama_dp_tp",  # dp 2 -> (dp 2, tp 2): another plan as well as another mesh
    "llama_fsdp": "llama_fsdp_tp",  # Shard(0) over dp 2 -> FSDP + TP on (2, 2) (_StridedShard)
    "phi3_tp": "phi3_fsdp_tp",  # q, k, v split per part over tp 2 -> the same under FSDP on (2, 2)
    "gpt2_tp": "gpt2_dp",  # c_attn split per third over tp 2 -> replicated over dp 4
}


@pytest.mark.parametrize("case", sorted(RESUME))
def test_checkpoint_saved_on_2_ranks_resumes_on_4(dist2, dist4, case, tmp_path):
    path = str(tmp_path / "ckpt")  # created here, shared by the ranks of both jobs
    before = dist2.run(save_job, case, path)[0]
    after, uninterrupted = dist4.run(resume_job, RESUME[case], path, case == "llama_tp")[0]
    torch.testing.assert_close(torch.cat([before, after]), uninterrupted)


def _save_pretrained(plan_name: str, axis: str, directory: str) -> bool:
    """transformers' save_pretrained on every rank of a parallelized HF Llama after a training
    step: rank 0 writes the gathered weights, which from_pretrained loads on one device."""
    import copy

    from hyper_parallel.testing.parity import build_plan

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan_name), mesh)
    model(**local_batch(global_batch("llama", 4, 16), mesh)).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # weights no longer the initial ones
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    model.save_pretrained(directory)  # every rank: the weights are gathered, rank 0 writes
    dist.barrier()
    from transformers import AutoModelForCausalLM

    loaded = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    for name, value in full.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    return any(not torch.equal(full[n], p) for n, p in reference.named_parameters())  # trained


@pytest.mark.parametrize("plan,axis", [("fsdp", "dp_shard"), ("tp", "tp")])
def test_transformers_save_pretrained_writes_full_weights(dist2, tmp_path, plan, axis):
    """The parallel state dict holds DTensors, which save_pretrained used to hand to safetensors
    as plain tensors ("invalid python storage")."""
    pytest.importorskip("transformers")
    assert dist2.run(_save_pretrained, plan, axis, str(tmp_path / plan)) == [True, True]


def _pipelined_save_pretrained(directory: str) -> list:
    """Under a pipeline plan each pp rank holds only its stages' weights: save_pretrained gathers
    them to rank 0 over the pp axis (it used to refuse, pointing at hp.save_checkpoint), and the
    full state dict without cpu_offload gives every rank every entry."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    plan = {"pipeline": {"split_points": ["model.layers.1"], "schedule": "1F1B", "num_microbatches": 2}}
    reference = build_model("hf_llama")
    model = hp.parallelize(build_model("hf_llama"), plan, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.step(global_batch("llama", 4, 16))
    opt.step()  # weights no longer the initial ones
    mine = {n: p.full_tensor() for n, p in model.named_parameters()}
    full = hp.get_model_state_dict(model, hp.StateDictOptions(full_state_dict=True))
    assert set(full) == set(reference.state_dict()), set(reference.state_dict()) ^ set(full)
    for name, value in mine.items():
        assert torch.equal(full[name], value), name
    model.save_pretrained(directory)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    for name, value in full.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    return sorted(mine)


def test_save_pretrained_under_a_pipeline_gathers_the_stages(dist2, tmp_path):
    pytest.importorskip("transformers")
    stage0, stage1 = dist2.run(_pipelined_save_pretrained, str(tmp_path))
    assert stage0 and stage1 and not set(stage0) & set(stage1)  # each rank held only its stage


def _train_steps(model, optimizer, steps: range, mesh, rows: int = 4, ignore_fraction: float = 0.0) -> list:
    """Optimizer steps on batches ``steps`` (seeded by the step), through ``step()`` under a
    pipeline; each rank's slice of the batch over the data-parallel axes. The losses."""
    losses = []
    for step in steps:
        batch = local_batch(global_batch("llama", rows, 16, seed=step + 1, ignore_fraction=ignore_fraction), mesh)
        if "pp" in mesh.mesh_dim_names:
            loss = model.step(batch)
        else:
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _pipeline_checkpoint_resume(path: str) -> dict:
    """hp.save_checkpoint of a pipelined model (each pp rank holds only its stage), resumed into a
    fresh pipeline and into FSDP without a pipeline: the resumed losses continue the uninterrupted
    run (AdamW state included). The manifest used to list rank 0's keys only, so every load failed
    with the other stages' keys "missing"."""
    plan = {"pipeline": {"split_points": ["model.layers.1"], "schedule": "1F1B", "num_microbatches": 2}}
    pp_mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    train = _train_steps
    fsdp_mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    return _save_and_resume(path, plan, pp_mesh, {"fsdp": ({"fully_shard": {"units": ["model.layers.*", ""]}}, fsdp_mesh)},
                            train)


def _save_and_resume(path: str, plan: dict, mesh, others: dict, train) -> dict:
    """Train 2 steps under ``plan``, save, train 2 more (uninterrupted); then a fresh model (another
    seed) under the same plan ("pipeline") and under each of ``others`` ({name: (plan, mesh)}) loads
    the checkpoint and trains the same 2 steps. The losses of each run."""
    model = hp.parallelize(build_model("hf_llama"), plan, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, range(2), mesh)
    hp.save_checkpoint(path, model, optimizer)
    uninterrupted = train(model, optimizer, range(2, 4), mesh)
    resumed = {}
    for name, (other_plan, other_mesh) in {"pipeline": (plan, mesh), **others}.items():
        other = hp.parallelize(build_model("hf_llama", seed=7), other_plan, other_mesh)
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        hp.load_checkpoint(path, other, other_optimizer)
        resumed[name] = train(other, other_optimizer, range(2, 4), other_mesh)
    return {"uninterrupted": uninterrupted, **resumed}


def test_pipeline_checkpoint_resumes_in_a_pipeline_and_without(dist2, tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "pp_ckpt")
    for result in dist2.run(_pipeline_checkpoint_resume, path):
        assert result["pipeline"] == result["uninterrupted"], result
        torch.testing.assert_close(result["fsdp"], result["uninterrupted"], rtol=1e-5, atol=1e-6)


def _pipeline_fsdp_bf16_checkpoint_resume(path: str) -> dict:
    """The same under pp x FSDP with bf16 parameters and fp32 reduction (fp32 shards stored, bf16
    compute), padded labels: resumed into the same plan, the losses continue the uninterrupted run
    exactly; into FSDP alone on all 4 ranks, within bf16's tolerance (another reduction order)."""
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp = {"units": ["model.layers.*", ""], "mixed_precision": policy}
    plan = {"pipeline": {"split_points": ["model.layers.1"], "schedule": "1F1B", "num_microbatches": 2},
            "fully_shard": fsdp}
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))

    def train(model, optimizer, steps: range, mesh) -> list:
        return _train_steps(model, optimizer, steps, mesh, rows=8, ignore_fraction=0.3)

    fsdp_mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    return _save_and_resume(path, plan, mesh, {"fsdp": ({"fully_shard": fsdp}, fsdp_mesh)}, train)


def test_pipeline_fsdp_bf16_checkpoint_resumes(dist4, tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "pp_fsdp_bf16_ckpt")
    for result in dist4.run(_pipeline_fsdp_bf16_checkpoint_resume, path):
        assert result["pipeline"] == result["uninterrupted"], result
        torch.testing.assert_close(result["fsdp"], result["uninterrupted"], rtol=2e-2, atol=2e-2)
