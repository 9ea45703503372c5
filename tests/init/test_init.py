"""distribute_parameters on real process groups: meta-built models get exactly the single-device
values from the same seed (TP, dim-0/FSDP-like and FSDP+TP strided layouts, tied weights, HF), real
models keep theirs, and a ~1B-parameter model is materialised without any rank holding more than
its shards plus one full parameter."""

import importlib.util
import os
import resource
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.fsdp.resolve import resolve_fully_shard
from hyper_parallel.init import InitStats, distribute_parameters, init_empty_weights, manual_seed
from hyper_parallel.models import MLP, LlamaConfig, LlamaForCausalLM, llama_tp_plan, mlp_tp_plan
from hyper_parallel.plan import resolve_plan

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# ~0.94 B parameters (3.8 GB fp32); HP_INIT_MEMORY_CONFIG=small runs a ~0.1 B variant instead.
BIG_LLAMA = dict(
    hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=32000,
)
SMALL_LLAMA = dict(
    hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=8, vocab_size=32000,
)


def _tensors(model):
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _dim0_placements(model, size):
    """FSDP-like: Shard(0) for every 2-D+ tensor whose dim 0 the axis divides, else Replicate."""
    return {
        fqn: (Shard(0),) if t.dim() >= 2 and t.shape[0] % size == 0 else (Replicate(),)
        for fqn, t in _tensors(model)
    }


def _compare(model, reference, placements):
    """Every FQN: a DTensor with the requested placements, a compact local shard, the reference's
    values. Returns a list of problems (empty when all is well). Calls full_tensor() (collective)
    on every rank in the same order."""
    ref = dict(_tensors(reference))
    problems = []
    for fqn, t in _tensors(model):
        if not isinstance(t, DTensor):
            problems.append(f"{fqn}: {type(t).__name__}, not a DTensor")
            continue
        if tuple(t.placements) != tuple(placements[fqn]):
            problems.append(f"{fqn}: placements {t.placements} != {placements[fqn]}")
        local = t.to_local()
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            problems.append(f"{fqn}: local shard keeps a {local.untyped_storage().nbytes()}-byte storage alive")
        if isinstance(ref[fqn], nn.Parameter) != isinstance(t, nn.Parameter):
            problems.append(f"{fqn}: parameter/buffer kind changed")
        if not torch.equal(t.full_tensor(), ref[fqn].detach()):
            problems.append(f"{fqn}: values differ from the single-device model")
    return problems


def _reference(cfg, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model, torch.get_rng_state()


def meta_llama_cases():
    world = dist.get_world_size()
    results = {}
    for axis in ("tp", "dp"):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        for tie in (False, True):
            cfg = LlamaConfig(tie_word_embeddings=tie)
            reference, rng_after_reference = _reference(cfg, seed=7)
            manual_seed(7)
            with init_empty_weights():
                model = LlamaForCausalLM(cfg)
            assert all(t.is_meta for _, t in _tensors(model))
            if axis == "tp":
                placements = resolve_plan(llama_tp_plan(), model, mesh).param_placements
            else:
                placements = _dim0_placements(model, world)
            stats = InitStats()
            distribute_parameters(model, placements, mesh, stats=stats)
            results[(axis, tie)] = {
                "problems": _compare(model, reference, placements),
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "params_are_parameters": all(isinstance(p, nn.Parameter) for p in model.parameters()),
                "rng_like_single_device": torch.equal(torch.get_rng_state(), rng_after_reference),
                "inv_freq_persistent": "model.rotary_emb.inv_freq" in model.state_dict(),
                "hook": stats.init_hook,
                "peak_ok": stats.peak_bytes <= stats.final_bytes + stats.largest_module_bytes,
            }
    return results


def test_meta_llama_equals_single_device_tp_and_dim0(dist2):
    for rank_result in dist2.run(meta_llama_cases):
        for (axis, tie), r in rank_result.items():
            where = f"mesh ({axis!r},) tie_word_embeddings={tie}"
            assert r["problems"] == [], where
            assert r["tied"] == tie, where
            assert r["params_are_parameters"] and r["rng_like_single_device"], where
            assert not r["inv_freq_persistent"], where
            assert r["hook"] == "LlamaForCausalLM.init_weights" and r["peak_ok"], where


def meta_mlp_tp():
    # No model init hook: the Linear layers' own reset_parameters() give the final values.
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(2)
    reference = MLP(num_layers=3)
    manual_seed(2)
    with init_empty_weights():
        model = MLP(num_layers=3)
    placements = resolve_plan(mlp_tp_plan(num_layers=3), model, mesh).param_placements
    stats = InitStats()
    distribute_parameters(model, placements, mesh, stats=stats)
    return _compare(model, reference, placements), stats.init_hook, sorted({str(p) for p in placements.values()})


def test_meta_mlp_without_init_hook(dist2):
    for problems, hook, kinds in dist2.run(meta_mlp_tp):
        assert problems == [] and hook == ""
        assert len(kinds) > 1  # colwise and rowwise layers: more than one layout was exercised


def meta_llama_fsdp_tp():
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(num_hidden_layers=2)
    reference, _ = _reference(cfg, seed=3)
    manual_seed(3)
    with init_empty_weights():
        model = LlamaForCausalLM(cfg)
    resolved = resolve_plan(llama_tp_plan(), model, mesh)
    placements = resolve_fully_shard({"units": ["model.layers.*", ""]}, model, resolved).param_placements
    strided = sorted(f for f, p in placements.items() if any(isinstance(x, _StridedShard) for x in p))
    distribute_parameters(model, placements, mesh)
    return _compare(model, reference, placements), strided


def test_meta_llama_fsdp_tp_strided_shards(dist4):
    for problems, strided in dist4.run(meta_llama_fsdp_tp):
        assert problems == []
        assert "model.layers.0.self_attn.q_proj.weight" in strided  # colwise under FSDP: _StridedShard


def real_llama_tied():
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    cfg = LlamaConfig(tie_word_embeddings=True)
    reference, _ = _reference(cfg, seed=5)
    model, _ = _reference(cfg, seed=5)
    keys = set(model.state_dict())
    placements = _dim0_placements(model, world)
    stats = InitStats()
    distribute_parameters(model, placements, mesh, stats=stats)
    return (
        _compare(model, reference, placements),
        model.lm_head.weight is model.model.embed_tokens.weight,
        set(model.state_dict()) == keys,
        stats.num_real,
    )


def test_real_model_tied_weights_stay_tied(dist2):
    for problems, tied, same_keys, num_real in dist2.run(real_llama_tied):
        assert problems == [] and tied and same_keys
        assert num_real == len({id(t) for _, t in _tensors(LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True)))})


def hf_meta_cases():
    import transformers

    from hyper_parallel.models import tiny_hf_llama_config

    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {}
    for tie in (False, True):
        cfg = tiny_hf_llama_config(tie_word_embeddings=tie)
        torch.manual_seed(11)
        reference = transformers.LlamaForCausalLM(cfg)
        manual_seed(11)
        with init_empty_weights():
            model = transformers.LlamaForCausalLM(cfg)
        placements = _dim0_placements(model, world)
        distribute_parameters(model, placements, mesh)
        out[tie] = (_compare(model, reference, placements), model.lm_head.weight is model.model.embed_tokens.weight)
    return out


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed (optional)")
def test_meta_hf_llama_equals_single_device(dist2):
    for rank_result in dist2.run(hf_meta_cases):
        for tie, (problems, tied) in rank_result.items():
            assert problems == [], f"tie_word_embeddings={tie}"
            assert tied == tie


def rank_dependent_seed():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    manual_seed(dist.get_rank())
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig())
    try:
        distribute_parameters(model, _dim0_placements(model, dist.get_world_size()), mesh)
    finally:
        assert all(t.is_meta for _, t in _tensors(model)), "model must be left as it was"


def test_different_rng_states_are_an_error(dist2):
    with pytest.raises(ValueError, match=r"generator states differ along mesh axis 'dp'.*manual_seed"):
        dist2.run(rank_dependent_seed)


class _Scale(nn.Module):
    """No reset_parameters(): only a model-level init hook can initialise it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class _HookMissesScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = _Scale()
        self.init_weights()

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear) and not m.weight.is_meta:
                nn.init.normal_(m.weight)


class _StaleBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def reset_parameters(self):
        pass  # forgets to recompute ``table``


def uninitialised_tensors(which):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    manual_seed(0)
    with init_empty_weights():
        model = _HookMissesScale() if which == "hook" else nn.Sequential(nn.Linear(4, 4), _StaleBuffer())
    placements = {fqn: (Replicate(),) for fqn, _ in _tensors(model)}
    try:
        distribute_parameters(model, placements, mesh)
    finally:
        assert all(t.is_meta for _, t in _tensors(model)), "model must be left as it was"


def test_uninitialised_meta_tensors_are_named(dist2):
    with pytest.raises(ValueError, match=r"'norm' \(_Scale\) has 'scale'.*_HookMissesScale.init_weights"):
        dist2.run(uninitialised_tensors, "hook")
    with pytest.raises(ValueError, match=r"'1' \(_StaleBuffer\).reset_parameters\(\) did not initialise its buffer 'table'"):
        dist2.run(uninitialised_tensors, "buffer")


def meta_memory(cfg_kwargs):
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    manual_seed(0)
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**cfg_kwargs))
    placements = _dim0_placements(model, world)
    distinct = {id(t): (fqn, t) for fqn, t in reversed(_tensors(model))}.values()
    replicated = sum(
        t.numel() * t.element_size() for fqn, t in distinct if all(isinstance(p, Replicate) for p in placements[fqn])
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = InitStats()
    start = time.perf_counter()
    distribute_parameters(model, placements, mesh, stats=stats)
    seconds = time.perf_counter() - start
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    held = sum(
        t.to_local().untyped_storage().nbytes()
        for t in {id(t): t for _, t in _tensors(model)}.values()
    )
    return dict(
        peak=stats.peak_bytes, final=stats.final_bytes, total=stats.total_bytes, held=held,
        largest_tensor=stats.largest_tensor_bytes, largest_module=stats.largest_module_bytes,
        replicated=replicated, rss_growth=rss_growth, seconds=seconds,
        num_params=sum(p.numel() for p in model.parameters()),
    )


def test_meta_init_memory_stays_at_shards_plus_one_parameter(dist4):
    big = os.environ.get("HP_INIT_MEMORY_CONFIG", "big") != "small"
    results = dist4.run(meta_memory, BIG_LLAMA if big else SMALL_LLAMA)
    world = len(results)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['num_params'] / 1e9:.2f} B params, total {r['total'] / 2**30:.2f} GiB, "
              f"peak {r['peak'] / 2**20:.0f} MiB, final {r['final'] / 2**20:.0f} MiB, largest "
              f"{r['largest_tensor'] / 2**20:.0f} MiB, maxrss growth {r['rss_growth'] / 2**20:.0f} MiB, "
              f"{r['seconds']:.1f} s")
        assert r["held"] == r["final"], "the counter must match the shards actually kept"
        # The shards left on this rank: a quarter of the sharded tensors plus the replicated ones.
        assert r["final"] == (r["total"] - r["replicated"]) // world + r["replicated"]
        # One module's full tensors at a time (one parameter each here), never the model.
        assert r["largest_module"] == r["largest_tensor"]
        assert r["peak"] <= r["final"] + r["largest_tensor"]
        # The brief's bound total/world + largest, plus the replicated norms' (world-1)/world share.
        assert r["peak"] <= r["total"] / world + r["largest_tensor"] + r["replicated"] * (world - 1) / world
        assert r["peak"] < r["total"] / 2
        # Sanity: the process's peak RSS grew by no more than the counted peak plus slack.
        assert r["rss_growth"] <= 1.25 * r["peak"] + 128 * 2**20
