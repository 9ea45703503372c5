"""Muon, ChainedOptimizer and get_hyper_optimizer in one process: the Newton–Schulz band, Muon
against a reference implementation written here (and torch.optim.Muon), the shard index maps the
sharded exchange relies on, state-dict round trips, and the errors."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

import hyper_parallel.optim as hpo
from hyper_parallel.compat import StridedShard
from hyper_parallel.optim.muon import newton_schulz
from hyper_parallel.optim.whole_matrix import shard_indices
from hyper_parallel.testing.parity import build_model, error_message, global_batch


def _reference_muon_step(params, grads, bufs, lr, momentum, wd, nesterov, scale):
    """Muon written out from its definition (Keller Jordan's post), one matrix at a time."""
    for p, g, buf in zip(params, grads, bufs):
        buf.mul_(momentum).add_((1 - momentum) * g)
        u = (1 - momentum) * g + momentum * buf if nesterov else buf.clone()
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / max(float(torch.linalg.matrix_norm(x)), 1e-7)
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        rows, cols = p.shape
        factor = math.sqrt(max(1.0, rows / cols)) if scale == "original" else 0.2 * math.sqrt(max(rows, cols))
        p.mul_(1 - lr * wd).sub_(lr * factor * o)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (8, 128)])
def test_newton_schulz_is_near_orthogonal(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g)
    assert out.shape == g.shape and out.dtype == torch.float32
    sv = torch.linalg.svdvals(out)
    assert 0.6 <= sv.min() and sv.max() <= 1.25, sv  # the quintic's band, not exactly 1
    # The same singular vectors as the input's polar factor: U^T O V is close to diagonal.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    core = u.T @ out @ vh.T
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-4, off.abs().max()
    torch.testing.assert_close(newton_schulz(7.5 * g), out, atol=1e-5, rtol=1e-4)  # scale-free
    assert not newton_schulz(torch.zeros(*shape)).any()  # zero stays zero (eps guards 0/0)


def test_newton_schulz_ill_conditioned_stays_bounded():
    g = torch.randn(48, 48, generator=torch.Generator().manual_seed(1))
    u, _, vh = torch.linalg.svd(g)
    sv = torch.linalg.svdvals(newton_schulz(u @ torch.diag(torch.logspace(0, -3, 48)) @ vh))
    assert sv.max() <= 1.25 and sv[:16].min() >= 0.6  # large directions in the band, none blown up


@pytest.mark.parametrize("nesterov,scale,wd", [(True, "original", 0.1), (False, "match_rms_adamw", 0.0)])
def test_muon_matches_reference_implementation(nesterov, scale, wd):
    gen = torch.Generator().manual_seed(2)
    shapes = [(16, 32), (48, 24), (20, 20)]
    params = [torch.randn(*s, generator=gen) for s in shapes]
    ref = [p.clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    live = [nn.Parameter(p.clone()) for p in params]
    opt = hpo.Muon(live, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=wd, adjust_lr_fn=scale)
    for _ in range(3):
        grads = [torch.randn(*s, generator=gen) for s in shapes]
        for p, g in zip(live, grads):
            p.grad = g.clone()
        opt.step()
        _reference_muon_step(ref, grads, bufs, 0.05, 0.9, wd, nesterov, scale)
    for p, r in zip(live, ref):
        torch.testing.assert_close(p.detach(), r)
    assert opt.last_step_collectives == [] and opt.comm_report()["count"] == 0  # plain tensors: no comm


def test_muon_bf16_tracks_torch_muon():
    """ns_dtype=bfloat16 is torch.optim.Muon's setting (its NS is always bf16): the same steps, while
    fp32 (our default) differs from it by bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(24, 40, generator=gen), torch.randn(40, 24, generator=gen)]
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    a = hpo.Muon(ours, lr=0.02, ns_dtype=torch.bfloat16)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q)


def test_muon_errors():
    msg = error_message(hpo.Muon, [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))])
    assert "params[1] of param group 0 (shape (4,))" in msg and "AdamW" in msg
    msg = error_message(hpo.Muon, [("model.norm.weight", nn.Parameter(torch.zeros(4)))])
    assert "model.norm.weight (shape (4,))" in msg
    for bad in ({"momentum": 1.0}, {"ns_steps": 0}, {"lr": -1.0}, {"adjust_lr_fn": "moon"}, {"ns_dtype": "int8"}):
        with pytest.raises(ValueError):
            hpo.Muon([nn.Parameter(torch.zeros(4, 4))], **bad)
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(2, 2, 2))


def test_shard_indices_follow_dtensor_slicing():
    # Uneven Shard: torch.chunk's sizes (3, 3, 3, 2), and an empty trailing shard (5 rows over 4).
    full = torch.arange(11 * 6).view(11, 6)
    for n_rows, chunks in ((11, full.chunk(4)), (5, full[:5].chunk(4))):
        for rank in range(4):
            rows, cols = shard_indices((n_rows, 6), (4,), (rank,), (Shard(0),))
            expected = chunks[rank] if rank < len(chunks) else full[:0]
            assert torch.equal(full[rows][:, cols], expected)
    # FSDP x TP's _StridedShard(0, 2) over dp + Shard(0) over tp: rank (dp, tp) holds block 2 * tp + dp.
    blocks = full[:8].chunk(4)
    for dp in range(2):
        for tp in range(2):
            rows, cols = shard_indices((8, 6), (2, 2), (dp, tp), (StridedShard(0, split_factor=2), Shard(0)))
            assert torch.equal(full[rows][:, cols], blocks[2 * tp + dp])
    rows, cols = shard_indices((8, 6), (2, 2), (1, 1), (Shard(0), Shard(1)))
    assert torch.equal(full[rows][:, cols], full[4:8, 3:6])


def _model_and_batch():
    model = build_model("llama", num_hidden_layers=1)
    return model, global_batch("llama", 2, 8)


def test_default_split_and_prefix_stripping():
    model, _ = _model_and_batch()
    muon, adamw = hpo.split_muon_adamw_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for p in muon[0]["params"])
    assert muon_names == sorted(n for n, p in model.named_parameters()
                                if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    assert len(muon_names) == 7  # q, k, v, o, gate, up, down
    assert {names[id(p)] for p in adamw[0]["params"]} >= {"model.embed_tokens.weight", "lm_head.weight",
                                                          "model.norm.weight"}
    chain = hpo.get_hyper_optimizer(model, muon_kwargs={"muon_lr": 0.01, "momentum": 0.9},
                                    adamw_kwargs={"adamw_lr": 3e-4, "adamw_betas": (0.9, 0.95)})
    assert isinstance(chain["muon"], hpo.Muon) and type(chain["adamw"]) is torch.optim.AdamW
    assert (chain["muon"].defaults["lr"], chain["muon"].defaults["momentum"]) == (0.01, 0.9)
    assert (chain["adamw"].defaults["lr"], chain["adamw"].defaults["betas"]) == (3e-4, (0.9, 0.95))
    assert chain["muon"].defaults["weight_decay"] == 0.1 and chain["adamw"].defaults["weight_decay"] == 0.01
    only_adamw = hpo.get_hyper_optimizer(model, muon_params=[], adamw_params=list(model.parameters()))
    assert list(only_adamw.optimizers) == ["adamw"]


def test_factory_and_chain_errors():
    model, _ = _model_and_batch()
    assert "lr" in error_message(hpo.get_hyper_optimizer, model, muon_kwargs={"lr": 1, "muon_lr": 2})
    assert "adamw_kwargs" in error_message(hpo.get_hyper_optimizer, model, muon_kwargs={"adamw_lr": 1})
    assert "both empty" in error_message(hpo.get_hyper_optimizer, model, [], [])
    msg = error_message(hpo.get_hyper_optimizer, model, muon_params=[{"params": [model.model.norm.weight]}])
    assert "model.norm.weight (shape (64,))" in msg
    q = model.model.layers[0].self_attn.q_proj.weight
    msg = error_message(hpo.ChainedOptimizer, model, {"muon": hpo.Muon([q]), "sgd": torch.optim.SGD([q], lr=1)})
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "'muon'" in msg and "'sgd'" in msg
    assert "Optimizer" in error_message(hpo.ChainedOptimizer, model, {"x": object()})
    chain = hpo.get_hyper_optimizer(model)
    assert "missing ['adamw']" in error_message(chain.load_state_dict, {"muon": chain["muon"].state_dict()})


def _train(model, chain, batch, steps):
    for _ in range(steps):
        chain.zero_grad()
        model(**batch)["loss"].backward()
        chain.step()


@pytest.mark.parametrize("flatten", [False, True])
def test_chain_steps_like_its_optimizers_and_round_trips(flatten):
    model, batch = _model_and_batch()
    twin = copy.deepcopy(model)
    chain = hpo.get_hyper_optimizer(model, flatten=flatten)
    muon, adamw = hpo.split_muon_adamw_params(twin)
    separate = [hpo.Muon(muon), torch.optim.AdamW(adamw)]
    assert [len(g["params"]) for g in chain.param_groups] == [7, 5]
    assert len(chain) == 2 and list(chain) == [chain["muon"], chain["adamw"]]
    for group in chain.param_groups:  # what an LR schedule does
        group["lr"] *= 0.5
    for opt in separate:
        for group in opt.param_groups:
            group["lr"] *= 0.5
    _train(model, chain, batch, 2)
    for _ in range(2):
        for opt in separate:
            opt.zero_grad()
        twin(**batch)["loss"].backward()
        for opt in separate:
            opt.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert len(chain.state) == 12 and all(chain.state[p] for p in model.parameters())
    # Round trip: the saved state resumes to the same parameters as training straight on.
    saved, snapshot = copy.deepcopy(chain.state_dict()), copy.deepcopy(model.state_dict())
    if flatten:  # keyed by parameter name, not by how parameters are grouped into optimizers
        assert "state.model.layers.0.mlp.up_proj.weight.momentum_buffer" in saved
        assert "state.lm_head.weight.exp_avg" in saved
    else:
        assert set(saved) == {"muon", "adamw"}
    _train(model, chain, batch, 2)
    straight = copy.deepcopy(model.state_dict())
    model.load_state_dict(snapshot)
    resumed = hpo.get_hyper_optimizer(model, flatten=flatten)
    resumed.load_state_dict(saved)  # mid-run: gradients are set
    _train(model, resumed, batch, 2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, straight[key]), key
