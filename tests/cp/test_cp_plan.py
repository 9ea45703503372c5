"""The context_parallel plan entry: styles, plain-dict (YAML) form, merging, resolution on a
Layout (no process group), the default input layout, and its errors."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.layout import Layout
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
from hyper_parallel.plan import ParallelPlan, merge_plans, resolve_plan

ATTENTION = "model.layers.*.self_attn"


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))


def test_styles_and_dict_form():
    assert hp.ContextParallel() == hp.ContextParallel(mode="all_to_all", load_balance=True, axis="cp")
    plan = ParallelPlan.from_dict({"context_parallel": {ATTENTION: {"style": "context_parallel", "axis": "seq"}}})
    assert plan.context_parallel[ATTENTION] == hp.ContextParallel(axis="seq")
    assert ParallelPlan(context_parallel={ATTENTION: "async_context_parallel"}).context_parallel[ATTENTION].asynchronous
    merged = merge_plans({"context_parallel": {ATTENTION: hp.ContextParallel()}}, {"fully_shard": {"units": [""]}})
    assert merged.context_parallel == {ATTENTION: hp.ContextParallel()}
    with pytest.raises(ValueError, match=r"mode is one of \['all_to_all', 'ring', 'all_gather'\]"):
        hp.ContextParallel(mode="ulysses")
    with pytest.raises(TypeError, match=r"context_parallel\['x'\]: expected hp.ContextParallel\(\)"):
        ParallelPlan(context_parallel={"x": 3})


def test_sequence_axis_shards_inputs_on_dim_1():
    resolved = resolve_plan({"context_parallel": {ATTENTION: hp.ContextParallel()}}, _llama(),
                            Layout((2, 2), ("dp", "cp")))
    assert resolved.sequence_axes == ("cp",)
    assert resolved.context.modules == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert resolved.input_placements("input_ids", 2) == (Shard(0), Shard(1))
    assert resolved.input_placements("lengths", 1) == (Shard(0), Replicate())  # no sequence dim
    assert resolved.data_parallel_axes == ("dp",)  # cp ranks hold other tokens, not other rows


def test_errors_name_the_entry():
    model, mesh = _llama(), Layout((2,), ("cp",))
    with pytest.raises(ValueError, match=r"mesh axis 'seq', which the mesh does not have"):
        resolve_plan({"context_parallel": {ATTENTION: hp.ContextParallel(axis="seq")}}, model, mesh)
    with pytest.raises(ValueError, match=r"differs from context_parallel\['model.layers.0.self_attn'\]"):
        resolve_plan({"context_parallel": {"model.layers.0.self_attn": hp.ContextParallel(),
                                           "model.layers.1.self_attn": hp.ContextParallel(mode="ring")}},
                     model, mesh)
    with pytest.raises(ValueError, match=r"has 4 heads, which cp=8 does not divide"):
        resolve_plan({"context_parallel": {ATTENTION: hp.ContextParallel()}}, model, Layout((8,), ("cp",)))
    with pytest.raises(ValueError, match=r"differs from context_parallel\['model.layers.0.self_attn'\]"):
        resolve_plan({"context_parallel": {"model.layers.0.self_attn": hp.ContextParallel(mode="ring"),
                                           "model.layers.1.self_attn": hp.AsyncContextParallel()}},
                     model, mesh)


def test_ring_mode_resolves_any_degree():
    """Ring attention splits the sequence, not the heads: cp=8 over 4 heads is fine."""
    context = resolve_plan({"context_parallel": {ATTENTION: hp.AsyncContextParallel(load_balance=False)}}, _llama(),
                           Layout((8,), ("cp",))).context
    assert (context.mode, context.degree, context.load_balance, context.asynchronous) == ("ring", 8, False, True)
    assert not context.balanced
    assert resolve_plan({"context_parallel": {ATTENTION: hp.ContextParallel(mode="ring")}}, _llama(),
                        Layout((2,), ("cp",))).context.balanced


def test_sequence_axis_after_the_data_parallel_axes():
    """With cp before dp the loss came out wrong (DTensor's strided shard of the [batch * sequence]
    flatten); the order is refused with the fix, in both modes."""
    for style in (hp.ContextParallel(), hp.ContextParallel(mode="ring")):
        with pytest.raises(ValueError, match=r"mesh axis 'cp' comes before the data-parallel axis \['dp'\] .*\('dp', 'cp'\)"):
            resolve_plan({"context_parallel": {ATTENTION: style}}, _llama(), Layout((2, 2), ("cp", "dp")))
    assert resolve_plan({"context_parallel": {ATTENTION: hp.ContextParallel()}}, _llama(),
                        Layout((2, 2), ("cp", "tp"))).context.axis == "cp"  # only data-parallel axes matter


def test_ulysses_degree_gives_the_hybrid():
    """``ulysses_degree`` (ParallelDims' field) between 1 and cp: ring attention over groups of
    Ulysses ranks, whatever ``mode`` says; 1 or cp are the pure modes. Heads need only divide by
    the Ulysses degree; the degree must divide cp."""
    def context(style, cp=8):
        return resolve_plan({"context_parallel": {ATTENTION: style}}, _llama(), Layout((cp,), ("cp",))).context

    hybrid = context(hp.ContextParallel(ulysses_degree=2))
    assert (hybrid.mode, hybrid.ulysses, hybrid.ring, hybrid.balanced) == ("hybrid", 2, 4, True)
    assert context(hp.AsyncContextParallel(ulysses_degree=4)).mode == "hybrid"  # 4 heads over 4, ring of 2
    assert context(hp.ContextParallel(mode="ring")).ulysses == 1
    assert context(hp.ContextParallel(ulysses_degree=1)).mode == "ring"
    assert context(hp.ContextParallel(mode="ring", ulysses_degree=4), cp=4).mode == "all_to_all"
    gathered = context(hp.ContextParallel(mode="all_gather"))
    assert (gathered.mode, gathered.ulysses, gathered.gathers, gathered.balanced) == ("all_gather", 1, True, True)
    hybrid_gather = context(hp.ContextParallel(mode="all_gather", ulysses_degree=2))
    assert (hybrid_gather.mode, hybrid_gather.gathers, hybrid_gather.ring) == ("hybrid", True, 4)
    assert not hybrid.gathers
    assert not context(hp.ContextParallel(ulysses_degree=4), cp=4).balanced  # no ring to balance
    with pytest.raises(ValueError, match=r"ulysses_degree=3 does not divide cp=8; .* pick one of \[1, 2, 4, 8\]"):
        context(hp.ContextParallel(ulysses_degree=3))
    with pytest.raises(ValueError, match=r"has 4 heads, which ulysses_degree=8 does not divide"):
        context(hp.ContextParallel(ulysses_degree=8), cp=16)
    with pytest.raises(ValueError, match=r"ulysses_degree=0\): give a positive int"):
        hp.ContextParallel(ulysses_degree=0)
