"""``repeated_blocks`` in training (issue 20): a transformers Llama whose capture traced two of its
three blocks and copied the third trains like one device, under FSDP with bf16 parameters and fp32
reduction and labels padded so the two ranks count different numbers of tokens.
tests/unit/test_repeated_blocks.py checks the copied graph against the trace of every block."""

import copy

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import (assert_matches_bf16_reference, bf16_reference_step, build_model,
                                           global_batch, local_batch)


def copied_blocks_parity(steps: int = 2) -> dict:
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    master = build_model("hf_llama", num_hidden_layers=3)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh, repeated_blocks="auto")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(master.parameters(), lr=0.1)
    counts = []
    for step in range(steps):
        full = global_batch("hf_llama", 4, 16, seed=step + 1, ignore_fraction=0.3)
        local = local_batch(full, mesh)
        counts.append(int((local["labels"] != -100).sum()))
        compute, ref_loss = bf16_reference_step(master, full)
        loss = model(**local).loss
        loss.backward()
        assert_matches_bf16_reference(model, loss, compute, ref_loss, f"step {step}: ")
        for p, cp in zip(master.parameters(), compute.parameters()):
            p.grad = cp.grad.float()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return {"traced": model.compile_summary()["repeated_blocks"], "counts": counts}


def test_copied_blocks_train_like_one_device(dist2):
    results = dist2.run(copied_blocks_parity)
    assert results[0]["traced"] == "2 of 3 blocks of model.layers traced"
    assert results[0]["counts"] != results[1]["counts"]  # the ranks count different tokens
