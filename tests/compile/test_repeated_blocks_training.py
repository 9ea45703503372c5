"""``repeated_blocks`` in training (issue 20): a transformers Llama whose capture traced two of its
three blocks and copied the third trains like one device, under FSDP with bf16 parameters and fp32
reduction and labels padded so the two ranks count different numbers of tokens.
tests/compile/test_repeated_blocks.py checks the copied graph against the trace of every block."""

import contextlib
import copy

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model
from hyper_parallel.testing.stepper import ParityStepper, batches, strided


def copied_blocks_parity(steps: int = 2) -> dict:
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    master = build_model("hf_llama", num_hidden_layers=3)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh, repeated_blocks="auto")
    counts = []
    # Against one device computing in bf16 from the fp32 master (which steps with its gradients).
    ParityStepper(master, model, mesh=mesh, batch=batches("hf_llama", ignore_fraction=0.3), bf16_reference=True,
                  before_step=lambda r: counts.append(int((r.local[0]["labels"] != -100).sum()))).run(steps)
    return {"traced": model.compile_summary()["repeated_blocks"], "counts": counts}


def test_copied_blocks_train_like_one_device(dist2):
    results = dist2.run(copied_blocks_parity)
    assert results[0]["traced"] == "2 of 3 blocks of model.layers traced, propagated and lowered"
    assert results[0]["counts"] != results[1]["counts"]  # the ranks count different tokens


def accumulated_copied_blocks(micro_steps: int = 2) -> list[str]:
    """FSDP gradient accumulation on transformers' 3-layer Llama with ``repeated_blocks="auto"``: the
    first micro-step's program copies the lowering; the later ones read pending gradients, so their
    compiles lower every block (refused right after the rewrites). The sum over micro-steps is one
    step on the whole batch. Returns each compile's ``repeated_blocks`` line."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    master = build_model("hf_llama", num_hidden_layers=3)
    model = hp.parallelize(copy.deepcopy(master), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh,
                           repeated_blocks="auto")
    traced = []

    @contextlib.contextmanager
    def micro_step(record, i):
        model.set_requires_gradient_sync(i == micro_steps - 1)
        yield
        traced.append(model.compile_summary()["repeated_blocks"])

    # One step: every gradient after the micro-steps (each loss / micro_steps) against the whole batch.
    ParityStepper(master, model, mesh=mesh, batch=batches("hf_llama", batch=4 * micro_steps), optimizer=None,
                  micro_batches=micro_steps, split=strided, reference_micro_batches=1, micro_context=micro_step,
                  check_loss=False).run(1)
    return traced


def test_copied_blocks_with_gradient_accumulation(dist2):
    traced = dist2.run(accumulated_copied_blocks)[0]
    assert traced == ["2 of 3 blocks of model.layers traced, propagated and lowered",
                      "2 of 3 blocks of model.layers traced"], traced


def pipelined_dumps(dump_root: str) -> dict:
    """A 2-stage 1F1B pipeline of the 4-layer example Llama, at parity with one device, compiled
    with and without copied blocks: the stage split reads the autograd order of the copies."""
    import os

    from hyper_parallel.testing.parity import run_pipeline_parity

    plan = {"pipeline": hp.PipelinePlan(split_points=["model.layers.2"], schedule="1F1B", num_microbatches=2)}
    traced = {}
    for option in (None, "auto"):
        out = run_pipeline_parity(plan, (2,), ("pp",), steps=1, dump_dir=os.path.join(dump_root, str(option)),
                                  parallelize_options={"repeated_blocks": option})
        traced[str(option)] = out["summary"]["repeated_blocks"]
    files = {}  # the front half under rank<r>/, each stage's programs under stage<s>/[no_sync/]rank<r>/
    for option in ("None", "auto"):
        root = os.path.join(dump_root, option)
        files[option] = {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                         for d, _, names in os.walk(root) for f in names
                         if os.path.basename(d) == f"rank{dist.get_rank()}"}
    measured = ("pipeline_trace.json",)  # the step's measured timings
    differing = sorted(n for n in files["None"] if files["None"][n] != files["auto"].get(n) and not n.endswith(measured))
    return {"traced": traced, "files": sorted(files["None"]), "differing": differing}


def test_copied_blocks_pipeline_like_traced_blocks(dist2, tmp_path):
    results = dist2.run(pipelined_dumps, str(tmp_path))
    for r in results:
        assert r["traced"] == {"None": "", "auto": "2 of 4 blocks of model.layers traced, propagated and lowered"}
        assert "rank0/schedule.txt" in r["files"] or "rank1/schedule.txt" in r["files"], r["files"]
        assert sum(f.startswith("stage") and f.endswith("_backward.py") for f in r["files"]) >= 1, r["files"]
        assert r["differing"] == [], r["differing"]
