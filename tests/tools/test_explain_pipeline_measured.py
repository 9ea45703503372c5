"""``explain`` with a pipeline against the pipeline executor running the same plan on 4 gloo ranks.

``explain`` prices a pipelined step by replaying the executor's schedule with each stage
program's simulated times (pipeline/step_cost.py). Here the same model, plan and mesh (built by
the same presets: 2 stages under 1F1B, 4 under interleaved 1F1B) train for real, bf16 mixed precision over FSDP with padded labels
(unequal tokens per rank): every pp rank must run its compute steps in exactly the order the
replay priced them. The measured per-stage forward times are printed beside the ones explain
predicts on the calibrated "cpu" profile (not asserted: the profile was calibrated with one
rank per core, and these 4 ranks share 2 cores).
"""

from __future__ import annotations

import re

import pytest
import torch

from hyper_parallel.pipeline.schedules.steps import T

TINY = {"base": "llama3-8b", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 256}
LOCAL_BATCH, SEQ, MICROBATCHES = 4, 16, 4
_COMPUTE = ("F", "B", "I", "W")


def _kind(name: str) -> str:
    """A step's type from its repr ("F2@s1" -> "F", "FR2@s1<s0" -> "FR")."""
    return re.match(r"[A-Z]+", name).group()


def _compute_step(name: str) -> str:
    """A compute step's repr without its peer stage."""
    return re.split(r"[<>]", name)[0]


def _fields() -> dict:
    from hyper_parallel.tools import presets

    fields = dict(TINY)
    return {**presets.load_model_config(fields.pop("base"))[1], **fields}


def _train_pipelined(parallel: dict, schedule: str) -> dict:
    """One compiling step, then one measured step; this pp rank's executed compute steps."""
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.tools import presets
    from hyper_parallel.tools.explain import build_model

    fields = _fields()
    dims = ParallelDims(**parallel, world_size=dist.get_world_size(), seq_len=SEQ, model_config=fields)
    mesh = dims.build_mesh("cpu")
    pipeline = {"schedule": schedule, "num_microbatches": MICROBATCHES, "stages_per_rank": None}
    choice = presets.build_plan("fsdp", dims.mesh_axes(), fields, mixed_precision=True, pipeline=pipeline)
    torch.manual_seed(0)
    net, _ = build_model("example", fields)
    pmodel = hp.parallelize(net, choice.plan, mesh)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(2):
        ids = torch.randint(0, TINY["vocab_size"], (LOCAL_BATCH, SEQ), generator=generator)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=generator) < 0.2 + 0.1 * dist.get_rank()] = -100
        loss = pmodel.step({"input_ids": ids, "labels": labels})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    report = pmodel.pipeline_report()
    assert torch.isfinite(torch.as_tensor(loss)).all()
    return {"timeline": report["timeline"], "pp_rank": mesh.get_coordinate()[mesh.mesh_dim_names.index("pp")]}


@pytest.mark.parametrize("parallel,schedule", [
    ({"dp_shard": 2, "pp": 2}, "1F1B"),
    ({"dp_shard": 2, "pp": 2}, "Interleaved1F1B"),  # 4 stages, 2 per pp rank
])
def test_explained_order_is_the_executed_order(dist4, parallel, schedule):
    from hyper_parallel.testing.explained import explain_pipelined_kept

    text = ",".join(f"{k}={v}" for k, v in parallel.items())
    report, seen = explain_pipelined_kept(config=dict(TINY), parallel=text, world_size=4, local_batch=LOCAL_BATCH,
                                          seq_len=SEQ, plan="fsdp", pp_schedule=schedule,
                                          num_microbatches=MICROBATCHES, hardware="cpu")
    predicted: dict[int, list[str]] = {}
    for rank, step, _, _ in seen["cost"].events:
        for sub in step.sub_steps or (step,):
            if sub.step_type in (T.FORWARD, T.BACKWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT):
                predicted.setdefault(rank, []).append(_compute_step(repr(sub)))

    runs = dist4.run(_train_pipelined, parallel, schedule)
    timeline = runs[0]["timeline"]
    assert sorted(timeline) == sorted(predicted), (sorted(timeline), sorted(predicted))
    for rank, events in timeline.items():
        executed = [_compute_step(name) for name, _, _, _ in events if _kind(name) in _COMPUTE]
        assert executed == predicted[rank], f"pp rank {rank}: executed {executed}, explained {predicted[rank]}"

    # Side by side: each stage's measured mean forward / backward on these CPU ranks, and explain's.
    measured: dict[tuple[str, int], list[float]] = {}
    for events in timeline.values():
        for name, stage, start, end in events:
            measured.setdefault((_kind(name), stage), []).append(end - start)
    for row in report["pipeline"]["stages"]:
        forward = measured[("F", row["stage"])]
        mean = sum(forward) / len(forward)
        print(f"{schedule} stage {row['stage']}: forward measured {1e3 * mean:.2f} ms, explained (cpu) "
              f"{1e3 * row['forward_s']:.2f} ms, predicted / measured {row['forward_s'] / mean:.2f}")
