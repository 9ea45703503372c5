"""Muon and the Muon + AdamW chain on sharded parameters (FSDP, TP, FSDP x TP on 4 ranks): the
parameters after 3 steps equal the same optimizers' on one device, Muon's collectives per step are
the two all-to-alls of the owner scheme with their analytic bytes, and the chain's state dict
(its own, ``hp.get_optimizer_state_dict``'s and ``hp.save_checkpoint``'s) resumes a run exactly.

One pool job compiles each plan once and runs every case on it, to keep the suite fast."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hyper_parallel as hp
import hyper_parallel.optim as hpo
from hyper_parallel.compat import StridedShard
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.optim.muon import newton_schulz
from hyper_parallel.optim.whole_matrix import apply_to_whole_matrices, shard_indices
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

WORLD = 4
MODEL = {"num_hidden_layers": 1, "num_key_value_heads": 4}  # 4 kv heads: tensor parallel over 4
HIDDEN_BYTES = (4 * 64 * 64 + 3 * 128 * 64) * 4  # q, k, v, o; gate, up, down (fp32)
HEAD_BYTES = 2 * 256 * 64 * 4  # the embedding and lm_head: 2-D, Muon's only when Muon takes all
PLANS = {
    "fsdp": ((WORLD,), ("dp",), lambda: {"fully_shard": hp.FullyShard(units=("model.layers.*", ""))}),
    "tp": ((WORLD,), ("tp",), llama_tp_plan),
    "fsdp_tp": ((2, 2), ("dp", "tp"), lambda: {**llama_tp_plan(), "fully_shard": {"units": ["model.layers.*", ""]}}),
}
STEPS = 3


def _muon_all_2d(model):
    return hpo.Muon([p for p in model.parameters() if p.dim() == 2])


def _chain(model):
    return hpo.get_hyper_optimizer(model, adamw_kwargs={"adamw_lr": 1e-3})


def _step(model, opt, mesh, step):
    full = global_batch("llama", 4, 16, seed=step + 1)
    opt.zero_grad()
    model(**(local_batch(full, mesh) if mesh is not None else full))["loss"].backward()
    opt.step()


def _run(model, reference, make, mesh, what):
    """STEPS steps of ``make``'s optimizers on the parallel model and on the one-device copy;
    the parameters must agree. Returns Muon's collectives of every step."""
    opt, ref_opt = make(model), make(reference)
    muon = opt if isinstance(opt, hpo.Muon) else opt["muon"]
    comms = []
    for step in range(STEPS):
        _step(model, opt, mesh, step)
        _step(reference, ref_opt, None, step)
        comms.append([(c.kind, c.phase, c.ranks, c.dtype, c.send_bytes, c.recv_bytes)
                      for c in muon.last_step_collectives])
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name], msg=lambda m, n=name: f"{what}: {n}: {m}")
    return comms


def _local_params(model):
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _restore(model, values):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(values[n])


def _resume_cases(model, mesh, ckpt_dir):
    """Chain: 1 step, save the state, 2 more steps; then back to the saved point, a fresh chain
    loading the state in each supported way, the same 2 steps: the same parameters, bit for bit."""
    _step(model, chain := _chain(model), mesh, 0)
    after_one = _local_params(model)
    own, flat = copy.deepcopy(chain.state_dict()), hpo.ChainedOptimizer(model, chain.optimizers, flatten=True)
    flat_sd = copy.deepcopy(flat.state_dict())
    fqn_sd = copy.deepcopy(hp.get_optimizer_state_dict(model, chain))
    hp.save_checkpoint(ckpt_dir, model, chain)
    for step in (1, 2):
        _step(model, chain, mesh, step)
    straight = _local_params(model)

    def load_own(m, c):
        c.load_state_dict(own)

    def load_flat(m, c):
        hpo.ChainedOptimizer(m, c.optimizers, flatten=True).load_state_dict(flat_sd)

    def load_fqn(m, c):
        hp.set_optimizer_state_dict(m, c, fqn_sd)

    def load_ckpt(m, c):
        # As when resuming a fresh process: no gradients yet. (With gradients set, torch's state-dict
        # code skips initialising a fresh optimizer's state, and the template DCP fills is empty.)
        m.zero_grad(set_to_none=True)
        hp.load_checkpoint(ckpt_dir, m, c)

    differing = {}
    for name, load in (("state_dict", load_own), ("flatten", load_flat), ("hp.get/set_optimizer_state_dict",
                       load_fqn), ("hp.save/load_checkpoint", load_ckpt)):
        _restore(model, {n: torch.zeros_like(v) for n, v in after_one.items()} if "checkpoint" in name else after_one)
        resumed = _chain(model)
        load(model, resumed)
        for step in (1, 2):
            _step(model, resumed, mesh, step)
        differing[name] = [n for n, v in _local_params(model).items() if not torch.equal(v, straight[n])]
    return differing


def uneven_and_replicated():
    """apply_to_whole_matrices on layouts the plans above do not produce: uneven and empty shards,
    a matrix replicated over one axis (two groups computing side by side), a strided shard."""
    meshes = {1: hp.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)),
              2: hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    cases = [((5, 7), 1, [Shard(0)]), ((6, 3), 1, [Shard(1)]), ((5, 3), 2, [Shard(0), Shard(1)]),
             ((6, 5), 2, [Replicate(), Shard(0)]), ((7, 4), 2, [StridedShard(0, split_factor=2), Shard(0)])]
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*shape, generator=gen) for shape, _, _ in cases]
    params = [distribute_tensor(f, meshes[m], p, src_data_rank=None) for f, (_, m, p) in zip(fulls, cases)]
    results, records = apply_to_whole_matrices(
        params, [p.to_local() for p in params], [torch.float32] * len(params), lambda i, full: newton_schulz(full))
    expected = [distribute_tensor(newton_schulz(f), p.device_mesh, p.placements, src_data_rank=None).to_local()
                for f, p in zip(fulls, params)]
    return {"equal": [torch.equal(r, e) for r, e in zip(results, expected)],
            "local_shapes": [tuple(p.to_local().shape) for p in params],
            "collectives": [(c.phase, c.ranks) for c in records]}


def optimizer_parity(ckpt_dir):
    out = {"uneven": uneven_and_replicated()}
    for plan_name, (shape, names, plan) in PLANS.items():
        mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=names)
        pristine = build_model("llama", **MODEL)
        model = hp.parallelize(copy.deepcopy(pristine), plan(), mesh)
        initial = _local_params(model)
        result = {}
        for case, make in (("muon", _muon_all_2d), ("chain", _chain)):
            _restore(model, initial)
            result[case] = _run(model, copy.deepcopy(pristine), make, mesh, f"{plan_name}/{case}")
        result["owners_ok"] = all([torch.equal(p.to_local(), mine) for p, mine in _own_slices(model)])
        if plan_name == "fsdp_tp":
            _restore(model, initial)
            result["resume"] = _resume_cases(model, mesh, f"{ckpt_dir}/{plan_name}")
        out[plan_name] = result
    return {"rank": dist.get_rank(), **out}


def _own_slices(model):
    """Every 2-D parameter's local shard next to the slice of its full tensor that the exchange's
    index maps give for this rank (the maps the owners use for every other rank)."""
    for p in model.parameters():
        if p.dim() == 2:
            mesh = p.device_mesh
            rows, cols = shard_indices(p.shape, mesh.shape, mesh.get_coordinate(), p.placements)
            yield p, p.full_tensor()[rows][:, cols]


def test_muon_and_chain_match_one_device_under_fsdp_tp_and_both(dist4, tmp_path):
    results = dist4.run(optimizer_parity, str(tmp_path))
    for plan in PLANS:
        for case, matrix_bytes in (("muon", HIDDEN_BYTES + HEAD_BYTES), ("chain", HIDDEN_BYTES)):
            for step in range(STEPS):
                per_rank = [r[plan][case][step] for r in results]
                # Two collectives per step for all matrices: shards to owners, results back.
                for comms in per_rank:
                    assert [(c[0], c[1], c[2], c[3]) for c in comms] == [
                        ("all_to_all_single", phase, tuple(range(WORLD)), torch.float32)
                        for phase in ("gather", "scatter")], (plan, case, comms)
                # Each matrix (every one sharded 4 ways) crosses the wire once each way but for the
                # owner's own quarter: 2 * 3/4 of the matrices' bytes, summed over the ranks
                # (all-gathering every matrix would move 4 * 3/4 of them).
                for phase in (0, 1):
                    sent = sum(comms[phase][4] for comms in per_rank)
                    received = sum(comms[phase][5] for comms in per_rank)
                    assert sent == received == matrix_bytes * (WORLD - 1) // WORLD, (plan, case, phase)
                # The owners share the work: every rank owns some matrices.
                assert all(comms[0][5] > 0 for comms in per_rank), (plan, case)
        assert all(r[plan]["owners_ok"] for r in results), plan
    assert 0 in [n for r in results for shape in r["uneven"]["local_shapes"] for n in shape]  # an empty shard
    for r in results:
        uneven = r["uneven"]
        assert all(uneven["equal"]), uneven
        # One exchange per mesh (the 1-D mesh's group, the 2x2 mesh's world group), both phases.
        assert uneven["collectives"] == [("gather", (0, 1, 2, 3)), ("scatter", (0, 1, 2, 3))] * 2
        assert r["fsdp_tp"]["resume"] == {"state_dict": [], "flatten": [], "hp.get/set_optimizer_state_dict": [],
                                          "hp.save/load_checkpoint": []}, r["fsdp_tp"]["resume"]


def _optimizer_built_before_parallelize(case: str):
    """The optimizer built from the model's parameters *before* parallelize (a common order in
    training scripts): parallelize replaces every parameter by a DTensor, and ``step()`` used to
    update the replaced tensors, which get no gradient, so nothing trained, with no error. The
    optimizer now gets the DTensor parameters at its first step: 3 steps equal one device's.
    Under a pipeline the parameters of the other stages leave it. ``stepped``: an optimizer that
    stepped before parallelize has state that is not sharded, an error naming the parameter."""
    mesh_shape, names, plan = {
        "dp": ((2,), ("dp",), {}),
        "fsdp": ((2,), ("dp_shard",), {"fully_shard": {"units": ["model.layers.*", ""]}}),
        "pipeline": ((2,), ("pp",), {"pipeline": {"split_points": ["model.layers.1"], "schedule": "1F1B",
                                                  "num_microbatches": 2}}),
        "stepped": ((2,), ("dp",), {}),
    }[case]
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    reference = build_model("hf_llama")
    model = copy.deepcopy(reference)
    # SGD with momentum: state per parameter, and no division by a tiny second moment that would
    # turn last-bit gradient differences into visible ones after a few steps (as AdamW's does).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    if case == "stepped":
        model(**global_batch("llama", 4, 16)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model = hp.parallelize(model, plan, mesh)
    for step in range(3):
        full = global_batch("llama", 4, 16, seed=step + 1)
        if case == "pipeline":
            model.step(full)
        else:
            model(**local_batch(full, mesh)).loss.backward()
        reference(**full).loss.backward()
        if case == "stepped":
            try:
                optimizer.step()
            except RuntimeError as exc:
                return str(exc)
            return "no error"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), expected[name], msg=lambda m, n=name: f"{n} after 3 steps: {m}")
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return len(held) == len(list(model.parameters())) and all(isinstance(p, torch.distributed.tensor.DTensor)
                                                                 for p in held)


def test_optimizer_built_before_parallelize_trains(dist2):
    pytest.importorskip("transformers")
    for case in ("dp", "fsdp", "pipeline"):
        assert dist2.run(_optimizer_built_before_parallelize, case) == [True, True], case
    for message in dist2.run(_optimizer_built_before_parallelize, "stepped"):
        assert "has state for parameter 'model.embed_tokens.weight'" in message, message
        assert "after parallelize(model, ...)" in message, message
