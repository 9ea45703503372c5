"""The pipeline split pass on the example Llama's lowered joint graph (one rank, two stages that
both run here: Interleaved1F1B on a single pp rank): which nodes and parameters each stage gets,
and exactly which values cross the cut in each direction."""

import pytest

from hyper_parallel.testing.distributed import get_pool


@pytest.fixture(scope="module")
def dist1():
    return get_pool(1)


def _split(split_point: str, tie: bool = False):
    import torch

    import hyper_parallel as hp
    from hyper_parallel.ir.graph import module_fqn_of
    from hyper_parallel.testing.parity import build_model, global_batch

    mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    plan = {"pipeline": {"split_points": [split_point], "schedule": "Interleaved1F1B", "stages_per_rank": 2,
                         "num_microbatches": 2}}
    model = build_model("llama", num_hidden_layers=4, tie_word_embeddings=tie)
    reference_loss = model(**global_batch("llama", 4, 16))["loss"].item()
    pmodel = hp.parallelize(model, plan, mesh)
    try:
        loss = pmodel.step(global_batch("llama", 4, 16)).item()
    except ValueError as exc:
        return {"error": str(exc)}
    entry = pmodel._hp.pipeline.last
    stages = []
    for graph in entry.stages:
        modules = {module_fqn_of(n) for n in graph.gm.graph.nodes if n.op == "call_function"}
        stages.append({
            "params": sorted(i.name for i in graph.inputs if i.kind == "param"),
            "inputs": sorted(i.name for i in graph.inputs if i.kind == "input"),
            "layers": sorted({m.split(".")[2] for m in modules if m.startswith("model.layers.")}),
        })
    transfers = [(t.phase, t.src, t.dst, t.shape, str(t.dtype)) for t in entry.stages[0].sends + entry.stages[1].sends]
    assert torch.isfinite(torch.tensor(loss))
    return {"stages": stages, "transfers": transfers, "loss": loss, "reference_loss": reference_loss}


def test_stages_get_their_layers_and_parameters(dist1):
    result = dist1.run(_split, "model.layers.1")[0]
    first, second = result["stages"]
    assert first["layers"] == ["0"] and second["layers"] == ["1", "2", "3"]
    assert all(p.startswith(("model.embed_tokens", "model.layers.0.")) for p in first["params"])
    assert "lm_head.weight" in second["params"] and "model.norm.weight" in second["params"]
    # The tokens feed the embedding; the labels feed the loss, in the last stage.
    assert first["inputs"] == ["input_ids"] and second["inputs"] == ["labels"]
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-6)


def test_only_the_hidden_state_crosses_the_cut(dist1):
    """Forward: the hidden state [2, 16, 64] of a micro-batch (2 of 4 rows); the rotary cos / sin
    tables, computed from a buffer alone, are recomputed by the second stage, not sent. Backward:
    only the hidden state's gradient."""
    transfers = dist1.run(_split, "model.layers.2")[0]["transfers"]
    assert transfers == [("forward", 0, 1, (2, 16, 64), "torch.float32"),
                         ("backward", 1, 0, (2, 16, 64), "torch.float32")], transfers


def test_tied_weights_across_stages_are_rejected(dist1):
    error = dist1.run(_split, "model.layers.2", True)[0]["error"]
    assert "parameter model.embed_tokens.weight is read by pipeline stages [0, 1] (tied weights?)" in error, error
