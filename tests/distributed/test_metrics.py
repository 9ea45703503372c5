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
    meter = hp.StepMeter(model)
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
            "tokens": batch["input_ids"].numel(), "peak": model.memory_report()["peak"]}


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
            assert m.profile == "cpu" and not m.memory_measured and m.peak_memory_bytes == result["peak"]
            assert "tok/s" in str(m) and "MFU" in str(m) and "(estimated)" in str(m)


def _profiled_step() -> list[str]:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("llama", num_hidden_layers=1), {}, mesh)
    batch = local_batch(global_batch("llama", 4, 16), mesh)
    model(**batch)["loss"].backward()  # compiled before profiling
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(**batch)["loss"].backward()
    return [e.name for e in prof.events()]


def test_profiler_trace_names_the_programs(dist2):
    """A torch.profiler trace of one compiled step holds each program as a named range, and the
    collectives inside them under their c10d names."""
    names = dist2.run(_profiled_step)[0]
    assert names.count("hyper_parallel::forward") == 1 and names.count("hyper_parallel::backward") == 1, names
    assert any("all_reduce" in n for n in names)
