"""``hp.StepMeter``: per-step loss, tokens/s, MFU measured and predicted, peak memory, checked
against what the test measures itself: the wall time of the steps, the tokens it passed, the loss
the model returned, the cost model's FLOPs of the programs and the memory estimator's peak."""

import time

import torch

import hyper_parallel as hp
from hyper_parallel.cost.compute import node_work
from hyper_parallel.testing.parity import build_model, global_batch, local_batch


def _three_steps() -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=1), {}, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = local_batch(global_batch("llama", 4, 16), mesh)
    model(**batch)["loss"].backward()  # compile outside the timed steps
    opt.zero_grad()
    meter = hp.StepMeter(model, optimizer=opt)
    results, losses, elapsed = [], [], 0.0
    for _ in range(3):
        started = time.perf_counter()
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed += time.perf_counter() - started  # the steps' own time, as this test measures it
        losses.append(float(loss.detach()))
        results.append(meter.step(loss, tokens=batch["input_ids"].numel()))
    forward, backward = model.compiled_programs()
    flops = sum(node_work(n).flops for gm in (forward, backward) for n in gm.graph.nodes)
    return {"metrics": results, "elapsed": elapsed, "losses": losses, "flops": flops,
            "tokens": batch["input_ids"].numel(), "memory": model.memory_report(opt)}


def test_step_meter_against_what_the_test_measures(dist2):
    for result in dist2.run(_three_steps):
        metrics = result["metrics"]
        assert [m.step for m in metrics] == [1, 2, 3]
        assert [m.loss for m in metrics] == result["losses"]
        assert all(m.tokens == result["tokens"] == 2 * 16 for m in metrics)
        measured = sum(m.step_s for m in metrics)
        assert result["elapsed"] <= measured <= 1.1 * result["elapsed"]  # the meter's own work not counted
        counted = 3 * result["tokens"] / result["elapsed"]
        assert abs(sum(m.tokens for m in metrics) / measured - counted) <= 0.1 * counted
        for m in metrics:
            assert m.tokens_per_s == m.tokens / m.step_s
            assert m.model_flops == result["flops"] > 0  # no recompute: model FLOPs are all FLOPs
            assert 0 < m.mfu < 1 and 0 < m.predicted_mfu < 1 and m.predicted_step_s > 0
            # On CPU: the estimator's peak with the optimizer's state, and the allocator model's
            # reserved peak (the default allocator: PYTORCH_CUDA_ALLOC_CONF is not set here).
            memory = result["memory"]
            assert m.profile == "cpu" and not m.memory_measured and m.peak_memory_bytes == memory["peak"]
            assert m.reserved_bytes is None and m.predicted_reserved_bytes == memory["reserved_default"] > 0
            assert "tok/s" in str(m) and "MFU" in str(m) and "(estimated)" in str(m) and "reserved predicted" in str(m)


def _profiled_step() -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""))}
    model = hp.parallelize(build_model("llama", num_hidden_layers=2), plan, mesh)
    batch = local_batch(global_batch("llama", 4, 16), mesh)
    plain = model(**batch)["loss"]  # compiled before profiling
    plain.backward()
    program = model._last_entry().program
    built_before = dict(program._with_ranges)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = model(**batch)["loss"]
        profiled.backward()
    return {"names": [e.name for e in prof.events()], "built_before": built_before,
            "losses": (float(plain.detach()), float(profiled.detach()))}


def test_profiler_trace_names_programs_units_and_collectives(dist2):
    """A torch.profiler trace of one compiled FSDP step holds each program as a named range, inside it
    each FSDP unit's stretch and each collective named by kind, axis and reason, and each wait. The
    ranges exist only while profiling, and do not change the numbers."""
    result = dist2.run(_profiled_step)[0]
    names = result["names"]
    assert names.count("hyper_parallel::forward") == 1 and names.count("hyper_parallel::backward") == 1, names
    for unit in ("model.layers.0", "model.layers.1", "<root>"):
        for phase in ("forward", "backward"):
            assert f"hyper_parallel::unit {unit} {phase}" in names, (unit, phase, sorted(set(names)))
    gather = "hyper_parallel::all_gather[dp] FSDP unit model.layers.1: all-gather of its parameters for forward"
    assert any(n.startswith(gather) for n in names), sorted(set(names))
    assert any(n.startswith("hyper_parallel::reduce_scatter[dp] FSDP unit model.layers.0: reduce-scatter")
               for n in names)
    assert "hyper_parallel::wait all_gather[dp]" in names and "hyper_parallel::wait reduce_scatter[dp]" in names
    assert result["built_before"] == {}  # without a profiler the programs run unchanged
    assert result["losses"][0] == result["losses"][1]
