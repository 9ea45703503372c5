"""Guards for the mistakes of a first run, each with the fix in its message: a script started with
plain ``python`` instead of torchrun, a mesh that is not the launched world, and a transformers
model left at ``use_cache=True``."""

import pytest
import torch

from hyper_parallel import init_device_mesh


def test_init_device_mesh_without_a_launcher_says_how_to_launch(monkeypatch):
    """First-run mistakes caught before torch creates the process group: plain ``python`` instead
    of torchrun (torch would say "environment variable RANK expected"), and a mesh that is not the
    launched world (torch would fail only after the group exists)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # as in a fresh process
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["train.py"])
    with pytest.raises(ValueError, match=r"not started by a launcher .* `torchrun --nproc-per-node 4 train.py`"):
        init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"mesh \(2, 2\) has 4 ranks but the world size is 2: .*--nproc-per-node 4"):
        init_device_mesh("cpu", (2, 2), ("dp", "tp"))


def test_a_kv_cache_in_the_output_names_use_cache():
    """transformers models default to ``use_cache=True``; torch.export cannot return the cache
    object. The capture error says so and gives the fix."""
    transformers = pytest.importorskip("transformers")
    from hyper_parallel.compile.capture import capture

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(Exception, match=r"config has use_cache=True .* use_cache=False"):
        capture(model, (), {"input_ids": ids, "labels": ids})
    assert capture(model, (), {"input_ids": ids, "labels": ids, "use_cache": False}).gm is not None


def test_calling_a_marked_model_before_parallelize(caplog):
    """``hp.fully_shard`` only marks units. Called before ``hp.parallelize``: with meta parameters
    a ValueError says to parallelize first (transformers would fail with "Tensor.item() cannot be
    called on meta tensors"); with real ones the call runs unsharded, and a warning says so once."""
    import hyper_parallel as hp
    from hyper_parallel.fsdp.fully_shard import _warned
    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

    _warned.discard("LlamaForCausalLM")  # warned once per process: start clean
    ids = torch.zeros(1, 8, dtype=torch.long)
    with hp.init_empty_weights():
        meta = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1))
    for layer in meta.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(meta)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM was marked with hp.fully_shard and is called before "
                                         r"hp.parallelize, with its parameters on the meta device.*hp.parallelize"):
        meta(input_ids=ids)
    real = hp.fully_shard(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1)))
    with caplog.at_level("WARNING", logger="hyper_parallel"):
        real(input_ids=ids)
        real(input_ids=ids)
    warnings = [r.getMessage() for r in caplog.records if "hp.parallelize has not run" in r.getMessage()]
    assert len(warnings) == 1 and "unsharded on this rank" in warnings[0], warnings
