"""How returned values leave a compiled program (propagation/engine.py's output sink): the loss
whole, other outputs this rank's part of the batch on the data-parallel axes and, elsewhere, the
sharding they were computed with unless ``plan.outputs`` says otherwise. Compiled on a fake mesh of
meta tensors: nothing runs, the decision is read from the compile."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM, llama_tp_plan

BATCH, SEQ = 4, 16


def _returned(plan, mesh_shape=(2,), names=("tp",)) -> tuple[dict, tuple]:
    """(output name -> placements, the runtime's (index, sub-mesh axes, placements) for DTensors)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids})
    entry = pmodel._last_entry()
    names_of = {0: "loss", 1: "logits"}
    placements = {names_of[i]: tuple(str(p) for p in v) for i, v in entry.report.output_placements.items()}
    dtensors = tuple((i, m.mesh_dim_names, tuple(str(p) for p in pl)) for i, m, pl in entry.returned)
    return placements, dtensors


def test_vocab_parallel_logits_are_returned_sharded():
    with fake_world(2):
        placements, dtensors = _returned(llama_tp_plan())
    assert placements == {"loss": ("R",), "logits": ("S(2)",)}
    assert dtensors == ((1, ("tp",), ("S(2)",)),)


@pytest.mark.slow
def test_logits_gathered_by_the_plan_are_returned_whole():
    with fake_world(2):
        # Sequence parallel without loss parallel gathers the logits at lm_head's output already.
        assert _returned(llama_tp_plan(sequence_parallel=True)) == ({"loss": ("R",), "logits": ("R",)}, ())
        # plan.outputs: whole, or another sharding than the computed one.
        assert _returned({**llama_tp_plan(), "outputs": {"logits": Replicate()}})[1] == ()
        assert _returned({**llama_tp_plan(), "outputs": {"logit*": {"tp": Shard(1)}}}) == (
            {"loss": ("R",), "logits": ("S(1)",)}, ((1, ("tp",), ("S(1)",)),))


@pytest.mark.slow
def test_data_parallel_axes_keep_the_batch_and_the_others_the_shard():
    with fake_world(4):
        placements, dtensors = _returned(llama_tp_plan(), (2, 2), ("dp", "tp"))
        assert placements == {"loss": ("R", "R"), "logits": ("S(0)", "S(2)")}
        assert dtensors == ((1, ("tp",), ("S(2)",)),)
        with pytest.raises(ValueError, match=r"outputs: 'logits' cannot be S\(0\) on 'tp': dim 0 is the batch dim the data-parallel axes \['dp'\] split; use Replicate\(\) or shard another dim"):
            _returned({**llama_tp_plan(), "outputs": {"logits": Shard(0)}}, (2, 2), ("dp", "tp"))
        with pytest.raises(ValueError, match=r"outputs: 'loss' cannot be S\(1\) on 'tp': it is a scalar"):
            _returned({**llama_tp_plan(), "outputs": {"loss": Shard(1)}}, (2, 2), ("dp", "tp"))
