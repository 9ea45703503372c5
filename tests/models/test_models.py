"""Tests for the bundled models and plans (hyper_parallel.models): shapes, grads, seeds, HF parity, export."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.utils._pytree as pytree

from hyper_parallel.models import (
    MLP,
    CausalLMOutput,
    LlamaConfig,
    LlamaForCausalLM,
    llama_dp_plan,
    llama_tp_plan,
    mlp_tp_plan,
    tiny_hf_llama,
)

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers not installed (optional; pip install -e '.[dev]')"
)

B, S = 2, 16


def _ids(vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _llama(seed: int = 0, **cfg) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _glob_matches(pattern: str, fqn: str) -> bool:
    p, f = pattern.split("."), fqn.split(".")
    return len(p) == len(f) and all(a == "*" or a == b for a, b in zip(p, f))


def test_llama_forward_shapes_and_loss():
    model = _llama()
    ids = _ids()
    out = model(ids, labels=ids)
    assert isinstance(out, CausalLMOutput) and isinstance(out, dict)
    assert list(out) == ["loss", "logits"]
    assert out.logits.shape == (B, S, 256)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    # untrained model with std-0.02 weights: loss close to log(vocab)
    assert abs(out.loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert out["loss"] is out.loss

    no_labels = model(ids)
    assert list(no_labels) == ["logits"] and no_labels.loss is None
    torch.testing.assert_close(no_labels.logits, out.logits)
    with pytest.raises(AttributeError):
        no_labels.not_a_field


def test_llama_loss_matches_manual_shifted_cross_entropy():
    model = _llama()
    ids = _ids()
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(out.loss, expected)


def test_llama_backward_populates_all_grads():
    model = _llama()
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_llama_parameter_names_and_buffers():
    model = _llama()
    names = {n for n, _ in model.named_parameters()}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.3.self_attn.k_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert len(names) == 2 + 1 + 4 * 9
    assert all(p.ndim == 1 or not n.endswith("bias") for n, p in model.named_parameters())
    # inv_freq is a non-persistent buffer: present, not in the state dict
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())
    assert set(model.state_dict()) == names


def test_llama_determinism_from_seed():
    a, b, c = _llama(0), _llama(0), _llama(1)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    w = a.model.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005
    assert torch.equal(a.model.norm.weight, torch.ones(64))


def test_llama_init_weights_seed_leaves_global_rng_and_works_from_meta():
    model = _llama()
    state = torch.get_rng_state()
    model.init_weights(seed=3)
    assert torch.equal(state, torch.get_rng_state())
    again = _llama(5)
    again.init_weights(seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n

    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q), n
    torch.testing.assert_close(meta.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    ids = _ids()
    torch.testing.assert_close(meta(ids).logits, model(ids).logits)


def test_llama_tied_embeddings():
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    ids = _ids()
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_llama_config_validation():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaConfig(hidden_size=66, num_attention_heads=4)


def test_llama_attention_infers_head_count():
    # Simulate a TP shard: halve q/k/v output features and o_proj input features; the attention
    # must run with the local head count (views use -1, never the configured count).
    model = _llama()
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        full = getattr(attn, name)
        half = torch.nn.Linear(64, full.out_features // 2, bias=False)
        half.weight.data.copy_(full.weight.data[: full.out_features // 2])
        setattr(attn, name, half)
    o_half = torch.nn.Linear(32, 64, bias=False)
    o_half.weight.data.copy_(attn.o_proj.weight.data[:, :32])
    attn.o_proj = o_half
    ids = _ids()
    assert model(ids).logits.shape == (B, S, 256)


def test_output_is_pytree():
    out = CausalLMOutput(loss=torch.tensor(1.0), logits=torch.zeros(2))
    leaves, spec = pytree.tree_flatten(out)
    assert len(leaves) == 2
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is CausalLMOutput and list(back) == ["loss", "logits"]
    paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(out)[0]]
    assert paths == ["['loss']", "['logits']"]


def test_llama_torch_export():
    model = _llama(num_hidden_layers=2)
    ids = _ids()
    ep = torch.export.export(model, (ids,), {"labels": ids}, strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.scaled_dot_product_attention.default in targets
    # no no_grad/autocast regions or mask construction in our graph
    assert not any(isinstance(t, torch._ops.HigherOrderOperator) for t in targets)
    for n in ep.graph.nodes:
        if n.target is torch.ops.aten.view.default and len(n.args[1]) == 4:
            assert n.args[1][2] == -1, f"head count hard-coded in {n.format_node()}"
    out = ep.module()(ids, labels=ids)
    assert type(out) is CausalLMOutput
    ref = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)
    sig = ep.graph_signature
    assert set(sig.parameters) == {n for n, _ in model.named_parameters()}
    assert "model.rotary_emb.inv_freq" in sig.non_persistent_buffers


def test_mlp():
    torch.manual_seed(0)
    model = MLP()
    assert [n for n, _ in model.named_parameters()] == [
        "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"
    ]
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    assert model(x).shape == (4, 8)
    loss = model(x, y)
    assert loss.shape == () and torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(model(x), y))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len(MLP(num_layers=3).layers) == 3
    with pytest.raises(ValueError):
        MLP(num_layers=0)
    ep = torch.export.export(model, (x, y), strict=False)
    torch.testing.assert_close(ep.module()(x, y), model(x, y))


def test_plans_are_plain_dicts_matching_module_names():
    assert llama_dp_plan() == {}
    plan = llama_tp_plan()
    tp = plan["tensor_parallel"]
    assert set(plan) == {"tensor_parallel"}
    assert all(isinstance(v, str) for v in tp.values())
    assert tp["model.embed_tokens"] == "rowwise" and tp["lm_head"] == "colwise"
    assert tp["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert tp["model.layers.*.mlp.up_proj"] == "colwise"
    modules = [n for n, _ in _llama().named_modules()]
    for key in tp:
        assert any(_glob_matches(key, m) for m in modules), key
    mlp_modules = [n for n, _ in MLP().named_modules()]
    for key in mlp_tp_plan()["tensor_parallel"]:
        assert key in mlp_modules
    assert llama_tp_plan() is not llama_tp_plan() and llama_tp_plan() == plan


@pytest.mark.skipif(
    importlib.util.find_spec("hyper_parallel.tp.styles") is None,
    reason="hyper_parallel.tp.styles not available yet (sequence/loss-parallel plans build style objects)",
)
def test_sequence_parallel_plan_builds_styles():
    plan = llama_tp_plan(sequence_parallel=True, loss_parallel=True)["tensor_parallel"]
    assert set(llama_tp_plan()["tensor_parallel"]) < set(plan)
    for key in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"):
        assert type(plan[key]).__name__ == "SequenceParallel"
    assert type(llama_tp_plan(loss_parallel=True)["tensor_parallel"]["lm_head"]).__name__ == "ColwiseParallel"


@needs_transformers
def test_parameter_names_match_hf():
    ours = _llama(num_hidden_layers=4)
    hf = tiny_hf_llama(num_hidden_layers=4)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}
    assert set(ours.state_dict()) == set(hf.state_dict())
    for key in llama_tp_plan()["tensor_parallel"]:
        assert any(_glob_matches(key, m) for m, _ in hf.named_modules()), key


@needs_transformers
def test_numerics_match_hf_with_same_weights():
    hf = tiny_hf_llama(seed=0)
    ours = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
    ours.load_state_dict(hf.state_dict())
    ids = _ids()
    a, b = ours(ids, labels=ids), hf(input_ids=ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)


@needs_transformers
def test_tiny_hf_llama_is_seeded_and_exports():
    state = torch.get_rng_state()
    a, b = tiny_hf_llama(seed=0), tiny_hf_llama(seed=0)
    assert torch.equal(state, torch.get_rng_state())
    assert a.config.num_hidden_layers == 2 and a.config._attn_implementation == "sdpa"
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    ids = _ids()
    ep = torch.export.export(a, (), {"input_ids": ids, "labels": ids}, strict=False)
    out = ep.module()(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, a(input_ids=ids, labels=ids).loss)


# --- the example mixture of experts (hyper_parallel.models.moe) ------------------------------------


def _dense_experts_reference(experts, x, index, weights):
    """Every (token, choice) through its expert one row at a time: what the sorted, split run of
    MoEExperts must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = torch.nn.functional.silu(x[t] @ experts.gate_proj[e]) * (x[t] @ experts.up_proj[e])
            out[t] += weights[t, j] * (h @ experts.down_proj[e])
    return out


def test_moe_experts_equal_a_row_by_row_reference_and_skip_unrouted_experts():
    from hyper_parallel.models.moe import MoEExperts

    torch.manual_seed(0)
    experts = MoEExperts(num_experts=4, hidden_size=8, intermediate_size=16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(6, 8)
    index = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0]])  # experts 1 and 3 get nothing
    weights = torch.rand(6, 2)
    torch.testing.assert_close(experts(x, index, weights), _dense_experts_reference(experts, x, index, weights))


def test_moe_forward_loss_aux_loss_and_grads():
    from hyper_parallel.models.moe import MoEConfig, MoEForCausalLM, load_balancing_loss

    torch.manual_seed(0)
    config = MoEConfig(num_hidden_layers=2, shared_expert_intermediate_size=16, first_k_dense_layers=1)
    model = MoEForCausalLM(config)
    ids = _ids()
    out = model(ids, labels=ids)
    assert out["logits"].shape == (B, S, config.vocab_size)
    torch.testing.assert_close(out["loss"], torch.nn.functional.cross_entropy(
        out["logits"][:, :-1].reshape(-1, config.vocab_size).float(), ids[:, 1:].reshape(-1)) + 0.01 * out["aux_loss"])
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())
    assert isinstance(model.model.layers[0].mlp, torch.nn.Module) and not hasattr(model.model.layers[0].mlp, "experts")
    # Balanced routing gives the minimum E * sum_e (1/E)(1/E) = 1.
    scores = torch.full((8, 4), 0.25)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(scores, index).item() == pytest.approx(1.0)


def test_moe_config_validation_and_sigmoid_router():
    from hyper_parallel.models.moe import MoEConfig, MoERouter

    with pytest.raises(ValueError, match="score_func='relu'"):
        MoEConfig(score_func="relu")
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        MoEConfig(num_experts_per_tok=5)
    router = MoERouter(MoEConfig(score_func="sigmoid", norm_topk_prob=False))
    weights, index, scores = router(torch.randn(5, 64))
    assert weights.dtype == torch.float32 and index.shape == (5, 2)
    torch.testing.assert_close(weights, scores.gather(1, index))
    assert ((scores > 0) & (scores < 1)).all()
